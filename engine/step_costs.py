"""What a step may take on, from the step times the engine measures: prompt tokens beside decoding
streams (`DecodePacer`) and draft tokens to verify (`DraftBudget`). No torch; the engine feeds
`observe` each step's time from the thread that computed it (`Engine.execute`).

Both rest on `DecodeStepTimes`, a moving average of decode-only steps' seconds per number of decode
rows (each decoding request's token and its drafts). On a memory-bound step (a small model's float
weights on a CPU, most models on a GPU) a few dozen extra rows cost almost nothing; on a
compute-bound one (K-quant weights on AVX2) each costs about a decode step's share. Which one holds
is measured, never assumed from the hardware.

**Decode pace.** A prompt prefilled by a worker that is decoding (a short prompt kept local, a long
one while every prefill worker is busy, a preempted request's recompute) shares its steps with the
running streams, and each of them waits for the whole step. The pacer holds one cap on a mixed
step's prompt tokens; after each mixed step it moves the cap toward what would have kept the step
within `max_slowdown` times a decode-only step of its decode rows, at the prompt tokens' measured
cost per token (at most halving or doubling it). Where even one prompt token costs more than that
(a step's cost jumps at some row counts), the prompt gets its time on average instead: every step
earns it (max_slowdown - 1) decode-only steps' time, a mixed step spends what it took beyond a
decode-only step, and a step finding the balance spent decodes alone (the balance stays within one
step's earnings either way, so neither a quiet spell nor one slow step piles up).
With no decode-only step measured near the batch's rows, or every `refresh_steps` mixed steps, it
asks for a decode-only step (cap 0) to measure one.
A short prompt is not paced: one with at most `unpaced_tokens` left to compute when it is admitted
(after its cached prefix; a chat's next turn on the decode worker that holds the history) runs whole
in its first step, as a chunked prefill without a pace would run it. Its streams' step is slower by
that much once; the pacer's balance takes the step's cost like any other, so the steps after it
decode alone until the debt is paid. Paced, such a tail took dozens of steps on a CPU where a prompt
token costs most of a decode step (docs/performance.md, multi-turn chat).

**Draft budget.** A draft costs a row and yields a token only if it and every draft before it are
accepted. With a request's per-draft acceptance p, its j-th draft is worth p**j tokens; a step of
cost a + b * rows over the decode-only steps' fit yields its tokens at (sum of worths) / (a + b *
rows). Drafts are added in order of worth while one raises that rate (that is, while its worth is
above b times the rate so far), so a step verifies drafts only where rows are cheaper than what they
are expected to return. A draft model's drafts cost their proposal too: its measured seconds per
draft count beside b. Without two row counts measured it allows every draft (which measures them);
every `explore_steps` decode steps it allows every draft once more, so a stale fit is corrected.
"""

from __future__ import annotations

from collections.abc import Sequence

_EMA_WEIGHT = 0.3  # of a new decode-only step in its moving average
_NEAR = 0.25  # a decode-only time measured at rows within this fraction stands for the batch's


class DecodeStepTimes:
    """Seconds of decode-only steps, a moving average per number of decode rows, kept apart per count
    of compute threads (a decode worker's count follows the load, server_runtime/threads.py): the
    answers are those of `threads`, the count the engine last computed a step on."""

    def __init__(self) -> None:
        self.threads = 1
        self._by_threads: dict[int, dict[int, float]] = {}

    @property
    def seconds(self) -> dict[int, float]:
        """Rows -> moving average of a decode-only step's seconds, on `threads` threads."""
        return self._by_threads.setdefault(self.threads, {})

    def observe(self, num_rows: int, seconds: float) -> None:
        old = self.seconds.get(num_rows)
        self.seconds[num_rows] = seconds if old is None else old + _EMA_WEIGHT * (seconds - old)

    def near(self, num_rows: int) -> float | None:
        """The time measured at the rows nearest `num_rows`, if within a quarter of them."""
        times = self.seconds
        if not times:
            return None
        rows = min(times, key=lambda r: abs(r - num_rows))
        return times[rows] if abs(rows - num_rows) <= _NEAR * num_rows else None

    def estimate(self, num_rows: int) -> float | None:
        """A decode-only step's seconds at `num_rows`: measured near them, else on the fitted line,
        else the fastest step measured; None before any."""
        measured = self.near(num_rows)
        if measured is not None:
            return measured
        line = self.fit()
        if line is not None:
            return line[0] + line[1] * num_rows
        return min(self.seconds.values(), default=None)

    def fit(self) -> tuple[float, float] | None:
        """(a, b) of the least-squares line seconds = a + b * rows over the measured row counts
        (b at least 0); None with fewer than two of them."""
        times = self.seconds
        if len(times) < 2:
            return None
        n = len(times)
        mean_rows = sum(times) / n
        mean_s = sum(times.values()) / n
        spread = sum((r - mean_rows) ** 2 for r in times)
        slope = sum((r - mean_rows) * (s - mean_s) for r, s in times.items()) / spread
        slope = max(slope, 0.0)
        return max(mean_s - slope * mean_rows, 0.0), slope


