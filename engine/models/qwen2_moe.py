"""Qwen2-MoE: Qwen2's attention; routed SwiGLU experts plus a sigmoid-gated shared expert on every
`decoder_sparse_step`-th layer except `mlp_only_layers`, which keep a dense MLP."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from engine.config import LayerFeatures, ModelConfig
from engine.models.config_readers import config_from_hf, hf_typed_window
from engine.models.family import ModelFamily
from engine.models.layers import MLP, CausalLM
from engine.moe import SparseMoeBlock


def _from_hf(config: Mapping[str, Any]) -> ModelConfig:
    return config_from_hf(
        config,
        qkv_bias=True,
        o_proj_bias=False,
        features=LayerFeatures(**hf_typed_window(config)),
        num_experts=int(config["num_experts"]),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(config["moe_intermediate_size"]),
        shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        decoder_sparse_step=int(config.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in config.get("mlp_only_layers") or ()),
    )


def _ffn(config: ModelConfig, layer_id: int) -> tuple[str, nn.Module]:
    hidden = config.hidden_size
    if not config.is_moe_layer(layer_id):
        return "mlp", MLP(hidden, config.intermediate_size)
    experts: list[nn.Module] = [MLP(hidden, config.moe_intermediate_size) for _ in range(config.num_experts)]
    width = config.shared_expert_intermediate_size
    return "mlp", SparseMoeBlock(config, experts, MLP(hidden, width) if width else None)


def build(config: ModelConfig) -> CausalLM:
    return CausalLM(config, _ffn)


FAMILY = ModelFamily(name="qwen2_moe", config_from_hf=_from_hf, build=build)
