"""gRPC clients for the prefill and decode workers: readiness tracking and round-robin picking."""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.errors import APIError
from tandem.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

logger = logging.getLogger(__name__)

_POLL_INTERVAL_S = 1.0
_PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the gateway must know about the served model, as the workers report it."""

    model_path: str
    architecture: str
    context_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


class Worker:
    def __init__(self, role: str, address: str) -> None:
        self.role = role
        self.address = address
        self.channel = grpc.aio.insecure_channel(address)
        stub_cls = prefill_pb2_grpc.PrefillServiceStub if role == "prefill" else decode_pb2_grpc.DecodeServiceStub
        self.stub = stub_cls(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.is_ready = False
        self.info: common_pb2.GetModelInfoResponse | None = None

    async def probe(self) -> bool:
        """Ask the worker's health service; fetch its model info the first time it answers."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=_PROBE_TIMEOUT_S)
            ready = reply.status == health_pb2.HealthCheckResponse.SERVING
            if ready and self.info is None:
                self.info = await self.stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=_PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            ready = False
        if ready != self.is_ready:
            logger.info("%s worker %s is %s", self.role, self.address, "ready" if ready else "not ready")
        self.is_ready = ready
        return ready


class WorkerPool:
    def __init__(self, prefill_addrs: tuple[str, ...], decode_addrs: tuple[str, ...]) -> None:
        self.workers = {"prefill": [Worker("prefill", a) for a in prefill_addrs],
                        "decode": [Worker("decode", a) for a in decode_addrs]}
        self._turns = {role: itertools.count() for role in self.workers}
        self._poller: asyncio.Task | None = None

    def start(self) -> None:
        self._poller = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for worker in self.all_workers():
            await worker.channel.close()

    def all_workers(self) -> list[Worker]:
        return self.workers["prefill"] + self.workers["decode"]

    async def probe_all(self) -> None:
        await asyncio.gather(*(w.probe() for w in self.all_workers()))

    async def _poll_forever(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(_POLL_INTERVAL_S)

    @property
    def is_ready(self) -> bool:
        return all(any(w.is_ready for w in ws) for ws in self.workers.values())

    def pick(self, role: str) -> Worker:
        """Round-robin over ready workers of `role`; 503 when none is ready."""
        ready = [w for w in self.workers[role] if w.is_ready]
        if not ready:
            raise APIError(503, f"no {role} worker is ready", "service_unavailable", code="worker_unavailable")
        return ready[next(self._turns[role]) % len(ready)]

    def limits(self) -> ModelLimits:
        """The tightest limits over every worker that has reported; 503 before any has."""
        infos = [w.info for w in self.all_workers() if w.info is not None]
        if not infos:
            raise APIError(503, "no worker has reported its model yet", "service_unavailable",
                           code="worker_unavailable")
        first = infos[0]
        return ModelLimits(model_path=first.model_path, architecture=first.architecture,
                           context_len=min(i.context_len for i in infos), vocab_size=first.vocab_size,
                           eos_token_ids=tuple(first.eos_token_ids))
