"""gateway/service/scoring.py's rules (pairing, ranking, which model scores how, sigmoid and cosine) and
the pair encoding it sends: MiniLM's tokenizer gives BERT's `[CLS] a [SEP] b [SEP]` and segments, as HF does."""

from __future__ import annotations

import asyncio
import math

import pytest
from transformers import AutoTokenizer

from gateway.cluster.pool import ModelLimits
from gateway.errors import APIError
from gateway.service.request_schemas import RerankRequest, ScoreRequest
from gateway.service.scoring import ScoreKind, check_pairing, cosine, ranking, score_kind, sigmoid
from gateway.text.text_input import encode_pairs
from gateway.text.tokenizer import load_tokenizer
from tests.conftest import minilm_dir
from tests.cross_encoders import save_tiny_qwen2_cross_encoder


def _limits(is_embedding: bool, is_classifier: bool = False, embedding_dim: int = 384) -> ModelLimits:
    return ModelLimits(model_path="m", architecture="a", context_len=512, vocab_size=30522, eos_token_ids=(),
                       is_embedding=is_embedding, embedding_dim=embedding_dim, is_classifier=is_classifier)


def _param(call) -> str | None:
    with pytest.raises(APIError) as caught:
        call()
    assert caught.value.status == 400
    return caught.value.param


def test_which_models_score_and_how() -> None:
    assert score_kind(_limits(True), "m", "/score") is ScoreKind.EMBEDDING
    assert score_kind(_limits(True, True, 1), "m", "/score") is ScoreKind.CROSS_ENCODER
    with pytest.raises(APIError) as generation:
        score_kind(_limits(False), "SmolLM2", "/score")
    assert generation.value.param == "model" and generation.value.code == "model_cannot_score"
    assert "SmolLM2" in generation.value.message and "generation model" in generation.value.message
    with pytest.raises(APIError) as labels:
        score_kind(_limits(True, True, 3), "m", "/rerank")
    assert "3 labels" in labels.value.message


def test_pairs_are_one_to_one_one_to_n_or_n_to_n() -> None:
    for firsts, seconds in ((["a"], ["b"]), (["a"], ["b", "c"]), (["a", "b"], ["c", "d"])):
        check_pairing(firsts, seconds, "text_1", "text_2")
    assert _param(lambda: check_pairing([], ["b"], "text_1", "text_2")) == "text_1"
    assert _param(lambda: check_pairing(["a"], [], "query", "documents")) == "documents"
    assert _param(lambda: check_pairing(["a", "b"], ["c"], "text_1", "text_2")) == "text_1"
    assert _param(lambda: check_pairing(["a", "b"], ["c", "d", "e"], "text_1", "text_2")) == "text_1"


def test_ranking_is_best_first_stable_and_cut_at_top_n() -> None:
    scores = [0.1, 0.9, 0.5, 0.9]
    assert ranking(scores, 0) == [1, 3, 2, 0]
    assert ranking(scores, 2) == [1, 3]
    assert ranking(scores, 10) == [1, 3, 2, 0]
    assert _param(lambda: ranking(scores, -1)) == "top_n"


def test_sigmoid_and_cosine() -> None:
    assert sigmoid(0.0) == 0.5
    assert sigmoid(2.0) == pytest.approx(1 / (1 + math.exp(-2.0)))
    assert sigmoid(-1000.0) == 0.0 and sigmoid(1000.0) == 1.0   # no overflow
    assert cosine([1.0, 0.0], [0.0, 2.0]) == 0.0
    assert cosine([1.0, 1.0], [2.0, 2.0]) == pytest.approx(1.0)
    assert cosine([1.0, 2.0], [-1.0, -2.0]) == pytest.approx(-1.0)
    assert cosine([0.0, 0.0], [1.0, 0.0]) == 0.0


def test_bert_pairs_get_hf_ids_and_segments() -> None:
    pairs = [("What is the capital of France?", "Paris."), ("hi", "naïve café")]
    encoded = asyncio.run(encode_pairs(load_tokenizer(str(minilm_dir())), pairs, "text_2", 512))
    hf = AutoTokenizer.from_pretrained(minilm_dir())
    assert encoded.token_lists == [hf(a, b)["input_ids"] for a, b in pairs]
    assert encoded.token_type_lists == [hf(a, b)["token_type_ids"] for a, b in pairs]
    assert set(encoded.token_type_lists[0]) == {0, 1}


def test_decoder_pairs_have_no_segments(tmp_path) -> None:
    directory = save_tiny_qwen2_cross_encoder(tmp_path / "cross")
    encoded = asyncio.run(encode_pairs(load_tokenizer(str(directory)), [("The capital", "is Paris")], "text_2", 128))
    assert encoded.token_lists == [AutoTokenizer.from_pretrained(directory)("The capital", "is Paris")["input_ids"]]
    assert encoded.token_type_lists is None


def test_bodies_take_vllm_forms() -> None:
    score = ScoreRequest.model_validate({"text_1": "q", "text_2": ["a", "b"]})
    assert (score.firsts(), score.seconds(), score.model) == (["q"], ["a", "b"], None)
    rerank = RerankRequest.model_validate({"query": "q", "documents": ["a", {"text": "b"}], "top_n": 1})
    assert rerank.document_texts() == ["a", "b"] and rerank.return_documents and rerank.top_n == 1
    assert RerankRequest.model_validate({"query": "q", "documents": ["a"]}).top_n == 0
