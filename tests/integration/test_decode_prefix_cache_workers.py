"""A chat's second turn through real worker servicers (tests/integration/inprocess_workers.py, a tiny
random Qwen2 in fp32, KV over a LocalTransport): Reserve with the prompt's tokens answers the tokens the
decode worker kept from the first turn (its prompt and answer), the prefill worker writes only the pages
after them, and the tokens decoded equal one engine's run of the whole second prompt. A target whose
skip_tokens was changed on the way is refused by the grant. A worker publishes the pages its prefix cache
stores and removes (SubscribeKvEvents) under the router's page keys."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from engine.weights import open_checkpoint
from tandem.page_keys import page_keys
from tandem.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.integration.inprocess_workers import ENGINE, running_workers
from tests.real_models import engine_greedy
from tests.tiny_models import save_tiny_qwen2

PAGE = 16
PROMPT = list(range(10, 47))   # 37 tokens
NUM_NEW = 20                   # 37 + 20 - 1 tokens with KV after the first turn: three full pages


def test_the_second_turn_sends_only_what_decode_lacks(tmp_path: Path) -> None:
    model_path = save_tiny_qwen2(tmp_path / "qwen2")
    first_turn, second_turn, second, kv_bytes = asyncio.run(_scenario(model_path))
    assert first_turn == _whole_run(model_path, PROMPT)
    assert second_turn == _whole_run(model_path, second)
    page_bytes = kv_bytes["page"]
    assert kv_bytes["first"] == 3 * page_bytes                # 37 tokens: every page
    assert kv_bytes["second"] == 2 * page_bytes               # 75 tokens, 48 held: pages 4 and 5 only


async def _scenario(model_path: Path) -> tuple[list[int], list[int], list[int], dict[str, int]]:
    async with running_workers(model_path) as workers:
        async with grpc.aio.insecure_channel(workers.prefill.address) as prefill_channel, \
                grpc.aio.insecure_channel(workers.decode.address) as decode_channel:
            prefill = prefill_pb2_grpc.PrefillServiceStub(prefill_channel)
            decode = decode_pb2_grpc.DecodeServiceStub(decode_channel)
            first_turn, first_bytes, page_bytes = await _turn(prefill, decode, "t1", PROMPT, expect_cached=0)
            second = PROMPT + first_turn + list(range(100, 118))
            await _forged_skip_is_refused(prefill, decode, second)
            second_turn, second_bytes, _ = await _turn(prefill, decode, "t2", second, expect_cached=48)
            load = await worker_pb2_grpc.WorkerServiceStub(decode_channel).GetLoad(common_pb2.GetLoadRequest())
            assert load.num_running == 0 and load.num_free_pages + load.num_cached_pages == load.num_total_pages
    return first_turn, second_turn, second, {"first": first_bytes, "second": second_bytes, "page": page_bytes}


async def _turn(prefill, decode, rid: str, prompt: list[int], expect_cached: int) -> tuple[list[int], int, int]:
    sampling = common_pb2.SamplingParams(temperature=0, max_new_tokens=NUM_NEW, ignore_eos=True)
    reserved = await decode.Reserve(
        decode_pb2.ReserveRequest(request_id=rid, prompt_len=len(prompt), prompt_token_ids=prompt))
    assert reserved.cached_tokens == reserved.kv_target.skip_tokens == expect_cached
    assert len(reserved.kv_target.page_ids) == -(-len(prompt) // PAGE) - expect_cached // PAGE
    first = await prefill.Prefill(prefill_pb2.PrefillRequest(
        request_id=rid, token_ids=prompt, sampling_params=sampling, kv_target=reserved.kv_target))
    tokens = [first.first_token.token_id]
    async for reply in decode.Generate(decode_pb2.GenerateRequest(
            request_id=rid, prompt_token_ids=prompt, first_token=first.first_token, sampling_params=sampling,
            weights_id=first.weights_id, kv_grant=reserved.kv_target.grant)):
        tokens += [token.token_id for token in reply.tokens]
    return tokens, first.kv_bytes, reserved.kv_target.layout.page_bytes


async def _forged_skip_is_refused(prefill, decode, prompt: list[int]) -> None:
    """A target whose skip_tokens was changed after the decode worker signed it is refused before any
    compute; the reservation is then dropped by the caller, as the gateway does."""
    reserved = await decode.Reserve(
        decode_pb2.ReserveRequest(request_id="forged", prompt_len=len(prompt), prompt_token_ids=prompt))
    target = common_pb2.KvTarget()
    target.CopyFrom(reserved.kv_target)
    target.skip_tokens = 0
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id="forged", token_ids=prompt, sampling_params=common_pb2.SamplingParams(max_new_tokens=1),
            kv_target=target))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.aio.AioRpcError):   # Generate with a grant for no reservation: the reservation stays
        async for _ in decode.Generate(decode_pb2.GenerateRequest(request_id="forged", kv_grant="x")):
            pass
    with pytest.raises(grpc.aio.AioRpcError) as dropped:   # the real grant, refused for its weights: dropped
        async for _ in decode.Generate(decode_pb2.GenerateRequest(
                request_id="forged", prompt_token_ids=prompt, first_token=common_pb2.TokenOutput(token_id=1),
                sampling_params=common_pb2.SamplingParams(max_new_tokens=1), kv_grant=reserved.kv_target.grant,
                weights_id="other weights")):
            pass
    assert dropped.value.code() == grpc.StatusCode.ABORTED


def _whole_run(model_path: Path, prompt: list[int]) -> list[int]:
    """The prompt start to finish on one engine: the tokens a handoff must reproduce."""
    return engine_greedy(open_checkpoint(str(model_path)), ENGINE, [prompt], NUM_NEW)[0]


def test_a_worker_publishes_what_its_prefix_cache_stores_and_removes(tmp_path: Path) -> None:
    model_path = save_tiny_qwen2(tmp_path / "qwen2")

    async def scenario() -> None:
        async with running_workers(model_path) as workers, \
                grpc.aio.insecure_channel(workers.decode.address) as channel:
            worker = worker_pb2_grpc.WorkerServiceStub(channel)
            stream = worker.SubscribeKvEvents(worker_pb2.SubscribeKvEventsRequest())
            snapshot = await stream.read()
            assert snapshot.is_snapshot and not snapshot.stored
            sampling = common_pb2.SamplingParams(temperature=0, max_new_tokens=NUM_NEW, ignore_eos=True)
            tokens = []
            async for reply in decode_pb2_grpc.DecodeServiceStub(channel).PrefillAndGenerate(
                    decode_pb2.PrefillAndGenerateRequest(request_id="local", prompt_token_ids=PROMPT,
                                                         sampling_params=sampling)):
                tokens += [t.token_id for t in reply.tokens]
            expected = page_keys(PROMPT + tokens[:-1], PAGE)   # every token with KV: three full pages
            stored: list[int] = []
            while len(stored) < len(expected):
                change = await asyncio.wait_for(stream.read(), 5)
                assert not change.is_snapshot and not change.removed
                stored += change.stored
            assert stored == list(expected)
            late = worker.SubscribeKvEvents(worker_pb2.SubscribeKvEventsRequest())   # a second subscriber
            assert sorted((await late.read()).stored) == sorted(expected)
            await worker.FlushCache(common_pb2.FlushCacheRequest())
            for subscriber in (stream, late):
                change = await asyncio.wait_for(subscriber.read(), 5)
                assert sorted(change.removed) == sorted(expected) and not change.stored
            stream.cancel()
            await workers.decode.drain(asyncio.Event())   # shutting down ends the streams at once
            assert await asyncio.wait_for(late.read(), 5) == grpc.aio.EOF

    asyncio.run(scenario())
