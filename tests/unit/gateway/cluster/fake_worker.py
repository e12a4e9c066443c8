"""A stand-in worker for the cluster wing's tests: a real gRPC server on loopback serving scripted
PrefillService, DecodeService, WorkerService and health servicers that record what they receive.
It replaces the worker processes, never the gateway code under test."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, worker_pb2_grpc

LAYOUT = common_pb2.KvLayout(num_layers=2, page_size=16, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_bytes=2048)
KV_TARGET = common_pb2.KvTarget(session_id="127.0.0.1:12345", base_addr=1 << 40, layout=LAYOUT, page_ids=[3, 4],
                                grant="g-1", grant_expires_unix_ms=1_700_000_000_000)
Failure = tuple[grpc.StatusCode, str]


def token(token_id: int, logprob: float = -0.5) -> common_pb2.TokenOutput:
    return common_pb2.TokenOutput(token_id=token_id, logprob=logprob,
                                  top_logprobs=[common_pb2.TokenLogprob(token_id=token_id, logprob=logprob)])


class FakePrefill(prefill_pb2_grpc.PrefillServiceServicer):
    """Prefill answers token 7 after `delay_s`, or aborts with `failure`."""

    def __init__(self) -> None:
        self.received: list = []
        self.failure: Failure | None = None
        self.delay_s = 0.0

    async def Prefill(self, request, context):
        self.received.append(request)
        await asyncio.sleep(self.delay_s)
        if self.failure is not None:
            await context.abort(*self.failure)
        return prefill_pb2.PrefillResponse(request_id=request.request_id, first_token=token(7), cached_tokens=16,
                                           queue_ms=1.5, compute_ms=2.5, transfer_ms=0.5, kv_bytes=4096,
                                           weights_id="w-1", prompt_logprobs=[token(5, -1.25)])

    async def CancelPrefill(self, request, context):
        self.received.append(request)
        return prefill_pb2.CancelPrefillResponse(was_running=True)


class FakeDecode(decode_pb2_grpc.DecodeServiceServicer):
    """Reserve answers RESOURCE_EXHAUSTED (no free pages) `num_full_reserves` times first, then
    `kv_target` with `cached_tokens` (what its prefix cache held). Generate streams token 8 (with
    queue_ms), then aborts with `failure`, or hangs while `is_stuck`, or ends with token 2 and
    FINISH_REASON_STOP. PrefillAndGenerate reports `cached_tokens` too."""

    def __init__(self) -> None:
        self.received: list = []
        self.failure: Failure | None = None
        self.is_stuck = False
        self.fails_reserve = True  # False: only the Generate stream fails with `failure`; Reserve answers
        self.num_full_reserves = 0
        self.kv_target = KV_TARGET
        self.cached_tokens = 0

    async def Reserve(self, request, context):
        self.received.append(request)
        if self.failure is not None and self.fails_reserve:
            await context.abort(*self.failure)
        if self.num_full_reserves > 0:
            self.num_full_reserves -= 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free pages")
        return decode_pb2.ReserveResponse(request_id=request.request_id, kv_target=self.kv_target, ttl_ms=5000,
                                          cached_tokens=self.cached_tokens)

    async def Generate(self, request, context):
        self.received.append(request)
        yield decode_pb2.GenerateResponse(request_id=request.request_id, tokens=[token(8)], queue_ms=0.75)
        if self.failure is not None:
            await context.abort(*self.failure)
        while self.is_stuck:
            await asyncio.sleep(0.05)
        yield decode_pb2.GenerateResponse(request_id=request.request_id, tokens=[token(2)],
                                          finish_reason=common_pb2.FINISH_REASON_STOP, matched_token_id=2)


    async def PrefillAndGenerate(self, request, context):
        """Prefill on decode: tokens 7 and 8 in the first message (with its times), then 2 and a stop,
        unless `failure` aborts it before any token."""
        self.received.append(request)
        if self.failure is not None:
            await context.abort(*self.failure)
        yield decode_pb2.GenerateResponse(request_id=request.request_id, tokens=[token(7), token(8)], queue_ms=0.25,
                                          prefill_compute_ms=1.75, cached_tokens=self.cached_tokens)
        yield decode_pb2.GenerateResponse(request_id=request.request_id, tokens=[token(2)],
                                          finish_reason=common_pb2.FINISH_REASON_STOP, matched_token_id=2)


class FakeControl(worker_pb2_grpc.WorkerServiceServicer):
    """FlushCache is left to the base class: UNIMPLEMENTED, as on an embedding worker. GetModelInfo
    reports `adapters` loaded (LoadLoraAdapter adds one, or aborts with `lora_failure`)."""

    def __init__(self) -> None:
        self.received: list = []
        self.adapters: list[str] = []
        self.lora_failure: Failure | None = None

    async def GetModelInfo(self, request, context):
        return common_pb2.GetModelInfoResponse(model_path="m", architecture="LlamaForCausalLM", context_len=2048,
                                               vocab_size=100, eos_token_ids=[2], kv_layout=LAYOUT, num_pages=64,
                                               role=common_pb2.WORKER_ROLE_DECODE, version="1", weights_id="w-1",
                                               lora_adapters=[common_pb2.LoraAdapterInfo(name=n, rank=8)
                                                              for n in self.adapters], max_loras=4)

    async def LoadLoraAdapter(self, request, context):
        self.received.append(request)
        if self.lora_failure is not None:
            await context.abort(*self.lora_failure)
        self.adapters.append(request.name)
        return common_pb2.LoadLoraAdapterResponse()

    async def UnloadLoraAdapter(self, request, context):
        self.received.append(request)
        if request.name not in self.adapters:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no LoRA adapter named {request.name!r} is loaded")
        self.adapters.remove(request.name)
        return common_pb2.UnloadLoraAdapterResponse()

    async def GetLoad(self, request, context):
        return common_pb2.GetLoadResponse(num_free_pages=64, num_total_pages=64)

    async def Abort(self, request, context):
        self.received.append(request)
        return common_pb2.AbortResponse(found=request.request_id == "known")

    async def UpdateWeights(self, request, context):
        await context.abort(grpc.StatusCode.INTERNAL, "Unexpected <class 'OSError'>: /srv/models/x on 10.0.0.7:31002")

    async def StartExpertDistributionRecord(self, request, context):
        self.received.append(request)
        return common_pb2.StartExpertDistributionRecordResponse()

    async def DumpExpertDistributionRecord(self, request, context):
        return common_pb2.DumpExpertDistributionRecordResponse(layer_ids=[0, 2], num_experts=2, counts=[1, 2, 3, 4],
                                                               num_experts_per_tok=1)


class FakeHealth(health.aio.HealthServicer):
    """The real health servicer, except that it answers nothing while `is_frozen` (a frozen process)."""

    def __init__(self) -> None:
        super().__init__()
        self.is_frozen = False

    async def Check(self, request, context):
        while self.is_frozen:
            await asyncio.sleep(0.05)
        return await super().Check(request, context)


@dataclasses.dataclass
class FakeWorker:
    address: str
    prefill: FakePrefill
    decode: FakeDecode
    control: FakeControl
    health: FakeHealth

    def aborts(self) -> list[tuple[str, bool]]:
        """(request id, kv_write_settled) of every Abort received, in order."""
        return [(r.request_id, r.kv_write_settled) for r in self.control.received
                if isinstance(r, common_pb2.AbortRequest)]

    def cancelled_prefills(self) -> list[prefill_pb2.CancelPrefillRequest]:
        return [r for r in self.prefill.received if isinstance(r, prefill_pb2.CancelPrefillRequest)]


@contextlib.asynccontextmanager
async def serve_fake_worker() -> AsyncIterator[FakeWorker]:
    """A fake worker on a free loopback port, its health SERVING, for the length of the block."""
    worker = FakeWorker("", FakePrefill(), FakeDecode(), FakeControl(), FakeHealth())
    server = grpc.aio.server()
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(worker.prefill, server)
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(worker.decode, server)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(worker.control, server)
    health_pb2_grpc.add_HealthServicer_to_server(worker.health, server)
    worker.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    await worker.health.set("", health_pb2.HealthCheckResponse.SERVING)
    try:
        yield worker
    finally:
        worker.health.is_frozen = False
        worker.decode.is_stuck = False
        await server.stop(None)
