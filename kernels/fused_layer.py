"""A dense decoder layer as one C++ call (`kernels/csrc/decoder.cpp`): the CPU path's fast case.

The layer's Python (RMSNorm, q/k/v, rotary and the KV store, attention, o, RMSNorm, gate/up, SiLU,
down) calls about ten C++ kernels with Python between them: at batch 1 that Python was a fifth of
a decode step. `decoder.cpp` calls the same kernels in the same order, so a fused layer's output
has the same bits as the layer's own forward (tests/unit/engine/test_fused_layers.py); it applies
only where every part is one of those kernels: float32 rows, packed weights, the `cpu` attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from kernels import native
from kernels.layers import NATIVE_KV_CACHE_DTYPES
from kernels.quant_linear import QuantizedLinear, activation_qmax


def fused_decoder_layer(
    input_norm: torch.Tensor,
    post_norm: torch.Tensor,
    eps: float,
    projections: Sequence[nn.Module],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    kv_dtype: torch.dtype,
) -> Any | None:
    """The C++ layer (its `forward(x, residual, positions, cos, sin, kv_cache, write_pages,
    write_offsets, qo_indptr, kv_indptr, kv_indices, kv_last_page_len)` returns (output, residual)
    as `DecoderLayer.forward` does), or None when a part is not what it computes: `projections`
    (qkv, o, gate_up, down) must all be `QuantizedLinear` (any formats, mixed ones included) with
    one activation rounding and float32 biases, the norms float32 CPU tensors, the KV pool
    (`kv_dtype`) one the kernels take, and the kernels built."""
    if not native.is_available() or len(projections) != 4 or kv_dtype not in NATIVE_KV_CACHE_DTYPES:
        return None
    linears = [p for p in projections if isinstance(p, QuantizedLinear)]
    if len(linears) != 4 or len({p.int8_activations for p in linears}) != 1:
        return None
    tensors = [input_norm, post_norm, *(p.bias for p in linears if p.bias is not None)]
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return None
    specs = [(p.quantized.data, p.quantized.table, None if p.bias is None else p.bias.detach()) for p in linears]
    qmax = activation_qmax(linears[0].int8_activations)
    return native.load().DecoderLayer(
        input_norm.detach().contiguous(),
        post_norm.detach().contiguous(),
        eps,
        specs,
        num_heads,
        num_kv_heads,
        head_dim,
        qmax,
        scale,
    )