class DecodePacer:
    """Caps a step's prompt tokens while requests decode in it (see the module docstring)."""

    def __init__(
        self,
        max_slowdown: float,
        times: DecodeStepTimes,
        initial_cap: int = 16,
        refresh_steps: int = 32,
        unpaced_tokens: int = 0,
    ) -> None:
        if max_slowdown <= 1:
            raise ValueError(f"max_slowdown must be above 1, got {max_slowdown}")
        if initial_cap < 1 or refresh_steps < 1:
            raise ValueError("initial_cap and refresh_steps must be positive")
        if unpaced_tokens < 0:
            raise ValueError(f"unpaced_tokens must be 0 or more, got {unpaced_tokens}")
        self.max_slowdown = max_slowdown
        self.unpaced_tokens = unpaced_tokens  # a prompt with at most these left to compute is not paced
        self.refresh_steps = refresh_steps
        self.times = times
        self.cap = float(initial_cap)
        self.balance = 0.0  # seconds of prompt time in hand (see the module docstring)
        self._mixed_steps = 0  # since the last decode-only step

    def prompt_budget(self, num_decode_tokens: int) -> int | None:
        """Prompt tokens a step with `num_decode_tokens` decode rows may add (None: no cap, no row decodes)."""
        if num_decode_tokens == 0:
            return None
        if self.times.near(num_decode_tokens) is None or self._mixed_steps >= self.refresh_steps or self.balance < 0:
            return 0
        return max(1, int(self.cap))

    def allowance(self, decode_s: float) -> float:
        """What a step may add beyond a decode-only step of `decode_s` seconds."""
        return (self.max_slowdown - 1) * decode_s

    def catch_up_seconds(self, num_decoding: int) -> float | None:
        """The time a step with `num_decoding` decoding requests may spend catching prompts up beside
        them (a draft model's KV): the allowance over a decode-only step of those rows, estimated; None
        with fewer than two (nobody else waits) or before any decode-only step is measured."""
        decode_s = self.times.estimate(num_decoding) if num_decoding >= 2 else None
        return None if decode_s is None else self.allowance(decode_s)

    def observe(self, num_decode_tokens: int, num_prompt_tokens: int, seconds: float) -> None:
        """Learn from a step that computed `num_decode_tokens` decode rows and `num_prompt_tokens`
        prompt rows in `seconds` (after `times` has seen it)."""
        if num_decode_tokens == 0:
            return
        decode_s = self.times.near(num_decode_tokens)
        if num_prompt_tokens == 0:
            self._mixed_steps = 0
        else:
            self._mixed_steps += 1
        if decode_s is None:
            return
        allowance = self.allowance(decode_s)
        extra_s = max(seconds - decode_s, 1e-9) if num_prompt_tokens else 0.0
        self.balance = min(max(self.balance + allowance - extra_s, -allowance), allowance)
        if num_prompt_tokens:
            fitting = allowance / (extra_s / num_prompt_tokens)
            self.cap = min(max(fitting, self.cap / 2, 1.0), self.cap * 2)


class DraftBudget:
    """How many drafts each decoding request of a step may verify (see the module docstring)."""

    def __init__(self, max_drafts: int, times: DecodeStepTimes, explore_steps: int = 128) -> None:
        if max_drafts < 1 or explore_steps < 1:
            raise ValueError("max_drafts and explore_steps must be positive")
        self.max_drafts = max_drafts
        self.times = times
        self.explore_steps = explore_steps
        self._steps = 0  # decode steps since the last that allowed every draft

    def num_drafts(self, acceptance: Sequence[float], draft_cost_s: float = 0.0) -> list[int]:
        """Drafts for each of a step's decoding requests, given each one's per-draft acceptance
        probability (in [0, 1]), in the same order; `draft_cost_s`: what proposing one draft costs
        besides its row (a draft model's forward pass, shared by the step's requests)."""
        self._steps += 1
        fit = self.times.fit()
        if fit is None or self._steps >= self.explore_steps:
            self._steps = 0
            return [self.max_drafts] * len(acceptance)
        a, b = fit
        tokens, seconds = float(len(acceptance)), a + b * len(acceptance)
        worths = sorted(
            ((p**j, i) for i, p in enumerate(acceptance) for j in range(1, self.max_drafts + 1)), reverse=True
        )
        counts = [0] * len(acceptance)
        for worth, i in worths:  # a request's j-th draft is worth less than its (j-1)-th: taken in order
            if worth * seconds <= (b + draft_cost_s) * tokens:
                break
            counts[i] += 1
            tokens, seconds = tokens + worth, seconds + b + draft_cost_s
        return counts
