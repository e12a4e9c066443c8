"""The decoder every family builds: plain nn.Modules with HF parameter names, options from `LayerFeatures`.

Attention goes through a pluggable `AttentionBackend` (a dense layer fused into one C++ call,
`DecoderLayer.fuse`, runs the `cpu` backend's kernel itself); the KV pool is passed into
`forward`, and everything per-step travels in one `ForwardBatch`, so the modules hold no per-step state.
MoE layers (`engine/moe.py`) replace the dense MLP where the family's `ffn` factory says so; a
sequence-classification config (`num_labels` > 0) gets HF's `score` head instead of `lm_head`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.lora_slots import LoraBatch
from engine.weight_loader import MergedLinear, Value, load_into
from kernels.attention import AttentionBackend, CpuPagedAttention
from kernels.fused_layer import AttentionShape, FusedDecoderLayer, LayerNorms, fused_decoder_layer
from kernels.layers import RotaryEmbedding, add_rms_norm, gelu_tanh_and_mul, plain_rms_norm, silu_and_mul

FfnFactory = Callable[[ModelConfig, int], tuple[str, nn.Module]]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); `residual` is updated in place (None: x alone)."""
        return add_rms_norm(x, residual, self.weight, self.eps)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """norm(x) over the last dimension, with no residual (a new tensor)."""
        return plain_rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """q/k/v (one fused matmul), optional per-head q/k RMSNorm, rotary + KV store, paged attention
    (over the last `window` positions on a sliding-window layer), o. `fused_qkv` names the checkpoint's
    single q/k/v tensor where a family stores it fused (Phi-3), else the parts are q_proj/k_proj/v_proj."""

    def __init__(self, config: ModelConfig, layer_id: int, fused_qkv: str | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        hidden, features = config.hidden_size, config.features
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.sizes = (q_size, kv_size, kv_size)
        parts = (
            ((fused_qkv, q_size + 2 * kv_size),)
            if fused_qkv
            else (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size))
        )
        self.qkv_proj = MergedLinear(hidden, parts, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if features.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if features.qk_norm else None
        self.window = config.window_of(layer_id)
        scale = features.attention_scale
        # the cpu backend takes another scale as it is; the others scale by head_dim ** -0.5, so it is folded into q
        self.q_scale = None if scale is None or math.isclose(scale * math.sqrt(config.head_dim), 1.0) else scale

    def scale(self, backend: AttentionBackend) -> float:
        """The softmax scale: the family's, else the backend's 1 / sqrt(head_dim)."""
        return backend.scale if self.q_scale is None else self.q_scale

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `rotary` is this layer's tables, and the tokens' K/V are written
        into `kv_cache` [P, 2, S, Hkv, D] where `batch.meta` says."""
        num_tokens, meta = x.shape[0], batch.meta
        qkv = self.qkv_proj(x)
        if batch.lora is not None:
            batch.lora.apply(self.layer_id, "qkv", x, qkv)
        q, k, v = qkv.split(self.sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.plain(q), self.k_norm.plain(k)
        q = rotary.apply_and_store(
            q,
            k,
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            batch.positions,
            kv_cache,
            meta.write_pages,
            meta.write_offsets,
        )
        if isinstance(backend, CpuPagedAttention):  # takes the scale and window itself, as the fused layer
            out = backend.attend(q, kv_cache, meta, self.window, self.scale(backend))
        else:
            if self.q_scale is not None:
                q = q * (self.q_scale * math.sqrt(self.head_dim))
            out = backend.attend(q, kv_cache, meta, self.window)
        out = out.reshape(num_tokens, -1)
        y = self.o_proj(out)
        if batch.lora is not None:
            batch.lora.apply(self.layer_id, "o", out, y)
        return y


_ACTIVATIONS = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}


class MLP(nn.Module):
    """Gated MLP `down(act(gate x) * up x)` (SwiGLU by default): the dense MLP, and Qwen2-MoE's routed
    and shared experts. `fused_gate_up` names the checkpoint's single gate/up tensor where a family
    stores it fused (Phi-3)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, activation: str = "silu", fused_gate_up: str | None = None
    ) -> None:
        super().__init__()
        parts = (
            ((fused_gate_up, 2 * intermediate_size),)
            if fused_gate_up
            else (("gate_proj", intermediate_size), ("up_proj", intermediate_size))
        )
        self.gate_up_proj = MergedLinear(hidden_size, parts, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.activation = activation
        self._act = _ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None, layer_id: int = 0) -> torch.Tensor:
        """With `lora`, each row's adapter update of layer `layer_id` is added to both projections."""
        gate_up = self.gate_up_proj(x)
        if lora is None:
            return self.down_proj(self._act(gate_up))
        lora.apply(layer_id, "gate_up", x, gate_up)
        h = self._act(gate_up)
        y = self.down_proj(h)
        lora.apply(layer_id, "down", h, y)
        return y


def dense_ffn(fused_gate_up: str | None = None) -> FfnFactory:
    """The factory of a dense family's MLP (every layer the same)."""

    def build(config: ModelConfig, layer_id: int) -> tuple[str, nn.Module]:
        mlp = MLP(config.hidden_size, config.intermediate_size, config.features.activation, fused_gate_up)
        return "mlp", mlp

    return build


