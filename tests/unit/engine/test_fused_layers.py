"""Fused decoder layers (engine/models/layers.py `DecoderLayer.fuse`, kernels/fused_layer.py): a layer
run as one C++ call gives the same bits as its modules run one by one, on the bundled model, on a
Qwen2 (q/k/v biases) quantized at load, on a Qwen2 GGUF of K-quants whose q/k/v and gate/up each mix
two formats, and on every other dense family (Qwen3's q/k norms, Gemma 3's sandwich norms, GeLU,
scale and local rotary, Mistral's and Phi-3's sliding windows, prompts longer than the window), with
float32 and bfloat16 KV pools; and only layers whose every part that call computes are fused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import Request, SamplingParams
from engine.weights import open_checkpoint
from tests.tiny_models import (
    TINY_WINDOW,
    save_tiny_gemma3,
    save_tiny_mistral,
    save_tiny_phi3,
    save_tiny_qwen2,
    save_tiny_qwen2_moe,
    save_tiny_qwen3,
)
from tests.unit.kernels.gguf_random import save_tiny_kquant_model


def _engine(path: Path, **config: object) -> Engine:
    return Engine(open_checkpoint(str(path)), EngineConfig(**{"max_total_tokens": 2048, **config}), progress=False)


def _generate(engine: Engine, prompts: list[list[int]], tokens: int) -> dict[str, list[tuple[int, float]]]:
    """Greedy tokens and their logprobs: a batch prefill of every prompt, then batched decodes."""
    sampling = SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(Request(f"r{i}", ids, sampling))
    out: dict[str, list[tuple[int, float]]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work:
        for step in engine.step():
            if step.token_id is not None:
                out[step.request_id].append((step.token_id, step.logprob))
    return out


def _unfuse(engine: Engine) -> None:
    for layer in engine.runner.model.model.layers:
        layer.fused = None


def test_the_bundled_model_fused_gives_the_bits_of_its_modules(smollm2_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 40000, (n,), generator=gen).tolist() for n in (37, 5, 70)]
    fused = _engine(smollm2_path, dtype="float32", quantization="gguf")
    assert all(layer.fused is not None for layer in fused.runner.model.model.layers)
    modules = _engine(smollm2_path, dtype="float32", quantization="gguf")
    _unfuse(modules)
    assert _generate(fused, prompts, 6) == _generate(modules, prompts, 6)


def test_a_qwen2_with_biases_quantized_at_load_fused_gives_the_same_bits(tmp_path: Path) -> None:
    path = save_tiny_qwen2(tmp_path / "qwen2")
    prompts = [[5, 9, 200, 17, 3, 44], [7, 8], list(range(20, 60))]
    for quantization in ("q8_0", "q4_1"):
        fused = _engine(path, dtype="float32", quantization=quantization, page_size=4)
        assert all(layer.fused is not None for layer in fused.runner.model.model.layers)
        modules = _engine(path, dtype="float32", quantization=quantization, page_size=4)
        _unfuse(modules)
        assert _generate(fused, prompts, 5) == _generate(modules, prompts, 5)


def test_a_gguf_of_k_quants_and_mixed_fused_projections_fused_gives_the_same_bits(tmp_path: Path) -> None:
    types = {"q_proj.weight": GGML.Q5_0, "k_proj.weight": GGML.Q5_0, "v_proj.weight": GGML.Q8_0,
             "o_proj.weight": GGML.Q4_K, "gate_proj.weight": GGML.Q5_K, "up_proj.weight": GGML.Q4_K,
             "down_proj.weight": GGML.Q6_K, "lm_head.weight": GGML.Q6_K}
    path = save_tiny_kquant_model(tmp_path / "hf", tmp_path / "kq.gguf", types)
    prompts = [[5, 9, 200, 17, 3, 44], [7, 8], list(range(20, 60))]
    fused = _engine(path, dtype="float32", quantization="gguf", page_size=4)
    layer = fused.runner.model.model.layers[0]
    assert layer.fused is not None and len(layer.self_attn.qkv_proj.quantized.segments) == 2
    modules = _engine(path, dtype="float32", quantization="gguf", page_size=4)
    _unfuse(modules)
    assert _generate(fused, prompts, 5) == _generate(modules, prompts, 5)


def test_only_layers_the_call_computes_are_fused(tmp_path: Path, smollm2_path: Path) -> None:
    assert not any(layer.fused for layer in _engine(smollm2_path, dtype="float32").runner.model.model.layers)
    torch_attention = _engine(smollm2_path, dtype="float32", quantization="gguf", attention_backend="torch")
    assert not any(layer.fused for layer in torch_attention.runner.model.model.layers)
    moe = _engine(save_tiny_qwen2_moe(tmp_path / "moe"), dtype="float32", quantization="q8_0")
    assert [layer.fused is not None for layer in moe.runner.model.model.layers] == [False, True, False]


def test_a_float32_model_over_a_bfloat16_pool_by_config(smollm2_path: Path) -> None:
    """`kv_cache_dtype`: the pool (and the layout workers compare) in bfloat16 under float32 rows. The
    fused layers give the bits of their modules over it (the C++ store rounds to nearest even, as torch
    does), and the same tokens as the torch attention backend (torch rotary store and SDPA)."""
    fused = _engine(smollm2_path, dtype="float32", quantization="gguf", kv_cache_dtype="bfloat16")
    assert fused.runner.kv_pool.tensor.dtype == torch.bfloat16 and fused.runner.layout.dtype == torch.bfloat16
    assert all(layer.fused is not None for layer in fused.runner.model.model.layers)
    modules = _engine(smollm2_path, dtype="float32", quantization="gguf", kv_cache_dtype="bfloat16")
    _unfuse(modules)
    torch_path = _engine(
        smollm2_path, dtype="float32", quantization="gguf", kv_cache_dtype="bfloat16", attention_backend="torch"
    )
    prompts = [[1, 9690, 198, 2683, 359, 253], [4093, 198, 1780]]
    ours = _generate(fused, prompts, 4)
    assert ours == _generate(modules, prompts, 4)
    theirs = _generate(torch_path, prompts, 4)
    assert {k: [t for t, _ in v] for k, v in ours.items()} == {k: [t for t, _ in v] for k, v in theirs.items()}


@pytest.mark.parametrize("save", [save_tiny_qwen3, save_tiny_gemma3, save_tiny_mistral, save_tiny_phi3],
                         ids=["qwen3", "gemma3", "mistral", "phi3"])
@pytest.mark.parametrize(("quantization", "kv_cache_dtype"), [("q8_0", "float32"), ("q4_1", "bfloat16")])
def test_every_dense_family_fuses_every_layer_with_the_bits_of_its_modules(
    save: Callable[[Path], Path], quantization: str, kv_cache_dtype: str, tmp_path: Path
) -> None:
    """Prompts longer than the sliding window (page_size 4: windows start mid-page), a short one, and
    decodes past the window; every layer fused, and the tokens and logprobs of the modules."""
    path = save(tmp_path / "model")
    prompts = [list(range(20, 20 + 3 * TINY_WINDOW)), [7, 8, 9], [5, 9, 200, 17, 3, 44, 61, 90, 100, 11]]
    config = {"dtype": "float32", "quantization": quantization, "kv_cache_dtype": kv_cache_dtype, "page_size": 4}
    fused = _engine(path, **config)
    num_layers = len(fused.runner.model.model.layers)
    assert fused.runner.model.fuse_layers(fused.runner.attention, fused.runner.kv_dtype) == num_layers
    modules = _engine(path, **config)
    _unfuse(modules)
    assert _generate(fused, prompts, 2 * TINY_WINDOW) == _generate(modules, prompts, 2 * TINY_WINDOW)
