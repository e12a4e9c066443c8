"""The engine against HF transformers: same greedy tokens (SmolLM2, fp32), same logits (tiny configs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.page_allocator import pages_needed
from engine.request import Request, SamplingParams
from engine.weights import open_checkpoint
from gateway.text.tokenizer import load_tokenizer
from tests.hf_oracle import assert_logits_match_hf, greedy_reference, hf_greedy, load_hf_dir, load_hf_smollm2
from tests.tiny_models import save_tiny_llama, save_tiny_qwen2

PROMPTS = [
    "What is the capital of France?",
    "List 3 countries and their capitals.",
    "Write a haiku about the sea.",
    "Explain what a prime number is.",
    "Say this is a test",
]
NUM_TOKENS = 32


def _generate(engine: Engine, prompts: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
    for i, ids in enumerate(prompts):
        engine.add_request(Request(f"r{i}", list(ids), sampling))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work:
        for out in engine.step():
            if out.token_id is not None:
                outputs[out.request_id].append(out.token_id)
    return [outputs[f"r{i}"] for i in range(len(prompts))]


def test_smollm2_fp32_greedy_matches_hf_token_for_token(smollm2_path: Path) -> None:
    tokenizer = load_tokenizer(str(smollm2_path))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    engine = Engine(open_checkpoint(str(smollm2_path)), EngineConfig(dtype="float32", max_total_tokens=2048),
                    progress=False)
    # all five prompts prefill in one batch and decode together: batching must not change tokens
    ours = _generate(engine, prompts, SamplingParams(temperature=0, max_new_tokens=NUM_TOKENS, ignore_eos=True))
    assert engine.allocator.num_free == engine.allocator.num_pages
    expected = greedy_reference(smollm2_path, "hf_greedy", prompts, NUM_TOKENS,
                                lambda: [hf_greedy(load_hf_smollm2(smollm2_path), ids, NUM_TOKENS) for ids in prompts])
    for prompt, tokens, reference in zip(PROMPTS, ours, expected):
        assert tokens == reference, prompt
    assert "Paris" in tokenizer.decode(ours[0])


def _assert_logits_match(model_dir: Path) -> None:
    """Prefill three prompts of different lengths in one batch, then decode four steps together;
    every step's logits must equal HF's full-sequence forward at the same position."""
    engine = Engine(open_checkpoint(str(model_dir)), EngineConfig(dtype="float32", page_size=4, max_total_tokens=256),
                    progress=False)
    assert_logits_match_hf(engine, load_hf_dir(model_dir, torch.float32), (5, 11, 2), page_size=4, num_decode_steps=5)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tiny_llama_logits_match_hf(tmp_path: Path, tied: bool) -> None:
    _assert_logits_match(save_tiny_llama(tmp_path / "llama", tie_word_embeddings=tied))


def test_tiny_qwen2_with_qkv_bias_logits_match_hf(tmp_path: Path) -> None:
    _assert_logits_match(save_tiny_qwen2(tmp_path / "qwen2"))


def test_smollm2_bf16_logits_stay_close_to_fp32(smollm2_path: Path) -> None:
    tokenizer = load_tokenizer(str(smollm2_path))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[1]}])
    checkpoint = open_checkpoint(str(smollm2_path))
    results = {}
    for dtype in ("float32", "bfloat16"):
        engine = Engine(checkpoint, EngineConfig(dtype=dtype, max_total_tokens=512), progress=False)
        req = Request("r", list(ids), SamplingParams())
        req.page_ids = engine.allocator.allocate(pages_needed(len(ids), 16))
        results[dtype] = engine.runner.forward_logits([req])[0]
    ref, low = results["float32"], results["bfloat16"]
    assert int(ref.argmax()) == int(low.argmax())
    probs_ref, probs_low = ref.softmax(-1), low.softmax(-1)
    assert (probs_ref - probs_low).abs().sum() < 0.1   # total variation distance under 5%
