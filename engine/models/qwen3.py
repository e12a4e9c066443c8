"""Qwen3: an RMSNorm over each head of q and k before rotary, an explicit head_dim, no q/k/v biases
(unless `attention_bias`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.config import LayerFeatures, ModelConfig
from engine.models.config_readers import GGUFMetadata, config_from_gguf, config_from_hf, hf_typed_window
from engine.models.family import ModelFamily
from engine.models.layers import CausalLM


def _from_hf(config: Mapping[str, Any]) -> ModelConfig:
    return config_from_hf(config, features=LayerFeatures(qk_norm=True, **hf_typed_window(config)))


def _from_gguf(meta: GGUFMetadata) -> ModelConfig:
    return config_from_gguf(meta, "Qwen3ForCausalLM", features=LayerFeatures(qk_norm=True))


FAMILY = ModelFamily(name="qwen3", config_from_hf=_from_hf, build=CausalLM, config_from_gguf=_from_gguf)
