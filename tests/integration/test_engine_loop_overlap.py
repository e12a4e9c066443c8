"""The engine loop answers reservations while a step computes: a step's forward pass runs on the
compute thread, a `reserve` that preempts nobody is answered before the step ends, one that would
preempt waits for the step's end and then preempts, and other commands keep their order after the
step. Real engine (tiny random Llama) and real threads; the step is held open by gating the real
`Engine.execute` on an event, so the timing is certain."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import Request, SamplingParams
from engine.weights import open_checkpoint
from server_runtime.engine_loop import EngineLoop
from server_runtime.metrics import WorkerMetrics
from tests.local_handoff import take_kv_in
from tests.tiny_models import save_tiny_llama

PAGE_SIZE = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


class GatedEngine(Engine):
    """The real engine whose `execute` (on the compute thread) waits for `release` after saying it began."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.began, self.release = threading.Event(), threading.Event()
        self.compute_threads: set[str] = set()

    def execute(self, scheduled):
        if not scheduled.is_empty:
            self.compute_threads.add(threading.current_thread().name)
            self.began.set()
            assert self.release.wait(30), "the test never released the step"
        return super().execute(scheduled)


def _engine(model_dir: Path, num_pages: int) -> GatedEngine:
    config = EngineConfig(dtype="float32", page_size=PAGE_SIZE, max_total_tokens=num_pages * PAGE_SIZE)
    engine = GatedEngine(open_checkpoint(str(model_dir)), config, progress=False)
    take_kv_in(engine)  # it takes reservations, as a decode worker's engine does
    return engine


async def _wait(event: threading.Event) -> None:
    while not event.is_set():
        await asyncio.sleep(0.005)


def test_a_reservation_is_answered_while_a_step_computes(model_dir: Path) -> None:
    engine = _engine(model_dir, num_pages=32)

    async def scenario() -> list[str]:
        loop = EngineLoop(engine, asyncio.get_running_loop(), WorkerMetrics("decode", "m", "0"))
        loop.start()
        order: list[str] = []
        try:
            sink = await loop.submit(Request("r", [3, 17, 42, 99, 5], SamplingParams(max_new_tokens=1)))
            await _wait(engine.began)

            async def later(name: str, coro) -> None:
                await coro
                order.append(name)

            tasks = [asyncio.create_task(later("count", loop.call(lambda e: len(e.scheduler.running)))),
                     asyncio.create_task(later("reserve", loop.reserve("k", 9, 0)))]
            await asyncio.wait_for(tasks[1], 10)   # answered with the step still held
            order.append("step released")
            engine.release.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 10)
            output = await asyncio.wait_for(sink.get(), 10)
            assert output.token_id is not None and output.finish_reason is not None
            assert await loop.call(lambda e: e.holds("k") and e.allocator.num_used == 3)
        finally:
            engine.release.set()
            loop.stop()
        return order

    order = asyncio.run(scenario())
    assert order == ["reserve", "step released", "count"]   # the plain command waited for the step
    assert engine.compute_threads and "engine-loop" not in engine.compute_threads


def test_a_reservation_that_would_preempt_waits_for_the_step_and_then_preempts(model_dir: Path) -> None:
    engine = _engine(model_dir, num_pages=6)

    async def scenario() -> None:
        loop = EngineLoop(engine, asyncio.get_running_loop(), WorkerMetrics("decode", "m", "0"))
        loop.start()
        try:
            engine.release.set()
            sink = await loop.submit(Request("low", list(range(3, 19)), SamplingParams(max_new_tokens=50, ignore_eos=True),
                                             priority=5))
            await asyncio.wait_for(sink.get(), 10)   # prefilled: 5 of 6 pages once it decodes
            engine.release.clear()
            engine.began.clear()
            await _wait(engine.began)   # a decode step of "low" is held
            reserving = asyncio.create_task(loop.reserve("high", 12, 0))   # 3 pages: only by preempting
            await asyncio.sleep(0.2)
            assert not reserving.done()   # it must not take pages the held step is writing
            engine.release.set()
            assert len((await asyncio.wait_for(reserving, 10)).page_ids) == 3
            assert await loop.call(lambda e: e.scheduler.num_preemptions == 1 and e.scheduler.has_resuming)
            await loop.abort("high", write_settled=True)
            await loop.abort("low")
        finally:
            engine.release.set()
            loop.stop()

    asyncio.run(scenario())


