"""`tandem serve --is-embedding` (gateway + one embedding prefill worker, no decode) serving all-MiniLM-L6-v2:
the OpenAI SDK's embeddings.create in every input form, SGLang's /encode as in seeds 002/003, the gRPC
API's Embed equal to /v1/embeddings, vLLM's /score, /rerank and /pooling as cosines and vectors of those
embeddings, and the generation stack refusing every pooling route (while /invocations chats there)."""

from __future__ import annotations

import base64
from pathlib import Path

import grpc
import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from tandem.api.v1 import embed_pb2, inference_service_pb2
from tandem.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc, worker_pb2_grpc
from tests.conftest import minilm_dir
from tests.e2e.grpc_client import bad_fields, call_error, chat_request, error_reason, inference_api
from tests.e2e.stack import WORKER_METADATA, Stack, start_stack

pytestmark = pytest.mark.slow

TEXTS = ["Once upon a time", "The capital of France is Paris.", "Embeddings map text to vectors.", ""]
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def embedding_stack(tmp_path_factory) -> Stack:
    stack = start_stack(tmp_path_factory.mktemp("embedding_stack"), "--is-embedding", "--model-path",
                        str(minilm_dir()), "--torch-threads", "2")
    yield stack
    survivors = stack.stop()
    assert stack.proc.returncode == 0
    assert survivors == [], f"orphaned processes after Ctrl-C: {survivors}"


@pytest.fixture(scope="module")
def model() -> str:
    return str(minilm_dir())   # the served name: the model path, as no --served-model-name is given


