"""Llama-family decoder (Llama, Qwen2, Qwen2-MoE, Mixtral) as plain nn.Modules with HF parameter names.

Attention goes through a pluggable `AttentionBackend`; the KV pool is passed into `forward`, and
per-step layout travels in `AttentionMetadata`, so the modules hold no per-step state. MoE layers
(`engine/moe.py`) replace the dense MLP where `ModelConfig.is_moe_layer`; a sequence-classification
config (`num_labels` > 0) gets HF's `score` head instead of `lm_head`.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from engine.config import Architecture, ModelConfig
from engine.moe import MixtralExpert, SparseMoeBlock
from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.layers import RotaryEmbedding, rms_norm, silu_and_mul


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        hidden, q_size, kv_size = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=config.o_proj_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                backend: AttentionBackend, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rotary.apply(q, k, positions)
        out = backend.forward(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    """SwiGLU `down(silu(gate x) * up x)`: the dense MLP, and Qwen2-MoE's routed and shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))


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
        if self.is_moe:
            self.ffn_name, ffn = _moe_block(config)
        else:
            self.ffn_name, ffn = "mlp", MLP(config.hidden_size, config.intermediate_size)
        self.add_module(self.ffn_name, ffn)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                backend: AttentionBackend, kv_cache: torch.Tensor, meta: AttentionMetadata,
                expert_counts: torch.Tensor | None = None) -> torch.Tensor:
        """`expert_counts` ([num_experts] int64, MoE layers only) is added to as `SparseMoeBlock` says."""
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, backend, kv_cache, meta)
        h = self.post_attention_layernorm(x)
        ffn = getattr(self, self.ffn_name)
        return x + (ffn(h, expert_counts) if self.is_moe else ffn(h))


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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                backend: AttentionBackend, kv_pool: torch.Tensor, meta: AttentionMetadata,
                expert_counts: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] int64; kv_pool: [P, num_layers, 2, S, Hkv, D] (written).

        `expert_counts` ([num_layers, num_experts] int64): when given, each MoE layer adds to its row
        the number of these tokens routed to each expert (T x num_experts_per_tok per layer).
        """
        x = self.model.embed_tokens(input_ids)
        for layer_id, layer in enumerate(self.model.layers):
            counts = expert_counts[layer_id] if expert_counts is not None and layer.is_moe else None
            x = layer(x, positions, rotary, backend, kv_pool[:, layer_id], meta, counts)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.score if self.config.num_labels else self.lm_head
        return head(hidden).float()

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters; every parameter must be covered exactly."""
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, tensor in tensors:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name not in params:
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
            param = params[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            seen.add(name)
        missing = set(params) - seen - ({"lm_head.weight"} if self.config.tie_word_embeddings else set())
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
