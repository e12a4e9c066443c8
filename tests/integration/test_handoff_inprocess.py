"""The gateway's handoff over real workers, all in this process: `WorkerPool` + `run_handoff` in front
of a prefill and a decode worker built with `build_worker` (tests/integration/inprocess_workers.py) on
a tiny random Qwen2, KV over a LocalTransport. A normal finish, an abort mid-stream, a prefill error
and an expired reservation; after each, every page is back (decode: all free; prefill: free or held
by its prefix cache) and nothing runs."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.engine import Engine
from engine.request import Request, SamplingParams
from engine.weights import open_checkpoint
from gateway.cluster.convert import kv_target_to_proto
from gateway.cluster.handoff import run_handoff
from gateway.cluster.pool import WorkerPool
from gateway.cluster.prefix_index import PromptPages
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.records import FinishReason, TokenChunk
from tandem.sampling import SamplingSpec
from tests.integration.inprocess_workers import ENGINE, Workers, running_workers
from tests.tiny_models import save_tiny_qwen2

PROMPT = list(range(10, 47))   # 37 tokens: three pages of 16
GREEDY = SamplingSpec(temperature=0.0, max_new_tokens=8, ignore_eos=True)
_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen2(tmp_path_factory.mktemp("handoff") / "qwen2")


@contextlib.asynccontextmanager
async def _gateway(model_path: Path, **worker_overrides) -> AsyncIterator[tuple[WorkerPool, GatewayConfig, Workers]]:
    async with running_workers(model_path, **worker_overrides) as workers:
        pool = WorkerPool((workers.prefill.address,), (workers.decode.address,))
        config = GatewayConfig(str(model_path), "tiny", (workers.prefill.address,), (workers.decode.address,),
                               data_dir="unused", stall_timeout_s=10.0)
        try:
            await pool.probe_all()
            assert pool.is_ready
            yield pool, config, workers
        finally:
            await pool.close()


def _events(pool: WorkerPool, config: GatewayConfig, request_id: str, prompt: list[int],
            sampling: SamplingSpec, metrics: GatewayMetrics) -> AsyncIterator[TokenChunk]:
    return run_handoff(pool, config, metrics, request_id, prompt, sampling)


async def _all_pages_back(pool: WorkerPool, within_s: float = _TIMEOUT_S) -> None:
    """Wait until nothing runs or waits on either worker and every page is free or held by the
    worker's prefix cache; fail with the last loads seen otherwise."""
    deadline = time.monotonic() + within_s
    while True:
        loads = {w.role: await w.client.load(_TIMEOUT_S) for w in pool.all_workers()}
        prefill, decode = loads["prefill"], loads["decode"]
        settled = (prefill.num_running == prefill.num_waiting == decode.num_running == decode.num_waiting == 0
                   and decode.num_free_pages + decode.num_cached_pages == decode.num_total_pages
                   and prefill.num_free_pages + prefill.num_cached_pages == prefill.num_total_pages)
        if settled:
            return
        assert time.monotonic() < deadline, f"pages still held: {loads}"
        await asyncio.sleep(0.05)