def test_the_thread_tuner_sets_the_count_on_the_thread_that_computes(model_dir: Path) -> None:
    """torch's thread count is per thread: a count set on the engine thread would not reach the
    compute thread's kernels. Every step must compute on the count the tuner chose for it."""
    import torch

    from server_runtime.threads import ThreadTuner

    engine = _engine(model_dir, num_pages=32)
    engine.release.set()
    calls: list[str] = []
    seen: list[tuple[int, int]] = []   # (count the tuner chose, count the computing thread has)

    def set_threads(count: int) -> None:
        calls.append(threading.current_thread().name)
        torch.set_num_threads(count)

    tuner = ThreadTuner(1, 2, hold_steps=2, probe_steps=2, set_threads=set_threads)
    real_execute = engine.execute

    def execute(scheduled):
        if not scheduled.is_empty:
            seen.append((tuner.threads, torch.get_num_threads()))
        return real_execute(scheduled)

    engine.execute = execute

    async def scenario() -> None:
        loop = EngineLoop(engine, asyncio.get_running_loop(), WorkerMetrics("decode", "m", "0"), tuner)
        loop.start()
        try:
            sink = await loop.submit(Request("r", [3, 17, 42, 99, 5], SamplingParams(max_new_tokens=20, ignore_eos=True)))
            while (await asyncio.wait_for(sink.get(), 30)).finish_reason is None:
                pass
        finally:
            loop.stop()

    torch_threads = torch.get_num_threads()
    try:
        asyncio.run(scenario())
    finally:
        torch.set_num_threads(torch_threads)
    assert calls and all(name.startswith("engine-compute") for name in calls)
    assert len(seen) == 20 and {chosen for chosen, _ in seen} == {1, 2}   # it probed both counts
    assert all(chosen == actual for chosen, actual in seen)


def test_a_draft_models_passes_run_where_steps_compute_on_the_tuned_count(model_dir: Path) -> None:
    """A draft model proposes inside `Engine.schedule`: the loop schedules on the compute thread, on the
    count the tuner chose, so its passes are tuned and timed with the step they draft for (on the engine
    thread they ran on the process's start-up count). The output is the plain engine's."""
    import torch

    from engine.draft_model import DraftModelProposer
    from server_runtime.threads import ThreadTuner

    config = EngineConfig(
        dtype="float32",
        page_size=PAGE_SIZE,
        max_total_tokens=128,
        speculative_algorithm="draft",
        speculative_num_draft_tokens=3,
        speculative_draft_policy="always",
    )
    engine = Engine(open_checkpoint(str(model_dir)), config, progress=False, draft=open_checkpoint(str(model_dir)))
    plain = Engine(open_checkpoint(str(model_dir)), EngineConfig(dtype="float32", page_size=PAGE_SIZE), progress=False)
    proposer = engine.scheduler.proposer
    assert isinstance(proposer, DraftModelProposer) and engine.schedule_computes and not plain.schedule_computes
    tuner = ThreadTuner(1, 2, hold_steps=2, probe_steps=2)
    seen: list[tuple[str, int, int]] = []   # (thread, count the tuner chose, count the proposing thread has)
    real_propose = proposer.propose

    def propose(asks, catch_up_s=None):
        seen.append((threading.current_thread().name, tuner.threads, torch.get_num_threads()))
        return real_propose(asks, catch_up_s)

    proposer.propose = propose
    prompt = [3, 17, 42, 99, 5, 3, 17, 42]

    async def scenario(engine: Engine, tuner: ThreadTuner | None) -> list[int]:
        loop = EngineLoop(engine, asyncio.get_running_loop(), WorkerMetrics("decode", "m", "0"), tuner)
        loop.start()
        tokens: list[int] = []
        try:
            params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
            sink = await loop.submit(Request("r", prompt, params))
            while True:
                out = await asyncio.wait_for(sink.get(), 30)
                tokens += [out.token_id] if out.token_id is not None else []
                if out.finish_reason is not None:
                    break
        finally:
            loop.stop()
        return tokens

    torch_threads = torch.get_num_threads()
    try:
        drafted = asyncio.run(scenario(engine, tuner))
        expected = asyncio.run(scenario(plain, None))
    finally:
        torch.set_num_threads(torch_threads)
    assert drafted == expected and len(drafted) == 24
    assert seen and all(name.startswith("engine-compute") for name, _, _ in seen)
    assert all(chosen == actual for _, chosen, actual in seen) and {chosen for _, chosen, _ in seen} == {1, 2}
    assert engine.scheduler.num_accepted_tokens > 0
