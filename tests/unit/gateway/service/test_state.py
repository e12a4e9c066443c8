"""What a request's `model` (or `lora_path`) names: the served model, a LoRA adapter the workers hold,
or nothing (404 model_not_found), over a pool whose workers' model infos are set by hand."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from gateway.cluster.pool import WorkerPool
from gateway.cluster.worker_records import LoraAdapterInfo
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.records import Role
from gateway.service.generation import GenerationService
from gateway.service.native_generate import _lora_names
from gateway.service.request_schemas import GenerateRequest
from gateway.service.state import GatewayState
from tests.unit.gateway.cluster.test_routing import _info


def _state(tmp_path: Path, adapters: dict[str, tuple[str, ...]]) -> GatewayState:
    """A state whose workers (address -> its adapters) are ready with those adapters loaded."""
    config = GatewayConfig(
        model_path="/models/base",
        served_model_name="base",
        prefill_addrs=("p:1",),
        decode_addrs=("d:1",),
        data_dir=str(tmp_path),
    )
    pool = WorkerPool(config.prefill_addrs, config.decode_addrs)
    for worker in pool.all_workers():
        names = adapters.get(worker.address, ())
        worker.info = replace(_info(worker.role), lora_adapters=tuple(LoraAdapterInfo(n, 8) for n in names))
        worker.is_ready = True
    metrics = GatewayMetrics()
    return GatewayState(config, None, pool, metrics, GenerationService(pool, config, None, metrics))


def _in_loop(test) -> None:
    async def main() -> None:
        test()

    asyncio.run(main())


def test_the_base_model_resolves_to_no_adapter_and_a_loaded_adapter_to_itself(tmp_path: Path) -> None:
    def test() -> None:
        state = _state(tmp_path, {"p:1": ("sql",), "d:1": ("sql", "chat")})
        assert state.resolve_model("base") == "" and state.resolve_model("/models/base") == ""
        assert state.resolve_model("sql") == "sql" and state.resolve_model("chat") == "chat"
        assert state.pool.lora_adapters() == {"chat": 8, "sql": 8}
        with pytest.raises(APIError) as missing:
            state.resolve_model("other")
        assert (missing.value.status, missing.value.code, missing.value.param) == (404, "model_not_found", "model")
        assert "`sql`" in missing.value.message
        with pytest.raises(APIError) as adapter:
            state.check_model("sql")  # a base-only route (embeddings, scoring)
        assert adapter.value.status == 400

    _in_loop(test)


def test_an_adapter_on_an_unready_worker_names_nothing(tmp_path: Path) -> None:
    def test() -> None:
        state = _state(tmp_path, {"d:1": ("sql",)})
        state.pool.workers[Role.DECODE][0].is_ready = False
        with pytest.raises(APIError):
            state.resolve_model("sql")

    _in_loop(test)


def test_lora_path_names_one_adapter_for_every_prompt_or_one_per_prompt(tmp_path: Path) -> None:
    def test() -> None:
        state = _state(tmp_path, {"p:1": ("sql",), "d:1": ("sql",)})
        assert _lora_names(state, GenerateRequest(text=["a", "b"]), 2) == ["", ""]
        assert _lora_names(state, GenerateRequest(text=["a", "b"], lora_path="sql"), 2) == ["sql", "sql"]
        assert _lora_names(state, GenerateRequest(text=["a", "b"], lora_path=[None, "sql"]), 2) == ["", "sql"]
        with pytest.raises(APIError) as count:
            _lora_names(state, GenerateRequest(text=["a", "b"], lora_path=["sql"]), 2)
        assert (count.value.status, count.value.param) == (400, "lora_path")
        with pytest.raises(APIError) as unknown:
            _lora_names(state, GenerateRequest(text="a", lora_path="nope"), 1)
        assert (unknown.value.status, unknown.value.code, unknown.value.param) == (404, "model_not_found", "lora_path")

    _in_loop(test)
