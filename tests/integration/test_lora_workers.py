"""LoRA adapters on real prefill and decode workers (built in-process, tests/integration/inprocess_workers.py,
real gRPC on loopback, KV over a LocalTransport) on a tiny random Llama: adapters load at start
(`lora_paths`) and at run time (LoadLoraAdapter, only from inside `lora_dir`); a handoff under an adapter
(Prefill and Generate both naming it) gives PEFT's greedy tokens, and so does a prompt prefilled on the
decode worker (PrefillAndGenerate); GetModelInfo lists the adapters; an unknown adapter is NOT_FOUND,
a path outside the directory INVALID_ARGUMENT, a worker without slots FAILED_PRECONDITION; after
UnloadLoraAdapter the name is gone; every page is back after each request."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import grpc
import pytest
import torch

from engine.config import EngineConfig
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, worker_pb2_grpc
from tests.integration.inprocess_workers import ENGINE, running_workers
from tests.peft_adapters import peft_greedy, save_peft_adapter
from tests.tiny_models import save_tiny_llama

torch.set_flush_denormal(True)

PROMPT = [5, 17, 99, 42, 7, 7, 130, 64, 3, 250, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
NUM_NEW_TOKENS = 8
SAMPLING = common_pb2.SamplingParams(temperature=0, max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True)


def test_workers_serve_adapters_loaded_at_start_and_at_run_time(tmp_path: Path) -> None:
    base = save_tiny_llama(tmp_path / "base", seed=11)
    lora_dir = tmp_path / "adapters"
    start = save_peft_adapter(base, tmp_path / "start", 1, target_modules=["q_proj", "v_proj", "down_proj"])
    later = save_peft_adapter(base, lora_dir / "later", 2, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"])
    (tmp_path / "outside").mkdir()
    expected = {
        name: peft_greedy(base, path, PROMPT, NUM_NEW_TOKENS)
        for name, path in (("start", start), ("later", later), ("", None))
    }
    asyncio.run(_scenario(base, lora_dir, start, expected))


async def _scenario(base: Path, lora_dir: Path, start: Path, expected: dict[str, list[int]]) -> None:
    engine = dataclasses.replace(ENGINE, max_loras=2, max_lora_rank=8)
    async with running_workers(base, engine=engine, lora_paths=(("start", str(start)),), lora_dir=str(lora_dir)) as w:
        async with grpc.aio.insecure_channel(w.prefill.address) as p, grpc.aio.insecure_channel(w.decode.address) as d:
            admins = [worker_pb2_grpc.WorkerServiceStub(channel) for channel in (p, d)]
            for admin in admins:
                await admin.LoadLoraAdapter(common_pb2.LoadLoraAdapterRequest(name="later", path="later"))
                info = await admin.GetModelInfo(common_pb2.GetModelInfoRequest())
                assert info.max_loras == 2
                assert [(a.name, a.rank) for a in info.lora_adapters] == [("start", 8), ("later", 8)]
            for name in ("start", "later", ""):
                assert await _hand_off(p, d, f"h-{name}", name) == expected[name], name
                assert await _local(d, f"l-{name}", name) == expected[name], name
            await _check_errors(p, d, admins[0])
            await admins[1].UnloadLoraAdapter(common_pb2.UnloadLoraAdapterRequest(name="later"))
            info = await admins[1].GetModelInfo(common_pb2.GetModelInfoRequest())
            assert [a.name for a in info.lora_adapters] == ["start"]
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await _local(d, "gone", "later")
            assert gone.value.code() == grpc.StatusCode.NOT_FOUND
            for admin in admins:
                load = await admin.GetLoad(common_pb2.GetLoadRequest())
                assert load.num_running == load.num_waiting == 0
                assert load.num_free_pages + load.num_cached_pages == load.num_total_pages


async def _hand_off(p: grpc.aio.Channel, d: grpc.aio.Channel, request_id: str, lora_name: str) -> list[int]:
    prefill, decode = prefill_pb2_grpc.PrefillServiceStub(p), decode_pb2_grpc.DecodeServiceStub(d)
    reserved = await decode.Reserve(decode_pb2.ReserveRequest(request_id=request_id, prompt_len=len(PROMPT)))
    first = await prefill.Prefill(
        prefill_pb2.PrefillRequest(
            request_id=request_id,
            token_ids=PROMPT,
            sampling_params=SAMPLING,
            kv_target=reserved.kv_target,
            lora_name=lora_name,
        )
    )
    tokens = [first.first_token.token_id]
    async for reply in decode.Generate(
        decode_pb2.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=PROMPT,
            first_token=first.first_token,
            sampling_params=SAMPLING,
            weights_id=first.weights_id,
            kv_grant=reserved.kv_target.grant,
            lora_name=lora_name,
        )
    ):
        tokens += [token.token_id for token in reply.tokens]
    return tokens


async def _local(d: grpc.aio.Channel, request_id: str, lora_name: str) -> list[int]:
    decode = decode_pb2_grpc.DecodeServiceStub(d)
    tokens: list[int] = []
    async for reply in decode.PrefillAndGenerate(
        decode_pb2.PrefillAndGenerateRequest(
            request_id=request_id, prompt_token_ids=PROMPT, sampling_params=SAMPLING, lora_name=lora_name
        )
    ):
        tokens += [token.token_id for token in reply.tokens]
    return tokens


async def _check_errors(p: grpc.aio.Channel, d: grpc.aio.Channel, admin: worker_pb2_grpc.WorkerServiceStub) -> None:
    calls = [
        (
            admin.LoadLoraAdapter(common_pb2.LoadLoraAdapterRequest(name="x", path="../outside")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "lora",
        ),
        (
            admin.LoadLoraAdapter(common_pb2.LoadLoraAdapterRequest(name="start", path="later")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "already loaded",
        ),
        (
            admin.UnloadLoraAdapter(common_pb2.UnloadLoraAdapterRequest(name="nobody")),
            grpc.StatusCode.NOT_FOUND,
            "nobody",
        ),
        (_hand_off(p, d, "unknown", "nobody"), grpc.StatusCode.NOT_FOUND, "nobody"),
    ]
    for call, code, words in calls:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await call
        assert failed.value.code() == code and words in failed.value.details().lower(), failed.value.details()
    # the refused handoff's reservation is dropped as the gateway drops it
    decode_admin = worker_pb2_grpc.WorkerServiceStub(d)
    assert (await decode_admin.Abort(common_pb2.AbortRequest(request_id="unknown", kv_write_settled=True))).found


def test_a_worker_without_slots_refuses_adapters(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running_workers(save_tiny_llama(tmp_path / "base"), engine=EngineConfig(dtype="float32")) as w:
            async with grpc.aio.insecure_channel(w.decode.address) as d:
                admin = worker_pb2_grpc.WorkerServiceStub(d)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await admin.LoadLoraAdapter(common_pb2.LoadLoraAdapterRequest(name="a", path="a"))
                assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                with pytest.raises(grpc.aio.AioRpcError) as unknown:
                    await _local(d, "r", "a")
                assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
                assert (await admin.GetModelInfo(common_pb2.GetModelInfoRequest())).max_loras == 0

    asyncio.run(scenario())
