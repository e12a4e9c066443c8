"""Tests for engine.lora: adapters made by the real `peft` on a tiny random Llama load into A/B pairs whose
`scaling * B @ A` is PEFT's own merged update; adapters Tandem cannot serve, adapters for another base and
paths outside --lora-dir fail with a clear `LoraLoadError`."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from engine.config import ModelConfig
from engine.errors import InvalidRequestError, LoraLoadError
from engine.lora import ADAPTER_WEIGHTS, LoraAdapter, Projection, resolve_adapter_path
from engine.weights.safetensors_reader import open_safetensors_dir
from tests.tiny_models import save_tiny_llama, save_tiny_qwen3

torch.set_flush_denormal(True)

ALL_TARGETS = [p.value for p in Projection]
NUM_LAYERS = 2  # tiny_models' Llama


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("base"), seed=3)


@pytest.fixture(scope="module")
def base_config(base_dir: Path) -> ModelConfig:
    return open_safetensors_dir(base_dir)[0]


def make_adapter(base_dir: Path, out: Path, seed: int = 0, safe: bool = True, **lora: Any) -> dict[str, torch.Tensor]:
    """Save a PEFT adapter (random A and B unless `init_lora_weights` says otherwise) for the model in
    `base_dir` to `out`; return PEFT's merged-minus-base weight of every linear module, by module name."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    base = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    peft_model = get_peft_model(model, LoraConfig(**{"init_lora_weights": False, **lora}))
    peft_model.save_pretrained(out, safe_serialization=safe)
    merged = peft_model.merge_and_unload().state_dict()
    return {name.removesuffix(".weight"): merged[name] - base[name] for name in base if name.endswith("proj.weight")}


@pytest.mark.parametrize(
    "lora",
    [
        {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        {"r": 8, "lora_alpha": 16, "target_modules": ALL_TARGETS},
        {"r": 16, "lora_alpha": 4, "target_modules": ALL_TARGETS, "use_rslora": True},
        {"r": 1, "lora_alpha": 3, "target_modules": ["k_proj", "o_proj", "down_proj"]},
        {
            "r": 4,
            "lora_alpha": 8,
            "target_modules": ALL_TARGETS,
            "rank_pattern": {"layers.1.self_attn.q_proj": 2, "down_proj": 8},
            "alpha_pattern": {"gate_proj": 32},
        },
    ],
    ids=["q_v_r4", "all_r8", "all_r16_rslora", "three_r1", "rank_and_alpha_patterns"],
)
def test_adapter_reproduces_peft_merged_update(
    base_dir: Path, base_config: ModelConfig, tmp_path: Path, lora: dict[str, Any]
) -> None:
    expected = make_adapter(base_dir, tmp_path, **lora)
    adapter = LoraAdapter.load(tmp_path, base_config)

    targets = set(lora["target_modules"])
    assert set(adapter.weights) == {(i, p) for i in range(NUM_LAYERS) for p in Projection if p.value in targets}
    assert adapter.settings.base_model_name_or_path == str(base_dir)
    for name, delta in expected.items():
        layer, projection = int(name.split(".")[2]), Projection(name.split(".")[-1])
        weights = adapter.weights.get((layer, projection))
        if weights is None:
            assert not delta.any(), f"{name} is not targeted but PEFT changed it"
            continue
        assert weights.a.dtype == weights.b.dtype == torch.float32
        assert weights.a.shape == (weights.rank, delta.shape[1]) and weights.b.shape == (delta.shape[0], weights.rank)
        assert delta.abs().max() > 1e-3, f"{name}: PEFT's update is too small to test anything"
        torch.testing.assert_close(weights.delta(), delta, rtol=1e-5, atol=1e-6, msg=name)
    if "rank_pattern" in lora:
        assert adapter.weights[(1, Projection.Q_PROJ)].rank == 2 and adapter.weights[(0, Projection.Q_PROJ)].rank == 4
        assert adapter.rank == 8
    if lora.get("use_rslora"):
        assert adapter.weights[(0, Projection.Q_PROJ)].scaling == pytest.approx(4 / 16**0.5)


def test_peft_default_init_adapter_changes_nothing(base_dir: Path, base_config: ModelConfig, tmp_path: Path) -> None:
    make_adapter(base_dir, tmp_path, r=8, target_modules=ALL_TARGETS, init_lora_weights=True)
    adapter = LoraAdapter.load(tmp_path, base_config)
    assert len(adapter.weights) == NUM_LAYERS * len(Projection)
    assert all(not w.delta().any() for w in adapter.weights.values())  # PEFT's B starts at zero


def test_adapter_for_another_base_names_the_mismatch(base_dir: Path, base_config: ModelConfig, tmp_path: Path) -> None:
    make_adapter(base_dir, tmp_path, r=4, target_modules=ALL_TARGETS)
    qwen3 = open_safetensors_dir(save_tiny_qwen3(tmp_path / "qwen3"))[0]  # head_dim 32: q is 128 wide
    with pytest.raises(LoraLoadError, match=r"model\.layers\.0\.self_attn\.q_proj\.lora_B is \[64, 4\], "
                                            r"expected \[128, 4\]") as raised:
        LoraAdapter.load(tmp_path, qwen3)
    assert "Qwen3ForCausalLM" in str(raised.value) and str(base_dir) in str(raised.value)

    narrower = dataclasses.replace(base_config, intermediate_size=96)
    with pytest.raises(LoraLoadError, match=r"mlp\.down_proj\.lora_A is \[4, 128\], expected \[4, 96\]"):
        LoraAdapter.load(tmp_path, narrower)
    with pytest.raises(LoraLoadError, match=r"it has layers \[1\] but the base model has 1 layers"):
        LoraAdapter.load(tmp_path, dataclasses.replace(base_config, num_layers=1))
    assert issubclass(LoraLoadError, InvalidRequestError) and issubclass(LoraLoadError, ValueError)


def test_rank_over_the_limit_is_refused(base_dir: Path, base_config: ModelConfig, tmp_path: Path) -> None:
    make_adapter(base_dir, tmp_path, r=8, target_modules=["q_proj"])
    with pytest.raises(LoraLoadError, match="rank 8 is over the limit of 4"):
        LoraAdapter.load(tmp_path, base_config, max_rank=4)
    assert LoraAdapter.load(tmp_path, base_config, max_rank=8).rank == 8


def test_pickled_adapter_is_refused(base_dir: Path, base_config: ModelConfig, tmp_path: Path) -> None:
    make_adapter(base_dir, tmp_path, safe=False, r=4, target_modules=["q_proj"])
    assert (tmp_path / "adapter_model.bin").is_file() and not (tmp_path / ADAPTER_WEIGHTS).exists()
    with pytest.raises(LoraLoadError, match="only adapter_model.bin, a pickle"):
        LoraAdapter.load(tmp_path, base_config)


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"target_modules": ["q_proj", "v_proj"], "use_dora": True}, r"does not serve DoRA \(use_dora\)"),
        ({"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, "does not serve modules_to_save"),
        ({"target_modules": ["q_proj"], "bias": "lora_only"}, r"bias='lora_only'"),
        ({"target_modules": ["q_proj", "lm_head"]}, "adapters on lm_head are not served"),
        ({"target_modules": ["embed_tokens", "q_proj"]}, "adapters on embed_tokens are not served"),
        ({"target_modules": r".*(q_proj|lm_head)"}, "embedding and lm_head adapters are not served.*lm_head"),
    ],
    ids=["dora", "modules_to_save", "bias", "lm_head", "embed_tokens", "lm_head_by_regex"],
)
def test_unserved_peft_features_are_refused(
    base_dir: Path, base_config: ModelConfig, tmp_path: Path, lora: dict[str, Any], message: str
) -> None:
    make_adapter(base_dir, tmp_path, r=4, **lora)
    with pytest.raises(LoraLoadError, match=message):
        LoraAdapter.load(tmp_path, base_config)