def _whole_run(model_path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    engine = Engine(open_checkpoint(str(model_path)), ENGINE, progress=False)
    engine.add_request(Request("whole", list(prompt), SamplingParams(temperature=0, max_new_tokens=max_new_tokens,
                                                                     ignore_eos=True)))
    tokens = []
    while engine.has_work:
        tokens += [output.token_id for output in engine.step() if output.token_id is not None]
    return tokens


def test_a_normal_finish_gives_the_single_engine_tokens_and_frees_every_page(model_path: Path) -> None:
    async def scenario() -> tuple[list[TokenChunk], GatewayMetrics]:
        metrics = GatewayMetrics()
        async with _gateway(model_path) as (pool, config, _):
            events = [event async for event in _events(pool, config, "normal", PROMPT, GREEDY, metrics)]
            await _all_pages_back(pool)
        return events, metrics

    events, metrics = asyncio.run(scenario())
    assert [t for event in events for t in event.token_ids] == _whole_run(model_path, PROMPT, 8)
    assert events[0].timings is not None and events[0].timings.kv_bytes > 0
    assert [event.finish for event in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1].finish.reason == FinishReason.LENGTH
    assert metrics.registry.get_sample_value("tandem_gateway_generations_total", {"outcome": "length"}) == 1


def test_closing_the_stream_mid_way_aborts_it_and_frees_every_page(model_path: Path) -> None:
    long = SamplingSpec(temperature=0.0, max_new_tokens=80, ignore_eos=True)

    async def scenario() -> tuple[int, GatewayMetrics]:
        metrics = GatewayMetrics()
        async with _gateway(model_path) as (pool, config, workers):
            events = _events(pool, config, "closed", PROMPT, long, metrics)
            seen = 0
            async with contextlib.aclosing(events):
                async for event in events:
                    seen += len(event.tokens)
                    if seen >= 3:
                        break
            await _all_pages_back(pool)
            decode_rpcs = workers.decode.context.loop.metrics.registry
            aborts = decode_rpcs.get_sample_value("tandem_worker_requests_total", {"method": "Abort", "code": "OK"})
            cancelled = decode_rpcs.get_sample_value("tandem_worker_requests_total",
                                                     {"method": "Generate", "code": "CANCELLED"})
            assert (aborts, cancelled) == (1, 1)   # the stream was cut and the decode worker told, not left to run
        return seen, metrics

    seen, metrics = asyncio.run(scenario())
    assert 3 <= seen < 80
    assert metrics.registry.get_sample_value("tandem_gateway_generations_total", {"outcome": "closed"}) == 1


def test_a_prefill_error_is_an_api_error_and_releases_the_reservation(model_path: Path) -> None:
    """Token 999 is outside the tiny model's 256-token vocabulary: Reserve succeeds (it sees only the
    length), the prefill worker refuses the prompt, and the decode worker's pages come back."""
    async def scenario() -> APIError:
        async with _gateway(model_path) as (pool, config, _):
            with pytest.raises(APIError) as refused:
                async for _ in _events(pool, config, "bad", [*PROMPT[:-1], 999], GREEDY, GatewayMetrics()):
                    pass
            await _all_pages_back(pool)
            # the workers still serve the next request
            events = [e async for e in _events(pool, config, "after", PROMPT, GREEDY, GatewayMetrics())]
            assert events[-1].finish.reason == FinishReason.LENGTH
            await _all_pages_back(pool)
        return refused.value

    error = asyncio.run(scenario())
    assert error.status == 400
    assert "127.0.0.1" not in error.message


def test_an_expired_reservation_frees_its_pages_and_its_grant_is_refused(model_path: Path) -> None:
    """A reservation whose prefill never comes: the decode worker takes its pages back after the
    TTL and the write grace, and a prefill that arrives later with its grant is refused."""
    async def scenario() -> APIError:
        async with _gateway(model_path, reservation_ttl_s=0.5, write_grace_s=0.3) as (pool, config, _):
            route = pool.route(PromptPages(PROMPT))
            prefill, decode = route.prefill, route.decode
            assert prefill is not None
            reservation = await decode.client.reserve("late", PROMPT, _TIMEOUT_S)
            held = await decode.client.load(_TIMEOUT_S)
            page_ids = kv_target_to_proto(reservation.kv_target).page_ids
            assert held.num_total_pages - held.num_free_pages == len(page_ids) == 3
            await _all_pages_back(pool, within_s=5.0)
            with pytest.raises(APIError) as refused:
                await prefill.client.prefill("late", PROMPT, GREEDY, reservation.kv_target, None, _TIMEOUT_S)
            await _all_pages_back(pool)
        return refused.value

    error = asyncio.run(scenario())
    assert error.message == "the prefill worker failed"   # the worker's words (an expired grant) stay in the log
