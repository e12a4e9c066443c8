"""Tests for kernels.quant: the block formats against gguf-py's quantizers, the C++ matmul against the
dequantized reference (float activations) or an exact emulation of llama.cpp's int8 arithmetic, and
row invariance (each row's bits independent of the rest of the batch, across row panels)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from kernels.quant import (
    BLOCK,
    QuantFormat,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    quantize,
    quantized_matmul,
    reference_matmul,
)

FORMATS = list(QuantFormat)
_GGML = {QuantFormat.Q8_0: GGMLQuantizationType.Q8_0, QuantFormat.Q4_0: GGMLQuantizationType.Q4_0,
         QuantFormat.Q4_1: GGMLQuantizationType.Q4_1}


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_quantize_agrees_with_gguf_py(fmt: QuantFormat) -> None:
    """Our quantizer's values dequantize to what llama.cpp's format gives for the same input
    (gguf-py's reference; scales differ only by its fp16 storage)."""
    w = _weight(8, 128, seed=1)
    ours = quantize(w, fmt).dequantize()
    theirs = torch.from_numpy(gguf_dequantize(gguf_quantize(w.numpy(), _GGML[fmt]), _GGML[fmt]).copy())
    scale = w.abs().amax()
    assert (ours - theirs).abs().max() <= scale * 2e-3
    assert (ours - w).norm() / w.norm() < (0.01 if fmt is QuantFormat.Q8_0 else 0.12)


def _emulated(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """The kernel's arithmetic in float64: rows quantized to int8 blocks (round half to even),
    exact integer block dots, scaled per block."""
    m, k = x.shape
    blocks = x.double().reshape(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    d = amax.float() / 127
    inv = torch.where(amax > 0, 127 / amax.float(), torch.zeros_like(amax.float()))
    xq = torch.round(blocks.float() * inv).double()          # torch.round: half to even, as the kernel
    n = weight.shape[0]
    if weight.format is QuantFormat.Q8_0:
        wq = weight.qs.view(torch.int8).double().reshape(n, -1, BLOCK)
    else:
        packed = weight.qs.reshape(n, -1, BLOCK // 2)
        wq = torch.cat((packed & 0x0F, packed >> 4), dim=-1).double()
        if weight.format is QuantFormat.Q4_0:
            wq = wq - 8
    dots = torch.einsum("mbi,nbi->mnb", xq, wq)
    out = (dots * (d.double().squeeze(-1)[:, None, :] * weight.scales.double()[None])).sum(-1)
    if weight.mins is not None:
        block_sums = (d.double().squeeze(-1) * xq.sum(-1))           # d * sum(q) per activation block
        out = out + block_sums @ weight.mins.double().T
    return out


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (5, 72, 576), (67, 33, 96)])
def test_quantized_matmul_equals_the_reference_or_its_int8_emulation(fmt: QuantFormat, m: int, n: int,
                                                                               k: int) -> None:
    weight = quantize(_weight(n, k, seed=m), fmt)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    reference = reference_matmul(x, weight)      # dequantized weights, float activations
    exact = quantized_matmul(x, weight)          # the default: float activations, blocks dequantized on the fly
    assert exact.shape == (m, n) and exact.dtype == torch.float32
    torch.testing.assert_close(exact, reference, rtol=1e-5, atol=1e-5)
    rounded = quantized_matmul(x, weight, int8_activations=True)     # llama.cpp's arithmetic
    torch.testing.assert_close(rounded.double(), _emulated(x, weight), rtol=1e-5, atol=1e-5)
    assert ((rounded - reference).norm() / reference.norm()).item() < 0.01


@pytest.mark.parametrize("int8_activations", [False, True], ids=["float-activations", "int8-activations"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_each_row_is_the_same_whatever_else_is_in_the_batch(fmt: QuantFormat, int8_activations: bool) -> None:
    weight = quantize(_weight(96, 192, seed=4), fmt)
    x = torch.randn(137, 192, generator=torch.Generator().manual_seed(9))
    together = quantized_matmul(x, weight, int8_activations)
    for rows in (slice(0, 1), slice(3, 4), slice(5, 9), slice(9, 137), slice(70, 131)):
        assert torch.equal(quantized_matmul(x[rows], weight, int8_activations), together[rows])


def test_bfloat16_activations_and_layers() -> None:
    weight = quantize(_weight(64, 64, seed=2), QuantFormat.Q4_1)
    bias = torch.randn(64)
    x = torch.randn(3, 2, 64).bfloat16()
    layer = QuantizedLinear(weight, torch.nn.Parameter(bias.bfloat16()))
    out = layer(x)
    assert out.shape == (3, 2, 64) and out.dtype == torch.bfloat16
    expected = quantized_matmul(x.reshape(6, 64), weight).reshape(3, 2, 64) + bias.bfloat16()
    torch.testing.assert_close(out, expected)
    table = QuantizedEmbedding(weight, torch.float32)
    ids = torch.tensor([[3, 0], [63, 3]])
    torch.testing.assert_close(table(ids), weight.dequantize()[ids])


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
    assert np.isclose(a.num_bytes, 8 * 64 / 2 + 2 * 8 * 2 * 4)
