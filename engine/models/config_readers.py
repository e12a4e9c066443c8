"""The keys every dense family shares, read from an HF `config.json` dict or from GGUF metadata.

A family file calls `config_from_hf` / `config_from_gguf` with what differs for it (its biases, its
`LayerFeatures`, its MoE fields) as keyword overrides, so the common keys are read in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from gguf import GGUFReader, TokenType

from engine.config import ConfigError, ModelConfig


def config_from_hf(config: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """A `ModelConfig` from an HF config dict: the common keys, then `overrides` (field -> value)."""
    num_heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    rope_theta, rope_scaling = hf_rope(config)
    fields: dict[str, Any] = dict(
        architecture=str(config["architectures"][0]),
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=bool(config.get("attention_bias", False)),
        o_proj_bias=bool(config.get("attention_bias", False)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos_ids,
        rope_scaling=tuple(sorted((k, v) for k, v in rope_scaling.items() if not isinstance(v, (list, dict)))),
    )
    return ModelConfig(**{**fields, **overrides})


def hf_rope(config: Mapping[str, Any], layer_type: str | None = None) -> tuple[float, dict[str, Any]]:
    """(rope theta, scaling dict) of an HF config. transformers 5 writes them into `rope_parameters`,
    per layer type where layers differ (Gemma 3: `{"full_attention": {...}, "sliding_attention": {...}}`);
    older files have `rope_theta` and `rope_scaling` at the top level."""
    parameters = dict(config.get("rope_parameters") or {})
    if layer_type is not None or "full_attention" in parameters:
        parameters = dict(parameters.get(layer_type or "full_attention") or {})
    scaling = dict(config.get("rope_scaling") or {})
    if not scaling and parameters.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in parameters.items() if k != "rope_theta"}
    theta = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
    return float(theta), scaling


def hf_sliding_layers(config: Mapping[str, Any]) -> tuple[int, ...]:
    """The layers HF's `layer_types` marks as sliding-window ones (() when it has none)."""
    types = config.get("layer_types") or ()
    return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")


class GGUFMetadata:
    """Typed reads of one GGUF file's metadata under its architecture's key prefix."""

    def __init__(self, reader: GGUFReader, arch: str) -> None:
        self.reader, self.arch = reader, arch
        self.tensor_names = frozenset(tensor.name for tensor in reader.tensors)

    _REQUIRED = object()

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        """The value of `key` (`{arch}.` is prepended to a key starting with '.'); ConfigError when a
        key with no default is missing."""
        full = f"{self.arch}{key}" if key.startswith(".") else key
        found = self.reader.get_field(full)
        if found is None:
            if default is GGUFMetadata._REQUIRED:
                raise ConfigError(f"{self.reader.data.filename}: GGUF metadata lacks required key {full!r}")
            return default
        return found.contents()

    def has_bias(self, part: str) -> bool:
        return f"blk.0.{part}.bias" in self.tensor_names

    def vocab_size(self) -> int:
        size = self.get(".vocab_size", None)
        if size is not None:
            return int(size)
        tokens = self.reader.get_field("tokenizer.ggml.tokens")
        if tokens is None:
            raise ConfigError(
                f"{self.reader.data.filename}: neither {self.arch}.vocab_size nor tokenizer.ggml.tokens "
                "gives the vocabulary size"
            )
        return len(tokens.data)  # one entry per array element; avoids decoding every token

    def end_of_generation_ids(self) -> tuple[int, ...]:
        """Every token id that ends generation: the file's eos, eot and eom ids, then each control token
        whose text is a known end of text or of turn. Qwen files name `<|im_end|>` as eos, yet their
        models also end with `<|endoftext|>` (HF's generation config lists both; llama.cpp stops on both)."""
        ids = [self.get(f"tokenizer.ggml.{kind}_token_id", None) for kind in ("eos", "eot", "eom")]
        tokens = self.reader.get_field("tokenizer.ggml.tokens")
        types = self.reader.get_field("tokenizer.ggml.token_type")
        if tokens is not None and types is not None:
            control = np.flatnonzero(np.concatenate([types.parts[i] for i in types.data]) == TokenType.CONTROL)
            texts = {int(i): bytes(tokens.parts[tokens.data[i]]).decode(errors="replace") for i in control}
            ids += [i for i, text in texts.items() if text in _END_TEXTS]
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


