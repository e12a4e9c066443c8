"""Layers over block-quantized weights: the matmul, and `nn.Linear` / `nn.Embedding` equivalents.

`quantized_matmul` runs the C++ kernel (`kernels/csrc/qmatmul.cpp`) on weights repacked into panels
(`kernels.packing`): each activation row is rounded to int16 blocks of 32 (one scale per block),
every product is an exact integer dot per block, and blocks are summed in float32. int16 keeps
1/65534 of a block's largest value as resolution: the bundled model's greedy output agrees with
the float32 reference on every prompt of benchmarks/greedy_match.py (docs/performance.md), at twice
the arithmetic rate of float32 FMAs. `int8_activations` rounds to int8 blocks instead, as llama.cpp
does (the same kernel and speed here; kept to reproduce llama.cpp's numbers). Each row's result is
independent of the other rows in the call, so batching does not change it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kernels import native
from kernels.packing import PackedWeight, pack
from kernels.quant import QuantizedWeight

INT16_QMAX = 32767
INT8_QMAX = 127


def activation_qmax(int8_activations: bool) -> int:
    """The largest integer an activation block is rounded to: int8 (llama.cpp's way) or int16."""
    return INT8_QMAX if int8_activations else INT16_QMAX


def _kernel() -> Callable[..., torch.Tensor] | None:
    """The C++ matmul when the kernels are built, else None (a fallback computes in torch)."""
    return native.load().qmatmul if native.is_available() else None


def quantized_matmul(
    x: torch.Tensor, weight: PackedWeight | QuantizedWeight, int8_activations: bool = False
) -> torch.Tensor:
    """x [..., K] (float32 or bfloat16) times weight^T -> [..., N] in x's dtype, one call for every
    segment of a mixed-format weight. A `QuantizedWeight` is packed first (tests; layers pack once).
    Without the C++ kernels: float activations times the dequantized weight (slow, and without the
    activation rounding)."""
    packed = weight if isinstance(weight, PackedWeight) else pack(weight)
    kernel = _kernel()
    if kernel is None:
        return (x.float() @ packed.dequantize().T).to(x.dtype)
    n, k = packed.shape
    flat = x.reshape(-1, k).float().contiguous()
    out = kernel(flat, packed.data, packed.table, activation_qmax(int8_activations))
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


class QuantizedLinear(nn.Module):
    """`nn.Linear` over a block-quantized weight, packed once here; the bias (if any) stays in the
    activation dtype. `int8_activations` picks llama.cpp's rounding (see `quantized_matmul`)."""

    def __init__(
        self,
        weight: QuantizedWeight | PackedWeight,
        bias: torch.Tensor | None = None,
        int8_activations: bool = False,
    ) -> None:
        super().__init__()
        self.quantized = weight if isinstance(weight, PackedWeight) else pack(weight)
        self.int8_activations = int8_activations
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = self.quantized.shape
        self._qmax = activation_qmax(int8_activations)
        self._kernel = _kernel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
            # the common case, with as little Python per call as possible (decode calls this 100+ times a step)
            w = self.quantized
            out = self._kernel(x, w.data, w.table, self._qmax)
        else:
            out = quantized_matmul(x, self.quantized, self.int8_activations)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        formats = "+".join(f.name for f in self.quantized.formats)
        return f"in_features={self.in_features}, out_features={self.out_features}, format={formats}"


class QuantizedEmbedding(nn.Module):
    """`nn.Embedding` over a block-quantized table (packed, so that a tied LM head shares it):
    looked-up rows are dequantized to `dtype`."""

    def __init__(self, weight: QuantizedWeight | PackedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.quantized = weight if isinstance(weight, PackedWeight) else pack(weight)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.quantized.dequantize(ids.reshape(-1)).to(self.dtype).reshape(*ids.shape, -1)
