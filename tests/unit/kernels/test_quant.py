"""Tests for kernels.quant: the block formats against gguf-py's quantizers, and fusing and selecting
rows of quantized weights (the matmul over them: test_quant_linear.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from kernels.quant import QuantFormat, QuantizedWeight, quantize

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
