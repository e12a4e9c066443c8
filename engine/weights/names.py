"""Parameter names and shapes a checkpoint must provide, and llama.cpp's names for them.

Every loader yields names exactly as transformers' `LlamaForCausalLM` / `Qwen2ForCausalLM` (and
`Qwen2MoeForCausalLM`, `MixtralForCausalLM`, `*ForSequenceClassification`) checkpoints spell them,
minus `lm_head.weight` when the embeddings are tied.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from engine.config import Architecture, ConfigError, ModelConfig

LM_HEAD = "lm_head.weight"
SCORE = "score.weight"  # the head of *ForSequenceClassification, instead of lm_head

# Buffers some older HF checkpoints saved next to the parameters; they carry no weights.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": LM_HEAD,
}
_GGUF_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")

Shape = tuple[int, ...]


def expected_shapes(config: ModelConfig) -> dict[str, Shape]:
    """HF parameter name -> shape for every parameter of `config`, in state_dict order."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    shapes: dict[str, Shape] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for proj, rows, has_bias in (
            ("q_proj", q_dim, config.qkv_bias),
            ("k_proj", kv_dim, config.qkv_bias),
            ("v_proj", kv_dim, config.qkv_bias),
        ):
            shapes[f"{attn}{proj}.weight"] = (rows, hidden)
            if has_bias:
                shapes[f"{attn}{proj}.bias"] = (rows,)
        shapes[f"{attn}o_proj.weight"] = (hidden, q_dim)
        if config.o_proj_bias:
            shapes[f"{attn}o_proj.bias"] = (hidden,)
        if config.is_moe_layer(i):
            shapes.update(_moe_shapes(config, f"model.layers.{i}."))
        else:
            shapes.update(_swiglu_shapes(mlp, hidden, inter))
        shapes[f"model.layers.{i}.input_layernorm.weight"] = (hidden,)
        shapes[f"model.layers.{i}.post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if config.num_labels:
        shapes[SCORE] = (config.num_labels, hidden)
    elif not config.tie_word_embeddings:
        shapes[LM_HEAD] = (config.vocab_size, hidden)
    return shapes


def _swiglu_shapes(prefix: str, hidden: int, inter: int) -> dict[str, Shape]:
    return {
        f"{prefix}gate_proj.weight": (inter, hidden),
        f"{prefix}up_proj.weight": (inter, hidden),
        f"{prefix}down_proj.weight": (hidden, inter),
    }


def _mixtral_expert_shapes(prefix: str, hidden: int, inter: int) -> dict[str, Shape]:
    return {
        f"{prefix}w1.weight": (inter, hidden),
        f"{prefix}w2.weight": (hidden, inter),
        f"{prefix}w3.weight": (inter, hidden),
    }


def _moe_shapes(config: ModelConfig, layer: str) -> dict[str, Shape]:
    """One MoE layer: Qwen2-MoE's `mlp.{gate, experts.<e>.*_proj, shared_expert.*, shared_expert_gate}`
    or Mixtral's `block_sparse_moe.{gate, experts.<e>.w1/w2/w3}`."""
    hidden, width = config.hidden_size, config.moe_intermediate_size
    is_mixtral = config.architecture is Architecture.MIXTRAL
    block = f"{layer}block_sparse_moe." if is_mixtral else f"{layer}mlp."
    shapes: dict[str, Shape] = {f"{block}gate.weight": (config.num_experts, hidden)}
    expert_shapes = _mixtral_expert_shapes if is_mixtral else _swiglu_shapes
    for e in range(config.num_experts):
        shapes.update(expert_shapes(f"{block}experts.{e}.", hidden, width))
    if config.shared_expert_intermediate_size:
        shapes.update(_swiglu_shapes(f"{block}shared_expert.", hidden, config.shared_expert_intermediate_size))
        shapes[f"{block}shared_expert_gate.weight"] = (1, hidden)
    return shapes


def check_tensors(found: Mapping[str, Shape], config: ModelConfig, where: str) -> None:
    """Raise `ConfigError` unless `found` (HF name -> shape) is exactly what `config` needs.

    An unexpected tensor (an MLP bias, an MoE expert) means the checkpoint is not the
    architecture `config` describes, so it is an error rather than something to drop.
    """
    check_shapes(found, expected_shapes(config), where, f"{config.architecture.value} with {config.num_layers} layers")


def check_shapes(found: Mapping[str, Shape], expected: Mapping[str, Shape], where: str, model: str) -> None:
    """Raise `ConfigError` unless `found` has exactly the names of `expected`, with its shapes.

    `model` names what was expected in the message (e.g. "BertModel with 6 layers").
    """
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    if missing or unexpected:
        raise ConfigError(
            f"{where}: tensors do not match {model}; missing {_preview(missing)}; unexpected {_preview(unexpected)}"
        )
    wrong = [
        f"{name} {tuple(found[name])} (expected {shape})"
        for name, shape in expected.items()
        if tuple(found[name]) != tuple(shape)
    ]
    if wrong:
        raise ConfigError(f"{where}: tensor shapes do not match the config: {_preview(wrong)}")


def is_ignored(name: str) -> bool:
    """True for stored tensors that are not parameters (e.g. saved rotary `inv_freq` buffers)."""
    return bool(_IGNORED.search(name))


def hf_name_from_gguf(name: str) -> str | None:
    """The HF name of llama.cpp tensor `name`, or None when it has no HF counterpart."""
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    match = _GGUF_BLOCK_NAME.match(name)
    if match is None or match.group(2) not in _GGUF_BLOCK:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_GGUF_BLOCK[part]}.{kind}"


def _preview(items: list[str], limit: int = 4) -> str:
    shown = ", ".join(items[:limit]) or "none"
    return shown if len(items) <= limit else f"{shown} (+{len(items) - limit} more)"
