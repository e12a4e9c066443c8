"""Model construction shared by the runner and the embedder: dtypes, the tie after `to_empty`, weights loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import _DTYPES, ConfigError
from engine.model_setup import load_causal_lm, torch_dtype
from engine.weights import open_checkpoint
from tests.tiny_models import save_tiny_llama


def test_every_dtype_the_config_accepts_has_a_torch_dtype() -> None:
    assert [torch_dtype(name) for name in _DTYPES] == [torch.bfloat16, torch.float32, torch.float16]
    with pytest.raises(ConfigError):
        torch_dtype("float64")


@pytest.mark.parametrize("tie_word_embeddings", [True, False])
def test_a_loaded_model_holds_the_checkpoint_weights_with_its_embeddings_tied(
        tmp_path: Path, tie_word_embeddings: bool) -> None:
    directory = save_tiny_llama(tmp_path, tie_word_embeddings=tie_word_embeddings)
    model = load_causal_lm(open_checkpoint(str(directory)), torch.float32, "cpu", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    assert not model.training
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie_word_embeddings
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)
    assert torch.equal(model.model.embed_tokens.weight, hf.model.embed_tokens.weight)
