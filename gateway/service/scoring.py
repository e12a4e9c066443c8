"""Relevance scores of text pairs, for vLLM's /score and /rerank on every front.

Two kinds of served model score, as in vLLM and sentence-transformers:

- a cross-encoder (a sequence classifier with one label: `BertForSequenceClassification`, or a
  Llama/Qwen2 `*ForSequenceClassification`) reads each pair as one input, joined as its tokenizer
  joins a pair (BERT: `[CLS] a [SEP] b [SEP]` with segments 0 then 1); the score is the sigmoid of
  its logit, in (0, 1);
- an embedding model embeds every text once; the score is the cosine of the two vectors, in [-1, 1].

Any other model (a generation model, a classifier with several labels) is a 400 naming `model`.
Pairs are 1 to 1, 1 to N (the one first text against every second text) or N to N (pairwise).
"""

from __future__ import annotations

import enum
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from gateway.cluster.pool import ModelLimits
from gateway.errors import bad_request
from gateway.service.pooling import PoolingWorkers, check_inputs
from gateway.service.request_schemas import RerankRequest, ScoreRequest
from gateway.service.state import GatewayState
from gateway.text.text_input import encode_pairs, encode_texts
from gateway.text.tokenizer import Tokenizer

T = TypeVar("T")


class ScoreKind(enum.Enum):
    CROSS_ENCODER = "cross_encoder"  # sigmoid of a one-label classifier's logit for the pair
    EMBEDDING = "embedding"  # cosine of the two texts' embeddings


@dataclass(frozen=True, slots=True)
class Scores:
    values: list[float]  # one per pair, in the second texts' order
    num_tokens: int  # tokens the model ran on, every input counted once


def score_kind(limits: ModelLimits, model_name: str, route: str) -> ScoreKind:
    """How the served model scores; 400 naming `model` when it cannot."""
    if limits.is_embedding and not limits.is_classifier:
        return ScoreKind.EMBEDDING
    if limits.is_classifier and limits.embedding_dim == 1:
        return ScoreKind.CROSS_ENCODER
    what = f"a classifier with {limits.embedding_dim} labels" if limits.is_classifier else "a generation model"
    raise bad_request(
        f"{route}: the served model `{model_name}` cannot score: it is {what}. Scoring needs a cross-encoder "
        "(a sequence classifier with one label) or an embedding model, served with `tandem serve --is-embedding`",
        "model",
        "model_cannot_score",
    )


def check_pairing(firsts: Sequence[str], seconds: Sequence[str], first_param: str, second_param: str) -> None:
    """400 unless both are non-empty and the first has one text or as many as the second (vLLM's 1:1, 1:N, N:N)."""
    if not firsts:
        raise bad_request(f"`{first_param}` must not be empty", first_param)
    if not seconds:
        raise bad_request(f"`{second_param}` must not be empty", second_param)
    if len(firsts) != 1 and len(firsts) != len(seconds):
        raise bad_request(
            f"`{first_param}` has {len(firsts)} texts and `{second_param}` {len(seconds)}: pairs are 1 to 1, "
            f"1 to N or N to N, so `{first_param}` needs one text or {len(seconds)}",
            first_param,
        )


