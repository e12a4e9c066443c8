"""A dense decoder layer as one C++ call (`kernels/csrc/decoder.cpp`): the CPU path's fast case.

The layer's Python (RMSNorm, q/k/v, the optional q/k norms, rotary and the KV store, attention, o,
the norms around the MLP, gate/up, SiLU or GeLU-tanh, down) calls about ten C++ kernels with Python
between them: at batch 1 that Python was a fifth of a decode step. `decoder.cpp` calls the same
kernels in the same order, so a fused layer's output has the same bits as the layer's own forward
(tests/unit/engine/test_fused_layers.py). It computes every dense family's layer (Llama, Qwen2/3,
Mistral, Phi-3, Gemma 3: q/k norms, a softmax scale, a sliding window, sandwich norms, the layer's
own rotary tables) and applies where every part is one of those kernels: float32 rows, packed
weights, the `cpu` attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kernels import native
from kernels.attention import AttentionMetadata
from kernels.layers import NATIVE_KV_CACHE_DTYPES, RotaryEmbedding
from kernels.quant_linear import QuantizedLinear, activation_qmax

ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True, slots=True)
class LayerNorms:
    """A layer's RMSNorm weights, all of one `eps`. `input` and `ffn` ([hidden]) normalize the stream
    before attention and before the MLP (Llama's post_attention_layernorm, Gemma's
    pre_feedforward_layernorm); `q`/`k` ([head_dim]) each head before rotary; `attn_out` and
    `ffn_out` ([hidden]) the attention and MLP outputs (Gemma's post_attention_layernorm and
    post_feedforward_layernorm). None: the layer has no such norm."""

    eps: float
    input: torch.Tensor
    ffn: torch.Tensor
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    attn_out: torch.Tensor | None = None
    ffn_out: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.input, self.ffn, self.q, self.k, self.attn_out, self.ffn_out) if t is not None]


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """Heads, the softmax scale of scores (q * scale) . k, and the sliding window (None: every position)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    window: int | None = None


class FusedDecoderLayer:
    """The C++ layer behind the step's parts as the engine's layer takes them: `forward` unpacks the
    rotary tables and the page table into the tensors the C++ call takes, so that call's argument
    order is known here only."""

    __slots__ = ("_layer",)

    def __init__(self, layer: Any) -> None:
        self._layer = layer

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, residual) as `DecoderLayer.forward` returns them: x [T, hidden] contiguous float32,
        `residual` (None for the first layer) updated in place, `positions` [T] int64, `rotary` the
        layer's own tables; the tokens' K/V are written into `kv_cache` [P, 2, S, Hkv, D]."""
        return self._layer.forward(  # type: ignore[no-any-return]
            x,
            residual,
            positions,
            rotary.cos,
            rotary.sin,
            kv_cache,
            meta.write_pages,
            meta.write_offsets,
            meta.qo_indptr,
            meta.kv_indptr,
            meta.kv_indices,
            meta.kv_last_page_len,
        )


def fused_decoder_layer(
    norms: LayerNorms,
    projections: Sequence[nn.Module],
    attention: AttentionShape,
    activation: str,
    kv_dtype: torch.dtype,
) -> FusedDecoderLayer | None:
    """The C++ layer, or None when a part is not what it computes: `projections` (qkv, o, gate_up,
    down) must all be `QuantizedLinear` (any formats, mixed ones included) with one activation
    rounding and float32 biases, the norms float32 CPU tensors, `activation` one of ACTIVATIONS, the
    KV pool (`kv_dtype`) one the kernels take, and the kernels built."""
    if not native.is_available() or len(projections) != 4 or kv_dtype not in NATIVE_KV_CACHE_DTYPES:
        return None
    if activation not in ACTIVATIONS:
        return None
    linears = [p for p in projections if isinstance(p, QuantizedLinear)]
    if len(linears) != 4 or len({p.int8_activations for p in linears}) != 1:
        return None
    tensors = [*norms.tensors(), *(p.bias for p in linears if p.bias is not None)]
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return None

    def weight(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach().contiguous()

    specs = [(p.quantized.data, p.quantized.table, weight(p.bias)) for p in linears]
    layer = native.load().DecoderLayer(
        weight(norms.input),
        weight(norms.ffn),
        weight(norms.q),
        weight(norms.k),
        weight(norms.attn_out),
        weight(norms.ffn_out),
        norms.eps,
        specs,
        attention.num_heads,
        attention.num_kv_heads,
        attention.head_dim,
        activation_qmax(linears[0].int8_activations),
        attention.scale,
        attention.window or 0,
        activation,
    )
    return FusedDecoderLayer(layer)
