"""Tests for engine.weight_loader: fused projections, GGUF blocks kept packed, quantization at load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from engine.config import EngineConfig
from engine.engine import Engine
from engine.page_allocator import pages_needed
from engine.request import Request, SamplingParams
from engine.weight_loader import MergedLinear
from engine.weights import open_checkpoint
from kernels.quant import QuantFormat
from kernels.quant_linear import QuantizedEmbedding, QuantizedLinear
from tests.tiny_models import save_tiny_gguf, save_tiny_llama
from tests.unit.kernels.gguf_random import save_tiny_kquant_model

MIXED = {"q_proj.weight": GGML.Q4_1, "k_proj.weight": GGML.Q8_0, "v_proj.weight": GGML.Q4_1,
         "o_proj.weight": GGML.Q4_0, "gate_proj.weight": GGML.Q4_1, "up_proj.weight": GGML.Q4_1,
         "down_proj.weight": GGML.Q8_0, "embed_tokens.weight": GGML.Q8_0}


# what Q4_K_M files hold (Qwen2.5-Coder-0.5B: q/k/o/gate/up/embedding Q5_0, v Q8_0, down Q6_K or Q4_K)
K_QUANTS = {"q_proj.weight": GGML.Q5_0, "k_proj.weight": GGML.Q5_0, "v_proj.weight": GGML.Q8_0,
            "o_proj.weight": GGML.Q5_K, "gate_proj.weight": GGML.Q4_K, "up_proj.weight": GGML.Q5_0,
            "down_proj.weight": GGML.Q6_K, "embed_tokens.weight": GGML.Q5_0, "lm_head.weight": GGML.Q6_K}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("llama"), tie_word_embeddings=True)


@pytest.fixture(scope="module")
def mixed_gguf(tiny_dir: Path, tmp_path_factory) -> Path:
    return save_tiny_gguf(tiny_dir, tmp_path_factory.mktemp("gguf") / "mixed.gguf", quantize=MIXED)


def _engine(path: Path, quantization: str) -> Engine:
    return Engine(open_checkpoint(str(path)), EngineConfig(dtype="float32", page_size=4, max_total_tokens=256,
                                                           quantization=quantization), progress=False)


def _logits(engine: Engine) -> torch.Tensor:
    """Prefill two prompts, then one decode step; both steps' logits stacked."""
    generator = torch.Generator().manual_seed(0)
    requests = [Request(f"r{n}", torch.randint(3, 256, (n,), generator=generator).tolist(), SamplingParams())
                for n in (7, 12)]
    for req in requests:
        req.page_ids = engine.allocator.allocate(pages_needed(req.prompt_len + 1, 4))
    first = engine.runner.forward_logits(requests)
    for row, req in enumerate(requests):
        req.num_computed = req.prompt_len
        req.output_ids.append(int(first[row].argmax()))
    second = engine.runner.forward_logits(requests)
    for req in requests:
        engine.allocator.free(req.page_ids)
    return torch.cat([first, second])


def test_packed_gguf_blocks_dequantize_to_exactly_the_float_path(mixed_gguf: Path) -> None:
    checkpoint = open_checkpoint(str(mixed_gguf))
    floats = dict(checkpoint.tensors(progress=False))
    packed = dict(checkpoint.tensors(progress=False, keep_quantized=True))
    formats = {name: value.format for name, value in packed.items() if not isinstance(value, torch.Tensor)}
    assert formats["model.layers.0.self_attn.q_proj.weight"] is QuantFormat.Q4_1   # rows un-permuted as blocks
    assert formats["model.layers.1.self_attn.k_proj.weight"] is QuantFormat.Q8_0
    assert formats["model.layers.0.self_attn.o_proj.weight"] is QuantFormat.Q4_0
    assert "model.norm.weight" not in formats
    for name, value in packed.items():
        expected = floats[name]
        got = value if isinstance(value, torch.Tensor) else value.dequantize()
        assert torch.equal(got, expected), name


def test_gguf_mode_keeps_the_files_formats_and_packs_parts_of_mixed_formats(mixed_gguf: Path) -> None:
    engine = _engine(mixed_gguf, "gguf")
    layer = engine.runner.model.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear)        # Q4_1 + Q8_0 + Q4_1: three segments, one call
    assert qkv.quantized.formats == (QuantFormat.Q4_1, QuantFormat.Q8_0, QuantFormat.Q4_1)
    assert isinstance(layer.mlp.gate_up_proj, QuantizedLinear)
    assert layer.mlp.gate_up_proj.quantized.format is QuantFormat.Q4_1
    assert layer.self_attn.o_proj.quantized.format is QuantFormat.Q4_0
    assert layer.mlp.down_proj.quantized.format is QuantFormat.Q8_0
    embed = engine.runner.model.model.embed_tokens
    assert isinstance(embed, QuantizedEmbedding)
    assert engine.runner.model.lm_head.quantized is embed.quantized              # tied: one packed table
    reference = _logits(_engine(mixed_gguf, "none"))                             # same weights, dequantized
    ours = _logits(engine)
    assert torch.nn.functional.cosine_similarity(ours, reference, dim=-1).min() > 0.999