async def score_texts(
    workers: PoolingWorkers,
    tokenizer: Tokenizer,
    firsts: Sequence[str],
    seconds: Sequence[str],
    route: str,
    params: tuple[str, str],
    use_activation: bool = True,
) -> Scores:
    """The score of every (first, second) pair, `firsts` holding one text or one per second text.
    `params` names the two fields in 400s. `use_activation` False: a cross-encoder's raw logit
    instead of its sigmoid (vLLM's field; an embedding model's cosine has no activation)."""
    check_pairing(firsts, seconds, *params)
    limits = workers.pool.limits()
    kind = score_kind(limits, workers.served_model_name, route)
    if kind is ScoreKind.CROSS_ENCODER:
        pairs = _zip_broadcast(firsts, seconds)
        encoded = await encode_pairs(tokenizer, pairs, params[1], limits.context_len)
        check_inputs(encoded.token_lists, limits, params[1])
        result = await workers.embed(encoded.token_lists, None, encoded.token_type_lists)
        activation = sigmoid if use_activation else float
        return Scores([activation(vector[0]) for vector in result.vectors], result.num_tokens)
    first_ids = await encode_texts(tokenizer, list(firsts), params[0], limits.context_len)
    second_ids = await encode_texts(tokenizer, list(seconds), params[1], limits.context_len)
    check_inputs(first_ids, limits, params[0])
    check_inputs(second_ids, limits, params[1])
    result = await workers.embed(first_ids + second_ids)
    first_vectors, second_vectors = result.vectors[: len(firsts)], result.vectors[len(firsts) :]
    values = [cosine(a, b) for a, b in _zip_broadcast(first_vectors, second_vectors)]
    return Scores(values, result.num_tokens)


def check_top_n(top_n: int) -> None:
    if top_n < 0:
        raise bad_request(f"`top_n` must be 0 (every document) or more, got {top_n}", "top_n")


def ranking(scores: Sequence[float], top_n: int) -> list[int]:
    """Indexes of `scores`, highest first (ties keep their order), the first `top_n` when it is positive."""
    check_top_n(top_n)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return order[:top_n] if top_n else order


def sigmoid(logit: float) -> float:
    """1 / (1 + e^-logit), without overflow for large negative logits."""
    if logit >= 0:
        return 1.0 / (1.0 + math.exp(-logit))
    exp = math.exp(logit)
    return exp / (1.0 + exp)


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine of two vectors of one length; 0 when either is all zeros."""
    norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return sum(x * y for x, y in zip(a, b)) / norms if norms else 0.0


def _zip_broadcast(firsts: Sequence[T], seconds: Sequence[T]) -> list[tuple[T, T]]:
    """Pairs of the one first item with every second, or of the two lists item by item."""
    if len(firsts) == 1:
        return [(firsts[0], second) for second in seconds]
    return list(zip(firsts, seconds))


async def score_answer(state: GatewayState, body: ScoreRequest) -> dict[str, Any]:
    """vLLM's ScoreResponse: one score per pair, in text_2's order."""
    model = _model(state, body.model)
    scores = await score_texts(
        state.pooling_workers(),
        state.require_tokenizer("text_1"),
        body.firsts(),
        body.seconds(),
        "/score",
        ("text_1", "text_2"),
        body.use_activation is not False,
    )
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"index": i, "object": "score", "score": value} for i, value in enumerate(scores.values)],
        "usage": {"prompt_tokens": scores.num_tokens, "total_tokens": scores.num_tokens, "completion_tokens": 0},
    }


async def rerank_answer(state: GatewayState, body: RerankRequest) -> dict[str, Any]:
    """vLLM's RerankResponse: the documents best first, the first `top_n` of them when it is positive."""
    model = _model(state, body.model)
    check_top_n(body.top_n)
    texts = body.document_texts()
    scores = await score_texts(
        state.pooling_workers(),
        state.require_tokenizer("query"),
        [body.query],
        texts,
        "/rerank",
        ("query", "documents"),
        body.use_activation is not False,
    )
    results = []
    for index in ranking(scores.values, body.top_n):
        result: dict[str, Any] = {"index": index, "relevance_score": scores.values[index]}
        if body.return_documents:
            result["document"] = {"text": texts[index]}
        results.append(result)
    usage = {"prompt_tokens": scores.num_tokens, "total_tokens": scores.num_tokens}
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": usage, "results": results}


def _model(state: GatewayState, model: str | None) -> str:
    """The answer's `model`: the request's, once checked, else the served name."""
    if model is None:
        return state.config.served_model_name
    state.check_model(model)
    return model
