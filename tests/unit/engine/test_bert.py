"""engine/bert.py and its checkpoint loader against the references: sentence-transformers' own vectors
for all-MiniLM-L6-v2, and HF transformers' BertModel for hidden states and inputs longer than
sentence-transformers keeps (it truncates at 256 tokens); a BERT cross-encoder against HF's
`BertForSequenceClassification` logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from transformers import BertModel as HFBertModel

from engine.bert import BertConfig, BertModel
from engine.config import ConfigError, EngineConfig
from engine.embedder import load_embedder
from engine.errors import InvalidRequestError
from engine.weights.bert_checkpoint import is_bert_dir, open_bert_checkpoint
from tests.cross_encoders import save_tiny_bert_cross_encoder
from tests.tiny_models import save_tiny_bert, save_tiny_qwen2

TEXTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog.", "",
         "Paris is the capital and most populous city of France.", "naïve café, 東京 and emoji 🙂!",
         "a " * 200]
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def minilm(minilm_path: Path):
    return load_embedder(str(minilm_path), EngineConfig(dtype="float32"), progress=False)


@pytest.fixture(scope="module")
def tokenizer(minilm_path: Path):
    return AutoTokenizer.from_pretrained(minilm_path, local_files_only=True)


def test_minilm_matches_sentence_transformers(minilm, tokenizer, minilm_path: Path) -> None:
    from sentence_transformers import SentenceTransformer
    reference = SentenceTransformer(str(minilm_path), device="cpu", local_files_only=True)
    expected = torch.from_numpy(reference.encode(TEXTS, batch_size=len(TEXTS)))
    ids = [tokenizer.encode(text) for text in TEXTS]
    assert max(map(len, ids)) <= reference.max_seq_length    # no input was truncated by the reference
    got = minilm.embed(ids)
    cosine = F.cosine_similarity(got, expected)
    assert cosine.min() >= MIN_COSINE, cosine.tolist()
    assert torch.allclose(got.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)


def test_minilm_long_input_matches_hf_mean_pooling(minilm, tokenizer, minilm_path: Path) -> None:
    """Past sentence-transformers' 256-token cut: HF BertModel + the directory's mean pooling is the oracle."""
    texts = ["word " * 400, "short one"]
    ids = [tokenizer.encode(text) for text in texts]
    assert len(ids[0]) > 256
    hf = HFBertModel.from_pretrained(minilm_path, local_files_only=True, add_pooling_layer=False).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = hf(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    expected = F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    cosine = F.cosine_similarity(minilm.embed(ids), expected)
    assert cosine.min() >= MIN_COSINE, cosine.tolist()


def test_vectors_do_not_depend_on_batch_padding(minilm, tokenizer) -> None:
    ids = [tokenizer.encode(text) for text in TEXTS]
    alone = torch.cat([minilm.embed([i]) for i in ids])
    assert torch.allclose(minilm.embed(ids), alone, atol=1e-5)


def test_tiny_bert_hidden_states_match_hf(tmp_path: Path) -> None:
    directory = save_tiny_bert(tmp_path / "bert")
    checkpoint = open_bert_checkpoint(directory)
    ours = BertModel(checkpoint.config)
    ours.load_weights(checkpoint.tensors(progress=False))
    hf = HFBertModel.from_pretrained(directory, attn_implementation="eager").eval()
    input_ids = torch.tensor([[1, 5, 9, 200, 3, 0], [7, 8, 2, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    with torch.no_grad():
        expected = hf(input_ids=input_ids, attention_mask=mask).last_hidden_state
        got = ours(input_ids, mask.bool())
    real = mask.bool()
    assert torch.allclose(got[real], expected[real], atol=1e-5)


def test_checkpoint_skips_pooler_and_buffers(minilm_path: Path) -> None:
    checkpoint = open_bert_checkpoint(minilm_path)
    names = {name for name, _ in checkpoint.tensors(progress=False)}
    assert not any(n.startswith("pooler.") or n.endswith("position_ids") for n in names)
    assert names == {name for name, _ in BertModel(checkpoint.config).named_parameters()}
    assert checkpoint.config == BertConfig(vocab_size=30522, hidden_size=384, num_layers=6, num_heads=12,
                                           intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2,
                                           layer_norm_eps=1e-12, hidden_act="gelu")


def test_checkpoint_with_wrong_tensors_is_rejected(tmp_path: Path) -> None:
    directory = save_tiny_bert(tmp_path / "bert")
    tensors = load_file(directory / "model.safetensors")
    tensors.pop("encoder.layer.1.output.dense.bias")
    tensors["encoder.layer.0.intermediate.dense.weight"] = torch.zeros(100, 64)
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ConfigError, match=r"missing encoder\.layer\.1\.output\.dense\.bias"):
        open_bert_checkpoint(directory)
    tensors["encoder.layer.1.output.dense.bias"] = torch.zeros(64)
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ConfigError, match=r"shapes do not match.*intermediate\.dense\.weight \(100, 64\)"):
        open_bert_checkpoint(directory)


def test_unsupported_bert_configs_are_rejected(tmp_path: Path) -> None:
    directory = save_tiny_bert(tmp_path / "bert")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "position_embedding_type": "relative_key"}))
    with pytest.raises(ConfigError, match="position_embedding_type"):
        open_bert_checkpoint(directory)
    (directory / "config.json").write_text(json.dumps({**config, "hidden_act": "swish"}))
    with pytest.raises(ConfigError, match="hidden_act"):
        open_bert_checkpoint(directory)


def test_is_bert_dir(tmp_path: Path, minilm_path: Path) -> None:
    assert is_bert_dir(minilm_path)
    assert not is_bert_dir(save_tiny_qwen2(tmp_path / "qwen2"))
    assert not is_bert_dir(tmp_path / "missing")
    shutil.copy(minilm_path / "config.json", tmp_path / "config.json")
    assert is_bert_dir(tmp_path)   # a config alone says BERT; opening it then fails on the weights
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        open_bert_checkpoint(tmp_path)


PAIRS = [("What is the capital of France?", "The capital of France is Paris."),
         ("What is the capital of France?", "Bananas are yellow."), ("hi", "naïve café, 東京 🙂 " * 20)]


def test_bert_cross_encoder_logits_equal_hf_with_token_types(tmp_path: Path) -> None:
    """`BertForSequenceClassification` (num_labels 1): the pair's [CLS] logit, HF fp32's to 1e-5, and the
    pair's segments change it."""
    directory = save_tiny_bert_cross_encoder(tmp_path / "cross")
    embedder = load_embedder(str(directory), EngineConfig(dtype="float32"), progress=False)
    info = embedder.info
    assert (info.architecture, info.embedding_dim, info.is_classifier, info.num_token_types) == (
        "BertForSequenceClassification", 1, True, 2)
    assert not embedder.pooling.normalize
    tokenizer = AutoTokenizer.from_pretrained(directory)
    encoded = [tokenizer(a, b) for a, b in PAIRS]
    hf = AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.cat([hf(**tokenizer(a, b, return_tensors="pt")).logits for a, b in PAIRS])
    ids, types = [e["input_ids"] for e in encoded], [e["token_type_ids"] for e in encoded]
    got = embedder.embed(ids, token_type_lists=types)
    assert got.shape == (len(PAIRS), 1)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (got, expected)
    assert not torch.allclose(embedder.embed(ids), expected, atol=1e-3)   # segment 0 everywhere: other logits
    with pytest.raises(InvalidRequestError, match="token type 2"):
        embedder.embed(ids[:1], token_type_lists=[[2] * len(ids[0])])
    with pytest.raises(InvalidRequestError, match="token types for"):
        embedder.embed(ids[:1], token_type_lists=[types[0][:-1]])


def test_bert_cross_encoder_checkpoint_needs_its_head(tmp_path: Path) -> None:
    directory = save_tiny_bert_cross_encoder(tmp_path / "cross")
    checkpoint = open_bert_checkpoint(directory)
    names = {name for name, _ in checkpoint.tensors(progress=False)}
    assert {"bert.pooler.dense.weight", "classifier.weight", "classifier.bias"} <= names
    assert "bert.embeddings.position_ids" not in names
    tensors = load_file(directory / "model.safetensors")
    del tensors["classifier.weight"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="classifier.weight"):
        open_bert_checkpoint(directory)
