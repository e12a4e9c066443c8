"""Embedding routes: OpenAI's /v1/embeddings and SGLang's native /encode and /classify.

All need a stack started with --is-embedding: the gateway tokenizes (special tokens added, so
BERT inputs get [CLS] ... [SEP]; token-id inputs are sent as given), checks every input against
the model's context length, and sends the token lists to the embedding prefill workers' `Embed`
in pieces of at most `INPUTS_PER_CALL`, concurrently and round-robin. A generation stack answers
every route with 400. /classify is /encode, as in SGLang: a reward model's (sequence classifier's)
vectors are its scores.

`dimensions`: the full size is always accepted; a smaller one only when the model declares
Matryoshka training (config.json `is_matryoshka` or `matryoshka_dimensions`); the worker then keeps
the first `dimensions` components and L2-normalizes again. Other models answer 400, as vLLM does,
rather than return truncated vectors of poor quality.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from gateway.api.json_route import JSONRoute
from gateway.api.schemas import EmbeddingRequest, EncodeRequest
from gateway.cluster.pool import ModelLimits
from gateway.cluster.worker_records import Embeddings
from gateway.errors import bad_request
from gateway.service.sampling import check_token_ids
from gateway.state import GatewayState, gateway_state
from gateway.text.text_input import encode_texts, token_id_lists

router = APIRouter(route_class=JSONRoute)

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
INPUTS_PER_CALL = 32  # inputs per Embed RPC: keeps each reply far below gRPC's 4 MiB default


@dataclass(frozen=True, slots=True)
class Embedded:
    vectors: list[list[float]]  # one per input, in input order
    num_tokens: int


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, state: GatewayState = Depends(gateway_state)) -> JSONResponse:
    return JSONResponse(await embeddings_answer(state, body))


async def embeddings_answer(state: GatewayState, body: EmbeddingRequest) -> dict:
    """OpenAI's embeddings answer, for every front."""
    state.check_model(body.model)
    limits = embedding_limits(state, "/v1/embeddings")
    token_lists = await _openai_inputs(state, body.input, limits)
    result = await embed(state, token_lists, check_dimensions(body.dimensions, limits), "input")
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
        for i, v in enumerate(result.vectors)
    ]
    usage = {"prompt_tokens": result.num_tokens, "total_tokens": result.num_tokens}
    return {"object": "list", "data": data, "model": body.model, "usage": usage}


@router.post("/encode")
async def encode(body: EncodeRequest, state: GatewayState = Depends(gateway_state)) -> JSONResponse:
    """SGLang's shape: `{"embedding", "meta_info"}` for one input, a list of them for a list."""
    return JSONResponse(await encode_answer(state, body, "/encode"))


@router.post("/classify")
async def classify(body: EncodeRequest, state: GatewayState = Depends(gateway_state)) -> JSONResponse:
    """SGLang's reward-model route: the body and answer of /encode, where a classifier's (e.g.
    `LlamaForSequenceClassification`) "embedding" is its `num_labels` scores for the input's last token."""
    return JSONResponse(await encode_answer(state, body, "/classify"))


async def encode_answer(state: GatewayState, body: EncodeRequest, route: str) -> dict | list[dict]:
    """/encode's or /classify's answer, for every front: one output, or a list for a list of inputs."""
    started = time.perf_counter()
    limits = embedding_limits(state, route)
    if body.text is not None and body.input_ids is None:
        is_batch, param = isinstance(body.text, list), "text"
        texts = body.text if isinstance(body.text, list) else [body.text]
        token_lists = await encode_texts(state.require_tokenizer("input"), texts, "text", limits.context_len)
    elif body.input_ids is not None and body.text is None:
        param = "input_ids"
        token_lists, is_batch = token_id_lists(body.input_ids)
        for ids in token_lists:
            check_token_ids(ids, limits, param)
    else:
        raise bad_request("exactly one of `text` and `input_ids` is required", "text")
    _check_inputs(token_lists, limits, param)
    rids = _rids(body.rid, len(token_lists), is_batch)
    result = await embed(state, token_lists, check_dimensions(body.dimensions, limits), param)
    latency = time.perf_counter() - started
    outputs = [
        {
            "embedding": vector,
            "meta_info": {
                "id": rid,
                "finish_reason": {"type": "length", "length": 0},
                "prompt_tokens": len(ids),
                "e2e_latency": latency,
            },
        }
        for vector, rid, ids in zip(result.vectors, rids, token_lists)
    ]
    return outputs if is_batch else outputs[0]


