"""Blocking work off the event loop: `BlockingWork`, a process's one executor for blocking calls that
are not the engine's step (opening a checkpoint, compiling a grammar, the embedder's batches), and its
serial `Lane`s; `use_device`, which makes a thread's current CUDA device the worker's."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")
_BLOCKING_THREADS = 4  # a grammar compile, an embedder batch and checkpoint opens at once, with room


class BlockingWork:
    """A process's one executor for blocking calls off the event loop. Threads start as needed.

    `run` takes any free thread; a `Lane` runs its calls one at a time. Calls already running when
    the caller stops waiting (cancelled, timed out) run to their end.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._executor = concurrent.futures.ThreadPoolExecutor(_BLOCKING_THREADS, thread_name_prefix="blocking")

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Start `fn(*args)` on the executor; the returned future is the event loop's."""
        return self._loop.run_in_executor(self._executor, fn, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the executor; returns its result or raises its exception."""
        return await self.submit(fn, *args)

    def lane(self) -> Lane:
        return Lane(self)

    def close(self) -> None:
        """Drop queued calls and stop taking new ones; calls already running end on their own."""
        self._executor.shutdown(wait=False, cancel_futures=True)


class Lane:
    """Calls on `BlockingWork`, one at a time, in arrival order: for work that is single-threaded
    (the embedder) or that must not pile up (grammar compiles). A call whose caller stopped
    waiting keeps the lane until it ends, so abandoned calls never overlap the next."""

    def __init__(self, work: BlockingWork) -> None:
        self._work = work
        self._free = asyncio.Lock()

    async def run(self, fn: Callable[..., T], *args: Any, timeout_s: float | None = None) -> T:
        """`fn(*args)` once the lane is free. `timeout_s` bounds the call itself, not the wait for
        the lane: past it, TimeoutError (the call goes on, holding the lane)."""
        await self._free.acquire()
        try:
            call = self._work.submit(fn, *args)
        except BaseException:
            self._free.release()
            raise
        call.add_done_callback(self._release)
        return await asyncio.wait_for(asyncio.shield(call), timeout_s)

    def _release(self, call: asyncio.Future) -> None:
        self._free.release()
        if not call.cancelled():
            call.exception()  # collected here: a caller that stopped waiting has had its answer


def use_device(device: str) -> None:
    """Make `device` (an `EngineConfig.device`) this thread's current CUDA device when it names one by
    index. CUDA's current device is per thread, and what does not follow a tensor's device (streams,
    events, FlashInfer's kernels, CUDA-graph capture and replay) follows it: a worker on cuda:1 calls
    this on the thread that builds its engine and on the engine thread. No-op for "cpu" and "cuda"
    (device 0, the default)."""
    index = torch.device(device).index if device.startswith("cuda") else None
    if index is not None:
        torch.cuda.set_device(index)
