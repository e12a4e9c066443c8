"""Sequence-classification (reward) models: the embedder's scores equal HF's `logits` for the same inputs
(tiny random LlamaForSequenceClassification and Qwen2ForSequenceClassification)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from engine.config import ConfigError, EngineConfig
from engine.embedder import load_embedder
from engine.engine import Engine
from engine.weights import open_checkpoint
from tests.tiny_models import save_tiny_classifier

INPUTS = [[5, 17, 42, 99, 3], [7], list(range(3, 70)), [250, 0, 1, 2]]


@pytest.mark.parametrize("num_labels,qwen2", [(1, False), (3, True)], ids=["llama_reward", "qwen2_3_labels"])
def test_scores_equal_hf_logits(tmp_path: Path, num_labels: int, qwen2: bool) -> None:
    model_dir = save_tiny_classifier(tmp_path / "classifier", num_labels=num_labels, qwen2=qwen2)
    # max_prefill_tokens 80: the batch runs in pieces, which must not change any score
    embedder = load_embedder(str(model_dir), EngineConfig(dtype="float32", max_prefill_tokens=80), progress=False)
    assert embedder.info.embedding_dim == num_labels and not embedder.info.is_matryoshka
    expected_arch = "Qwen2ForSequenceClassification" if qwen2 else "LlamaForSequenceClassification"
    assert embedder.info.architecture == expected_arch
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.stack([hf(input_ids=torch.tensor([ids])).logits[0] for ids in INPUTS])
    scores = embedder.embed(INPUTS)
    assert scores.shape == (len(INPUTS), num_labels)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(embedder.embed(INPUTS[1:2]), expected[1:2], rtol=1e-4, atol=1e-5)


def test_classifier_config_and_generation_engine_refusal(tmp_path: Path) -> None:
    model_dir = save_tiny_classifier(tmp_path / "reward")
    checkpoint = open_checkpoint(str(model_dir))
    assert checkpoint.config.num_labels == 1 and checkpoint.config.architecture.endswith("ForSequenceClassification")
    with pytest.raises(ConfigError, match="--is-embedding"):
        Engine(checkpoint, EngineConfig(dtype="float32", max_total_tokens=256), progress=False)
