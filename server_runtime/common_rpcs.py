"""The RPCs every worker answers the same way, whatever its role: Abort, GetModelInfo, GetLoad.

A role's servicer lists `WorkerRpcs` before its generated base class and sets `role`.
"""

from __future__ import annotations

import grpc

from server_runtime.worker import WorkerContext
from tandem.v1 import common_pb2


class WorkerRpcs:
    role: int = common_pb2.WORKER_ROLE_UNSPECIFIED

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx

    async def Abort(self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> common_pb2.AbortResponse:
        return common_pb2.AbortResponse(found=await self.ctx.loop.abort(request.request_id, "aborted by client"))

    async def GetModelInfo(self, request: common_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
                           ) -> common_pb2.GetModelInfoResponse:
        return self.ctx.model_info(self.role)

    async def GetLoad(self, request: common_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
                      ) -> common_pb2.GetLoadResponse:
        return await self.ctx.load()
