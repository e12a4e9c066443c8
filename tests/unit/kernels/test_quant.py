"""Tests for kernels.quant: the block formats against gguf-py's quantizers, and fusing and selecting
rows of quantized weights (the matmul over them: test_quant_linear.py; GGUF's other block types read
from files: test_kquants.py)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from kernels.quant import QuantFormat, QuantizedWeight, quantize
from tests.unit.kernels.gguf_random import random_weight

QUANTIZABLE = [QuantFormat.Q8_0, QuantFormat.Q4_0, QuantFormat.Q4_1]


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("fmt", QUANTIZABLE, ids=lambda f: f.name)
def test_quantize_agrees_with_gguf_py(fmt: QuantFormat) -> None:
    """Our quantizer's values dequantize to what llama.cpp's format gives for the same input
    (gguf-py's reference; scales differ only by its fp16 storage)."""
    w = _weight(8, 128, seed=1)
    qtype = GGMLQuantizationType[fmt.name]
    ours = quantize(w, fmt).dequantize()
    theirs = torch.from_numpy(gguf_dequantize(gguf_quantize(w.numpy(), qtype), qtype).copy())
    scale = w.abs().amax()
    assert (ours - theirs).abs().max() <= scale * 2e-3
    assert (ours - w).norm() / w.norm() < (0.01 if fmt is QuantFormat.Q8_0 else 0.12)


def test_fusing_and_row_selection_keep_every_block() -> None:
    a, b = quantize(_weight(8, 64, 5), QuantFormat.Q4_1), quantize(_weight(4, 64, 6), QuantFormat.Q4_1)
    fused = QuantizedWeight.cat([a, b])
    torch.testing.assert_close(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    order = torch.tensor([3, 0, 1, 2])
    torch.testing.assert_close(b.index_rows(order).dequantize(), b.dequantize()[order])
    with pytest.raises(ValueError, match="cannot fuse"):
        QuantizedWeight.cat([a, quantize(_weight(4, 64, 7), QuantFormat.Q8_0)])
    with pytest.raises(ValueError, match="not a multiple of 32"):
        quantize(_weight(4, 48, 1), QuantFormat.Q8_0)
    with pytest.raises(ValueError, match="only Q8_0, Q4_0 and Q4_1"):
        quantize(_weight(4, 256, 1), QuantFormat.Q4_K)
    assert a.num_bytes == 8 * 64 + 2 * 8 * 2 * 4  # a code per element, float32 scales and offsets


@pytest.mark.parametrize("fmt", [QuantFormat.Q5_0, QuantFormat.Q4_K, QuantFormat.Q6_K], ids=lambda f: f.name)
def test_k_quants_fuse_and_select_rows_with_their_super_block_scales(fmt: QuantFormat) -> None:
    a, b = random_weight(fmt, 6, 512, seed=1), random_weight(fmt, 3, 512, seed=2)
    fused = QuantizedWeight.cat([a, b])
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    order = torch.tensor([2, 0, 1, 1])
    assert torch.equal(b.index_rows(order).dequantize(), b.dequantize()[order])


def test_a_weight_must_have_the_scales_its_format_names() -> None:
    k_quant = random_weight(QuantFormat.Q4_K, 2, 256, seed=3)
    with pytest.raises(ValueError, match="super-block mins"):
        QuantizedWeight(QuantFormat.Q4_K, k_quant.codes, k_quant.scales, k_quant.mins, k_quant.super_scales)
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantizedWeight(QuantFormat.Q6_K, k_quant.codes[:, :32], torch.zeros(2, 2), super_scales=torch.zeros(2, 0))
    with pytest.raises(ValueError, match="scales"):
        QuantizedWeight(QuantFormat.Q8_0, k_quant.codes, torch.zeros(2, 3))
