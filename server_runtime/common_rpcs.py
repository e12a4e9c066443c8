"""WorkerService: the RPCs every worker answers, whatever its kind.

`WorkerInfoServicer` (GetModelInfo, GetLoad; Abort finds nothing) is an embedding worker's;
`WorkerServicer` is an engine worker's: Abort, FlushCache, UpdateWeights, SubscribeKvEvents (the prefix
cache's pages as they change, for the gateway's router) and the expert distribution record too. Each
worker kind registers its own (`add_worker_info_servicer`, `add_worker_servicer`) next to its role's
service.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import grpc

from engine.config import ConfigError
from engine.errors import EngineError, InvalidRequestError
from engine.moe import ExpertRecorder
from engine.weights import open_checkpoint
from server_runtime.context import WorkerContext
from server_runtime.convert import (
    embedding_model_info_to_proto,
    expert_distribution_to_proto,
    load_to_proto,
    model_info_to_proto,
)
from server_runtime.embedding import EmbeddingContext
from server_runtime.errors import WorkerWithoutLorasError, abort_with
from server_runtime.lora_serving import DEFAULT_UNLOAD_TIMEOUT_S, LoraAdapters
from tandem.request_log import bind_request_id
from tandem.v1 import common_pb2, worker_pb2, worker_pb2_grpc

T = TypeVar("T")
logger = logging.getLogger(__name__)

_SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name


def _not_found(path: str) -> str:
    return f"Failed to get weights iterator: {path} (repository not found)."


def is_within(path: str, directory: str) -> bool:
    """True when `path`, links resolved, is `directory` or lies under it. A path with a `..` component
    is never within: where `..` lands depends on links outside `directory` (`/bin/..` is `/usr`), so
    answering it would tell the caller which outside names are links."""
    if ".." in path.split(os.sep):
        return False
    resolved, root = os.path.realpath(path), os.path.realpath(directory)
    return resolved == root or resolved.startswith(root.rstrip(os.sep) + os.sep)


class WorkerInfoServicer(worker_pb2_grpc.WorkerServiceServicer):
    """An embedding worker's WorkerService: GetModelInfo and GetLoad. Abort finds nothing: such a
    worker holds nothing between calls."""

    def __init__(self, ctx: EmbeddingContext) -> None:
        self.ctx = ctx

    async def GetModelInfo(
        self, request: common_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.GetModelInfoResponse:
        return embedding_model_info_to_proto(self.ctx.info, self.ctx.config.model_path, self.ctx.version)

    async def GetLoad(
        self, request: common_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.GetLoadResponse:
        return load_to_proto(self.ctx.stats())

    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        return common_pb2.AbortResponse(found=False)


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """An engine worker's WorkerService. Start-up facts come from `ctx.facts`, live numbers and
    every change from the engine thread (`ctx.loop`)."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx

    async def SubscribeKvEvents(
        self, request: worker_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.KvEvents]:
        if self.ctx.is_draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        events = await self.ctx.loop.subscribe_kv_events()
        try:
            while (change := await events.get()) is not None:  # None: the worker drains
                yield worker_pb2.KvEvents(is_snapshot=change.is_snapshot, stored=change.stored, removed=change.removed)
        finally:
            await asyncio.shield(self.ctx.loop.unsubscribe_kv_events(events))

    async def GetModelInfo(
        self, request: common_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.GetModelInfoResponse:
        ctx = self.ctx
        info = model_info_to_proto(ctx.facts, ctx.config.model_path, ctx.config.role, ctx.version, ctx.weights_id)
        info.prefix_cache_disabled = not ctx.config.engine.enable_prefix_cache
        if ctx.loras is not None:
            info.max_loras = ctx.loras.registry.max_loras
            info.lora_adapters.extend(
                common_pb2.LoraAdapterInfo(name=a.name, rank=a.rank) for a in ctx.loras.registry.info()
            )
        return info

    async def LoadLoraAdapter(
        self, request: common_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.LoadLoraAdapterResponse:
        try:
            await self._loras().load(request.name, request.path)
        except EngineError as exc:
            await abort_with(context, exc)
        logger.info("loaded LoRA adapter %r", request.name)
        return common_pb2.LoadLoraAdapterResponse()

    async def UnloadLoraAdapter(
        self, request: common_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.UnloadLoraAdapterResponse:
        timeout_s = request.timeout_ms / 1000 if request.HasField("timeout_ms") else DEFAULT_UNLOAD_TIMEOUT_S
        try:
            await self._loras().unload(request.name, self.ctx.loop, timeout_s)
        except EngineError as exc:
            await abort_with(context, exc)
        logger.info("unloaded LoRA adapter %r", request.name)
        return common_pb2.UnloadLoraAdapterResponse()

    def _loras(self) -> LoraAdapters:
        if self.ctx.loras is None:
            raise WorkerWithoutLorasError("this worker serves no LoRA adapters: start it with --max-loras above 0")
        return self.ctx.loras

    async def GetLoad(
        self, request: common_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.GetLoadResponse:
        return load_to_proto(await self.ctx.stats())

    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        bind_request_id(request.request_id)
        return common_pb2.AbortResponse(
            found=await self.ctx.loop.abort(request.request_id, "aborted by client", request.kv_write_settled)
        )

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.FlushCacheResponse:
        def flush(engine) -> common_pb2.FlushCacheResponse:
            if engine.has_work:
                return common_pb2.FlushCacheResponse(
                    success=False, message="requests are running or waiting; the cache was not flushed"
                )
            freed = engine.flush_prefix_cache()
            return common_pb2.FlushCacheResponse(
                success=True, message=f"freed {freed} cached pages", num_freed_pages=freed
            )

        return await self.ctx.loop.call(flush)

    async def UpdateWeights(
        self, request: common_pb2.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.UpdateWeightsResponse:
        path = request.model_path
        if not any(is_within(path, directory) for directory in self.ctx.weights_dirs):
            # SGLang's answer for a missing model, whether or not the path exists: the RPC cannot probe files.
            logger.warning("refused to load weights from %r: outside --weights-dir %s", path, self.ctx.weights_dirs)
            return self._failed(_not_found(path))
        try:
            checkpoint = await self.ctx.loop.work.run(open_checkpoint, path)
        except FileNotFoundError:
            return self._failed(_not_found(path))
        except (ConfigError, ValueError, OSError) as exc:
            return self._failed(f"Failed to open {path}: {exc}")
        try:
            self.ctx.weights_id = await self.ctx.loop.update_weights(checkpoint)
        except InvalidRequestError as exc:
            return self._failed(str(exc))
        return common_pb2.UpdateWeightsResponse(
            success=True, message="Succeeded to update model weights.", weights_id=self.ctx.weights_id
        )

    def _failed(self, message: str) -> common_pb2.UpdateWeightsResponse:
        """No update: the weights served are still `ctx.weights_id`."""
        return common_pb2.UpdateWeightsResponse(success=False, message=message, weights_id=self.ctx.weights_id)

    # The expert counts live in the model runner and are touched only on the engine thread.

    async def StartExpertDistributionRecord(
        self, request: common_pb2.StartExpertDistributionRecordRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.StartExpertDistributionRecordResponse:
        await self._on_recorder(context, lambda recorder: recorder.start())
        return common_pb2.StartExpertDistributionRecordResponse()

    async def StopExpertDistributionRecord(
        self, request: common_pb2.StopExpertDistributionRecordRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.StopExpertDistributionRecordResponse:
        await self._on_recorder(context, lambda recorder: recorder.stop())
        return common_pb2.StopExpertDistributionRecordResponse()

    async def DumpExpertDistributionRecord(
        self, request: common_pb2.DumpExpertDistributionRecordRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.DumpExpertDistributionRecordResponse:
        return expert_distribution_to_proto(await self._on_recorder(context, lambda recorder: recorder.dump()))

    async def _on_recorder(self, context: grpc.aio.ServicerContext, fn: Callable[[ExpertRecorder], T]) -> T:
        """`fn(expert recorder)` on the engine thread; a model without experts ends the RPC (INVALID_ARGUMENT)."""
        try:
            return await self.ctx.loop.call(lambda engine: fn(engine.runner.expert_recorder))
        except EngineError as exc:
            await abort_with(context, exc)


def add_worker_servicer(server: grpc.aio.Server, ctx: WorkerContext) -> str:
    """Register an engine worker's WorkerService; returns the service's full name."""
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(ctx), server)
    return _SERVICE_NAME


def add_worker_info_servicer(server: grpc.aio.Server, ctx: EmbeddingContext) -> str:
    """Register an embedding worker's WorkerService; returns the service's full name."""
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerInfoServicer(ctx), server)
    return _SERVICE_NAME
