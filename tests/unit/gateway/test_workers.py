"""A worker's model info is fetched again whenever it comes back, so a restart with other limits is seen."""

from __future__ import annotations

import asyncio
import socket

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.workers import Worker
from tandem.v1 import common_pb2, worker_pb2_grpc


class _Decode(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self) -> None:
        self.context_len = 2048
        self.num_info_calls = 0

    async def GetModelInfo(self, request, context):
        self.num_info_calls += 1
        return common_pb2.GetModelInfoResponse(model_path="m", architecture="LlamaForCausalLM",
                                               context_len=self.context_len, vocab_size=100, eos_token_ids=[2])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_model_info_is_fetched_on_every_return_to_ready_and_only_then() -> None:
    async def main() -> None:
        address = f"127.0.0.1:{_free_port()}"
        decode, status = _Decode(), health.aio.HealthServicer()
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(decode, server)
        health_pb2_grpc.add_HealthServicer_to_server(status, server)
        server.add_insecure_port(address)
        await server.start()
        await status.set("", health_pb2.HealthCheckResponse.SERVING)
        worker = Worker("decode", address)
        try:
            assert await worker.probe() and worker.info.context_len == 2048
            assert await worker.probe() and decode.num_info_calls == 1     # steady: no refetch
            await status.set("", health_pb2.HealthCheckResponse.NOT_SERVING)   # "restarting"
            assert not await worker.probe()
            decode.context_len = 1024
            await status.set("", health_pb2.HealthCheckResponse.SERVING)
            assert await worker.probe() and worker.info.context_len == 1024 and decode.num_info_calls == 2
        finally:
            await worker.channel.close()
            await server.stop(None)

    asyncio.run(main())