def test_unreadable_adapters_fail_clearly(base_dir: Path, base_config: ModelConfig, tmp_path: Path) -> None:
    with pytest.raises(LoraLoadError, match="is not a directory"):
        LoraAdapter.load(tmp_path / "absent", base_config)
    with pytest.raises(LoraLoadError, match="has no adapter_model.safetensors"):
        LoraAdapter.load(tmp_path, base_config)
    make_adapter(base_dir, tmp_path, r=4, target_modules=["q_proj"])
    (tmp_path / ADAPTER_WEIGHTS).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(LoraLoadError, match="cannot read the safetensors header"):
        LoraAdapter.load(tmp_path, base_config)
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "rank_pattern": {"q_(": 2}}')
    with pytest.raises(LoraLoadError, match="missing \\)"):
        LoraAdapter.load(tmp_path, base_config)
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 0}')
    with pytest.raises(LoraLoadError, match="r must be a positive integer, got 0"):
        LoraAdapter.load(tmp_path, base_config)
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "IA3"}')
    with pytest.raises(LoraLoadError, match="peft_type is 'IA3', not 'LORA'"):
        LoraAdapter.load(tmp_path, base_config)


def test_adapter_paths_stay_inside_lora_dir(tmp_path: Path) -> None:
    lora_dir, outside = tmp_path / "loras", tmp_path / "outside"
    (lora_dir / "team" / "mine").mkdir(parents=True)
    outside.mkdir()
    os.symlink(outside, lora_dir / "escape")
    os.symlink(lora_dir / "team" / "mine", lora_dir / "alias")

    assert resolve_adapter_path(lora_dir, "team/mine") == (lora_dir / "team" / "mine").resolve()
    assert resolve_adapter_path(lora_dir, "alias") == (lora_dir / "team" / "mine").resolve()
    assert resolve_adapter_path(lora_dir, str(lora_dir / "team" / "mine")) == (lora_dir / "team/mine").resolve()
    for escape in ("../outside", "team/../../outside", "escape", str(outside), "/etc", ".", ""):
        with pytest.raises(LoraLoadError, match="outside --lora-dir|invalid LoRA adapter path"):
            resolve_adapter_path(lora_dir, escape)
    with pytest.raises(LoraLoadError, match="no LoRA adapter directory 'team/theirs'"):
        resolve_adapter_path(lora_dir, "team/theirs")
    with pytest.raises(LoraLoadError, match="at run time is off: start the server with --lora-dir"):
        resolve_adapter_path(None, "team/mine")
