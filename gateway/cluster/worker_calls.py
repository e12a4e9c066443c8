"""Each call a trip makes to a worker, watched for stalls, and the releases that end a trip early.

`unless_stalled` awaits a call's answer and, each time `--stall-timeout` passes without one, checks
that the worker still answers health checks; a call that fails because of its worker marks the worker
(`Worker.record_failure`) and one that is answered clears its count (`Worker.record_success`).
`release` frees a decode worker's pages for an unfinished trip (asking a ready prefill worker first to
confirm that no KV write into them is still running), and `settle` runs such a release to its end even
if the trip that started it is cancelled again. Event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

from gateway.cluster.client import DecodeStream
from gateway.cluster.worker import Worker
from gateway.cluster.worker_errors import WorkerError, stalled_error
from gateway.cluster.worker_records import KvTarget, PrefillResult
from gateway.errors import APIError
from gateway.records import TokenChunk

logger = logging.getLogger(__name__)

T = TypeVar("T")

_ABORT_TIMEOUT_S = 2.0
_SETTLE_TIMEOUT_S = 10.0  # a running KV write finishes within this (or the decode pages rest for the grace)


class PrefillAnswered(Exception):
    """The prefill server answered with an error: its KV write, if any, is over."""

    def __init__(self, error: APIError) -> None:
        self.error = error


async def prefill_answer(worker: Worker, call: Awaitable[PrefillResult], stall_timeout_s: float) -> PrefillResult:
    """The prefill's answer. A failure the worker itself answered is raised as `PrefillAnswered`;
    one the client side raised (deadline, cancel, lost connection, a stall) as is: the write may
    still be running then."""
    try:
        return await unless_stalled(worker, call, stall_timeout_s)
    except WorkerError as exc:
        if not exc.is_settled:
            raise
        raise PrefillAnswered(exc) from None


async def chunks(worker: Worker, stream: DecodeStream, stall_timeout_s: float) -> AsyncGenerator[TokenChunk, None]:
    while (chunk := await unless_stalled(worker, stream.read(), stall_timeout_s)) is not None:
        yield chunk


async def unless_stalled(worker: Worker, awaitable: Awaitable[T], stall_timeout_s: float) -> T:
    """Await a call's answer; each time `stall_timeout_s` passes without one, check that the worker
    still answers health checks. A worker that does not (frozen, wedged, its host gone) ends the
    wait with a 503 and is marked unready; a slow but live one (a long prompt, a queue) is waited for.
    A call that fails because of its worker marks the worker (`Worker.record_failure`); an answer
    clears its count of failures in a row (`Worker.record_success`)."""
    pending = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait((pending,), timeout=stall_timeout_s)
            if done:
                answer = pending.result()
                worker.record_success()
                return answer
            if not await worker.responds():
                logger.warning(
                    "%s worker %s sent nothing for %g s and does not answer health checks",
                    worker.role,
                    worker.address,
                    stall_timeout_s,
                )
                raise stalled_error(worker.role, worker.address, stall_timeout_s)
    except WorkerError as exc:
        if exc.is_worker_failure:
            worker.record_failure(exc)
        raise
    finally:
        pending.cancel()


async def release(decode: Worker, prefill: Worker, request_id: str, unsettled: KvTarget | None) -> None:
    """Free the decode server's pages for an unfinished trip. `unsettled` is the KV target of a
    Prefill that has not answered: the prefill server is asked to stop it and confirm its write is
    over, so the decode server frees the pages at once; if it cannot confirm, they rest for the
    write grace instead. A prefill worker that is not ready (just marked failed, or stalled) is not
    asked: waiting on it would only delay the failover. (Cancelling a Generate stream frees the
    pages too; the Abort makes it certain.)"""
    write_settled = unsettled is None
    if unsettled is not None:
        is_asked = prefill.is_ready
        if is_asked:
            with contextlib.suppress(WorkerError):
                await prefill.client.cancel_prefill(request_id, unsettled, timeout_s=_SETTLE_TIMEOUT_S)
                write_settled = True
        if not write_settled:
            logger.warning(
                "prefill worker %s did not confirm that %s's KV write is over%s; its decode pages "
                "rest for the write grace",
                prefill.address,
                request_id,
                "" if is_asked else " (it is not ready: not asked)",
            )
    await abort(decode, request_id, write_settled)


async def abort(decode: Worker, request_id: str, write_settled: bool = True) -> None:
    with contextlib.suppress(WorkerError):
        await decode.client.abort(request_id, write_settled, timeout_s=_ABORT_TIMEOUT_S)


_releasing: set[asyncio.Task] = set()  # strong references: a shielded release outlives its cancelled trip


async def settle(release: Awaitable[None]) -> None:
    """Run a release to its end even if the trip that started it is cancelled again meanwhile."""
    task = asyncio.ensure_future(release)
    _releasing.add(task)
    task.add_done_callback(_releasing.discard)
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.shield(task)
