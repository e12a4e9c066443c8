"""An embedding worker in-process (`build_worker` with the EMBEDDING kind): the real `EmbeddingServicer` on a
gRPC port, a tiny random Qwen2 as the model, and the gateway's `WorkerPool` in front of it with no decode
worker at all."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch

from engine.config import EngineConfig
from gateway.cluster.client import WorkerClient
from gateway.cluster.pool import WorkerPool
from gateway.cluster.worker_records import FlushResult
from gateway.errors import APIError
from kv_transfer import TransportConfig
from prefill_server.embedding_servicer import EMBEDDING
from server_runtime.context import WorkerConfig
from server_runtime.worker import build_worker
from tandem.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc, worker_pb2_grpc
from tests.tiny_models import save_tiny_qwen2

INPUTS = [[5, 17, 42, 99, 3], [7], list(range(1, 40)), [250, 0]]


def _config(model_path: Path, port: int) -> WorkerConfig:
    return WorkerConfig(role="prefill", model_path=str(model_path), host="127.0.0.1", port=port,
                        engine=EngineConfig(dtype="float32", context_len=64), transport=TransportConfig(backend="local"),
                        torch_threads=1, is_embedding=True)


def test_embedding_is_for_prefill_workers_only(tmp_path: Path) -> None:
    config = _config(tmp_path, 1)
    with pytest.raises(ValueError, match="prefill workers only"):
        WorkerConfig(**{**{f: getattr(config, f) for f in config.__dataclass_fields__}, "role": "decode"})


def test_embed_over_grpc_with_a_pool_that_has_no_decode_worker(tmp_path: Path) -> None:
    asyncio.run(_scenario(save_tiny_qwen2(tmp_path / "qwen2")))


async def _scenario(model_path: Path) -> None:
    running = await build_worker(_config(model_path, 0), EMBEDDING)   # port 0: any free one
    ctx = running.context
    pool = WorkerPool((running.address,), ())
    try:
        assert running.service_names == ("tandem.v1.PrefillService", "tandem.v1.WorkerService")
        await pool.probe_all()
        assert pool.is_ready                            # ready with a prefill worker alone
        limits = pool.limits()
        assert limits.is_embedding and limits.embedding_dim == 64 and limits.context_len == 64
        assert not limits.is_matryoshka and limits.architecture == "Qwen2ForCausalLM"
        expected = ctx.embedder.embed(INPUTS)
        async with grpc.aio.insecure_channel(running.address) as channel:   # the servicer's own answers
            stub = prefill_pb2_grpc.PrefillServiceStub(channel)
            await _check_embed(stub, expected)
            await _check_refusals(stub)
            control = worker_pb2_grpc.WorkerServiceStub(channel)
            load = await control.GetLoad(common_pb2.GetLoadRequest())
            assert (load.num_running, load.num_waiting) == (0, 0)
            assert not (await control.Abort(common_pb2.AbortRequest(request_id="r"))).found
            with pytest.raises(grpc.aio.AioRpcError) as caught:       # no engine: nothing to flush
                await control.FlushCache(common_pb2.FlushCacheRequest())
            assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        await _check_client(pool.pick("prefill").client, expected)
    finally:
        await pool.close()
        await running.close()


async def _check_embed(stub: prefill_pb2_grpc.PrefillServiceStub, expected: torch.Tensor) -> None:
    request = prefill_pb2.EmbedRequest(request_id="r", inputs=[prefill_pb2.EmbedInput(token_ids=t) for t in INPUTS])
    # Several calls at once: they queue for the one embedder thread and each gets its own vectors.
    replies = await asyncio.gather(*(stub.Embed(request) for _ in range(4)))
    for reply in replies:
        got = torch.tensor([list(e.values) for e in reply.embeddings])
        assert torch.equal(got, expected)
        assert reply.request_id == "r" and reply.num_tokens == sum(map(len, INPUTS)) and reply.compute_ms > 0


async def _check_client(client: WorkerClient, expected: torch.Tensor) -> None:
    """The gateway's typed client over the same worker: vectors, load, abort, flush, a refusal as a 400."""
    embedded = await client.embed("typed", INPUTS, None, timeout_s=30)
    assert torch.equal(torch.tensor(embedded.vectors), expected) and embedded.num_tokens == sum(map(len, INPUTS))
    load = await client.load(timeout_s=5)
    assert (load.num_running, load.num_waiting) == (0, 0)
    assert not await client.abort("r", kv_write_settled=False, timeout_s=5)
    assert await client.flush_cache(timeout_s=5) == FlushResult(True, "no cache")   # nothing to flush
    with pytest.raises(APIError) as caught:
        await client.embed("long", [list(range(65))], None, timeout_s=5)
    assert (caught.value.status, caught.value.code) == (400, "context_length_exceeded")
    assert "65 tokens" in caught.value.message


async def _check_refusals(stub: prefill_pb2_grpc.PrefillServiceStub) -> None:
    cases = [
        (prefill_pb2.EmbedRequest(request_id="long", inputs=[prefill_pb2.EmbedInput(token_ids=list(range(65)))]),
         grpc.StatusCode.OUT_OF_RANGE, "65 tokens"),
        (prefill_pb2.EmbedRequest(request_id="dims", inputs=[prefill_pb2.EmbedInput(token_ids=[1])], dimensions=8),
         grpc.StatusCode.INVALID_ARGUMENT, "Matryoshka"),
        (prefill_pb2.EmbedRequest(request_id="none"), grpc.StatusCode.INVALID_ARGUMENT, "no inputs"),
    ]
    for request, code, text in cases:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Embed(request)
        assert caught.value.code() == code and text in caught.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Prefill(prefill_pb2.PrefillRequest(request_id="p", token_ids=[1, 2]))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "Embed" in caught.value.details()
