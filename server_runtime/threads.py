"""How many torch threads a decode worker's steps run on, chosen from the step times it measures.

A decode step at small batches reads every weight once. Where the machine's other cores are idle (no
prefill running on them, as at one stream after the prompt), a second thread reads and multiplies
faster; where they are busy (a prefill burst, the gateway), each of the step's parallel regions waits
for the thread that lost its core, and one thread is faster. Which one wins depends on the CPU, the
model and the load of the moment, so the engine thread measures it (`ThreadTuner`).

It keeps one choice per situation: steps while some prompt's KV is on its way to this worker (a
reservation waits for its prefill, which `tandem serve` runs on this machine's cores) and steps while
none is. In each:

- it holds a thread count for `hold_steps` steps, then runs `probe_steps` steps on the other count;
- each probe step is compared with the held count's recent steps of the same rows (or of nearly the
  same: within 1/16), so drafts and joining requests that change the rows from step to step still
  give a verdict; the probe wins when the median of those ratios is below `margin`;
- a lost probe, or one whose steps matched too few held steps (fewer than half: no verdict), doubles
  the hold (up to `max_hold_steps`), so a settled or unmeasurable choice costs little; a won probe
  starts the hold again from `hold_steps`;
- when the held count's steps of some rows grow slower than at its last verdict by more than the
  margin (other work took a core, say), it probes at once.

The C++ kernels split output columns or (sequence, head) items among threads, never a sum, so a
step's results are the same bits on any thread count: the choice changes the speed, never the tokens.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)


@dataclass
class _Choice:
    """One situation's state: the count held, the count the next step runs on, the hold and its steps."""

    chosen: int
    threads: int
    hold_steps: int
    recent: dict[int, deque[float]] = field(default_factory=dict)  # rows -> last step seconds on `chosen`
    held: int = 0  # steps on `chosen` since the last probe
    probe: list[tuple[int, float]] = field(default_factory=list)  # (rows, seconds) on the other count
    verdict: dict[int, float] = field(default_factory=dict)  # rows -> median seconds of `chosen` at its last verdict


class ThreadTuner:
    """Picks between `low` and `high` torch threads for the engine's steps: call `before_step` (saying
    whether KV is on its way) on the thread that computes the step, since torch's thread count is per
    thread, and `after_step` once the step is over, never at the same time."""

    def __init__(
        self,
        low: int,
        high: int,
        hold_steps: int = 64,
        probe_steps: int = 6,
        margin: float = 0.9,
        max_hold_steps: int = 2048,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        if not 1 <= low < high:
            raise ValueError(f"need 1 <= low < high threads, got {low} and {high}")
        if probe_steps < 1 or hold_steps < probe_steps or not 0 < margin <= 1:
            raise ValueError("need 1 <= probe_steps <= hold_steps and 0 < margin <= 1")
        self.low, self.high = low, high
        self.min_hold_steps, self.probe_steps, self.margin = hold_steps, probe_steps, margin
        self.max_hold_steps = max(max_hold_steps, hold_steps)
        self._set_threads = set_threads
        self._choices = {waiting: _Choice(low, low, hold_steps) for waiting in (False, True)}
        self._current = self._choices[False]
        self._applied = 0  # the count last handed to `set_threads`
        self.switches = 0

    @property
    def threads(self) -> int:
        """The count the last (or next) step runs on."""
        return self._current.threads

    def chosen(self, kv_on_its_way: bool = False) -> int:
        """The count held in one situation."""
        return self._choices[kv_on_its_way].chosen

    def hold_steps(self, kv_on_its_way: bool = False) -> int:
        return self._choices[kv_on_its_way].hold_steps

    def before_step(self, kv_on_its_way: bool = False) -> None:
        self._current = self._choices[kv_on_its_way]
        if self._applied != self._current.threads:
            self._set_threads(self._current.threads)
            self._applied = self._current.threads

    def after_step(self, seconds: float, rows: int) -> None:
        c = self._current
        if c.threads == c.chosen:
            c.recent.setdefault(rows, deque(maxlen=self.probe_steps)).append(seconds)
            c.held += 1
            if self._slowed(c, rows):
                c.held, c.hold_steps = c.hold_steps, self.min_hold_steps
            if c.held >= c.hold_steps:
                c.threads = self.high if c.chosen == self.low else self.low
                c.probe = []
            return
        c.probe.append((rows, seconds))
        if len(c.probe) >= self.probe_steps:
            self._judge(c)

    def _slowed(self, c: _Choice, rows: int) -> bool:
        """Whether the held count's last steps of `rows` rows, a full window of them, got slower than at its
        last verdict."""
        window = c.recent[rows]
        if rows not in c.verdict or len(window) < self.probe_steps:
            return False
        return statistics.median(window) * self.margin > c.verdict[rows]

    def _held_median(self, c: _Choice, rows: int) -> float | None:
        """The held count's recent median step time at `rows` rows, or at the nearest row count within
        1/16 of it; None without at least two such steps."""
        near = [r for r, w in c.recent.items() if abs(r - rows) <= rows // 16 and len(w) >= 2]
        if not near:
            return None
        return statistics.median(c.recent[min(near, key=lambda r: abs(r - rows))])

    def _judge(self, c: _Choice) -> None:
        matched = [(rows, seconds, self._held_median(c, rows)) for rows, seconds in c.probe]
        ratios = [seconds / held for _, seconds, held in matched if held]
        has_verdict = 2 * len(ratios) >= len(c.probe)
        ratio = statistics.median(ratios) if has_verdict else 1.0
        if has_verdict and ratio < self.margin:
            logger.info(
                "decode steps (KV %s) now run on %d threads: %.2fx the time of steps of the same rows on %d "
                "(%d to %d rows)",
                "on its way" if c is self._choices[True] else "not awaited",
                c.threads,
                ratio,
                c.chosen,
                min(r for r, _ in c.probe),
                max(r for r, _ in c.probe),
            )
            c.chosen = c.threads
            c.recent = {}
            for rows, seconds in c.probe:
                c.recent.setdefault(rows, deque(maxlen=self.probe_steps)).append(seconds)
            c.verdict = {rows: statistics.median(window) for rows, window in c.recent.items()}
            c.hold_steps = self.min_hold_steps
            self.switches += 1
        else:  # lost, or the probe's rows matched too few held steps (no verdict): probe less often
            logger.debug(
                "a probe of %d threads %s; %d threads held",
                c.threads,
                f"lost ({ratio:.2f}x the time)" if has_verdict else "matched too few held steps (no verdict)",
                c.chosen,
            )
            c.threads = c.chosen
            c.hold_steps = min(2 * c.hold_steps, self.max_hold_steps)
            if has_verdict:
                c.verdict = {rows: held for rows, _, held in matched if held}
        c.held = 0
        c.probe = []
