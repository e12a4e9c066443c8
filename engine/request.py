"""Request records shared by the scheduler, the model runner and the servers. No torch here."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError


class RequestStatus(enum.Enum):
    WAITING = "waiting"    # prompt KV not computed yet
    RUNNING = "running"    # has KV for every token but the last one; decodes each step
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"          # eos or a stop token id
    LENGTH = "length"      # max_new_tokens or the context length
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Resolved sampling settings (defaults already applied). temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0            # 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0 <= self.min_p <= 1):
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise InvalidRequestError(f"seed must be in [0, 2^63), got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass(slots=True)
class Request:
    """One sequence in the engine.

    `prompt_ids` + `output_ids` is the sequence; KV is held in `page_ids` for the first
    `num_computed` tokens. A prefill-only request (`is_prefill_only`) finishes after its first
    sampled token and keeps its pages until the server releases them (after the KV transfer).
    """

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    is_prefill_only: bool = False
    page_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    num_computed: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    matched_token_id: int | None = None
    abort_message: str = ""

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one engine step produced for one request: a new token, a finish, or both."""

    request_id: str
    token_id: int | None
    logprob: float | None
    finish_reason: FinishReason | None = None
    matched_token_id: int | None = None
    abort_message: str = ""
