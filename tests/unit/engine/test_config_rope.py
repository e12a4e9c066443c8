"""Rope scaling read from HF configs in both spellings (`rope_scaling`, and transformers 5's
`rope_parameters`) reaches the engine's rotary tables."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.config import ConfigError, EngineConfig
from engine.engine import Engine
from engine.models.registry import config_from_hf
from engine.request import Request, SamplingParams
from engine.weights import open_checkpoint
from kernels.layers import rope_inv_freq

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, eos_token_id=2)


def _hf_dict(rope_parameters: dict) -> dict:
    config = LlamaConfig(architectures=["LlamaForCausalLM"], rope_parameters=rope_parameters, **SIZES)
    return config.to_dict()


def test_transformers5_rope_parameters_carry_llama3_scaling() -> None:
    hf = _hf_dict({"rope_theta": 50000.0, **LLAMA3})
    assert "rope_scaling" not in hf or not hf["rope_scaling"]  # the layout this test is about
    config = config_from_hf(hf)
    assert config.rope_theta == 50000.0
    assert dict(config.rope_scaling) == LLAMA3
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**hf))
    torch.testing.assert_close(rope_inv_freq(config.head_dim, config.rope_theta, dict(config.rope_scaling)),
                               expected, rtol=1e-6, atol=0)


def test_legacy_rope_scaling_key_is_read() -> None:
    hf = {"architectures": ["LlamaForCausalLM"], "rope_theta": 50000.0, "rope_scaling": dict(LLAMA3),
          **SIZES}
    config = config_from_hf(hf)
    assert dict(config.rope_scaling) == LLAMA3 and config.rope_theta == 50000.0


def test_default_rope_has_no_scaling() -> None:
    config = config_from_hf(_hf_dict({"rope_type": "default", "rope_theta": 10000.0}))
    assert config.rope_scaling == () and config.rope_theta == 10000.0


def test_unsupported_scaling_in_rope_parameters_is_rejected() -> None:
    hf = _hf_dict({"rope_theta": 10000.0, **LLAMA3})
    hf["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(ConfigError, match="yarn"):
        config_from_hf(hf)


def test_engine_with_llama3_scaling_matches_transformers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(rope_parameters={"rope_theta": 10000.0, **LLAMA3}, **SIZES)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    engine = Engine(open_checkpoint(str(tmp_path)),
                    EngineConfig(dtype="float32", page_size=4, max_total_tokens=128), progress=False)
    prompt = [int(t) for t in torch.randint(3, 256, (40,))]  # positions past the original 32
    engine.add_request(Request("r", prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=6)))
    outputs = []
    while engine.has_work:
        outputs += engine.step()
    tokens = [o.token_id for o in outputs]
    reference = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + tokens])).logits[0]
    expected = torch.log_softmax(logits[len(prompt) - 1:-1].float(), dim=-1)
    chosen = expected.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor([o.logprob for o in outputs]), chosen, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chosen, expected.max(dim=-1).values, atol=1e-4, rtol=0)
