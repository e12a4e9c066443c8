"""The records one engine step passes along: what the scheduler chose (`SchedulerOutput`), what the
model sampled for it (`ModelOutput`). Frozen values; no torch here."""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import PromptLogprobs, Request


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's batch: request `requests[i]` feeds its tokens `num_computed ... num_computed +
    num_new_tokens[i] - 1` (prompt, then output; their pages are allocated) and, when `is_sampling[i]`,
    samples its next token from its last row. A request that is not sampling is part-way through its
    prompt (a chunk). Decode rows come first, then prompt chunks; prefill and decode share the batch.

    `num_decode_tokens`: the decode rows' tokens (each decoding request's one and its drafts), the first
    of `num_new_tokens`; the rest are prompt tokens.
    `aborted`: requests that could never fit the pool, already finished by the scheduler this step.
    `preempted`: requests that gave their pages back this step, to be recomputed later."""

    requests: tuple[Request, ...]
    num_new_tokens: tuple[int, ...]
    is_sampling: tuple[bool, ...]
    aborted: tuple[Request, ...] = ()
    preempted: tuple[Request, ...] = ()
    num_decode_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode_only(self) -> bool:
        """Every request feeds one token and samples (the CUDA-graph shape)."""
        return all(self.is_sampling) and all(n == 1 for n in self.num_new_tokens)

    @property
    def sampling_requests(self) -> list[Request]:
        """The requests that sample this step, in batch order (the rows of the step's logits)."""
        return [r for r, is_sampling in zip(self.requests, self.is_sampling) if is_sampling]


@dataclass(frozen=True, slots=True)
class SampledToken:
    """One request's token from a step: its logprob, and its top / requested logprobs when asked."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    requested: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class ModelOutput:
    """What a step computed, per request of its `SchedulerOutput` (same order): `sampled[i]` the
    tokens request i sampled (one for a sampling request, none for a prompt chunk), `prompt[i]` the
    piece of its prompt this step scored (None: none asked or none in this chunk), and `non_finite`
    the indices of requests whose logits held a NaN or +inf (or only -inf): their tokens mean nothing
    and they fail."""

    sampled: tuple[tuple[SampledToken, ...], ...]
    prompt: tuple[PromptLogprobs | None, ...]
    non_finite: frozenset[int] = frozenset()
