"""Tests for kernels.layers against transformers' Llama implementation (and torch's GeLU)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from kernels import native
from kernels.layers import (
    RotaryEmbedding,
    add_rms_norm,
    gelu_tanh_and_mul,
    plain_rms_norm,
    rms_norm,
    rope_inv_freq,
    silu_and_mul,
)

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def _hf_config(head_dim: int, theta: float, rope_scaling: dict | None = None,
               max_position_embeddings: int = 131072) -> LlamaConfig:
    rope_parameters = {"rope_type": "default", "rope_theta": theta}
    if rope_scaling:
        rope_parameters.update(rope_scaling)
    return LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=head_dim, max_position_embeddings=max_position_embeddings,
                       rope_parameters=rope_parameters)


def _hf_rotate(config: LlamaConfig, q: torch.Tensor, k: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotary on our [T, H, D] layout."""
    cos, sin = LlamaRotaryEmbedding(config)(q, positions.unsqueeze(0))
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), cos, sin)
    return q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1)


@pytest.mark.parametrize(("head_dim", "theta", "scaling"), [
    (16, 10000.0, None),
    (64, 500000.0, LLAMA3_SCALING),
    (32, 10000.0, {"rope_type": "linear", "factor": 4.0}),
], ids=["default", "llama3", "linear"])
def test_rotary_matches_transformers(head_dim: int, theta: float, scaling: dict | None) -> None:
    gen = torch.Generator().manual_seed(0)
    max_positions = 20000
    positions = torch.cat([torch.arange(6), torch.randint(0, max_positions, (26,), generator=gen)])
    q = torch.randn(len(positions), 4, head_dim, generator=gen)
    k = torch.randn(len(positions), 2, head_dim, generator=gen)
    rotary = RotaryEmbedding(head_dim, max_positions, theta, scaling or {}, torch.float32)
    q_ours, k_ours = rotary.apply(q, k, positions)
    q_hf, k_hf = _hf_rotate(_hf_config(head_dim, theta, scaling), q, k, positions)
    # Far positions amplify fp32 rounding of the angle (pos * inv_freq), hence the tolerance.
    torch.testing.assert_close(q_ours, q_hf, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(k_ours, k_hf, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(q_ours[:6], q_hf[:6], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(q_ours[1:6], q[1:6])  # the rotation did something


def test_rotary_keeps_the_input_dtype() -> None:
    rotary = RotaryEmbedding(16, 64, 10000.0, {}, torch.bfloat16)
    q = torch.randn(5, 4, 16, dtype=torch.bfloat16)
    k = torch.randn(5, 2, 16, dtype=torch.bfloat16)
    q_out, k_out = rotary.apply(q, k, torch.arange(5))
    assert q_out.dtype == k_out.dtype == torch.bfloat16
    q_ref, k_ref = RotaryEmbedding(16, 64, 10000.0, {}, torch.float32).apply(q.float(), k.float(), torch.arange(5))
    torch.testing.assert_close(q_out.float(), q_ref, atol=0.05, rtol=0.02)


def test_llama3_inv_freq_matches_transformers() -> None:
    head_dim, theta = 128, 500000.0
    ours = rope_inv_freq(head_dim, theta, LLAMA3_SCALING)
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](_hf_config(head_dim, theta, LLAMA3_SCALING))
    assert attention_factor == 1.0
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    # The config exercises all three bands: unscaled, divided by the factor, and smoothed between.
    plain = rope_inv_freq(head_dim, theta, {})
    ratio = plain / ours
    assert (ratio == 1).any() and torch.isclose(ratio, torch.tensor(8.0)).any()
    assert ((ratio > 1.01) & (ratio < 7.99)).any()


def test_linear_inv_freq_matches_transformers() -> None:
    scaling = {"rope_type": "linear", "factor": 4.0}
    theirs, _ = ROPE_INIT_FUNCTIONS["linear"](_hf_config(64, 10000.0, scaling))
    torch.testing.assert_close(rope_inv_freq(64, 10000.0, scaling), theirs, rtol=1e-6, atol=0)
    legacy = {"type": "linear", "factor": 4.0}  # pre-`rope_type` spelling
    torch.testing.assert_close(rope_inv_freq(64, 10000.0, legacy), theirs, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (3.0 * torch.randn(7, 64, generator=gen)).to(dtype)
    weight = (1.0 + 0.1 * torch.randn(64, generator=gen)).to(dtype)
    reference = LlamaRMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        reference.weight.copy_(weight)
        expected = reference(x)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_adds_the_residual_in_place_and_normalizes_the_sum(dtype: torch.dtype) -> None:
    """float32 takes the fused C++ kernel, bfloat16 the torch code: both against transformers."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 576, generator=gen).to(dtype)
    residual = (4.0 * torch.randn(9, 576, generator=gen)).to(dtype)
    weight = (1.0 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    reference = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    with torch.no_grad():
        reference.weight.copy_(weight)
        expected_sum = x + residual
        expected = reference(expected_sum)
    x_before = x.clone()
    out, total = add_rms_norm(x, residual, weight, 1e-5)
    assert total is residual and torch.equal(residual, expected_sum) and torch.equal(x, x_before)
    torch.testing.assert_close(out, expected, atol=2e-6 if dtype == torch.float32 else 0, rtol=1e-5)
    alone, stream = add_rms_norm(x, None, weight, 1e-5)       # the first layer: no residual yet
    assert torch.equal(stream, x) and stream is not x
    torch.testing.assert_close(alone, reference(x), atol=2e-6 if dtype == torch.float32 else 0, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_rms_norm_over_heads_matches_transformers(dtype: torch.dtype) -> None:
    """Per-head norms (q/k of Qwen3, Gemma 3) of strided head views: float32 takes the C++ kernel,
    whose rows get exactly what it gives them as rows of a contiguous [T, H] tensor."""
    gen = torch.Generator().manual_seed(4)
    qkv = (3.0 * torch.randn(5, 8 * 32, generator=gen)).to(dtype)
    heads = qkv[:, 32:160].view(5, 4, 32)  # four heads of 32, rows strided
    weight = (1.0 + 0.1 * torch.randn(32, generator=gen)).to(dtype)
    reference = LlamaRMSNorm(32, eps=1e-6).to(dtype)
    with torch.no_grad():
        reference.weight.copy_(weight)
        expected = reference(heads)
    out = plain_rms_norm(heads, weight, 1e-6)
    assert out.shape == heads.shape and out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=2e-6 if dtype == torch.float32 else 0, rtol=1e-5)
    if dtype == torch.float32 and native.is_available():
        rows = native.load().rms_norm(heads.reshape(-1, 32).contiguous(), weight, 1e-6, None)
        assert torch.equal(out.reshape(-1, 32), rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul_matches_torch(dtype: torch.dtype) -> None:
    """float32 takes the C++ kernel (vector lanes and a scalar tail), bfloat16 the torch code."""
    gen = torch.Generator().manual_seed(6)
    gate = torch.cat([torch.tensor([-30.0, -9.0, -3.0, -0.5, 0.0, 0.5, 3.0, 9.0, 30.0]),
                      4 * torch.randn(28, generator=gen)]).repeat(3, 1)
    up = torch.randn(3, 37, generator=gen)
    expected = torch.nn.functional.gelu(gate, approximate="tanh") * up
    out = gelu_tanh_and_mul(torch.cat([gate, up], dim=1).to(dtype))
    assert out.dtype == dtype and out.shape == (3, 37)
    torch.testing.assert_close(out.float(), expected, rtol=1e-5 if dtype == torch.float32 else 2e-2,
                               atol=1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype: torch.dtype) -> None:
    gate = torch.tensor([[-2.0, 0.0, 1.0, 3.0], [0.5, -0.5, 8.0, -8.0]])
    up = torch.tensor([[1.0, 5.0, 2.0, -1.0], [2.0, 2.0, 0.25, 1.0]])
    expected = gate / (1 + torch.exp(-gate)) * up
    out = silu_and_mul(torch.cat([gate, up], dim=1).to(dtype))
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_store_rotates_q_k_and_writes_k_v_to_their_slots(dtype: torch.dtype) -> None:
    """The fused C++ call (float32) and the torch path (bfloat16) against transformers' rotary, on q, k, v
    that are views of one fused projection, as the model passes them."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim = 6, 2, 64
    qkv = torch.randn(5, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(5, heads, dim), k.view(5, kv_heads, dim), v.view(5, kv_heads, dim)
    positions = torch.tensor([0, 3, 17, 40, 41])
    expected_q, expected_k = _hf_rotate(_hf_config(dim, 10000.0), q.float().clone(), k.float().clone(), positions)
    v_before = v.clone()
    cache = torch.zeros(8, 2, 4, kv_heads, dim, dtype=dtype)
    pages, offsets = torch.tensor([5, 5, 1, 7, 2]), torch.tensor([0, 3, 2, 1, 1])
    rotary = RotaryEmbedding(dim, 64, 10000.0, {}, dtype)
    out_q = rotary.apply_and_store(q, k, v, positions, cache, pages, offsets)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(out_q.float(), expected_q, **tolerance)
    torch.testing.assert_close(cache[pages, 0, offsets].float(), expected_k, **tolerance)
    assert torch.equal(cache[pages, 1, offsets], v_before)
    written = torch.zeros(8, 4, dtype=torch.bool)
    written[pages, offsets] = True
    assert not cache.transpose(1, 2)[~written].any()       # nothing else in the cache was touched
