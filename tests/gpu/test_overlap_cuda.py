"""Overlapped steps on a GPU (engine/overlap.py through the engine loop's two threads): the shadows' decode
steps replay CUDA graphs like any decode step, and the tokens equal those of a loop without overlap. The
CPU side is tests/unit/engine/test_overlap.py and tests/integration/test_overlap_schedule.py.

Needs CUDA and FlashInfer; skipped without.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer", reason="pip install -e '.[gpu]' installs FlashInfer")

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.request import Request, SamplingParams  # noqa: E402
from engine.weights import open_checkpoint  # noqa: E402
from server_runtime.engine_loop import EngineLoop  # noqa: E402

PROMPTS = [list(range(100, 100 + n)) for n in (5, 16, 17, 40, 3)]


def _serve(model: Path, overlap: bool) -> tuple[dict[str, list[int]], int]:
    config = EngineConfig(dtype="bfloat16", device="cuda", max_total_tokens=4096, attention_backend="flashinfer",
                          sampling_backend="torch", cuda_graph_batch_sizes=(1, 2, 4, 8), overlap_schedule=overlap)
    engine = Engine(open_checkpoint(str(model)), config, progress=False)

    async def scenario() -> tuple[dict[str, list[int]], int]:
        loop = EngineLoop(engine, asyncio.get_running_loop())
        loop.start()
        try:
            sinks = {}
            for i, prompt in enumerate(PROMPTS):
                sampling = SamplingParams(temperature=0, max_new_tokens=12 + 4 * i, ignore_eos=True)
                sinks[f"r{i}"] = await loop.submit(Request(f"r{i}", list(prompt), sampling))
            tokens: dict[str, list[int]] = {}
            for rid, sink in sinks.items():
                tokens[rid] = []
                while (out := await asyncio.wait_for(sink.get(), 120)).finish_reason is None:
                    tokens[rid].append(out.token_id)
                tokens[rid].append(out.token_id)
            return tokens, loop.num_overlapped_steps
        finally:
            loop.stop()

    return asyncio.run(scenario())


def test_overlapped_decode_on_cuda_gives_the_same_tokens(smollm2_path: Path) -> None:
    plain, _ = _serve(smollm2_path, overlap=False)
    overlapped, num_overlapped = _serve(smollm2_path, overlap=True)
    assert overlapped == plain
    assert num_overlapped > 10