def embedding_limits(state: GatewayState, route: str) -> ModelLimits:
    """The served model's limits; 400 when it is a generation model."""
    limits = state.pool.limits()
    if not limits.is_embedding:
        raise bad_request(
            f"{route} needs an embedding model, but `{state.config.served_model_name}` is a generation "
            "model; serve an embedding model with `tandem serve --is-embedding`",
            "model",
            "model_not_embedding",
        )
    return limits


def check_dimensions(dimensions: int | None, limits: ModelLimits) -> int | None:
    """`dimensions` if the model serves that size (None: full size); 400 naming the param otherwise."""
    if dimensions is None or dimensions == limits.embedding_dim:
        return None
    if not limits.is_matryoshka:
        raise bad_request(
            f"This model does not support `dimensions` other than its full size "
            f"{limits.embedding_dim}: it declares no Matryoshka training.",
            "dimensions",
        )
    if limits.matryoshka_dimensions and dimensions not in limits.matryoshka_dimensions:
        raise bad_request(
            f"`dimensions` must be one of {sorted(limits.matryoshka_dimensions)} or "
            f"{limits.embedding_dim} for this model, got {dimensions}",
            "dimensions",
        )
    if not 1 <= dimensions <= limits.embedding_dim:
        raise bad_request(f"`dimensions` must be between 1 and {limits.embedding_dim}, got {dimensions}", "dimensions")
    return dimensions


async def embed(state: GatewayState, token_lists: list[list[int]], dimensions: int | None, param: str) -> Embedded:
    """Embed `token_lists` on the prefill workers, `INPUTS_PER_CALL` per call, all calls at once."""
    request_id = uuid.uuid4().hex
    pieces = [token_lists[i : i + INPUTS_PER_CALL] for i in range(0, len(token_lists), INPUTS_PER_CALL)]
    replies = await asyncio.gather(
        *(_embed_piece(state, f"{request_id}-{n}", piece, dimensions) for n, piece in enumerate(pieces))
    )
    vectors = [vector for reply in replies for vector in reply.vectors]
    return Embedded(vectors, sum(reply.num_tokens for reply in replies))


async def _embed_piece(
    state: GatewayState, request_id: str, token_lists: list[list[int]], dimensions: int | None
) -> Embeddings:
    worker = state.pool.pick("prefill")
    return await worker.client.embed(request_id, token_lists, dimensions, timeout_s=state.config.prefill_timeout_s)


async def _openai_inputs(state: GatewayState, value: str | list, limits: ModelLimits) -> list[list[int]]:
    """OpenAI's four input forms -> one token list per input (texts get the model's special tokens)."""
    if isinstance(value, str):
        value = [value]
    if value and all(isinstance(v, str) for v in value):
        token_lists = await encode_texts(state.require_tokenizer("text"), value, "input", limits.context_len)
    else:
        token_lists = [list(value)] if value and isinstance(value[0], int) else [list(v) for v in value]
        for ids in token_lists:
            check_token_ids(ids, limits, "input")
    _check_inputs(token_lists, limits, "input")
    return token_lists


def _check_inputs(token_lists: list[list[int]], limits: ModelLimits, param: str) -> None:
    if not token_lists:
        raise bad_request(f"`{param}` must not be empty", param)
    if len(token_lists) > MAX_INPUTS:
        raise bad_request(f"`{param}` has {len(token_lists)} inputs; at most {MAX_INPUTS} are allowed", param)
    for i, ids in enumerate(token_lists):
        if not ids:
            raise bad_request(f"`{param}` item {i} is empty", param)
        if len(ids) > limits.context_len:
            raise bad_request(
                f"This model's maximum context length is {limits.context_len} tokens. However, you "
                f"requested {len(ids)} tokens in the input for embedding generation. Please reduce "
                "the length of the input.",
                param,
                "context_length_exceeded",
            )


def _rids(rid: str | list[str] | None, num_inputs: int, is_batch: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(num_inputs)]
    if not is_batch:
        if not isinstance(rid, str):
            raise bad_request("`rid` must be a string for a single input", "rid")
        return [rid]
    if not isinstance(rid, list) or len(rid) != num_inputs:
        raise bad_request(f"`rid` must be a list of {num_inputs} ids, one per input", "rid")
    return rid


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """`base64`: the little-endian float32 bytes, as OpenAI's SDK decodes them."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
