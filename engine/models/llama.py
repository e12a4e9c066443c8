"""Llama 2 and 3.x (rope scaling: linear, llama3), and Llama-architecture classifiers (reward models).

Llama's GGUF files interleave q and k's rotary pairs (llama.cpp's converter), which the reader undoes.
Mistral's GGUF files say "llama" too, and load here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.config import LayerFeatures, ModelConfig
from engine.models.config_readers import (
    GGUFMetadata,
    config_from_gguf,
    config_from_hf,
    head_fields,
    hf_uniform_window,
)
from engine.models.family import ModelFamily
from engine.models.layers import CausalLM


def _from_hf(config: Mapping[str, Any]) -> ModelConfig:
    return config_from_hf(
        config,
        **head_fields(config),
        features=LayerFeatures(**hf_uniform_window(config)),
    )


def _from_gguf(meta: GGUFMetadata) -> ModelConfig:
    return config_from_gguf(meta, "LlamaForCausalLM")


FAMILY = ModelFamily(
    name="llama",
    config_from_hf=_from_hf,
    build=CausalLM,
    config_from_gguf=_from_gguf,
    gguf_rope_permuted=True,
)
