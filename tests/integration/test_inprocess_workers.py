"""A prefill and a decode worker built in-process (`build_worker`, tests/integration/inprocess_workers.py)
on a tiny random Qwen2: they answer GetModelInfo and GetLoad, hand a prompt off through their real
servicers (Reserve, Prefill writing the KV over a LocalTransport, Generate), drain and shut down cleanly."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.engine import Engine
from engine.request import Request, SamplingParams
from engine.weights import open_checkpoint
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, worker_pb2_grpc
from tests.integration.inprocess_workers import ENGINE, Workers, running_workers
from tests.tiny_models import save_tiny_qwen2

PROMPT = list(range(10, 47))   # 37 tokens: three pages of 16, the last one partly filled
NUM_NEW_TOKENS = 8


def test_workers_serve_hand_off_and_shut_down(tmp_path: Path) -> None:
    model_path = save_tiny_qwen2(tmp_path / "qwen2")
    engine_threads_before = _num_engine_threads()
    tokens, addresses = asyncio.run(_scenario(model_path))
    assert _num_engine_threads() == engine_threads_before   # both engine threads ended
    asyncio.run(_check_gone(addresses))
    assert tokens == _whole_run(model_path)


async def _scenario(model_path: Path) -> tuple[list[int], tuple[str, str]]:
    async with running_workers(model_path) as workers:
        async with grpc.aio.insecure_channel(workers.prefill.address) as prefill_channel, \
                grpc.aio.insecure_channel(workers.decode.address) as decode_channel:
            await _check_model_info(prefill_channel, decode_channel)
            tokens = await _hand_off(prefill_channel, decode_channel)
            await _check_load(prefill_channel, decode_channel)
            await _check_drain(workers, decode_channel)
        return tokens, (workers.prefill.address, workers.decode.address)


async def _check_model_info(prefill_channel: grpc.aio.Channel, decode_channel: grpc.aio.Channel) -> None:
    prefill, decode = [await worker_pb2_grpc.WorkerServiceStub(channel).GetModelInfo(common_pb2.GetModelInfoRequest())
                       for channel in (prefill_channel, decode_channel)]
    assert (prefill.role, decode.role) == (common_pb2.WORKER_ROLE_PREFILL, common_pb2.WORKER_ROLE_DECODE)
    for info in (prefill, decode):
        assert info.architecture == "Qwen2ForCausalLM" and info.vocab_size == 256 and info.context_len == 128
        assert list(info.eos_token_ids) == [2] and not info.is_embedding
        assert info.num_pages == 1024 // 16 and info.weights_id and info.version
    assert prefill.kv_layout == decode.kv_layout and prefill.weights_id == decode.weights_id


async def _hand_off(prefill_channel: grpc.aio.Channel, decode_channel: grpc.aio.Channel) -> list[int]:
    """Reserve, Prefill, Generate as the gateway's handoff does them; returns every token sampled."""
    prefill = prefill_pb2_grpc.PrefillServiceStub(prefill_channel)
    decode = decode_pb2_grpc.DecodeServiceStub(decode_channel)
    sampling = common_pb2.SamplingParams(temperature=0, max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    reserved = await decode.Reserve(decode_pb2.ReserveRequest(request_id="h1", prompt_len=len(PROMPT)))
    assert len(reserved.kv_target.page_ids) == 3
    first = await prefill.Prefill(prefill_pb2.PrefillRequest(
        request_id="h1", token_ids=PROMPT, sampling_params=sampling, kv_target=reserved.kv_target))
    assert first.kv_bytes == 3 * reserved.kv_target.layout.page_bytes and first.weights_id
    tokens = [first.first_token.token_id]
    async for reply in decode.Generate(decode_pb2.GenerateRequest(
            request_id="h1", prompt_token_ids=PROMPT, first_token=first.first_token, sampling_params=sampling,
            weights_id=first.weights_id, kv_grant=reserved.kv_target.grant)):
        tokens += [token.token_id for token in reply.tokens]
    assert reply.finish_reason == common_pb2.FINISH_REASON_LENGTH
    return tokens


async def _check_load(prefill_channel: grpc.aio.Channel, decode_channel: grpc.aio.Channel) -> None:
    """Nothing running; every page free again, but the prompt's pages the prefix caches keep."""
    prefill, decode = [await worker_pb2_grpc.WorkerServiceStub(channel).GetLoad(common_pb2.GetLoadRequest())
                       for channel in (prefill_channel, decode_channel)]
    for load in (prefill, decode):
        assert (load.num_running, load.num_waiting, load.num_total_pages) == (0, 0, 64)
    # 37 + 8 - 1 tokens have KV on decode: the prompt's two full pages, cached when it was admitted
    assert decode.num_cached_pages == 2 and decode.num_free_pages == 62
    assert prefill.num_cached_pages == 2 and prefill.num_free_pages == 62   # the two full pages of the prompt


async def _check_drain(workers: Workers, decode_channel: grpc.aio.Channel) -> None:
    """An idle worker drains at once: NOT_SERVING, new reservations refused, the rest of its grace left."""
    grace_s = await workers.decode.drain(asyncio.Event())
    assert grace_s > 1.0
    health = await health_pb2_grpc.HealthStub(decode_channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await decode_pb2_grpc.DecodeServiceStub(decode_channel).Reserve(
            decode_pb2.ReserveRequest(request_id="late", prompt_len=4))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def _check_gone(addresses: tuple[str, str]) -> None:
    for address in addresses:
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await worker_pb2_grpc.WorkerServiceStub(channel).GetModelInfo(common_pb2.GetModelInfoRequest(),
                                                                              timeout=2)
            assert gone.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _whole_run(model_path: Path) -> list[int]:
    """The same request start to finish on one engine: the tokens the handoff must reproduce."""
    engine = Engine(open_checkpoint(str(model_path)), ENGINE, progress=False)
    engine.add_request(Request("whole", list(PROMPT), SamplingParams(temperature=0, max_new_tokens=NUM_NEW_TOKENS,
                                                                     ignore_eos=True)))
    tokens = []
    while engine.has_work:
        tokens += [output.token_id for output in engine.step() if output.token_id is not None]
    return tokens


def _num_engine_threads() -> int:
    return sum(thread.name == "engine-loop" and thread.is_alive() for thread in threading.enumerate())
