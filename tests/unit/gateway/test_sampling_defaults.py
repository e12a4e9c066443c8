"""Server sampling defaults: generation_config.json, --default-sampling, and how requests override them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cluster.pool import ModelLimits
from gateway.errors import APIError
from gateway.sampling_defaults import SamplingDefaults, load_generation_config
from gateway.service.sampling import build_sampling
from tandem.sampling import SamplingSpec

LIMITS = ModelLimits("m", "LlamaForCausalLM", context_len=100, vocab_size=50, eos_token_ids=(2,))


def test_generation_config_fields_become_defaults(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": 2}))
    assert load_generation_config(str(tmp_path)) == SamplingDefaults(temperature=0.6, top_p=0.9)


def test_do_sample_false_means_greedy_and_gguf_has_no_defaults(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert load_generation_config(str(tmp_path)) == SamplingDefaults(temperature=0.0)
    assert load_generation_config(str(tmp_path / "model.gguf")) == SamplingDefaults()


def test_overrides_and_validation() -> None:
    merged = SamplingDefaults(temperature=0.6, top_p=0.9).overridden_by(SamplingDefaults(temperature=0.0))
    assert merged == SamplingDefaults(temperature=0.0, top_p=0.9)
    with pytest.raises(ValueError, match="unknown default sampling keys"):
        SamplingDefaults.from_mapping({"temprature": 1})
    with pytest.raises(ValueError):
        SamplingDefaults(top_p=0)


def test_request_values_win_and_unset_fields_take_the_defaults() -> None:
    defaults = SamplingDefaults(temperature=0.0, top_p=0.5)
    unset = build_sampling(SamplingSpec(), 10, LIMITS, defaults)
    assert unset.temperature == 0.0 and unset.top_p == 0.5
    explicit = build_sampling(SamplingSpec(temperature=1.0), 10, LIMITS, defaults)
    assert explicit.temperature == 1.0
    plain = build_sampling(SamplingSpec(), 10, LIMITS, SamplingDefaults())
    assert plain.temperature is None and plain.top_p is None   # unset: the workers' own defaults
    assert plain.max_new_tokens == 90   # unset max tokens fill the rest of the context


def test_out_of_range_request_values_are_400_naming_the_param() -> None:
    with pytest.raises(APIError) as info:
        build_sampling(SamplingSpec(top_p=1.5), 10, LIMITS, SamplingDefaults())
    assert info.value.status == 400 and info.value.param == "top_p"
    with pytest.raises(APIError) as info:
        build_sampling(SamplingSpec(max_new_tokens=95), 10, LIMITS, SamplingDefaults())
    assert info.value.code == "context_length_exceeded"