# The texts of the special tokens that end a text or a turn in the families' chat formats.
_END_TEXTS = frozenset(
    {
        "<|endoftext|>",
        "<|im_end|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end_of_text|>",
        "<|end|>",
        "<end_of_turn>",
        "<eos>",
        "</s>",
        "<EOT>",
    }
)


def config_from_gguf(meta: GGUFMetadata, architecture: str, **overrides: Any) -> ModelConfig:
    """A `ModelConfig` from GGUF metadata: the common keys, then `overrides` (field -> value)."""
    hidden = int(meta.get(".embedding_length"))
    num_heads = int(meta.get(".attention.head_count"))
    bos = meta.get("tokenizer.ggml.bos_token_id", None)
    if len({meta.has_bias("attn_q"), meta.has_bias("attn_k"), meta.has_bias("attn_v")}) != 1:
        raise ConfigError(f"{meta.reader.data.filename}: q, k and v must all have a bias or none")
    fields: dict[str, Any] = dict(
        architecture=architecture,
        vocab_size=meta.vocab_size(),
        hidden_size=hidden,
        intermediate_size=int(meta.get(".feed_forward_length")),
        num_layers=int(meta.get(".block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta.get(".attention.head_count_kv", num_heads)),
        head_dim=int(meta.get(".attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(meta.get(".attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(".rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta.get(".context_length")),
        tie_word_embeddings="output.weight" not in meta.tensor_names,
        qkv_bias=meta.has_bias("attn_q"),
        o_proj_bias=meta.has_bias("attn_output"),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=meta.end_of_generation_ids(),
        rope_scaling=gguf_rope_scaling(meta),
    )
    return ModelConfig(**{**fields, **overrides})


def gguf_rope_scaling(meta: GGUFMetadata) -> tuple[tuple[str, Any], ...]:
    kind = meta.get(".rope.scaling.type", "none")
    if kind == "none":
        return ()
    if kind == "linear":
        return (("factor", float(meta.get(".rope.scaling.factor"))), ("rope_type", "linear"))
    raise ConfigError(f"{meta.reader.data.filename}: unsupported GGUF rope scaling type {kind!r} (supported: linear)")


def hf_typed_window(config: Mapping[str, Any]) -> dict[str, Any]:
    """`LayerFeatures` window fields of a family whose layers are typed (Qwen2, Qwen3, Gemma 3): the
    layers `layer_types` marks sliding, or in older files those from `max_window_layers` on when
    `use_sliding_window` is set."""
    window = config.get("sliding_window")
    if "layer_types" in config:
        layers = hf_sliding_layers(config)
    elif config.get("use_sliding_window"):
        layers = tuple(range(int(config.get("max_window_layers", 0)), int(config["num_hidden_layers"])))
    else:
        layers = ()
    if not layers or window is None:
        return {}
    return dict(sliding_window=int(window), sliding_layers=layers)


def hf_uniform_window(config: Mapping[str, Any]) -> dict[str, Any]:
    """`LayerFeatures` window fields of a family whose every layer uses `sliding_window` when it is
    set (Mistral, Mixtral, Phi-3)."""
    window = config.get("sliding_window")
    return {} if window is None else dict(sliding_window=int(window))


def head_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The `ModelConfig` fields of the model's head: a `*ForSequenceClassification` has a score head of
    `num_labels` outputs and never ties it to the embeddings; a causal LM ties where the config says."""
    if not str(config["architectures"][0]).endswith("ForSequenceClassification"):
        return {"tie_word_embeddings": bool(config.get("tie_word_embeddings", False)), "num_labels": 0}
    labels = config.get("id2label")  # one entry per output; `num_labels` alone in older files; HF's default is 2
    return {"tie_word_embeddings": False, "num_labels": len(labels) if labels else int(config.get("num_labels", 2))}