@pytest.fixture(scope="module")
def embed_client(embedding_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{embedding_stack.url}/v1", api_key="None")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True)


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """sentence-transformers' own vectors for TEXTS: the oracle."""
    from sentence_transformers import SentenceTransformer
    st = SentenceTransformer(str(minilm_dir()), device="cpu", local_files_only=True)
    return dict(zip(TEXTS, torch.from_numpy(st.encode(TEXTS))))


def _vectors(response) -> torch.Tensor:
    assert [d.index for d in response.data] == list(range(len(response.data)))
    assert all(d.object == "embedding" for d in response.data)
    return torch.tensor([d.embedding for d in response.data])


def _assert_close_to(vectors: torch.Tensor, expected: list[torch.Tensor]) -> None:
    cosine = F.cosine_similarity(vectors, torch.stack(expected))
    assert cosine.min() >= MIN_COSINE, cosine.tolist()


def test_every_input_form_matches_sentence_transformers(embed_client, model, tokenizer, reference) -> None:
    one = embed_client.embeddings.create(model=model, input=TEXTS[0], encoding_format="float")
    assert one.object == "list" and one.model == model and len(one.data[0].embedding) == 384
    _assert_close_to(_vectors(one), [reference[TEXTS[0]]])

    many = embed_client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    _assert_close_to(_vectors(many), [reference[t] for t in TEXTS])

    ids = [tokenizer.encode(t) for t in TEXTS]
    one_ids = embed_client.embeddings.create(model=model, input=ids[1], encoding_format="float")
    _assert_close_to(_vectors(one_ids), [reference[TEXTS[1]]])
    many_ids = embed_client.embeddings.create(model=model, input=ids, encoding_format="float")
    assert torch.allclose(_vectors(many_ids), _vectors(many), atol=1e-6)


def test_usage_counts_the_tokenizers_tokens(embed_client, model, tokenizer) -> None:
    response = embed_client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    expected = sum(len(tokenizer.encode(t)) for t in TEXTS)     # [CLS] and [SEP] included
    assert response.usage.prompt_tokens == expected == response.usage.total_tokens


def test_base64_equals_float_exactly(embed_client, embedding_stack, model) -> None:
    floats = embed_client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    # The SDK asks for base64 by default and decodes it itself.
    decoded_by_sdk = embed_client.embeddings.create(model=model, input=TEXTS)
    assert [d.embedding for d in decoded_by_sdk.data] == [d.embedding for d in floats.data]
    raw = httpx.post(f"{embedding_stack.url}/v1/embeddings",
                     json={"model": model, "input": TEXTS[:2], "encoding_format": "base64"}).json()
    for item, expected in zip(raw["data"], floats.data):
        assert isinstance(item["embedding"], str)
        assert np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4").tolist() == expected.embedding


def test_dimensions_full_size_only_for_a_model_without_matryoshka(embed_client, model) -> None:
    full = embed_client.embeddings.create(model=model, input=TEXTS[0], dimensions=384, encoding_format="float")
    assert len(full.data[0].embedding) == 384
    with pytest.raises(openai.BadRequestError) as caught:
        embed_client.embeddings.create(model=model, input=TEXTS[0], dimensions=128)
    error = caught.value.body
    assert error["param"] == "dimensions" and "Matryoshka" in error["message"]


def test_too_long_input_is_a_400_context_length_exceeded(embed_client, embedding_stack, model) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        embed_client.embeddings.create(model=model, input=["short", "word " * 600])
    assert caught.value.code == "context_length_exceeded" and "512" in caught.value.body["message"]
    response = httpx.post(f"{embedding_stack.url}/encode", json={"input_ids": list(range(1000, 1513))})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        embed_client.embeddings.create(model="no-such-model", input="x")
    with pytest.raises(openai.BadRequestError):
        embed_client.embeddings.create(model=model, input=[])


def test_encode_as_in_the_seeds(embedding_stack, model, tokenizer, reference) -> None:
    # seeds 002/003: requests.post(url, json={"model": ..., "text": "Once upon a time"}), then ['embedding'][:10]
    url = f"{embedding_stack.url}/encode"
    response_json = httpx.post(url, json={"model": model, "text": "Once upon a time"}).json()
    assert set(response_json) == {"embedding", "meta_info"}
    assert len(response_json["embedding"][:10]) == 10
    _assert_close_to(torch.tensor([response_json["embedding"]]), [reference[TEXTS[0]]])
    meta = response_json["meta_info"]
    assert meta["prompt_tokens"] == len(tokenizer.encode(TEXTS[0])) and meta["id"]
    assert meta["finish_reason"] == {"type": "length", "length": 0}

    batch = httpx.post(url, json={"text": TEXTS[:2], "rid": ["a", "b"]}).json()
    assert [item["meta_info"]["id"] for item in batch] == ["a", "b"]
    _assert_close_to(torch.tensor([item["embedding"] for item in batch]), [reference[t] for t in TEXTS[:2]])
    by_ids = httpx.post(url, json={"input_ids": [tokenizer.encode(t) for t in TEXTS[:2]]}).json()
    assert [item["embedding"] for item in by_ids] == [item["embedding"] for item in batch]
    single_ids = httpx.post(url, json={"input_ids": tokenizer.encode(TEXTS[1])}).json()
    # alone rather than padded in a batch: equal up to float rounding
    assert torch.allclose(torch.tensor(single_ids["embedding"]), torch.tensor(batch[1]["embedding"]), atol=1e-5)


def test_grpc_embed_equals_the_http_route(embedding_stack, embed_client, model, tokenizer) -> None:
    http = embed_client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    with inference_api(embedding_stack.grpc_target) as api:
        answer = api.Embed(embed_pb2.EmbedRequest(model=model, input=TEXTS), timeout=60)
        by_ids = embed_pb2.EmbedRequest(model=model)
        for text in TEXTS:
            by_ids.input_token_ids.add(ids=tokenizer.encode(text))
        by_ids_answer = api.Embed(by_ids, timeout=60)
        narrow = call_error(api.Embed, embed_pb2.EmbedRequest(model=model, input=["x"], dimensions=128), timeout=30)
        too_long = call_error(api.Embed, embed_pb2.EmbedRequest(model=model, input=["word " * 600]), timeout=30)
        chat = call_error(api.ChatComplete, chat_request("hi", model=model), timeout=30)
        info = api.GetModelInfo(inference_service_pb2.GetModelInfoRequest(), timeout=30)
    assert (answer.object, answer.model) == ("list", model)
    assert [(d.object, d.index) for d in answer.data] == [("embedding", i) for i in range(len(TEXTS))]
    # float32 on the wire either way: the same numbers
    expected = torch.tensor([d.embedding for d in http.data], dtype=torch.float32)
    assert torch.equal(torch.tensor([list(d.embedding) for d in answer.data]), expected)
    assert torch.equal(torch.tensor([list(d.embedding) for d in by_ids_answer.data]), expected)
    assert (answer.usage.prompt_tokens, answer.usage.total_tokens) == (http.usage.prompt_tokens,
                                                                       http.usage.total_tokens)
    assert narrow.code() is grpc.StatusCode.INVALID_ARGUMENT and bad_fields(narrow) == ["dimensions"]
    assert too_long.code() is grpc.StatusCode.OUT_OF_RANGE and error_reason(too_long) == "CONTEXT_LENGTH_EXCEEDED"
    assert chat.code() is grpc.StatusCode.INVALID_ARGUMENT and error_reason(chat) == "MODEL_NOT_GENERATIVE"
    assert not info.is_generation


def test_score_and_rerank_are_cosines_of_the_embeddings(embedding_stack, embed_client, model) -> None:
    query, documents = "What is the capital of France?", TEXTS[:3]
    vectors = _vectors(embed_client.embeddings.create(model=model, input=[query, *documents], encoding_format="float"))
    expected = F.cosine_similarity(vectors[:1], vectors[1:]).double()
    score = httpx.post(f"{embedding_stack.url}/v1/score", json={"model": model, "text_1": query, "text_2": documents},
                       timeout=60).json()
    assert [(d["index"], d["object"]) for d in score["data"]] == [(i, "score") for i in range(len(documents))]
    assert torch.allclose(torch.tensor([d["score"] for d in score["data"]], dtype=torch.float64), expected, atol=1e-6)
    pairwise = httpx.post(f"{embedding_stack.url}/score", json={"text_1": documents, "text_2": documents[::-1]},
                          timeout=60).json()
    assert pairwise["data"][1]["score"] == pytest.approx(1.0, abs=1e-6)   # the middle text against itself
    rerank = httpx.post(f"{embedding_stack.url}/rerank", json={"query": query, "documents": documents, "top_n": 2},
                        timeout=60).json()
    assert [r["index"] for r in rerank["results"]] == [1, 2]      # the Paris sentence first
    assert [r["relevance_score"] for r in rerank["results"]] == pytest.approx(
        [score["data"][1]["score"], score["data"][2]["score"]], abs=1e-9)
    pooling = httpx.post(f"{embedding_stack.url}/pooling", json={"input": documents}, timeout=60).json()
    assert [d["object"] for d in pooling["data"]] == ["pooling"] * len(documents)
    assert torch.equal(torch.tensor([d["data"] for d in pooling["data"]]), vectors[1:])


def test_embedding_stack_is_healthy_without_a_decode_worker(embedding_stack) -> None:
    assert httpx.get(f"{embedding_stack.url}/health").status_code == 200
    with grpc.insecure_channel(f"127.0.0.1:{embedding_stack.prefill_port}") as channel:
        info = worker_pb2_grpc.WorkerServiceStub(channel).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=5,
                                                                         metadata=WORKER_METADATA)
    assert info.is_embedding and info.embedding_dim == 384 and info.context_len == 512
    assert info.architecture == "BertModel"


