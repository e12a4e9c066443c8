"""vLLM's scoring routes through the real gateway and an `--is-embedding` worker serving a tiny random
`BertForSequenceClassification` with one label (a cross-encoder; MiniLM's own tokenizer, so pairs carry
BERT's token types): /score, /v1/score, /rerank, /v1/rerank, /v2/rerank, /pooling and /invocations
in vLLM's shapes, the gRPC API's Score and Rerank, and the 400s of bad bodies. Every score is HF's
`sigmoid(logit)` for the pair; the cosine scores of an embedding model are in test_embeddings.py."""

from __future__ import annotations

import math
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tandem.api.v1 import score_pb2
from tests.cross_encoders import save_tiny_bert_cross_encoder
from tests.e2e.grpc_client import bad_fields, call_error, inference_api
from tests.e2e.stack import Stack, start_stack

pytestmark = pytest.mark.slow

QUERY = "What is the capital of France?"
DOCUMENTS = ["The capital of France is Paris.", "Bananas are yellow.", "France borders Spain and Italy.",
             "The Eiffel Tower is in Paris, the capital."]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_bert_cross_encoder(tmp_path_factory.mktemp("cross_encoder") / "tiny-bert-cross-encoder")


@pytest.fixture(scope="module")
def scoring_stack(model_dir: Path, tmp_path_factory) -> Stack:
    stack = start_stack(tmp_path_factory.mktemp("scoring_stack"), "--is-embedding", "--model-path", str(model_dir),
                        "--served-model-name", "tiny-reranker", "--torch-threads", "1")
    yield stack
    assert stack.stop() == []


