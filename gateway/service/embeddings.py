"""The embedding operations, for every front: OpenAI's /v1/embeddings, SGLang's native /encode and
/classify, vLLM's /pooling.

All need a stack started with --is-embedding: the gateway tokenizes (special tokens added, so
BERT inputs get [CLS] ... [SEP]; token-id inputs are sent as given), checks every input against
the model's context length, and sends the token lists to the embedding prefill workers
(`gateway/service/pooling.py`). A generation stack answers every route with 400. /classify is
/encode, as in SGLang: a reward model's (sequence classifier's) vectors are its scores. /pooling is
/v1/embeddings in vLLM's PoolingResponse shape: each input's raw pooled output (the vector, or a
classifier's logits).

`dimensions`: the full size is always accepted; a smaller one only when the model declares
Matryoshka training (config.json `is_matryoshka` or `matryoshka_dimensions`); the worker then keeps
the first `dimensions` components and L2-normalizes again. Other models answer 400, as vLLM does,
rather than return truncated vectors of poor quality.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid

from gateway.cluster.pool import ModelLimits
from gateway.errors import bad_request
from gateway.service.pooling import check_inputs
from gateway.service.request_schemas import EmbeddingRequest, EncodeRequest, PoolingRequest
from gateway.service.sampling import check_token_ids
from gateway.service.state import GatewayState
from gateway.text.text_input import encode_texts, token_id_lists


async def embeddings_answer(state: GatewayState, body: EmbeddingRequest) -> dict:
    """OpenAI's embeddings answer, for every front."""
    state.check_model(body.model)
    limits = embedding_limits(state, "/v1/embeddings")
    token_lists = await _openai_inputs(state, body.input, limits)
    result = await state.pooling_workers().embed(token_lists, check_dimensions(body.dimensions, limits))
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
        for i, v in enumerate(result.vectors)
    ]
    usage = {"prompt_tokens": result.num_tokens, "total_tokens": result.num_tokens}
    return {"object": "list", "data": data, "model": body.model, "usage": usage}


async def pooling_answer(state: GatewayState, body: PoolingRequest) -> dict:
    """vLLM's PoolingResponse: `{"index", "object": "pooling", "data"}` per input."""
    if body.model is not None:
        state.check_model(body.model)
    limits = embedding_limits(state, "/pooling")
    token_lists = await _openai_inputs(state, body.input, limits)
    result = await state.pooling_workers().embed(token_lists, check_dimensions(body.dimensions, limits))
    data = [
        {"index": i, "object": "pooling", "data": _encoded(v, body.encoding_format)}
        for i, v in enumerate(result.vectors)
    ]
    return {
        "id": f"pool-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": body.model or state.config.served_model_name,
        "data": data,
        "usage": {"prompt_tokens": result.num_tokens, "total_tokens": result.num_tokens, "completion_tokens": 0},
    }


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
    check_inputs(token_lists, limits, param)
    rids = _rids(body.rid, len(token_lists), is_batch)
    result = await state.pooling_workers().embed(token_lists, check_dimensions(body.dimensions, limits))
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
    return state.pooling_workers().limits(route)


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
    check_inputs(token_lists, limits, "input")
    return token_lists


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