class DecoderLayer(nn.Module):
    """Pre-norm attention and feed-forward blocks on the residual stream; with `sandwich_norms` each
    block's output is normalized again before it is added (Gemma 3)."""

    def __init__(self, config: ModelConfig, layer_id: int, ffn: FfnFactory, fused_qkv: str | None = None) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.layer_id = layer_id
        self.self_attn = Attention(config, layer_id, fused_qkv)
        self.is_moe = config.is_moe_layer(layer_id)
        self.ffn_name, module = ffn(config, layer_id)
        self.add_module(self.ffn_name, module)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.is_sandwich = config.features.sandwich_norms
        if self.is_sandwich:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.fused: FusedDecoderLayer | None = None  # the layer as one C++ call, when `fuse` found it can be

    def fuse(self, backend: AttentionBackend, kv_dtype: torch.dtype) -> bool:
        """Compute this layer as one C++ call (`kernels.fused_layer`) from now on, if it is a dense
        layer whose every part is a kernel that call runs (packed weights, float32, the `cpu`
        attention, a KV pool in `kv_dtype` the kernels take); else keep the modules. Call again
        after its weights are replaced."""
        self.fused = None
        attn, mlp = self.self_attn, getattr(self, self.ffn_name)
        norms = self._layer_norms()
        if self.is_moe or norms is None or not isinstance(backend, CpuPagedAttention):
            return False
        shape = AttentionShape(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale(backend), attn.window)
        projections = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        self.fused = fused_decoder_layer(norms, projections, shape, mlp.activation, kv_dtype)
        return self.fused is not None

    def _layer_norms(self) -> LayerNorms | None:
        """The norms as the fused call takes them (None if their eps differ): with sandwich norms the
        stream's norm before the MLP is pre_feedforward_layernorm, post_attention_layernorm that of
        the attention output."""
        attn = self.self_attn
        ffn, attn_out, ffn_out = (
            (self.pre_feedforward_layernorm, self.post_attention_layernorm, self.post_feedforward_layernorm)
            if self.is_sandwich
            else (self.post_attention_layernorm, None, None)
        )
        eps = self.input_layernorm.eps
        if any(norm is not None and norm.eps != eps for norm in (ffn, attn.q_norm, attn.k_norm, attn_out, ffn_out)):
            return None
        q, k, attn_out_w, ffn_out_w = (
            None if n is None else n.weight for n in (attn.q_norm, attn.k_norm, attn_out, ffn_out)
        )
        return LayerNorms(eps, self.input_layernorm.weight, ffn.weight, q, k, attn_out_w, ffn_out_w)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer on the residual stream: returns (this layer's output, the stream before it is added);
        the stream `residual` (None for the first layer) is updated in place, as is this layer's row
        of `batch.expert_counts` (MoE layers only, as `SparseMoeBlock` says). `kv_cache` is this
        layer's [P, 2, S, Hkv, D] of the pool."""
        tables = rotary.for_layer(self.self_attn.window is not None)
        if self.fused is not None and batch.lora is None:
            return self.fused.forward(x.contiguous(), residual, batch.positions, tables, kv_cache, batch.meta)
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, batch, tables, backend, kv_cache)
        if self.is_sandwich:
            h = self.post_attention_layernorm.plain(h)
            h, residual = self.pre_feedforward_layernorm(h, residual)
        else:
            h, residual = self.post_attention_layernorm(h, residual)
        ffn = getattr(self, self.ffn_name)
        if self.is_moe:
            counts = batch.expert_counts
            out = ffn(h, None if counts is None else counts[self.layer_id])
        else:
            out = ffn(h, batch.lora, self.layer_id)
        return (self.post_feedforward_layernorm.plain(out) if self.is_sandwich else out), residual


class DecoderStack(nn.Module):
    def __init__(self, config: ModelConfig, ffn: FfnFactory, fused_qkv: str | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, ffn, fused_qkv) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """`forward` returns final hidden states [T, hidden]; `compute_logits` maps rows to fp32 logits.

    With `config.num_labels` (HF `*ForSequenceClassification`, e.g. a reward model) the head is
    `score` [num_labels, hidden] and `compute_logits` gives the class scores instead. `ffn` builds each
    layer's feed-forward block (dense MLP or MoE) and the attribute name HF gives it.
    """

    def __init__(self, config: ModelConfig, ffn: FfnFactory | None = None, fused_qkv: str | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config, ffn or dense_ffn(), fused_qkv)
        self.embedding_scale = config.features.embedding_scale
        self.softcap = config.features.final_logit_softcap
        if config.num_labels:
            self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
            return
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, batch: ForwardBatch, rotary: RotaryEmbedding, backend: AttentionBackend, kv_pool: torch.Tensor
    ) -> torch.Tensor:
        """The final hidden states [T, hidden] of `batch`'s T new tokens; their K/V are written into
        `kv_pool` [P, num_layers, 2, S, Hkv, D]. When `batch.expert_counts` ([num_layers, num_experts]
        int64) is given, each MoE layer adds to its row the number of these tokens routed to each
        expert (T x num_experts_per_tok per layer)."""
        x, residual = self.model.embed_tokens(batch.input_ids), None
        if self.embedding_scale is not None:
            x = x * torch.tensor(self.embedding_scale, dtype=x.dtype)
        for layer_id, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, batch, rotary, backend, kv_pool[:, layer_id])
        return self.model.norm(x, residual)[0]

    def fuse_layers(self, backend: AttentionBackend, kv_dtype: torch.dtype) -> int:
        """`DecoderLayer.fuse` on every layer (after every weight load); how many are fused."""
        layers: list[DecoderLayer] = list(self.model.layers)  # type: ignore[arg-type]
        return sum(layer.fuse(backend, kv_dtype) for layer in layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.score if self.config.num_labels else self.lm_head
        logits = head(hidden).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def load_weights(
        self,
        tensors: Iterable[tuple[str, Value]],
        quantization: str = "none",
        int8_activations: bool = False,
    ) -> None:
        """Copy HF-named tensors into the parameters (every one covered exactly), fusing projections
        and keeping or making quantized weights as `engine.weight_loader` says for `quantization`."""
        load_into(self, tensors, quantization, int8_activations)
