"""Gemma 3 (text): embeddings scaled by sqrt(hidden), four RMSNorms per layer (attention and MLP each
normalized before and after), q/k RMSNorm, GeLU-tanh MLP, sliding-window layers (5 of every 6) that
rotate with their own base, and a softmax scale from `query_pre_attn_scalar`.

Gemma's norms compute `x * (1 + w)`: the module keeps `1 + w` (as llama.cpp's GGUF files store it), so
an HF checkpoint's norm weights get 1 added as they load.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from engine.config import ConfigError, LayerFeatures, ModelConfig
from engine.models.config_readers import GGUFMetadata, config_from_gguf, config_from_hf, hf_rope, hf_typed_window
from engine.models.family import ModelFamily
from engine.models.layers import CausalLM

_GLOBAL_EVERY = 6  # llama.cpp's and HF's default pattern: layers 5, 11, 17, ... attend globally
_LOCAL_ROPE_THETA = 10000.0  # llama.cpp's value for the local layers (their GGUF files do not store it)


def _from_hf(config: Mapping[str, Any]) -> ModelConfig:
    if config.get("attn_logit_softcapping") is not None:
        raise ConfigError("Gemma 3 with attn_logit_softcapping is not supported")
    if config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ConfigError(f"Gemma 3 with hidden_activation {config['hidden_activation']!r} is not supported")
    window = hf_typed_window(config)
    if not window and "layer_types" not in config and config.get("sliding_window"):
        pattern = int(config.get("sliding_window_pattern", _GLOBAL_EVERY))
        layers = tuple(i for i in range(int(config["num_hidden_layers"])) if (i + 1) % pattern)
        window = dict(sliding_window=int(config["sliding_window"]), sliding_layers=layers)
    local_theta = config.get("rope_local_base_freq")
    if local_theta is None:
        local_theta = hf_rope(config, "sliding_attention")[0] if config.get("rope_parameters") else _LOCAL_ROPE_THETA
    features = LayerFeatures(
        qk_norm=True,
        sandwich_norms=True,
        activation="gelu_tanh",
        attention_scale=float(config.get("query_pre_attn_scalar", 256)) ** -0.5,
        local_rope_theta=float(local_theta),
        embedding_scale=math.sqrt(int(config["hidden_size"])),
        final_logit_softcap=config.get("final_logit_softcapping"),
        **window,
    )
    return config_from_hf(config, tie_word_embeddings=bool(config.get("tie_word_embeddings", True)), features=features)


def _from_gguf(meta: GGUFMetadata) -> ModelConfig:
    hidden, num_layers = int(meta.get(".embedding_length")), int(meta.get(".block_count"))
    num_heads = int(meta.get(".attention.head_count"))
    head_dim = int(meta.get(".attention.key_length", hidden // num_heads))
    # llama.cpp scales by head_dim ** -0.5, except for the 27B model (query_pre_attn_scalar = hidden / heads)
    scale = (hidden / num_heads) ** -0.5 if hidden == 5376 else head_dim**-0.5
    window = meta.get(".attention.sliding_window", None)
    features = LayerFeatures(
        qk_norm=True,
        sandwich_norms=True,
        activation="gelu_tanh",
        attention_scale=scale,
        sliding_window=None if window is None else int(window),
        sliding_layers=tuple(i for i in range(num_layers) if (i + 1) % _GLOBAL_EVERY),
        local_rope_theta=_LOCAL_ROPE_THETA,
        embedding_scale=math.sqrt(hidden),
    )
    return config_from_gguf(meta, "Gemma3ForCausalLM", features=features)


def _from_hf_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor + 1 if name.endswith("norm.weight") else tensor


FAMILY = ModelFamily(
    name="gemma3",
    config_from_hf=_from_hf,
    build=CausalLM,
    config_from_gguf=_from_gguf,
    from_hf_tensor=_from_hf_tensor,
)