def test_generation_stack_refuses_embeddings(stack: Stack) -> None:
    for path, body in (("/v1/embeddings", {"model": "SmolLM2-135M-Instruct", "input": "hi"}),
                       ("/encode", {"text": "Once upon a time"})):
        response = httpx.post(f"{stack.url}{path}", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and "generation model" in error["message"]
    for path, body in (("/score", {"text_1": "a", "text_2": ["b"]}), ("/v2/rerank", {"query": "a", "documents": ["b"]}),
                       ("/invocations", {"query": "a", "documents": ["b"]})):
        response = httpx.post(f"{stack.url}{path}", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "model" and "cannot score" in error["message"], error
    pooling = httpx.post(f"{stack.url}/pooling", json={"input": "hi"})
    assert pooling.status_code == 400 and pooling.json()["error"]["code"] == "model_not_embedding"
    chat = httpx.post(f"{stack.url}/invocations", timeout=120, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "model": "SmolLM2-135M-Instruct"})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion", chat.text
    completion = httpx.post(f"{stack.url}/invocations", timeout=120, json={"prompt": "The capital", "max_tokens": 2,
                                                                            "model": "SmolLM2-135M-Instruct"})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion", completion.text
    with grpc.insecure_channel(f"127.0.0.1:{stack.prefill_port}") as channel:
        with pytest.raises(grpc.RpcError) as caught:
            prefill_pb2_grpc.PrefillServiceStub(channel).Embed(
                prefill_pb2.EmbedRequest(request_id="x", inputs=[prefill_pb2.EmbedInput(token_ids=[1])]), timeout=5,
                metadata=WORKER_METADATA)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_embedding_stack_refuses_generation_and_answers_the_admin_routes(embedding_stack, model) -> None:
    chat = httpx.post(f"{embedding_stack.url}/v1/chat/completions",
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "model_not_generative"
    generate = httpx.post(f"{embedding_stack.url}/generate", json={"text": "hi"})
    assert generate.status_code == 400 and generate.json()["error"]["param"] == "model"
    assert httpx.get(f"{embedding_stack.url}/health_generate", timeout=30).json() == {"status": "ok"}
    assert httpx.get(f"{embedding_stack.url}/get_model_info").json()["is_generation"] is False
    assert httpx.post(f"{embedding_stack.url}/flush_cache").status_code == 200
    info = httpx.get(f"{embedding_stack.url}/get_server_info")
    assert info.status_code == 200 and [w["role"] for w in info.json()["workers"]] == ["prefill"]
