"""Mixtral: Llama/Mistral attention; every layer routes each token to the top-k of its experts
(`block_sparse_moe`, experts `w1`/`w2`/`w3` of width `intermediate_size`), weights renormalized."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from engine.config import LayerFeatures, ModelConfig
from engine.models.config_readers import config_from_hf, hf_uniform_window
from engine.models.family import ModelFamily
from engine.models.layers import CausalLM
from engine.moe import MixtralExpert, SparseMoeBlock


def _from_hf(config: Mapping[str, Any]) -> ModelConfig:
    return config_from_hf(
        config,
        features=LayerFeatures(**hf_uniform_window(config)),
        num_experts=int(config["num_local_experts"]),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(config["intermediate_size"]),
        norm_topk_prob=True,
    )


def _ffn(config: ModelConfig, layer_id: int) -> tuple[str, nn.Module]:
    experts: list[nn.Module] = [
        MixtralExpert(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
    ]
    return "block_sparse_moe", SparseMoeBlock(config, experts, None)


def build(config: ModelConfig) -> CausalLM:
    return CausalLM(config, _ffn)


FAMILY = ModelFamily(name="mixtral", config_from_hf=_from_hf, build=build)
