"""Phi-3: Llama's layers with q/k/v stored as one `qkv_proj` and gate/up as one `gate_up_proj` in the
checkpoint (llama.cpp: `attn_qkv`, and `ffn_up` holding both), a sliding window on every layer when set."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.config import ConfigError, LayerFeatures, ModelConfig
from engine.models.config_readers import GGUFMetadata, config_from_gguf, config_from_hf, hf_uniform_window
from engine.models.family import ModelFamily
from engine.models.layers import CausalLM, dense_ffn


def _from_hf(config: Mapping[str, Any]) -> ModelConfig:
    if float(config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError("Phi-3 with partial_rotary_factor != 1 is not supported")
    return config_from_hf(config, features=LayerFeatures(**hf_uniform_window(config)))


def _from_gguf(meta: GGUFMetadata) -> ModelConfig:
    window = meta.get(".attention.sliding_window", None)
    return config_from_gguf(
        meta, "Phi3ForCausalLM", features=LayerFeatures(sliding_window=int(window) if window else None)
    )


def build(config: ModelConfig) -> CausalLM:
    return CausalLM(config, dense_ffn(fused_gate_up="gate_up_proj"), fused_qkv="qkv_proj")


FAMILY = ModelFamily(name="phi3", config_from_hf=_from_hf, build=build, config_from_gguf=_from_gguf)
