"""Each model family against HF transformers in fp32, on tiny random-weight checkpoints: the same logits
at every position of a batched prefill and of batched decode steps, and the same greedy tokens, with
prompts that run past the sliding window of the families that have one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import Request, SamplingParams
from engine.weights import open_checkpoint
from tests.hf_oracle import assert_logits_match_hf, hf_greedy, load_hf_dir
from tests.tiny_models import (
    TINY_WINDOW,
    save_tiny_gemma3,
    save_tiny_llama,
    save_tiny_mistral,
    save_tiny_phi3,
    save_tiny_qwen2,
    save_tiny_qwen3,
)

FAMILIES: dict[str, Callable[[Path], Path]] = {
    "llama": save_tiny_llama,
    "qwen2": save_tiny_qwen2,
    "qwen3": save_tiny_qwen3,
    "mistral": save_tiny_mistral,
    "phi3": save_tiny_phi3,
    "gemma3": save_tiny_gemma3,
}
PAGE = 4


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_flush_denormal(True)
    return FAMILIES[request.param](tmp_path_factory.mktemp(request.param))


def _engine(model_dir: Path, attention_backend: str = "auto") -> Engine:
    config = EngineConfig(dtype="float32", page_size=PAGE, max_total_tokens=512, attention_backend=attention_backend)
    return Engine(open_checkpoint(str(model_dir)), config, progress=False)


@pytest.mark.parametrize("attention_backend", ["auto", "torch"])
def test_prefill_and_decode_logits_match_hf(family_dir: Path, attention_backend: str) -> None:
    """Three prompts of different lengths (one longer than the window) prefill in one batch, then decode
    six steps together: each row's logits equal HF's full forward at that position. `auto` is the C++
    kernel (the fused layer); `torch` is the path a GPU backend takes, each layer's window passed to `attend`."""
    engine, hf = _engine(family_dir, attention_backend), load_hf_dir(family_dir, torch.float32)
    assert_logits_match_hf(engine, hf, (5, 2 * TINY_WINDOW + 3, 2), PAGE, num_decode_steps=6)


def test_greedy_tokens_match_hf_past_the_window(family_dir: Path) -> None:
    """Greedy generation through the engine's scheduler (batched, paged) equals HF's, token for token,
    for 3 * window new tokens after prompts shorter and longer than the window."""
    engine, hf = _engine(family_dir), load_hf_dir(family_dir, torch.float32)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (3, TINY_WINDOW + 5)]
    num_tokens = 3 * TINY_WINDOW
    sampling = SamplingParams(temperature=0, max_new_tokens=num_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(Request(f"r{i}", list(ids), sampling))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work:
        for out in engine.step():
            if out.token_id is not None:
                outputs[out.request_id].append(out.token_id)
    for i, ids in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(hf, ids, num_tokens)
    assert engine.allocator.num_free == engine.allocator.num_pages
