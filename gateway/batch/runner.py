"""Runs batches in the background of the gateway, at lower priority than interactive requests.

Each unfinished batch has one asyncio task: validate (parse the input file, store its lines), run
every unanswered line, then finalize (write the output and error files). A line is answered by its
endpoint's operation (`gateway/service/batch_line.py`), with the validation and the errors an HTTP
client of that route gets. Its answer is stored before the line
counts as done (`BatchStore.record_result`), so after a restart the gateway resumes every unfinished
batch and runs only the lines with no answer: each custom_id is answered exactly once.

Priority: at most `concurrency` lines run at once, over all batches (one semaphore), and a new line
starts only while fewer than `InteractiveTraffic.yield_threshold` interactive requests are in
flight (default 1: any interactive request holds new batch lines back; lines already running go
on) and while a prefill and a decode worker are ready. A line runs as a batch `Caller`
(`gateway/caller.py`): the admission queue and the workers rank it below every interactive request,
in the order of its own `priority`, and the batches take turns as tenants. A line answered 503 (no worker ready, KV
capacity) is run again after a pause, up to `_MAX_ATTEMPTS` times in all.

Cancelling a batch stops new lines and cancels the running ones (their workers abort them; they stay
unanswered), then finalizes it as `cancelled` with the answers it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request

from gateway.batch.lines import BatchError, ParsedInput, parse_input, response_line
from gateway.batch.records import BatchRecord, BatchStatus, PendingLine
from gateway.batch.store import BatchStore
from gateway.batch.traffic import InteractiveTraffic
from gateway.caller import Caller, bind_caller
from gateway.service.batch_line import answer_line

logger = logging.getLogger(__name__)

_MAX_ATTEMPTS = 4
_RETRY_DELAY_S = 1.0
_READY_POLL_S = 0.5
_PENDING_CHUNK = 64


@dataclass(slots=True)
class _Job:
    batch_id: str
    task: asyncio.Task | None = None
    dispatch: asyncio.Task | None = None
    is_cancel_requested: bool = False


# A line's answer: (endpoint, body) -> (HTTP status, JSON body), as an HTTP client of the endpoint would get it.
AnswerLine = Callable[[str, str], Awaitable[tuple[int, dict]]]


class BatchRunner:
    """Owns the batch tasks. `start()` resumes unfinished batches; `submit()` a new one; `cancel()`
    after `BatchStore.request_cancel`; `stop()` cancels everything (unanswered lines run again later)."""

    def __init__(
        self,
        store: BatchStore,
        answer: AnswerLine,
        traffic: InteractiveTraffic,
        concurrency: int,
        is_ready: Callable[[], bool],
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"batch concurrency must be >= 1, got {concurrency}")
        self._store = store
        self._traffic = traffic
        self._is_ready = is_ready
        self._slots = asyncio.Semaphore(concurrency)
        self._jobs: dict[str, _Job] = {}
        self._answer = answer

    async def start(self) -> None:
        for batch_id in await self._store.run(self._store.unfinished_batch_ids):
            logger.info("resuming batch %s", batch_id)
            self.submit(batch_id)

    def submit(self, batch_id: str) -> None:
        job = _Job(batch_id)
        job.task = asyncio.create_task(self._run(job), name=f"batch {batch_id}")
        job.task.add_done_callback(lambda _: self._jobs.pop(batch_id, None))
        self._jobs[batch_id] = job

    def cancel(self, batch_id: str) -> None:
        job = self._jobs.get(batch_id)
        if job is None:
            return
        job.is_cancel_requested = True
        if job.dispatch is not None:
            job.dispatch.cancel()

    async def stop(self) -> None:
        tasks = [job.task for job in self._jobs.values() if job.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, job: _Job) -> None:
        store = self._store
        try:
            batch = await store.run(store.get_batch, job.batch_id)
            if batch.status is BatchStatus.VALIDATING:
                batch = await self._validate(batch)
            if batch.status is BatchStatus.IN_PROGRESS and not job.is_cancel_requested:
                job.dispatch = asyncio.create_task(self._dispatch(batch))
                try:
                    await asyncio.wait({job.dispatch})
                finally:  # the gateway is stopping: stop the lines, leave the batch to the next start
                    job.dispatch.cancel()
                    await asyncio.wait({job.dispatch})
                if not job.dispatch.cancelled() and (failure := job.dispatch.exception()) is not None:
                    raise failure
            batch = await store.run(store.finalize, job.batch_id)
            logger.info(
                "batch %s %s: %d completed, %d failed of %d",
                batch.id,
                batch.status.value,
                batch.num_completed,
                batch.num_failed,
                batch.num_total,
            )
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("batch %s stopped; it resumes when the gateway next starts", job.batch_id)

    async def _validate(self, batch: BatchRecord) -> BatchRecord:
        path = self._store.file_path(batch.input_file_id)
        try:
            parsed = await asyncio.to_thread(_parse_file, path, batch.endpoint)
        except FileNotFoundError:
            errors = (BatchError("input_file_missing", f"the input file {batch.input_file_id} was deleted"),)
            parsed = ParsedInput((), errors)
        if parsed.errors:
            return await self._store.run(self._store.fail_batch, batch.id, parsed.errors)
        return await self._store.run(self._store.start_batch, batch.id, parsed.lines)

    async def _dispatch(self, batch: BatchRecord) -> None:
        """Start every unanswered line as slots free up; return when all have been answered."""
        running: set[asyncio.Task] = set()

        def line_done(task: asyncio.Task) -> None:
            running.discard(task)
            self._slots.release()

        try:
            async for line in self._pending(batch.id):
                await self._slots.acquire()
                try:
                    await self._traffic.wait_quiet()
                    await self._wait_ready()
                except BaseException:
                    self._slots.release()
                    raise
                task = asyncio.create_task(self._run_line(batch, line))
                running.add(task)
                task.add_done_callback(line_done)
            await asyncio.gather(*running)
        finally:
            for task in list(running):
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _pending(self, batch_id: str) -> AsyncIterator[PendingLine]:
        after = -1
        while lines := await self._store.run(self._store.pending_lines, batch_id, after, _PENDING_CHUNK):
            for line in lines:
                yield line
            after = lines[-1].line_index

    async def _run_line(self, batch: BatchRecord, line: PendingLine) -> None:
        request_id = uuid.uuid4().hex
        bind_caller(Caller(f"batch-{batch.id}", is_batch=True))  # below every interactive request; batches take turns
        for attempt in range(_MAX_ATTEMPTS):
            status, body = await self._answer(batch.endpoint, line.body)
            if status != 503 or attempt == _MAX_ATTEMPTS - 1:
                break
            await asyncio.sleep(_RETRY_DELAY_S * 2**attempt)
            await self._wait_ready()
        result, is_error = response_line(line.custom_id, request_id, status, body)
        await self._store.run(self._store.record_result, batch.id, line.line_index, result, is_error)

    async def _wait_ready(self) -> None:
        while not self._is_ready():
            await asyncio.sleep(_READY_POLL_S)


def _parse_file(path, endpoint: str) -> ParsedInput:
    with open(path, "rb") as f:
        return parse_input(f, endpoint)


@dataclass(frozen=True, slots=True)
class BatchService:
    """What the files and batches routes need (held on `app.state.batches`)."""

    store: BatchStore
    runner: BatchRunner


def batch_service(request: Request) -> BatchService:
    return request.app.state.batches


@contextlib.asynccontextmanager
async def run_batches(
    app,
    data_dir: str,
    traffic: InteractiveTraffic,
    concurrency: int,
    is_ready: Callable[[], bool],
) -> AsyncIterator[BatchService]:
    """Open the store, resume unfinished batches, and set `app.state.batches` for the routes; on exit
    stop the runner (running lines are cancelled and run again at the next start) and close the store.
    The lines run on the operations of `app.state.gateway`."""
    store = BatchStore(data_dir)
    runner = BatchRunner(store, functools.partial(answer_line, app.state.gateway), traffic, concurrency, is_ready)
    app.state.batches = BatchService(store, runner)
    try:
        await runner.start()
        yield app.state.batches
    finally:
        await runner.stop()
        store.close()
