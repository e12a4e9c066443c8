"""`PoolingWorkers`: what every pooling operation (embeddings, /encode and /classify, /pooling, /score,
/rerank) asks of the embedding prefill workers of a stack started with --is-embedding.

`limits` refuses a generation stack with a 400 naming the route; `embed` sends token lists to the
workers' `Embed` in pieces of at most `INPUTS_PER_CALL`, concurrently, each piece to the worker
`WorkerPool.pick` chooses; `check_inputs` is the 400s every route gives before any worker is called.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from gateway.cluster.pool import ModelLimits, WorkerPool
from gateway.cluster.worker_records import Embeddings
from gateway.errors import bad_request
from gateway.records import Role

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
INPUTS_PER_CALL = 32  # inputs per Embed RPC: keeps each reply far below gRPC's 4 MiB default


@dataclass(frozen=True, slots=True)
class Embedded:
    vectors: list[list[float]]  # one per input, in input order
    num_tokens: int


@dataclass(frozen=True, slots=True)
class PoolingWorkers:
    """The pool of a stack serving `served_model_name`; each Embed call gets `timeout_s`."""

    pool: WorkerPool
    served_model_name: str
    timeout_s: float

    def limits(self, route: str) -> ModelLimits:
        """The served model's limits; 400 when it is a generation model."""
        limits = self.pool.limits()
        if not limits.is_embedding:
            raise bad_request(
                f"{route} needs an embedding model, but `{self.served_model_name}` is a generation "
                "model; serve an embedding model with `tandem serve --is-embedding`",
                "model",
                "model_not_embedding",
            )
        return limits

    async def embed(
        self,
        token_lists: list[list[int]],
        dimensions: int | None = None,
        token_type_lists: list[list[int]] | None = None,
    ) -> Embedded:
        """One vector per token list, in order (`token_type_lists`: each list's segments, or None)."""
        request_id = uuid.uuid4().hex
        starts = range(0, len(token_lists), INPUTS_PER_CALL)
        replies = await asyncio.gather(
            *(
                self._embed_piece(
                    f"{request_id}-{n}",
                    token_lists[i : i + INPUTS_PER_CALL],
                    dimensions,
                    None if token_type_lists is None else token_type_lists[i : i + INPUTS_PER_CALL],
                )
                for n, i in enumerate(starts)
            )
        )
        vectors = [vector for reply in replies for vector in reply.vectors]
        return Embedded(vectors, sum(reply.num_tokens for reply in replies))

    async def _embed_piece(
        self,
        request_id: str,
        token_lists: list[list[int]],
        dimensions: int | None,
        token_type_lists: list[list[int]] | None,
    ) -> Embeddings:
        worker = self.pool.pick(Role.PREFILL)
        return await worker.client.embed(request_id, token_lists, dimensions, self.timeout_s, token_type_lists)


def check_inputs(token_lists: list[list[int]], limits: ModelLimits, param: str) -> None:
    """400 naming `param` for no inputs, too many, an empty one, or one over the context length."""
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