@pytest.fixture(scope="module")
def hf_logits(model_dir: Path):
    """HF fp32 logits of (text, text_pair) pairs, or of single texts (text_pair None): the oracle."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logits(pairs: list[tuple[str, str | None]]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.cat([model(**tokenizer(a, b, return_tensors="pt")).logits[0] for a, b in pairs])

    return logits


def _post(stack: Stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.url}{path}", json=body, timeout=60)


def test_score_one_to_n_and_n_to_n_equal_hf_sigmoid(scoring_stack, model_dir, hf_logits) -> None:
    one_to_n = _post(scoring_stack, "/score", {"model": "tiny-reranker", "text_1": QUERY, "text_2": DOCUMENTS})
    assert one_to_n.status_code == 200, one_to_n.text
    answer = one_to_n.json()
    assert answer["id"].startswith("score-") and answer["object"] == "list" and answer["model"] == "tiny-reranker"
    assert isinstance(answer["created"], int)
    assert [(d["index"], d["object"]) for d in answer["data"]] == [(i, "score") for i in range(len(DOCUMENTS))]
    expected = torch.sigmoid(hf_logits([(QUERY, d) for d in DOCUMENTS]))
    got = torch.tensor([d["score"] for d in answer["data"]])
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-5), (got, expected)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    num_tokens = sum(len(tokenizer(QUERY, d)["input_ids"]) for d in DOCUMENTS)
    assert answer["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}

    firsts = ["Paris", "fruit", QUERY, "Italy"]
    n_to_n = _post(scoring_stack, "/v1/score", {"text_1": firsts, "text_2": DOCUMENTS}).json()
    expected = torch.sigmoid(hf_logits(list(zip(firsts, DOCUMENTS))))
    assert torch.allclose(torch.tensor([d["score"] for d in n_to_n["data"]]), expected, atol=1e-6, rtol=1e-5)
    single = _post(scoring_stack, "/score", {"text_1": [QUERY], "text_2": DOCUMENTS[0]}).json()
    assert [d["score"] for d in single["data"]] == [pytest.approx(answer["data"][0]["score"], abs=1e-6)]
    raw = _post(scoring_stack, "/score", {"text_1": QUERY, "text_2": DOCUMENTS, "use_activation": False}).json()
    expected = hf_logits([(QUERY, d) for d in DOCUMENTS])
    assert torch.allclose(torch.tensor([d["score"] for d in raw["data"]]), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_the_documents_by_hf_sigmoid(scoring_stack, hf_logits, path: str) -> None:
    response = _post(scoring_stack, path, {"query": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 200, response.text
    answer = response.json()
    expected = torch.sigmoid(hf_logits([(QUERY, d) for d in DOCUMENTS]))
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -float(expected[i]))
    assert answer["id"].startswith("rerank-") and answer["model"] == "tiny-reranker"
    assert [r["index"] for r in answer["results"]] == order
    assert [r["document"] for r in answer["results"]] == [{"text": DOCUMENTS[i]} for i in order]
    got = torch.tensor([r["relevance_score"] for r in answer["results"]])
    assert torch.allclose(got, expected[order], atol=1e-6, rtol=1e-5)
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 0


def test_rerank_top_n_return_documents_and_document_objects(scoring_stack) -> None:
    full = _post(scoring_stack, "/rerank", {"query": QUERY, "documents": DOCUMENTS}).json()["results"]
    top = _post(scoring_stack, "/v1/rerank", {"query": QUERY, "top_n": 2, "return_documents": False,
                                             "documents": [{"text": d} for d in DOCUMENTS]}).json()["results"]
    assert [(r["index"], r["relevance_score"]) for r in top] == [(r["index"], r["relevance_score"]) for r in full[:2]]
    assert all("document" not in r for r in top)
    more = _post(scoring_stack, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 10}).json()["results"]
    assert more == full


def test_pooling_is_the_raw_classifier_output(scoring_stack, hf_logits) -> None:
    texts = [QUERY, DOCUMENTS[1]]
    response = _post(scoring_stack, "/pooling", {"model": "tiny-reranker", "input": texts})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["id"].startswith("pool-") and answer["object"] == "list" and answer["model"] == "tiny-reranker"
    assert [(d["index"], d["object"], len(d["data"])) for d in answer["data"]] == [(0, "pooling", 1), (1, "pooling", 1)]
    expected = hf_logits([(t, None) for t in texts])
    assert torch.allclose(torch.tensor([d["data"][0] for d in answer["data"]]), expected, atol=1e-5, rtol=1e-5)
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 0


def test_invocations_routes_by_the_body(scoring_stack) -> None:
    score = _post(scoring_stack, "/score", {"text_1": QUERY, "text_2": DOCUMENTS[:2]}).json()
    by_score = _post(scoring_stack, "/invocations", {"text_1": QUERY, "text_2": DOCUMENTS[:2]}).json()
    assert by_score["object"] == "list" and by_score["data"] == score["data"]
    rerank = _post(scoring_stack, "/rerank", {"query": QUERY, "documents": DOCUMENTS}).json()
    by_rerank = _post(scoring_stack, "/invocations", {"query": QUERY, "documents": DOCUMENTS}).json()
    assert by_rerank["results"] == rerank["results"]
    by_input = _post(scoring_stack, "/invocations", {"model": "tiny-reranker", "input": [QUERY]}).json()
    assert by_input["object"] == "list" and by_input["data"][0]["object"] == "embedding"
    chat = _post(scoring_stack, "/invocations", {"messages": [{"role": "user", "content": "hi"}], "model": "x"})
    assert chat.status_code in (400, 404) and "error" in chat.json()
    unknown = _post(scoring_stack, "/invocations", {"text": "hi"})
    assert unknown.status_code == 400 and "text_1" in unknown.json()["error"]["message"]
    bad = _post(scoring_stack, "/invocations", {"query": QUERY, "documents": "not a list"})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("documents")


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/rerank", {"documents": DOCUMENTS}, "query"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": -1}, "top_n"),
    ("/score", {"text_1": [], "text_2": DOCUMENTS}, "text_1"),
    ("/score", {"text_1": QUERY, "text_2": []}, "text_2"),
    ("/score", {"text_1": ["a", "b"], "text_2": DOCUMENTS}, "text_1"),
    ("/score", {"text_2": DOCUMENTS}, "text_1"),
    ("/score", {"text_1": "word " * 600, "text_2": "x"}, "text_2"),
    ("/pooling", {"input": []}, "input"),
])
def test_bad_bodies_are_400s_naming_the_field(scoring_stack, path: str, body: dict, param: str) -> None:
    response = _post(scoring_stack, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_an_unknown_model_is_a_404(scoring_stack) -> None:
    response = _post(scoring_stack, "/score", {"model": "nope", "text_1": QUERY, "text_2": DOCUMENTS})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


def test_grpc_score_and_rerank_equal_the_http_routes(scoring_stack) -> None:
    http_score = _post(scoring_stack, "/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    http_rerank = _post(scoring_stack, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 3}).json()
    with inference_api(scoring_stack.grpc_target) as api:
        score = api.Score(score_pb2.ScoreRequest(model="tiny-reranker", text_1=[QUERY], text_2=DOCUMENTS), timeout=60)
        rerank = api.Rerank(score_pb2.RerankRequest(query=QUERY, documents=DOCUMENTS, top_n=3), timeout=60)
        raw = api.Score(score_pb2.ScoreRequest(text_1=[QUERY], text_2=DOCUMENTS, use_activation=False), timeout=60)
        bare = api.Rerank(score_pb2.RerankRequest(query=QUERY, documents=DOCUMENTS, return_documents=False),
                          timeout=60)
        empty = call_error(api.Rerank, score_pb2.RerankRequest(query=QUERY), timeout=30)
        negative = call_error(api.Rerank, score_pb2.RerankRequest(query=QUERY, documents=DOCUMENTS, top_n=-2),
                              timeout=30)
        unpaired = call_error(api.Score, score_pb2.ScoreRequest(text_1=["a", "b"], text_2=DOCUMENTS), timeout=30)
    assert (score.object, score.model) == ("list", "tiny-reranker") and score.id.startswith("score-")
    assert [(d.index, d.object) for d in score.data] == [(d["index"], d["object"]) for d in http_score["data"]]
    assert [d.score for d in score.data] == pytest.approx([d["score"] for d in http_score["data"]], abs=1e-9)
    assert score.usage.prompt_tokens == http_score["usage"]["prompt_tokens"]
    assert [1 / (1 + math.exp(-d.score)) for d in raw.data] == pytest.approx([d.score for d in score.data], abs=1e-6)
    assert [(r.index, r.document.text) for r in rerank.results] == [
        (r["index"], r["document"]["text"]) for r in http_rerank["results"]]
    assert [r.relevance_score for r in rerank.results] == pytest.approx(
        [r["relevance_score"] for r in http_rerank["results"]], abs=1e-9)
    assert rerank.usage.total_tokens == http_rerank["usage"]["total_tokens"]
    assert len(bare.results) == len(DOCUMENTS) and not any(r.HasField("document") for r in bare.results)
    for error, field in ((empty, "documents"), (negative, "top_n"), (unpaired, "text_1")):
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and bad_fields(error) == [field]
