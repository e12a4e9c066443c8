"""Mixture-of-experts models against HF transformers: the same logits at every prefill and decode step
(tiny random Qwen2-MoE and Mixtral), and expert counts equal to HF's own routing of the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.moe import route
from engine.request import Request, SamplingParams
from engine.weights import open_checkpoint
from tests.hf_oracle import load_hf_dir
from tests.integration.test_engine_vs_hf import _assert_logits_match
from tests.tiny_models import save_tiny_mixtral, save_tiny_qwen2_moe

PROMPTS = [[5, 17, 42, 99, 3, 8, 120], [7, 7, 200], list(range(10, 40))]
NUM_NEW_TOKENS = 5


def test_tiny_qwen2_moe_logits_match_hf(tmp_path: Path) -> None:
    """Routed experts (weights not renormalized), a sigmoid-gated shared expert, and a dense layer."""
    _assert_logits_match(save_tiny_qwen2_moe(tmp_path / "qwen2_moe"))


def test_tiny_qwen2_moe_with_norm_topk_prob_logits_match_hf(tmp_path: Path) -> None:
    _assert_logits_match(save_tiny_qwen2_moe(tmp_path / "qwen2_moe", seed=1, norm_topk_prob=True))


def test_tiny_mixtral_logits_match_hf(tmp_path: Path) -> None:
    _assert_logits_match(save_tiny_mixtral(tmp_path / "mixtral"))


@pytest.mark.parametrize("save", [save_tiny_qwen2_moe, save_tiny_mixtral], ids=["qwen2_moe", "mixtral"])
def test_expert_counts_equal_hf_routing_of_every_computed_token(tmp_path: Path, save) -> None:
    """Prefill computes every prompt token; each decode step computes the previous output token, so the
    tokens counted are every token of prompt + output but the last output token."""
    model_dir = save(tmp_path / "moe")
    engine = Engine(open_checkpoint(str(model_dir)), EngineConfig(dtype="float32", page_size=4, max_total_tokens=512),
                    progress=False)
    recorder = engine.runner.expert_recorder
    engine.add_request(Request("before", [1, 2, 3], SamplingParams(temperature=0, max_new_tokens=2)))
    while engine.has_work:   # not recording: not counted
        engine.step()
    recorder.start()
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    for i, ids in enumerate(PROMPTS):
        engine.add_request(Request(f"r{i}", list(ids), SamplingParams(temperature=0, max_new_tokens=NUM_NEW_TOKENS,
                                                                       ignore_eos=True)))
    while engine.has_work:
        for out in engine.step():
            if out.token_id is not None:
                outputs[out.request_id].append(out.token_id)
    recorder.stop()
    dump = recorder.dump()

    config = engine.model_config
    hf = load_hf_dir(model_dir, torch.float32)
    expected = torch.zeros(len(dump.layer_ids), config.num_experts, dtype=torch.int64)
    for i, prompt in enumerate(PROMPTS):
        computed = prompt + outputs[f"r{i}"][:-1]
        with torch.inference_mode():
            router_logits = hf(input_ids=torch.tensor([computed]), output_router_logits=True).router_logits
        for row, logits in enumerate(router_logits):
            _, ids = route(logits, config.num_experts_per_tok, config.norm_topk_prob)
            expected[row] += torch.bincount(ids.flatten(), minlength=config.num_experts)
    num_tokens = sum(len(p) + NUM_NEW_TOKENS - 1 for p in PROMPTS)
    assert torch.tensor(dump.counts).tolist() == expected.tolist()
    assert sum(map(sum, dump.counts)) == num_tokens * config.num_experts_per_tok * len(config.moe_layer_ids)
