"""A worker's model info is fetched on every probe while it is ready, so a restart with other limits
or an update to other weights is seen; the pool pairs prefill and decode workers only when their
weights agree (real gRPC servers on loopback)."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.cluster.pool import WorkerPool
from gateway.cluster.prefix_index import PromptPages
from gateway.cluster.worker import Worker
from gateway.errors import APIError
from tandem.v1 import common_pb2, worker_pb2_grpc


class _Worker(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, weights_id: str = "a") -> None:
        self.context_len = 2048
        self.weights_id = weights_id
        self.num_info_calls = 0

    async def GetModelInfo(self, request, context):
        self.num_info_calls += 1
        return common_pb2.GetModelInfoResponse(model_path="m", architecture="LlamaForCausalLM",
                                               context_len=self.context_len, vocab_size=100, eos_token_ids=[2],
                                               weights_id=self.weights_id)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _serve(servicer: _Worker) -> tuple[str, grpc.aio.Server, health.aio.HealthServicer]:
    address = f"127.0.0.1:{_free_port()}"
    server, status = grpc.aio.server(), health.aio.HealthServicer()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(status, server)
    server.add_insecure_port(address)
    await server.start()
    await status.set("", health_pb2.HealthCheckResponse.SERVING)
    return address, server, status


def test_model_info_is_fetched_on_every_probe_of_a_ready_worker() -> None:
    async def main() -> None:
        decode = _Worker()
        address, server, status = await _serve(decode)
        worker = Worker("decode", address)
        try:
            assert await worker.probe() and worker.info.context_len == 2048 and worker.weights_id == "a"
            decode.weights_id = "b"                                           # updated in place
            assert await worker.probe() and worker.weights_id == "b" and decode.num_info_calls == 2
            await status.set("", health_pb2.HealthCheckResponse.NOT_SERVING)   # "restarting"
            assert not await worker.probe() and decode.num_info_calls == 2
            decode.context_len = 1024
            await status.set("", health_pb2.HealthCheckResponse.SERVING)
            assert await worker.probe() and worker.info.context_len == 1024
            assert await worker.responds()
            await server.stop(None)
            assert not await worker.responds() and not worker.is_ready      # gone: no new requests
        finally:
            await worker.client.close()
            await server.stop(None)

    asyncio.run(main())


def test_the_pool_pairs_workers_only_when_their_weights_agree() -> None:
    async def main() -> None:
        prefill, decode_a, decode_b = _Worker("a"), _Worker("a"), _Worker("b")
        served = [await _serve(w) for w in (prefill, decode_a, decode_b)]
        pool = WorkerPool((served[0][0],), (served[1][0], served[2][0]))
        try:
            await pool.probe_all()
            assert pool.is_ready
            picks = {pool.route(PromptPages([1, 2, 3])).decode.address for _ in range(4)}
            assert picks == {served[1][0]}                                    # never the "b" decode worker
            prefill.weights_id = "c"
            await pool.probe_all()
            assert not pool.is_ready
            with pytest.raises(APIError) as refused:
                pool.route(PromptPages([1, 2, 3]))
            assert refused.value.status == 503 and "same model weights" in refused.value.message
            prefill.weights_id = "b"
            await pool.probe_all()
            assert pool.is_ready and pool.route(PromptPages([1, 2, 3])).decode.address == served[2][0]
        finally:
            await pool.close()
            for _, server, _ in served:
                await server.stop(None)

    asyncio.run(main())
