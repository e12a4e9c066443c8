"""engine/embedder.py: decoder models pooled at the last token (gte-Qwen2 style) against HF's last hidden
state, a Qwen2 cross-encoder against HF's logits, input checks, Matryoshka `dimensions`, and batches split
by max_batch_tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from engine.config import EngineConfig
from engine.embedder import EmbeddingModelInfo, load_embedder
from engine.errors import ContextLengthExceededError, InvalidRequestError
from engine.pooling import PoolingMode
from tests.cross_encoders import save_tiny_qwen2_cross_encoder
from tests.tiny_models import save_tiny_llama, save_tiny_qwen2

INPUTS = [[5, 17, 42, 99, 3], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [250, 0]]
MIN_COSINE = 0.9999


def _hf_last_token(directory: Path, inputs: list[list[int]]) -> torch.Tensor:
    """HF `Qwen2Model`/`LlamaModel` (no LM head): the last token's final hidden state, L2-normalized."""
    model = AutoModel.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        rows = [model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1] for ids in inputs]
    return F.normalize(torch.stack(rows), dim=-1)


@pytest.mark.parametrize("save", [save_tiny_qwen2, save_tiny_llama], ids=["qwen2", "llama"])
def test_decoder_last_token_pooling_matches_hf(tmp_path: Path, save) -> None:
    directory = save(tmp_path / "model")
    embedder = load_embedder(str(directory), EngineConfig(dtype="float32"), progress=False)
    assert embedder.pooling.mode is PoolingMode.LAST and embedder.pooling.normalize
    assert embedder.info.embedding_dim == 64 and embedder.info.context_len == 128
    got = embedder.embed(INPUTS)
    cosine = F.cosine_similarity(got, _hf_last_token(directory, INPUTS))
    assert cosine.min() >= MIN_COSINE, cosine.tolist()
    assert torch.allclose(got.norm(dim=1), torch.ones(len(INPUTS)), atol=1e-5)


def test_small_max_batch_tokens_splits_batches_without_changing_vectors(tmp_path: Path) -> None:
    directory = save_tiny_qwen2(tmp_path / "model")
    whole = load_embedder(str(directory), EngineConfig(dtype="float32"), progress=False)
    split = load_embedder(str(directory), EngineConfig(dtype="float32", max_prefill_tokens=8), progress=False)
    assert torch.allclose(whole.embed(INPUTS), split.embed(INPUTS), atol=1e-5)


def test_bad_inputs_are_rejected_before_computing(tmp_path: Path) -> None:
    embedder = load_embedder(str(save_tiny_qwen2(tmp_path / "model")),
                             EngineConfig(dtype="float32", context_len=16), progress=False)
    with pytest.raises(InvalidRequestError, match="no inputs"):
        embedder.embed([])
    with pytest.raises(InvalidRequestError, match="input 1 has no tokens"):
        embedder.embed([[1], []])
    with pytest.raises(ContextLengthExceededError, match="17 tokens; the model's maximum is 16"):
        embedder.embed([list(range(17))])
    with pytest.raises(InvalidRequestError, match="token id 256 is outside"):
        embedder.embed([[1, 256]])
    with pytest.raises(InvalidRequestError, match="declares no Matryoshka"):
        embedder.embed([[1, 2]], dimensions=32)
    assert embedder.embed([[1, 2]], dimensions=64).shape == (1, 64)   # the full size is always fine


def test_matryoshka_model_truncates_and_renormalizes(tmp_path: Path) -> None:
    directory = save_tiny_qwen2(tmp_path / "model")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    embedder = load_embedder(str(directory), EngineConfig(dtype="float32"), progress=False)
    assert embedder.info.is_matryoshka and embedder.info.matryoshka_dimensions == (16, 32)
    full = embedder.embed(INPUTS)
    cut = embedder.embed(INPUTS, dimensions=16)
    assert cut.shape == (len(INPUTS), 16)
    assert torch.allclose(cut, F.normalize(full[:, :16], dim=-1), atol=1e-6)
    with pytest.raises(InvalidRequestError, match=r"one of \[16, 32\] or 64"):
        embedder.embed(INPUTS, dimensions=8)


def test_any_size_for_is_matryoshka_without_a_list() -> None:
    info = EmbeddingModelInfo("Qwen2ForCausalLM", 128, 256, 64, is_matryoshka=True)
    info.check_dimensions(1)
    info.check_dimensions(None)
    for bad in (0, -3, 65):
        with pytest.raises(InvalidRequestError, match="between 1 and 64"):
            info.check_dimensions(bad)


def test_qwen2_cross_encoder_pairs_equal_hf(tmp_path: Path) -> None:
    """`Qwen2ForSequenceClassification` with one label, fed pairs as its tokenizer joins them (no segments):
    the last token's logit, HF fp32's to 1e-5."""
    directory = save_tiny_qwen2_cross_encoder(tmp_path / "cross")
    embedder = load_embedder(str(directory), EngineConfig(dtype="float32"), progress=False)
    info = embedder.info
    assert (info.architecture, info.embedding_dim, info.is_classifier, info.num_token_types) == (
        "Qwen2ForSequenceClassification", 1, True, 1)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    pairs = [("What is the capital of France?", "The capital of France is Paris."),
             ("What is the capital of France?", "a sigmoid node"), ("The output", "of a sigmoid node is bounded")]
    hf = AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.cat([hf(**tokenizer(a, b, return_tensors="pt")).logits for a, b in pairs])
    ids = [tokenizer(a, b)["input_ids"] for a, b in pairs]
    assert torch.allclose(embedder.embed(ids), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(InvalidRequestError, match="token type 1"):   # a decoder has no second segment
        embedder.embed(ids[:1], token_type_lists=[[1] * len(ids[0])])
