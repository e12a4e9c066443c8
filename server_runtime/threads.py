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
- the probe wins when its median step time is below `margin` times the median of the steps just before
  it, and both ran the same number of rows;
- a lost probe, or one across a batch change (no verdict), doubles the hold (up to `max_hold_steps`),
  so a settled or unmeasurable choice costs little; a won probe starts the hold again from `hold_steps`;
- when the held count's steps of the same rows grow slower than at its last verdict by more than the
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
    recent: deque[tuple[int, float]]  # (rows, seconds) of the last steps on `chosen`
    held: int = 0  # steps on `chosen` since the last probe
    probe: list[tuple[int, float]] = field(default_factory=list)
    verdict: tuple[int, float] | None = None  # (rows, median seconds) of `chosen` at its last verdict


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
        self._choices = {waiting: self._new_choice() for waiting in (False, True)}
        self._current = self._choices[False]
        self._applied = 0  # the count last handed to `set_threads`
        self.switches = 0

    def _new_choice(self) -> _Choice:
        return _Choice(self.low, self.low, self.min_hold_steps, deque(maxlen=self.probe_steps))

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
            c.recent.append((rows, seconds))
            c.held += 1
            if self._slowed(c):
                c.held, c.hold_steps = c.hold_steps, self.min_hold_steps
            if c.held >= c.hold_steps and len(c.recent) == self.probe_steps:
                c.threads = self.high if c.chosen == self.low else self.low
                c.probe = []
            return
        c.probe.append((rows, seconds))
        if len(c.probe) >= self.probe_steps:
            self._judge(c)

    def _slowed(self, c: _Choice) -> bool:
        """Whether the held count's last steps, all of the rows of its last verdict, got slower than then."""
        if c.verdict is None or len(c.recent) < self.probe_steps:
            return False
        rows, seconds = c.verdict
        if any(r != rows for r, _ in c.recent):
            return False
        return statistics.median(s for _, s in c.recent) * self.margin > seconds

    def _judge(self, c: _Choice) -> None:
        rows = {r for r, _ in c.recent} | {r for r, _ in c.probe}
        held = statistics.median(s for _, s in c.recent)
        probed = statistics.median(s for _, s in c.probe)
        if len(rows) == 1 and probed < self.margin * held:
            logger.info(
                "decode steps (%d rows, KV %s) now run on %d threads: %.1f ms a step, against %.1f ms on %d",
                c.probe[0][0],
                "on its way" if c is self._choices[True] else "not awaited",
                c.threads,
                probed * 1e3,
                held * 1e3,
                c.chosen,
            )
            c.chosen = c.threads
            c.recent.clear()
            c.recent.extend(c.probe)
            c.verdict = (c.probe[0][0], probed)
            c.hold_steps = self.min_hold_steps
            self.switches += 1
        else:  # lost, or the batch changed under the probe (no verdict): probe less often
            c.threads = c.chosen
            c.hold_steps = min(2 * c.hold_steps, self.max_hold_steps)
            if len(rows) == 1:
                c.verdict = (c.probe[0][0], held)
        c.held = 0
        c.probe = []
