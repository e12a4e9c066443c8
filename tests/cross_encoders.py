"""Tiny random-weight cross-encoders (a sequence classifier with one label) for the scoring tests:
HF `BertForSequenceClassification` with all-MiniLM-L6-v2's own WordPiece tokenizer (so a pair is
`[CLS] a [SEP] b [SEP]` with token types 0 then 1), and Qwen2's classifier with the tiny BPE
tokenizer (a pair is the two texts' tokens end to end). Nothing is downloaded."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import BertConfig, BertForSequenceClassification

from tests.conftest import minilm_dir
from tests.tiny_models import save_tiny_classifier, save_tiny_tokenizer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def save_tiny_bert_cross_encoder(path: str | Path, seed: int = 0) -> Path:
    """A random 2-layer `BertForSequenceClassification` (hidden 32, num_labels 1) over MiniLM's vocabulary."""
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=512, num_labels=1)
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():   # weights large enough that each token and segment moves the score
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("LayerNorm.weight") else 0.2 * noise)
    directory = Path(path)
    model.save_pretrained(directory)
    for name in _TOKENIZER_FILES:
        shutil.copy(minilm_dir() / name, directory / name)
    return directory


def save_tiny_qwen2_cross_encoder(path: str | Path, seed: int = 0) -> Path:
    """A random 2-layer `Qwen2ForSequenceClassification` with one label and the tiny BPE tokenizer."""
    return save_tiny_tokenizer(save_tiny_classifier(path, seed=seed, num_labels=1, qwen2=True))
