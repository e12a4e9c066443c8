"""The ranges of the sampling fields: one table, read by the gateway (whose 400 names the HTTP param)
and by the engine (which checks what any gRPC client sends). Standard library only, so that both
sides may import it; the engine's own defaults for unset fields live in `engine.request.SamplingParams`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class Range:
    """The values a field may take, from `low` to `high` (None: unbounded), either end excluded when
    `*_open`; `rule` says it in words. NaN is in no range."""

    low: float | None
    high: float | None
    rule: str
    is_low_open: bool = False
    is_high_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.is_low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.is_high_open else value <= self.high)
        return above and below

    def error(self, name: str, value: float) -> str:
        """The message for `value` out of range, naming the field (or HTTP param) `name`."""
        return f"{name} {self.rule}, got {value}"


MAX_N = 64  # choices per prompt (`n`, `best_of`)
MAX_TOP_LOGPROBS = 20  # most likely tokens reported per position
MAX_SEED = 2**63  # seeds are in [0, MAX_SEED)
DEFAULT_MAX_NEW_TOKENS = 128  # a request that names no limit: the engine's default, and native /generate's

TEMPERATURE = Range(0, 2, "must be between 0 and 2")  # 0: greedy
TOP_P = Range(0, 1, "must be in (0, 1]", is_low_open=True)
TOP_K = Range(-1, None, "must be -1 (disabled) or a positive integer")  # 0 disables it too
MIN_P = Range(0, 1, "must be in [0, 1]")
SEED = Range(0, MAX_SEED, "must be in [0, 2^63)", is_high_open=True)
MAX_NEW_TOKENS = Range(1, None, "must be >= 1")
MIN_NEW_TOKENS = Range(0, None, "must be >= 0")
PENALTY = Range(-2, 2, "must be in [-2, 2]")  # presence and frequency, OpenAI's semantics
REPETITION_PENALTY = Range(0, 10, "must be in (0, 10]", is_low_open=True)  # HF's semantics; 1: off
LOGIT_BIAS = Range(-100, 100, "must be in [-100, 100]")
TOP_LOGPROBS_NUM = Range(0, MAX_TOP_LOGPROBS, f"must be between 0 and {MAX_TOP_LOGPROBS}")

# A request's `priority`, vLLM's convention: lower values are served first, 0 is the default. Batch
# lines run `BATCH_PRIORITY_OFFSET` below their own value, so below every interactive request; the
# workers' protocol carries any int32 (the engine orders by it and checks nothing).
MAX_PRIORITY = 2**20
PRIORITY = Range(-MAX_PRIORITY, MAX_PRIORITY, f"must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}]")
BATCH_PRIORITY_OFFSET = 2 * MAX_PRIORITY + 1
MAX_TENANT_LEN = 128  # characters of a tenant id (the `x-tandem-tenant` header)

# The scalar fields of tandem.v1.SamplingParams (the engine's names) and their ranges.
SAMPLING_RANGES: Mapping[str, Range] = MappingProxyType(
    {
        "temperature": TEMPERATURE,
        "top_p": TOP_P,
        "top_k": TOP_K,
        "min_p": MIN_P,
        "seed": SEED,
        "max_new_tokens": MAX_NEW_TOKENS,
        "min_new_tokens": MIN_NEW_TOKENS,
        "presence_penalty": PENALTY,
        "frequency_penalty": PENALTY,
        "repetition_penalty": REPETITION_PENALTY,
        "top_logprobs_num": TOP_LOGPROBS_NUM,
    }
)
