"""The engine loop's overlapped steps (engine/overlap.py) with real threads: a decode step queued on the
compute thread while the step before it computes. Tiny random Llama; the same requests through a loop
with and without `overlap_schedule` give the same tokens, an abort and a late prompt find their way
in between overlapped steps, and every page comes back."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import FinishReason, Request, SamplingParams, StepOutput
from engine.weights import open_checkpoint
from server_runtime.engine_loop import EngineLoop
from server_runtime.metrics import WorkerMetrics
from tests.tiny_models import save_tiny_llama

PAGE_SIZE = 4
CONFIG = EngineConfig(dtype="float32", page_size=PAGE_SIZE, max_total_tokens=1024, enable_prefix_cache=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def _requests() -> list[Request]:
    reqs = []
    for i in range(8):
        prompt = [(7 * i + 13 * j) % 250 + 3 for j in range(5 + 3 * i)]
        sampling = SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, ignore_eos=True, max_new_tokens=6 + 5 * i,
                                  presence_penalty=0.4 if i == 3 else 0.0)
        reqs.append(Request(f"r{i}", prompt, sampling))
    return reqs


async def _collect(sink: asyncio.Queue) -> list[StepOutput]:
    outputs = []
    while True:
        output = await asyncio.wait_for(sink.get(), 60)
        outputs.append(output)
        if output.finish_reason is not None:
            return outputs


def _serve(model_dir: Path, overlap: bool, abort_after: int | None = None) -> tuple[dict[str, list], EngineLoop]:
    engine = Engine(open_checkpoint(str(model_dir)), replace(CONFIG, overlap_schedule=overlap), progress=False)

    async def scenario() -> tuple[dict[str, list], EngineLoop]:
        loop = EngineLoop(engine, asyncio.get_running_loop(), WorkerMetrics("decode", "m", "0"))
        loop.start()
        try:
            sinks = {r.request_id: await loop.submit(r) for r in _requests()}
            collecting = {rid: asyncio.create_task(_collect(sink)) for rid, sink in sinks.items()}
            if abort_after is not None:
                while loop.num_steps < abort_after:
                    await asyncio.sleep(0.001)
                await loop.abort("r7")
                late = Request("late", [5, 4, 3, 2], SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=8))
                collecting["late"] = asyncio.create_task(_collect(await loop.submit(late)))
            results = {rid: [(o.token_id, o.finish_reason) for o in await task] for rid, task in collecting.items()}
            assert await loop.call(lambda e: not e.has_work)
            await loop.call(lambda e: e.pages.check_integrity())
            refs = await loop.call(lambda e: e.pages.cached_page_refs())
            assert all(n == 0 for n in refs.values())
            assert await loop.call(lambda e: e.allocator.num_used == e.pages.num_cached_pages)
        finally:
            loop.stop()
        return results, loop

    return asyncio.run(scenario())


def test_the_same_tokens_with_and_without_overlapped_steps(model_dir: Path) -> None:
    plain, plain_loop = _serve(model_dir, overlap=False)
    overlapped, loop = _serve(model_dir, overlap=True)
    assert overlapped == plain
    assert plain_loop.num_overlapped_steps == 0
    assert loop.num_overlapped_steps >= loop.num_steps // 2   # most steps decode ahead
    assert loop.metrics.overlapped_steps._value.get() == loop.num_overlapped_steps


def test_an_abort_and_a_late_prompt_between_overlapped_steps(model_dir: Path) -> None:
    plain, _ = _serve(model_dir, overlap=False)
    results, loop = _serve(model_dir, overlap=True, abort_after=6)
    assert results["r7"][-1] == (None, FinishReason.ABORT)
    assert len(results["r7"]) < len(plain["r7"])
    assert {rid: out for rid, out in results.items() if rid not in ("r7", "late")} == {
        rid: out for rid, out in plain.items() if rid != "r7"
    }
    assert len(results["late"]) == 8 and loop.num_overlapped_steps > 0