@pytest.mark.parametrize("mode,fmt,min_cosine", [("q8_0", QuantFormat.Q8_0, 0.999), ("q4_0", QuantFormat.Q4_0, 0.95),
                                                 ("q4_1", QuantFormat.Q4_1, 0.95)])
def test_safetensors_weights_are_quantized_at_load(tiny_dir: Path, mode: str, fmt: QuantFormat,
                                                   min_cosine: float) -> None:
    engine = _engine(tiny_dir, mode)
    model = engine.runner.model
    for layer in model.model.layers:
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                       layer.mlp.down_proj):
            assert isinstance(module, QuantizedLinear) and module.quantized.format is fmt
    assert model.model.embed_tokens.quantized.format is QuantFormat.Q8_0        # the table stays 8-bit
    reference = _logits(_engine(tiny_dir, "none"))
    assert torch.nn.functional.cosine_similarity(_logits(engine), reference, dim=-1).min() > min_cosine


def test_update_weights_reloads_a_quantized_model_in_place(mixed_gguf: Path) -> None:
    engine = _engine(mixed_gguf, "gguf")
    before = _logits(engine)
    identity = engine.weights_id
    engine.update_weights(open_checkpoint(str(mixed_gguf)))
    assert engine.weights_id == identity   # the same file: the same weights
    assert torch.equal(_logits(engine), before)


def test_the_bundled_model_keeps_its_q4_1_layers_and_q8_0_table(smollm2_path: Path) -> None:
    engine = Engine(open_checkpoint(str(smollm2_path)), EngineConfig(dtype="float32", quantization="gguf",
                                                                    max_total_tokens=512), progress=False)
    model = engine.runner.model
    assert all(layer.self_attn.qkv_proj.quantized.format is QuantFormat.Q4_1 for layer in model.model.layers)
    assert all(layer.mlp.gate_up_proj.quantized.format is QuantFormat.Q4_1 for layer in model.model.layers)
    assert model.lm_head.quantized is model.model.embed_tokens.quantized
    assert model.lm_head.quantized.format is QuantFormat.Q8_0
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
              8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    engine.add_request(Request("r", prompt, SamplingParams(temperature=0, max_new_tokens=8)))
    tokens = []
    while engine.has_work:
        tokens += [o.token_id for o in engine.step() if o.token_id is not None]
    assert tokens[:5] == [504, 3575, 282, 4649, 314]    # "The capital of France is"


@pytest.mark.parametrize("llama", [False, True], ids=["qwen2", "llama"])
def test_a_q4_k_m_like_file_stays_packed_in_its_formats(tmp_path: Path, llama: bool) -> None:
    """Every projection packed as the file has it (q/k/v and gate/up as segments of two formats), the
    blocks dequantizing to exactly the float path's tensors (Llama's Q/K rows un-permuted as whole
    rows), and the logits those of the float model."""
    path = save_tiny_kquant_model(tmp_path / "hf", tmp_path / "kq.gguf", K_QUANTS, llama=llama)
    checkpoint = open_checkpoint(str(path))
    floats = dict(checkpoint.tensors(progress=False))
    packed = dict(checkpoint.tensors(progress=False, keep_quantized=True))
    assert packed["model.layers.0.mlp.down_proj.weight"].format is QuantFormat.Q6_K
    for name, value in packed.items():
        assert torch.equal(value if isinstance(value, torch.Tensor) else value.dequantize(), floats[name]), name
    engine = _engine(path, "gguf")
    model = engine.runner.model
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.quantized.formats == (QuantFormat.Q5_0, QuantFormat.Q8_0)
    assert layer.mlp.gate_up_proj.quantized.formats == (QuantFormat.Q4_K, QuantFormat.Q5_0)
    assert layer.self_attn.o_proj.quantized.format is QuantFormat.Q5_K
    assert model.lm_head.quantized.format is QuantFormat.Q6_K
    assert model.model.embed_tokens.quantized.format is QuantFormat.Q5_0
    reference = _logits(_engine(path, "none"))
    assert torch.nn.functional.cosine_similarity(_logits(engine), reference, dim=-1).min() > 0.999


def test_a_file_with_q2_k_and_q3_k_tensors_loads_them_in_float(tmp_path: Path) -> None:
    """Types without a packed form are dequantized, as before: here q (Q2_K) and hence all of q/k/v,
    and down (Q3_K); the rest stays packed."""
    types = {**K_QUANTS, "q_proj.weight": GGML.Q2_K, "down_proj.weight": GGML.Q3_K}
    path = save_tiny_kquant_model(tmp_path / "hf", tmp_path / "low.gguf", types)
    engine = _engine(path, "gguf")
    layer = engine.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, MergedLinear) and type(layer.mlp.down_proj) is torch.nn.Linear
    assert isinstance(layer.mlp.gate_up_proj, QuantizedLinear)
    floats = dict(open_checkpoint(str(path)).tensors(progress=False))
    assert torch.equal(layer.mlp.down_proj.weight, floats["model.layers.0.mlp.down_proj.weight"])
    reference = _logits(_engine(path, "none"))
    assert torch.nn.functional.cosine_similarity(_logits(engine), reference, dim=-1).min() > 0.999
