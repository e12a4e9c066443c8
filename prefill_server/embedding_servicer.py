"""PrefillService as a worker started with --is-embedding answers it: Embed.

Such a worker has no engine and no KV, so `Prefill` is refused with FAILED_PRECONDITION. Its
WorkerService is `server_runtime.common_rpcs.WorkerInfoServicer`; `EMBEDDING` is its worker kind.
"""

from __future__ import annotations

import logging

import grpc

from engine.errors import EngineError
from server_runtime.common_rpcs import add_worker_info_servicer
from server_runtime.embedding import EmbeddingContext
from server_runtime.errors import abort_with
from server_runtime.worker import WorkerKind, start_embedding_worker
from tandem.request_log import bind_request_id
from tandem.v1 import prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)


class EmbeddingServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, ctx: EmbeddingContext) -> None:
        self.ctx = ctx

    async def Embed(
        self, request: prefill_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.EmbedResponse:
        bind_request_id(request.request_id)
        token_lists = [list(item.token_ids) for item in request.inputs]
        # Segments only when some input has them; an input without them is all segment 0.
        has_types = any(item.token_type_ids for item in request.inputs)
        token_type_lists = (
            [list(item.token_type_ids) or [0] * len(item.token_ids) for item in request.inputs] if has_types else None
        )
        dimensions = request.dimensions if request.HasField("dimensions") else None
        try:
            result = await self.ctx.embed(token_lists, dimensions, token_type_lists)
        except EngineError as exc:
            logger.warning("embed %s failed: %s", request.request_id, exc)
            await abort_with(context, exc)
        return prefill_pb2.EmbedResponse(
            request_id=request.request_id,
            embeddings=[prefill_pb2.Embedding(values=row) for row in result.vectors.tolist()],
            num_tokens=result.num_tokens,
            queue_ms=result.queue_ms,
            compute_ms=result.compute_ms,
        )

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            "this worker serves an embedding model (--is-embedding): it answers Embed, not Prefill",
        )


def add_embedding_servicer(server: grpc.aio.Server, ctx: EmbeddingContext) -> str:
    """Register an embedding worker's PrefillService; returns the service's full name."""
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(EmbeddingServicer(ctx), server)
    return prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name


EMBEDDING = WorkerKind("embedding", start_embedding_worker, (add_embedding_servicer, add_worker_info_servicer))
