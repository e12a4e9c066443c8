"""Qwen2 and Qwen2.5 (q/k/v biases, no o bias; sliding window on the layers `layer_types` marks), and
Qwen2 classifiers. Qwen's GGUF files keep HF's rotate-half order (no un-permutation)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.config import LayerFeatures, ModelConfig
from engine.models.config_readers import (
    GGUFMetadata,
    config_from_gguf,
    config_from_hf,
    head_fields,
    hf_typed_window,
)
from engine.models.family import ModelFamily
from engine.models.layers import CausalLM


def _from_hf(config: Mapping[str, Any]) -> ModelConfig:
    return config_from_hf(
        config,
        qkv_bias=True,
        o_proj_bias=False,
        **head_fields(config),
        features=LayerFeatures(**hf_typed_window(config)),
    )


def _from_gguf(meta: GGUFMetadata) -> ModelConfig:
    return config_from_gguf(meta, "Qwen2ForCausalLM", qkv_bias=True)


FAMILY = ModelFamily(name="qwen2", config_from_hf=_from_hf, build=CausalLM, config_from_gguf=_from_gguf)
