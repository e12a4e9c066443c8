"""The one place where threads meet asyncio: an engine thread driven from a gRPC event loop, and
one executor for the other blocking work (`BlockingWork`).

The engine thread owns the `Engine` (which is single-threaded by contract). Coroutines send it
commands with `call()`; per-request `StepOutput`s come back through an asyncio.Queue opened with
`submit()`. A command or step that raises never kills the thread: commands return
the exception to their caller, a failing step aborts the requests it held.

Each step's forward pass runs on a compute thread (the kernels release the GIL) while the engine
thread waits for it: meanwhile it answers the commands that may run during a step (`reserve`, which
then preempts nobody) and keeps the others, in order, for the step's end. So a decode worker answers
a reservation in the time of the call, not of the step it arrived in. When the next step is a certain
decode step (engine/overlap.py), it is queued on the compute thread right behind the step computing,
and the step's update and delivery run while the next one computes; the other commands then wait until
no step is queued (with one pending, nothing more is planned ahead).

Blocking calls that are not the engine's (opening a checkpoint, compiling a grammar, the
embedder's batches) run on `BlockingWork`'s executor; what they produce for the engine enters it
through `call()`. KV writes run on the transport's own terms, started and polled by the engine's KV
connector (server_runtime/kv_send.py), which `wake`s the engine thread when one settles; an idle engine
thread still polls the connector every `_TICK_S`, for the reservations past their deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.engine import Engine
from engine.errors import InvalidRequestError, WouldPreemptError
from engine.kv_connector import ReservedPages
from engine.kv_host_tier import TierReads
from engine.overlap import AheadStep, execute_ahead, plan_ahead, settle_ahead
from engine.request import FinishReason, Request, StepOutput
from engine.step_records import ModelOutput, SchedulerOutput
from server_runtime.blocking import BlockingWork, use_device
from server_runtime.metrics import WorkerMetrics
from server_runtime.threads import ThreadTuner
from tandem.sampling import GrammarSpec

logger = logging.getLogger(__name__)

T = TypeVar("T")
_TICK_S = 0.25


@dataclass(frozen=True, slots=True)
class _Command:
    """`run(engine, is_in_step)` on the engine thread; its result or exception goes to `future` (None:
    nobody waits). With `is_during_step`, it may run while a step computes (`is_in_step` True); it
    raises WouldPreemptError to run again after the step instead."""

    run: Callable[[Engine, bool], Any]
    future: asyncio.Future | None
    is_during_step: bool = False


_STEP_DONE = _Command(lambda engine, is_in_step: None, None)  # the compute thread's signal
_Computed = tuple[ModelOutput, float]  # a step's output and the seconds its computation took
_WAKE = _Command(lambda engine, is_in_step: None, None, is_during_step=True)  # only ends a wait for commands


class EngineLoop:
    """The engine thread, its compute thread and the process's `BlockingWork` (`work`), owned together:
    `start()` starts the engine thread, `stop()` ends them all. Once started only the engine thread
    touches `engine`, except `Engine.execute` (and `execute_ahead`, on shadow requests), which the
    compute thread runs while the engine thread answers reservations (and updates the step before an
    overlapped one), and `Engine.schedule` where it runs a draft model, which the compute thread runs
    while the engine thread waits."""

    def __init__(
        self,
        engine: Engine,
        loop: asyncio.AbstractEventLoop,
        metrics: WorkerMetrics | None = None,
        threads: ThreadTuner | None = None,
    ) -> None:
        self.engine = engine
        self.threads = threads  # None: the steps keep the thread count the process set
        self.metrics = metrics or WorkerMetrics("unknown")  # steps and pool state: written on the engine thread
        self.work = BlockingWork(loop)
        self._loop = loop
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._deferred: list[_Command] = []  # arrived during the last step, to run before the queue
        self._queued: tuple[AheadStep, concurrent.futures.Future[_Computed]] | None = None  # the step after
        self._compute = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="engine-compute", initializer=use_device, initargs=(engine.config.device,)
        )
        self._sinks: dict[str, asyncio.Queue] = {}  # touched only on the engine thread
        self._prefill_only: set[str] = set()  # of the sinks, those whose first output is their last
        self._kv_subscribers: list[asyncio.Queue[KvEvents | None]] = []  # touched only on the engine thread
        self._stopped = threading.Event()
        self._grammar = engine.grammar  # its load and compile may run off the engine thread
        self._grammar_lane = self.work.lane()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.num_steps = 0
        self.num_overlapped_steps = 0  # of those, queued while the step before them computed

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopped.set()
        self._commands.put(_Command(lambda engine, is_in_step: None, None))
        self._thread.join(timeout_s)
        self._compute.shutdown(wait=False)
        self.work.close()

    # ---- asyncio side --------------------------------------------------------------------

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the engine thread and return its result (or raise its exception)."""
        future = self._loop.create_future()
        self._commands.put(_Command(lambda engine, is_in_step: fn(engine), future))
        return await future

    async def reserve(
        self,
        request_id: str,
        prompt_len: int,
        priority: int,
        prompt_ids: list[int] | None = None,
        namespace: str | None = "",
    ) -> ReservedPages:
        """`Engine.reserve`, answered even while a step computes (then preempting nobody: one that
        would preempt waits for the step's end). The prompt's pages that only the disk tier or the store
        hold are read first, on `work`, so the engine thread never waits on them."""
        reads: TierReads = []
        if prompt_ids and namespace is not None:
            digests = await self._call_during_step(
                lambda engine, is_in_step: engine.slow_tier_digests(prompt_ids, namespace)
            )
            if digests:
                reads = await self.work.run(self.engine.read_slow_tiers, digests)
        return await self._call_during_step(
            lambda engine, is_in_step: engine.reserve(
                request_id, prompt_len, priority, not is_in_step, prompt_ids, namespace, reads
            )
        )

    async def _call_during_step(self, fn: Callable[[Engine, bool], T]) -> T:
        """Like `call`, but answered even while a step computes: `fn(engine, is_in_step)` may raise
        WouldPreemptError then, to run again at the step's end."""
        future = self._loop.create_future()
        self._commands.put(_Command(fn, future, is_during_step=True))
        return await future

    async def prepare_grammar(self, spec: GrammarSpec, timeout_s: float) -> None:
        """Compile a request's grammar on the grammar lane of `work` (the first one also loads the
        tokenizer's vocabulary, which is not timed) and hand it to the engine's cache through the
        engine thread, so the engine thread never stalls on it. A grammar already cached is not
        compiled again.

        A compile that takes over `timeout_s` raises InvalidRequestError. Its thread cannot be
        stopped: it keeps the lane until it ends, so abandoned compiles never pile up.
        """
        if await self.call(lambda engine: engine.grammar.lookup(spec) is not None):
            return
        await self._grammar_lane.run(self._grammar.load)
        try:
            compiled = await self._grammar_lane.run(self._grammar.compile, spec, timeout_s=timeout_s)
        except TimeoutError:
            raise InvalidRequestError(
                f"the {spec.kind.value} is too complex: compiling it took over {timeout_s:g} s "
                "(--grammar-compile-timeout)"
            ) from None
        # Not awaited: commands run in order, so the request this grammar is for, submitted next, finds it.
        self._commands.put(_Command(lambda engine, is_in_step: engine.grammar.store(spec, compiled), None))

    async def submit(self, req: Request) -> asyncio.Queue:
        """Queue a prompt, or confirm a reservation (`Engine.add_request`); its outputs arrive on the
        returned queue."""
        sink: asyncio.Queue = asyncio.Queue()

        def add(engine: Engine) -> None:
            output = engine.add_request(req)
            if output is not None:  # a confirmed reservation whose first token ends it
                sink.put_nowait(output)  # safe: the queue is not shared with the loop yet
                return
            self._sinks[req.request_id] = sink
            if req.is_prefill_only:
                self._prefill_only.add(req.request_id)

        await self.call(add)
        return sink

    async def abort(self, request_id: str, message: str = "aborted", write_settled: bool = False) -> bool:
        """Abort a request (its stream gets a final ABORT output) or drop what it holds."""

        def abort(engine: Engine) -> bool:
            held = request_id in self._sinks or engine.holds(request_id)
            output = engine.abort(request_id, message, write_settled)
            if output is not None:
                self._deliver(output)
            self._sinks.pop(request_id, None)
            self._prefill_only.discard(request_id)
            return held or output is not None

        return await self.call(abort)

    async def stop_compute(self, request_id: str, message: str) -> None:
        """Abort a request still waiting or running. Pages a KV send holds stay held until it is over
        (`Engine.abort`)."""

        def stop(engine: Engine) -> None:
            if output := engine.abort(request_id, message):
                self._deliver(output)

        await self.call(stop)

    async def update_weights(self, checkpoint) -> str:
        """Swap weights between steps; the aborted requests' streams get their final outputs.
        Returns the new `weights_id`."""

        def update(engine: Engine) -> str:
            for output in engine.update_weights(checkpoint):
                self._deliver(output)
            return engine.weights_id

        return await self.call(update)

    async def subscribe_kv_events(self) -> asyncio.Queue[KvEvents | None]:
        """A queue of the prefix cache's changes: first a snapshot of every page key it holds, then
        what was stored and removed, about every 0.25 s when something changed; None once
        `end_kv_events` ended it. Pass it to `unsubscribe_kv_events` when done."""
        events: asyncio.Queue[KvEvents | None] = asyncio.Queue()

        def subscribe(engine: Engine) -> None:
            self._publish_kv_events()  # the others get what happened before this snapshot
            engine.pages.is_recording_events = True
            self._kv_subscribers.append(events)
            snapshot = KvEvents(True, engine.pages.page_keys(), [])
            self._loop.call_soon_threadsafe(events.put_nowait, snapshot)  # callbacks run in order: before any delta

        await self.call(subscribe)
        return events

    async def end_kv_events(self) -> None:
        """End every subscription: each queue gets None (the worker is shutting down)."""

        def end(engine: Engine) -> None:
            for events in self._kv_subscribers:
                self._loop.call_soon_threadsafe(events.put_nowait, None)
            self._kv_subscribers.clear()
            engine.pages.is_recording_events = False
            engine.pages.take_events()

        await self.call(end)

    async def unsubscribe_kv_events(self, events: asyncio.Queue[KvEvents | None]) -> None:
        def unsubscribe(engine: Engine) -> None:
            if events in self._kv_subscribers:
                self._kv_subscribers.remove(events)
            if not self._kv_subscribers:
                engine.pages.is_recording_events = False
                engine.pages.take_events()

        await self.call(unsubscribe)

    # ---- engine thread -------------------------------------------------------------------

    def _publish_kv_events(self) -> None:
        if not self._kv_subscribers:
            return
        stored, removed = self.engine.pages.take_events()
        if stored or removed:
            for events in self._kv_subscribers:
                self._loop.call_soon_threadsafe(events.put_nowait, KvEvents(False, stored, removed))

    def wake(self) -> None:
        """From any thread: make an idle engine thread look at its work now (a KV send settled)."""
        self._commands.put(_WAKE)

    def _run(self) -> None:
        use_device(self.engine.config.device)
        next_tick = 0.0
        while not self._stopped.is_set():
            if self._queued is None:
                self._drain_commands(block=not self.engine.has_work)
            else:
                self._answer_during_step()  # a step is queued or computing: nothing else may touch the engine
            self.engine.poll_kv()  # the connector's sends, expired reservations, quarantine
            now = time.monotonic()
            if now >= next_tick:
                # not every step: counting cached pages walks the cache
                self.metrics.observe_stats(self.engine.stats())
                self._publish_kv_events()
                next_tick = now + _TICK_S
            if self._queued is not None or self.engine.has_work:
                self._step()

    def _drain_commands(self, block: bool) -> None:
        deferred, self._deferred = self._deferred, []
        for command in deferred:
            self._execute(command, is_in_step=False)
        try:
            command = self._commands.get(timeout=_TICK_S) if block and not deferred else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._execute(command, is_in_step=False)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _answer_during_step(self) -> None:
        """Run the queued commands that may run while a step computes; keep the others for after it."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            self._during_step(command)

    def _during_step(self, command: _Command) -> None:
        if command is _STEP_DONE:
            return
        if not (command.is_during_step and self._execute(command, is_in_step=True)):
            self._deferred.append(command)

    def _execute(self, command: _Command, is_in_step: bool) -> bool:
        """Run `command`; False when it must wait for the step's end (it raised WouldPreemptError)."""
        future = command.future
        try:
            result = command.run(self.engine, is_in_step)
        except Exception as exc:  # returned to the caller, which maps it to a status code
            if is_in_step and isinstance(exc, WouldPreemptError):
                return False
            if future is not None:
                self._loop.call_soon_threadsafe(_set_exception, future, exc)
            return True
        if future is not None:
            self._loop.call_soon_threadsafe(_set_result, future, result)
        return True

    def _submit(self, fn: Callable[..., _Computed], *args: Any) -> concurrent.futures.Future[_Computed]:
        """Queue a step on the compute thread; its end wakes the engine thread's wait for commands."""
        computing = self._compute.submit(fn, *args)
        computing.add_done_callback(lambda _: self._commands.put(_STEP_DONE))
        return computing

    def _wait(self, computing: concurrent.futures.Future[_Computed]) -> _Computed:
        """The step's result, once the compute thread has it; meanwhile the engine thread runs the
        commands that may run during a step and keeps the others for after it. Raises what the step raised."""
        while not computing.done():
            self._during_step(self._commands.get())
        return computing.result()

    def _schedule(self, kv_on_its_way: bool) -> SchedulerOutput:
        """`Engine.schedule`; where it runs a model (a draft model's passes), on the compute thread and
        its tuned thread count, the engine thread waiting meanwhile (no command runs during it)."""
        if not self.engine.schedule_computes:
            return self.engine.schedule()
        return self._compute.submit(self._compute_schedule, kv_on_its_way).result()

    def _compute_schedule(self, kv_on_its_way: bool) -> SchedulerOutput:
        """On the compute thread."""
        if self.threads is not None:
            self.threads.before_step(kv_on_its_way=kv_on_its_way)
        return self.engine.schedule()

    def _compute_step(self, scheduled: SchedulerOutput, kv_on_its_way: bool) -> _Computed:
        """On the compute thread: `Engine.execute` on the threads the tuner picks (torch's count is per
        thread), which it then tells how long the step took."""
        return self._timed(lambda: self.engine.execute(scheduled), scheduled.num_tokens, kv_on_its_way)

    def _compute_ahead(
        self, ahead: AheadStep, previous: concurrent.futures.Future[_Computed], kv_on_its_way: bool
    ) -> _Computed:
        """On the compute thread, right after the step before `ahead` (so `previous` is done)."""
        before, _ = previous.result()  # raises what that step raised: this one cannot run without it
        return self._timed(lambda: execute_ahead(self.engine, ahead, before), ahead.computed.num_tokens, kv_on_its_way)

    def _timed(self, compute: Callable[[], ModelOutput], rows: int, kv_on_its_way: bool) -> _Computed:
        if self.threads is not None:
            self.threads.before_step(kv_on_its_way=kv_on_its_way)
        started = time.perf_counter()
        output = compute()
        seconds = time.perf_counter() - started
        if self.threads is not None and rows:
            self.threads.after_step(seconds, rows)  # the forward's rows: decode, drafts, chunks
        return output, seconds

    def _step(self) -> None:
        """Take the step queued ahead or schedule one and compute it; queue the next one while it
        computes when that one is certain (engine/overlap.py); then record and deliver its outputs."""
        kv_on_its_way = self.engine.num_receiving > 0
        ahead: AheadStep | None = None
        if self._queued is not None:
            ahead, computing = self._queued
            scheduled = ahead.scheduled
            self._queued = None
        else:
            try:
                scheduled = self._schedule(kv_on_its_way)
            except Exception:
                self._fail_step()
                return
            computing = self._submit(self._compute_step, scheduled, kv_on_its_way)
        # not while experts are counted: a row the step ahead computes for a finished request would count
        if (
            self.engine.config.overlap_schedule
            and not self._deferred
            and not self.engine.runner.expert_recorder.is_recording
        ):
            if (after := plan_ahead(self.engine.scheduler, scheduled)) is not None:
                self._queued = (after, self._submit(self._compute_ahead, after, computing, kv_on_its_way))
        try:
            output, seconds = self._wait(computing)
            if ahead is not None:
                scheduled, output = settle_ahead(ahead, output)
            writing = self._queued[0].request_ids if self._queued is not None else frozenset()
            outputs = self.engine.update(scheduled, output, writing)
        except Exception:
            self._fail_step()
            return
        self.num_steps += 1
        if self.threads is not None:
            self.metrics.torch_threads.set(self.threads.threads)
        if ahead is not None:
            self.num_overlapped_steps += 1
        num_tokens = sum(o.token_id is not None for o in outputs)
        self.metrics.observe_step(seconds, len(outputs), num_tokens, is_overlapped=ahead is not None)
        self._deliver(*outputs)

    def _fail_step(self) -> None:
        """A step failed: once the step queued after it is over too (it fails with it), abort every
        request the engine loop serves."""
        logger.exception("engine step failed; aborting the requests it held")
        if self._queued is not None:
            concurrent.futures.wait([self._queued[1]])
            self._queued = None
        self.engine.scheduler.release_parked()
        message = "internal error in the engine step"
        for request_id in list(self._sinks):
            output = self.engine.abort(request_id, message)
            self._deliver(output or StepOutput(request_id, None, None, FinishReason.ABORT, abort_message=message))

    def _deliver(self, *outputs: StepOutput) -> None:
        """Hand `outputs` to their requests' sinks, in order, with one wake of the event loop: a
        step's outputs (one per running request) go together."""
        delivered: list[tuple[asyncio.Queue, StepOutput]] = []
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:
                continue
            # a speculative step may give one request several outputs, its finish last: only that one ends it
            if output.finish_reason is not None or output.request_id in self._prefill_only:
                del self._sinks[output.request_id]
                self._prefill_only.discard(output.request_id)
            delivered.append((sink, output))
        if delivered:
            self._loop.call_soon_threadsafe(_put_each, delivered)


@dataclass(frozen=True, slots=True)
class KvEvents:
    """One message of `EngineLoop.subscribe_kv_events`: page keys (tandem/page_keys.py) stored in and
    removed from the prefix cache; a snapshot's `stored` is every page it holds."""

    is_snapshot: bool
    stored: list[int]
    removed: list[int]


def _put_each(delivered: list[tuple[asyncio.Queue, StepOutput]]) -> None:
    for sink, output in delivered:
        sink.put_nowait(output)


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
