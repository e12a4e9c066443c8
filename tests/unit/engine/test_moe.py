"""Mixture of experts: routing, the sparse block against a dense reference, the expert recorder, and the
MoE fields of `ModelConfig` and the expected checkpoint names."""

from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError, ModelConfig
from engine.errors import InvalidRequestError
from engine.models.layers import MLP
from engine.models.registry import build_model, config_from_hf
from engine.moe import ExpertRecorder, MixtralExpert, SparseMoeBlock, route
from engine.weight_loader import checkpoint_shapes
from engine.weights.names import expected_shapes

_BASE = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64)
QWEN2_MOE = {**_BASE, "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 6, "num_experts_per_tok": 2,
             "moe_intermediate_size": 8, "shared_expert_intermediate_size": 12, "norm_topk_prob": False,
             "decoder_sparse_step": 1, "mlp_only_layers": [1]}
MIXTRAL = {**_BASE, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2,
           "sliding_window": None}


def _config(raw: dict, **overrides) -> ModelConfig:
    return config_from_hf({**raw, **overrides})


def test_route_takes_the_top_k_of_the_softmax_and_renormalizes_when_asked() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.5]])
    probs = torch.softmax(logits, -1)
    weights, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [0, 3]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    assert weights.dtype == torch.float32


def _dense_reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by the (zero for unchosen) routing weight: the definition."""
    weights, ids = route(block.gate(x), block.top_k, block.renormalize)
    full = torch.zeros(x.shape[0], len(block.experts)).scatter(1, ids, weights)
    out = sum(full[:, e:e + 1] * expert(x) for e, expert in enumerate(block.experts))
    if block.has_shared_expert:
        out = out + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return out


@pytest.mark.parametrize("raw", [QWEN2_MOE, MIXTRAL], ids=["qwen2_moe", "mixtral"])
def test_sparse_block_equals_the_dense_definition_and_counts_each_choice_once(raw: dict) -> None:
    torch.manual_seed(0)
    config = _config(raw)
    model = build_model(config)
    block = getattr(model.model.layers[0], model.model.layers[0].ffn_name)
    x = torch.randn(9, config.hidden_size)
    counts = torch.zeros(config.num_experts, dtype=torch.int64)
    with torch.no_grad():
        torch.testing.assert_close(block(x, counts), _dense_reference(block, x))
        _, ids = route(block.gate(x), config.num_experts_per_tok, config.norm_topk_prob)
    assert counts.tolist() == torch.bincount(ids.flatten(), minlength=config.num_experts).tolist()
    assert int(counts.sum()) == 9 * config.num_experts_per_tok


def test_layers_get_hf_names_dense_or_moe() -> None:
    qwen = build_model(_config(QWEN2_MOE))
    assert [layer.is_moe for layer in qwen.model.layers] == [True, False, True, True]
    assert isinstance(qwen.model.layers[1].mlp, MLP) and isinstance(qwen.model.layers[0].mlp, SparseMoeBlock)
    mixtral = build_model(_config(MIXTRAL))
    assert isinstance(mixtral.model.layers[0].block_sparse_moe.experts[3], MixtralExpert)
    for model, config in ((qwen, _config(QWEN2_MOE)), (mixtral, _config(MIXTRAL))):
        assert checkpoint_shapes(model) == expected_shapes(config)


def test_qwen2_moe_config_fields() -> None:
    config = _config(QWEN2_MOE, decoder_sparse_step=2)
    assert config.architecture == "Qwen2MoeForCausalLM" and config.qkv_bias
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.shared_expert_intermediate_size, config.norm_topk_prob) == (6, 2, 8, 12, False)
    assert config.moe_layer_ids == (3,)   # every 2nd layer (1-based), minus mlp_only_layers
    shapes = expected_shapes(config)
    assert shapes["model.layers.3.mlp.experts.5.down_proj.weight"] == (16, 8)
    assert shapes["model.layers.3.mlp.shared_expert_gate.weight"] == (1, 16)
    assert shapes["model.layers.1.mlp.gate_proj.weight"] == (24, 16)


def test_mixtral_config_fields() -> None:
    config = _config(MIXTRAL, sliding_window=32)
    assert config.architecture == "MixtralForCausalLM" and not config.qkv_bias
    assert (config.num_experts, config.moe_intermediate_size, config.norm_topk_prob) == (4, 24, True)
    assert config.moe_layer_ids == (0, 1, 2, 3) and config.shared_expert_intermediate_size == 0
    assert config.max_position_embeddings == 64 and config.window_of(3) == 32   # every layer slides
    assert expected_shapes(config)["model.layers.2.block_sparse_moe.experts.3.w2.weight"] == (16, 24)


def test_invalid_moe_configs_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        _config(QWEN2_MOE, num_experts_per_tok=7)
    with pytest.raises(ConfigError, match="moe_intermediate_size"):
        _config(QWEN2_MOE, moe_intermediate_size=0)


def test_recorder_counts_only_while_recording_and_dump_clears() -> None:
    config = _config(QWEN2_MOE)
    recorder = ExpertRecorder(config)
    assert recorder.step_counts() is None
    recorder.start()
    counts = recorder.step_counts()
    assert counts is not None and counts.shape == (4, 6)
    counts[0, 1] += 5
    counts[3, 0] += 2
    recorder.stop()
    assert recorder.step_counts() is None
    dump = recorder.dump()
    assert (dump.layer_ids, dump.num_experts, dump.num_experts_per_tok) == ((0, 2, 3), 6, 2)
    assert dump.counts == ((0, 5, 0, 0, 0, 0), (0,) * 6, (2, 0, 0, 0, 0, 0))
    assert recorder.dump().counts == ((0,) * 6,) * 3
    recorder.start()
    recorder.step_counts()[0, 0] += 1
    recorder.start()   # start clears
    assert recorder.dump().counts[0][0] == 0


def test_recorder_of_a_dense_model_refuses() -> None:
    dense = config_from_hf({**_BASE, "architectures": ["LlamaForCausalLM"]})
    recorder = ExpertRecorder(dense)
    for action in (recorder.start, recorder.stop, recorder.dump):
        with pytest.raises(InvalidRequestError, match="no mixture-of-experts"):
            action()
