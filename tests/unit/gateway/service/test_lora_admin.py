"""Loading and unloading adapters through the gateway over two fake workers (real gRPC): every
worker or none, the pool's view updated at once, and each refusal with its status and no address."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from gateway.cluster.pool import WorkerPool
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.service.generation import GenerationService
from gateway.service.lora_admin import adapter_cards, load_adapter, unload_adapter
from gateway.service.model_info import model_card, model_list
from gateway.service.state import GatewayState
from tests.unit.gateway.cluster.fake_worker import FakeWorker, serve_fake_worker


def _run(tmp_path: Path, scenario) -> None:
    async def main() -> None:
        async with serve_fake_worker() as a, serve_fake_worker() as b:
            config = GatewayConfig(model_path="/models/base", served_model_name="base", prefill_addrs=(a.address,),
                                   decode_addrs=(b.address,), data_dir=str(tmp_path))
            pool = WorkerPool(config.prefill_addrs, config.decode_addrs)
            metrics = GatewayMetrics()
            state = GatewayState(config, None, pool, metrics, GenerationService(pool, config, None, metrics))
            try:
                await pool.probe_all()
                await scenario(state, a, b)
            finally:
                await pool.close()

    asyncio.run(main())


def test_a_load_reaches_every_worker_and_names_the_adapter_at_once(tmp_path: Path) -> None:
    async def scenario(state: GatewayState, a: FakeWorker, b: FakeWorker) -> None:
        await load_adapter(state, "sql", "adapters/sql")
        assert a.control.adapters == b.control.adapters == ["sql"]
        assert state.resolve_model("sql") == "sql"   # no poll round needed
        cards = {c.id: c for c in model_list(state).data}
        assert (cards["sql"].parent, cards["sql"].root) == ("base", "adapters/sql")
        assert model_card(state, "sql") == cards["sql"] and cards["base"].parent is None
        with pytest.raises(APIError) as again:
            await load_adapter(state, "sql", "adapters/sql")
        assert again.value.status == 400
        await unload_adapter(state, "sql")
        assert a.control.adapters == b.control.adapters == [] and adapter_cards(state) == []
        with pytest.raises(APIError) as gone:
            await unload_adapter(state, "sql")
        assert (gone.value.status, gone.value.code) == (404, "model_not_found")
        with pytest.raises(APIError) as missing:
            state.resolve_model("sql")
        assert missing.value.status == 404

    _run(tmp_path, scenario)


@pytest.mark.parametrize(
    ("failure", "status"),
    [
        ((grpc.StatusCode.INVALID_ARGUMENT, "bad adapter at /srv/secret/x from 10.1.2.3:5000: wrong shapes"), 400),
        ((grpc.StatusCode.FAILED_PRECONDITION, "this worker serves no LoRA adapters"), 400),
        ((grpc.StatusCode.INTERNAL, "Unexpected <class 'OSError'>: /srv/secret"), 500),
    ],
)
def test_a_load_one_worker_refuses_is_undone_on_the_others(tmp_path: Path, failure, status: int) -> None:
    async def scenario(state: GatewayState, a: FakeWorker, b: FakeWorker) -> None:
        b.control.lora_failure = failure
        with pytest.raises(APIError) as refused:
            await load_adapter(state, "sql", "adapters/sql")
        assert refused.value.status == status
        assert "10.1.2.3" not in refused.value.message and "/srv/secret" not in refused.value.message
        assert a.control.adapters == [] and b.control.adapters == []   # loaded on a, unloaded again
        assert state.pool.lora_adapters() == {}

    _run(tmp_path, scenario)


def test_bad_bodies_are_refused_before_any_worker_is_asked(tmp_path: Path) -> None:
    async def scenario(state: GatewayState, a: FakeWorker, b: FakeWorker) -> None:
        for name, path in (("", "p"), ("x", ""), ("base", "p"), ("/models/base", "p")):
            with pytest.raises(APIError) as refused:
                await load_adapter(state, name, path)
            assert refused.value.status == 400
        assert a.control.received == [] and b.control.received == []

    _run(tmp_path, scenario)


def test_a_worker_that_comes_back_without_a_run_time_adapter_gets_it_again(tmp_path: Path) -> None:
    async def scenario(state: GatewayState, a: FakeWorker, b: FakeWorker) -> None:
        await load_adapter(state, "sql", "adapters/sql")
        a.control.adapters.clear()   # a restart: the worker comes back with its --lora-paths only
        prefill = state.pool.workers["prefill"][0]
        prefill.is_ready = False
        await state.pool.probe_all()
        await state.pool.wait_restores()
        assert a.control.adapters == ["sql"] and "sql" in prefill.info.lora_names
        loads = [r for r in a.control.received if type(r).__name__ == "LoadLoraAdapterRequest"]
        assert [(r.name, r.path) for r in loads] == [("sql", "adapters/sql")] * 2
        await state.pool.probe_all()   # the same ready turn: no load again
        await state.pool.wait_restores()
        assert len([r for r in a.control.received if type(r).__name__ == "LoadLoraAdapterRequest"]) == 2
        await unload_adapter(state, "sql")
        assert state.pool.lora_paths == {}

    _run(tmp_path, scenario)
