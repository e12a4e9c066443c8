"""The gateway's own records of a generation, shared by the cluster wing that fills them from the
workers' messages and the services and routes that read them. Plain values: no proto, no HTTP."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.StrEnum):
    """Why a generation ended, as the workers report it (mapped from the proto's enum in
    `gateway/cluster/client.py`); the value is the word the HTTP APIs answer."""

    STOP = "stop"  # an eos or stop token, or a stop string the gateway matched
    LENGTH = "length"  # max_new_tokens or the context
    ABORT = "abort"  # aborted by the worker (the message says why)


class Role(enum.StrEnum):
    """A worker's part in a generation; the value is the word used in flags, logs and metrics."""

    PREFILL = "prefill"
    DECODE = "decode"


class PrefillPath(enum.StrEnum):
    """Which worker prefilled a request's prompt (`--local-prefill-threshold`)."""

    DISAGGREGATED = "disaggregated"  # a prefill worker, which wrote the KV into the decode worker's pages
    LOCAL = "local"  # the decode worker itself: no KV transfer (reserve, transfer and decode queue are 0 / None)


@dataclass(frozen=True, slots=True)
class HandoffTimings:
    """Per-phase timings of one request, in milliseconds. `first_token_ms` counts from the trip's
    start; `gateway_queue_ms` is the time before it (from the HTTP request's arrival), and
    `decode_queue_ms` arrives with the decode server's first message (None until then). `prefill_path`
    says which worker prefilled the prompt. `cached_tokens` are the prompt tokens the prefilling
    worker served from its prefix cache; `decode_cached_tokens` those the decode worker already held
    (the reservation's, which the prefill worker did not write; for a local prefill, `cached_tokens`)."""

    reserve_ms: float
    prefill_queue_ms: float
    prefill_compute_ms: float
    transfer_ms: float
    kv_bytes: int
    first_token_ms: float
    cached_tokens: int
    gateway_queue_ms: float = 0.0
    decode_queue_ms: float | None = None
    prefill_path: PrefillPath = PrefillPath.DISAGGREGATED
    decode_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class GeneratedToken:
    """One token with its logprob, plus top / requested (token_id, logprob) pairs when asked for."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    requested: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Finish:
    """Why a generation ended: the reason, what matched (a stop token id a worker matched, or a stop
    string the gateway matched) and, for an abort, the worker's message."""

    reason: FinishReason
    matched: str | int | None = None
    message: str = ""


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """Tokens of one generation as they arrive: the one record from a decode worker's message to the
    text the fronts format. The cluster wing reads it off the worker's stream (`queue_ms`,
    `prefill_compute_ms` and `cached_tokens` as the worker reported them, on its first message) and
    hands it on with the trip's `timings`; `gateway/service/generation.py` fills in `text` (detokenized,
    stop strings applied). The last chunk of a generation has `finish`."""

    tokens: list[GeneratedToken]
    finish: Finish | None = None
    timings: HandoffTimings | None = None  # on the first chunk, again once decode_queue_ms is known
    prompt_logprobs: list[GeneratedToken] = field(default_factory=list)  # first chunk, when asked for
    text: str = ""
    queue_ms: float | None = None
    prefill_compute_ms: float | None = None
    cached_tokens: int = 0
    spec_verify_ct: int = 0  # the last chunk's: steps that verified drafts, and drafts accepted
    spec_accepted_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]
