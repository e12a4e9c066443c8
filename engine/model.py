"""Llama-family decoder (Llama, Qwen2, Qwen2-MoE, Mixtral) as plain nn.Modules with HF parameter names.

Attention goes through a pluggable `AttentionBackend` (a dense layer fused into one C++ call,
`DecoderLayer.fuse`, runs the `cpu` backend's kernel itself); the KV pool is passed into `forward`, and
per-step layout travels in `AttentionMetadata`, so the modules hold no per-step state. MoE layers
(`engine/moe.py`) replace the dense MLP where `ModelConfig.is_moe_layer`; a sequence-classification
config (`num_labels` > 0) gets HF's `score` head instead of `lm_head`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.config import Architecture, ModelConfig
from engine.moe import MixtralExpert, SparseMoeBlock
from engine.weight_loader import MergedLinear, load_into
from kernels.attention import AttentionBackend, AttentionMetadata, CpuPagedAttention
from kernels.fused_layer import fused_decoder_layer
from kernels.layers import RotaryEmbedding, add_rms_norm, silu_and_mul
from kernels.quant import QuantizedWeight


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); `residual` is updated in place (None: x alone)."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        hidden = config.hidden_size
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = MergedLinear(
            hidden, (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)), bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(q_size, hidden, bias=config.o_proj_bias)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = rotary.apply_and_store(
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            positions,
            kv_cache,
            meta.write_pages,
            meta.write_offsets,
        )
        out = backend.attend(q, kv_cache, meta)
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    """SwiGLU `down(silu(gate x) * up x)`: the dense MLP, and Qwen2-MoE's routed and shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(
            hidden_size, (("gate_proj", intermediate_size), ("up_proj", intermediate_size)), bias=False
        )
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


def _moe_block(config: ModelConfig) -> tuple[str, SparseMoeBlock]:
    """The MoE feed-forward of one layer and the attribute name HF gives it."""
    hidden, width = config.hidden_size, config.moe_intermediate_size
    if config.architecture is Architecture.MIXTRAL:
        experts: list[nn.Module] = [MixtralExpert(hidden, width) for _ in range(config.num_experts)]
        return "block_sparse_moe", SparseMoeBlock(config, experts, None)
    experts = [MLP(hidden, width) for _ in range(config.num_experts)]
    shared = MLP(hidden, config.shared_expert_intermediate_size) if config.shared_expert_intermediate_size else None
    return "mlp", SparseMoeBlock(config, experts, shared)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.is_moe = config.is_moe_layer(layer_id)
        ffn: nn.Module
        if self.is_moe:
            self.ffn_name, ffn = _moe_block(config)
        else:
            self.ffn_name, ffn = "mlp", MLP(config.hidden_size, config.intermediate_size)
        self.add_module(self.ffn_name, ffn)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fused: Any = None  # the layer as one C++ call, when `fuse` found it can be

    def fuse(self, backend: AttentionBackend, kv_dtype: torch.dtype) -> bool:
        """Compute this layer as one C++ call (`kernels.fused_layer`) from now on, if it is a dense
        layer whose every part is a kernel that call runs (packed weights, float32, the `cpu`
        attention, a KV pool in `kv_dtype` the kernels take); else keep the modules. Call again
        after its weights are replaced."""
        self.fused = None
        if not self.is_moe and isinstance(backend, CpuPagedAttention):
            attn, mlp = self.self_attn, getattr(self, self.ffn_name)
            self.fused = fused_decoder_layer(
                self.input_layernorm.weight,
                self.post_attention_layernorm.weight,
                self.input_layernorm.eps,
                [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj],
                attn.num_heads,
                attn.num_kv_heads,
                attn.head_dim,
                backend.scale,
                kv_dtype,
            )
        return self.fused is not None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        expert_counts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer on the residual stream: returns (this layer's output, the stream before it is added);
        the stream `residual` (None for the first layer) is updated in place. `expert_counts`
        ([num_experts] int64, MoE layers only) is added to as `SparseMoeBlock` says."""
        if self.fused is not None:
            return self.fused.forward(  # type: ignore[no-any-return]
                x.contiguous(),
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
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rotary, backend, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        ffn = getattr(self, self.ffn_name)
        return (ffn(h, expert_counts) if self.is_moe else ffn(h)), residual


class DecoderStack(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """`forward` returns final hidden states [T, hidden]; `compute_logits` maps rows to fp32 logits.

    With `config.num_labels` (HF `*ForSequenceClassification`, e.g. a reward model) the head is
    `score` [num_labels, hidden] and `compute_logits` gives the class scores instead.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        if config.num_labels:
            self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
            return
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        kv_pool: torch.Tensor,
        meta: AttentionMetadata,
        expert_counts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64; kv_pool: [P, num_layers, 2, S, Hkv, D] (written).

        `expert_counts` ([num_layers, num_experts] int64): when given, each MoE layer adds to its row
        the number of these tokens routed to each expert (T x num_experts_per_tok per layer).
        """
        x, residual = self.model.embed_tokens(input_ids), None
        for layer_id, layer in enumerate(self.model.layers):
            counts = expert_counts[layer_id] if expert_counts is not None and layer.is_moe else None
            x, residual = layer(x, residual, positions, rotary, backend, kv_pool[:, layer_id], meta, counts)
        return self.model.norm(x, residual)[0]

    def fuse_layers(self, backend: AttentionBackend, kv_dtype: torch.dtype) -> int:
        """`DecoderLayer.fuse` on every layer (after every weight load); how many are fused."""
        layers: list[DecoderLayer] = list(self.model.layers)  # type: ignore[arg-type]
        return sum(layer.fuse(backend, kv_dtype) for layer in layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.score if self.config.num_labels else self.lm_head
        return head(hidden).float()

    def load_weights(
        self,
        tensors: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
        quantization: str = "none",
        int8_activations: bool = False,
    ) -> None:
        """Copy HF-named tensors into the parameters (every one covered exactly), fusing projections
        and keeping or making quantized weights as `engine.weight_loader` says for `quantization`."""
        load_into(self, tensors, quantization, int8_activations)
