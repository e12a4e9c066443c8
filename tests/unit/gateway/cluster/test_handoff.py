"""`run_handoff` through a real `WorkerPool` and `WorkerClient` against a fake worker on loopback: a
whole trip, and each way a trip ends early (a prefill error, a prefill past its deadline, a frozen
decode worker, a reader that stops) tells the workers, with `kv_write_settled` only once no KV write
can be in flight; what a trip tells the pool (worker failures cleared, the prefix index, the admission
queue)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from gateway.cluster.handoff import run_handoff
from gateway.cluster.pool import WorkerPool
from gateway.cluster.worker_errors import stalled_error
from gateway.config import GatewayConfig, RouterPolicy, RoutingConfig
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.records import Finish, FinishReason, PrefillPath, Role, TokenChunk
from tandem.sampling import SamplingSpec
from tandem.v1 import decode_pb2
from tests.unit.gateway.cluster.fake_worker import KV_TARGET, FakeWorker, serve_fake_worker

PROMPT = [1, 2, 3]
SAMPLING = SamplingSpec(temperature=0.0, max_new_tokens=8)


def _run(tmp_path: Path, scenario: Callable[[WorkerPool, GatewayConfig, FakeWorker], Awaitable[None]],
         **config) -> None:
    """`scenario` with a ready pool whose prefill and decode worker are one fake worker."""
    async def main() -> None:
        async with serve_fake_worker() as worker:
            gateway_config = GatewayConfig(model_path="m", served_model_name="m", prefill_addrs=(worker.address,),
                                           decode_addrs=(worker.address,), data_dir=str(tmp_path), **config)
            pool = WorkerPool(gateway_config.prefill_addrs, gateway_config.decode_addrs)
            try:
                await pool.probe_all()
                assert pool.is_ready
                await scenario(pool, gateway_config, worker)
            finally:
                await pool.close()

    asyncio.run(main())


def _trip(pool: WorkerPool, config: GatewayConfig, request_id: str = "r1"):
    return run_handoff(pool, config, GatewayMetrics(), request_id, PROMPT, SAMPLING)


def test_a_whole_trip_yields_the_first_token_then_the_stream_and_aborts_nothing(tmp_path: Path) -> None:
    async def scenario(pool: WorkerPool, config: GatewayConfig, worker: FakeWorker) -> None:
        events: list[TokenChunk] = [event async for event in _trip(pool, config)]
        assert [e.token_ids for e in events] == [[7], [8], [2]]
        assert events[0].timings.kv_bytes == 4096 and events[0].timings.cached_tokens == 16
        assert events[1].timings.decode_queue_ms == 0.75 and events[2].timings is None
        assert events[-1].finish == Finish(FinishReason.STOP, 2)
        generate = worker.decode.received[-1]
        assert (generate.kv_grant, generate.weights_id, list(generate.prompt_token_ids)) == ("g-1", "w-1", PROMPT)
        assert generate.sampling_params.temperature == 0.0 and not generate.sampling_params.HasField("top_p")
        assert worker.aborts() == [] and worker.cancelled_prefills() == []

    _run(tmp_path, scenario)


def test_a_prefill_error_frees_the_reservation_at_once(tmp_path: Path) -> None:
    async def scenario(pool: WorkerPool, config: GatewayConfig, worker: FakeWorker) -> None:
        worker.prefill.failure = (grpc.StatusCode.INVALID_ARGUMENT, "invalid regex")
        with pytest.raises(APIError) as refused:
            [event async for event in _trip(pool, config)]
        assert (refused.value.status, refused.value.message) == (400, "invalid regex")
        assert worker.aborts() == [("r1", True)] and worker.cancelled_prefills() == []   # its write is over

    _run(tmp_path, scenario)


def test_a_prefill_past_its_deadline_is_cancelled_before_the_pages_are_freed(tmp_path: Path) -> None:
    async def scenario(pool: WorkerPool, config: GatewayConfig, worker: FakeWorker) -> None:
        worker.prefill.delay_s = 5.0
        with pytest.raises(APIError) as late:
            [event async for event in _trip(pool, config)]
        assert late.value.status == 504
        cancelled = worker.cancelled_prefills()
        assert [(c.request_id, c.kv_target) for c in cancelled] == [("r1", KV_TARGET)]
        assert worker.aborts() == [("r1", True)]   # the prefill worker confirmed its write is over

    _run(tmp_path, scenario, prefill_timeout_s=0.3)


def test_a_frozen_decode_worker_ends_the_stream_with_a_503_and_leaves_the_pool(tmp_path: Path) -> None:
    async def scenario(pool: WorkerPool, config: GatewayConfig, worker: FakeWorker) -> None:
        worker.decode.is_stuck = True
        events = []
        with pytest.raises(APIError) as stalled:
            async for event in _trip(pool, config):
                events.append(event)
                if len(events) == 2:
                    worker.health.is_frozen = True   # silent from now on, health checks included
        assert (stalled.value.status, stalled.value.code) == (503, "worker_stalled")
        assert "stopped responding" in stalled.value.message and stalled.value.retry_after_s == 1
        assert [e.token_ids for e in events] == [[7], [8]]
        assert not pool.workers["decode"][0].is_ready
        assert worker.aborts() == [("r1", True)]

    _run(tmp_path, scenario, stall_timeout_s=0.3)


def test_a_reader_that_stops_early_releases_the_pages(tmp_path: Path) -> None:
    async def scenario(pool: WorkerPool, config: GatewayConfig, worker: FakeWorker) -> None:
        worker.decode.is_stuck = True
        events = _trip(pool, config)
        async with contextlib.aclosing(events):
            assert (await anext(events)).token_ids == [7]
            assert (await anext(events)).token_ids == [8]
        assert worker.aborts() == [("r1", True)]

    _run(tmp_path, scenario)


def test_a_decode_worker_that_answers_has_its_failures_in_a_row_cleared(tmp_path: Path) -> None:
    async def scenario(pool: WorkerPool, config: GatewayConfig, worker: FakeWorker) -> None:
        decode = pool.workers["decode"][0]
        for _ in range(2):
            decode.record_failure(stalled_error(Role.DECODE, decode.address, 1.0))
            await pool.probe_all()   # serving again, with two failures in a row counted
        assert [e.token_ids async for e in _trip(pool, config)][-1] == [2]
        decode.record_failure(stalled_error(Role.DECODE, decode.address, 1.0))
        await pool.probe_all()
        assert decode.is_routable   # one failure since the trip's answers, not the third in a row: not skipped

    _run(tmp_path, scenario)


def _run_pair(tmp_path: Path, scenario, routing: RoutingConfig = RoutingConfig(policy=RouterPolicy.ROUND_ROBIN),
              **config) -> None:
    """`scenario(pool, config, a, b)` with prefill workers (a, b) and decode worker b, round-robin."""
    async def main() -> None:
        async with serve_fake_worker() as a, serve_fake_worker() as b:
            gateway_config = GatewayConfig(model_path="m", served_model_name="m", prefill_addrs=(a.address, b.address),
                                           decode_addrs=(b.address,), data_dir=str(tmp_path), routing=routing,
                                           **config)
            pool = WorkerPool(gateway_config.prefill_addrs, gateway_config.decode_addrs, routing=routing)
            try:
                await pool.probe_all()
                await scenario(pool, gateway_config, a, b)
            finally:
                await pool.close()

    asyncio.run(main())


def test_a_prefill_worker_that_fails_before_the_first_token_is_replaced_once(tmp_path: Path) -> None:
    async def scenario(pool: WorkerPool, config: GatewayConfig, a: FakeWorker, b: FakeWorker) -> None:
        a.prefill.failure = (grpc.StatusCode.UNAVAILABLE, "the prefill worker is shutting down")
        metrics = GatewayMetrics()
        events = [e async for e in run_handoff(pool, config, metrics, "r1", PROMPT, SAMPLING)]
        assert [e.token_ids for e in events] == [[7], [8], [2]]
        assert [len(w.prefill.received) for w in (a, b)] == [1, 1]   # a, just failed, is not asked to cancel
        assert b.aborts() == [("r1", False)]   # the first reservation: its pages rest for the write grace
        assert not pool.workers["prefill"][0].is_ready and pool.workers["prefill"][1].is_ready
        assert metrics.failovers._value.get() == 1
        a.prefill.failure = (grpc.StatusCode.UNAVAILABLE, "still down")   # the next request avoids a at once
        assert [e.token_ids async for e in run_handoff(pool, config, metrics, "r2", PROMPT, SAMPLING)][0] == [7]
        assert len(a.prefill.received) == 1

    _run_pair(tmp_path, scenario)


def test_a_failure_after_the_first_token_is_not_retried(tmp_path: Path) -> None:
    async def scenario(pool: WorkerPool, config: GatewayConfig, a: FakeWorker, b: FakeWorker) -> None:
        b.decode.failure, b.decode.fails_reserve = (grpc.StatusCode.UNAVAILABLE, "connection reset"), False
        events = []
        with pytest.raises(APIError) as failed:
            async for event in run_handoff(pool, config, GatewayMetrics(), "r1", PROMPT, SAMPLING):
                events.append(event)
        assert failed.value.status == 503 and [e.token_ids for e in events] == [[7], [8]]
        generates = [r for r in b.decode.received if isinstance(r, decode_pb2.GenerateRequest)]
        assert len(generates) == 1

    _run_pair(tmp_path, scenario)


def test_a_request_error_is_not_retried(tmp_path: Path) -> None:
    async def scenario(pool: WorkerPool, config: GatewayConfig, a: FakeWorker, b: FakeWorker) -> None:
        a.prefill.failure = (grpc.StatusCode.INVALID_ARGUMENT, "invalid regex")
        with pytest.raises(APIError) as refused:
            [e async for e in run_handoff(pool, config, GatewayMetrics(), "r1", PROMPT, SAMPLING)]
        assert refused.value.status == 400 and len(b.prefill.received) == 0
        assert pool.workers["prefill"][0].is_ready   # the request's fault, not the worker's

    _run_pair(tmp_path, scenario)


def test_a_short_prompt_is_prefilled_by_its_decode_worker(tmp_path: Path) -> None:
    async def scenario(pool: WorkerPool, config: GatewayConfig, a: FakeWorker, b: FakeWorker) -> None:
        events = [e async for e in run_handoff(pool, config, GatewayMetrics(), "r1", PROMPT, SAMPLING)]
        assert [e.token_ids for e in events] == [[7], [8], [2]]
        timings = events[0].timings
        assert timings.prefill_path is PrefillPath.LOCAL and (timings.kv_bytes, timings.reserve_ms) == (0, 0.0)
        assert (timings.prefill_queue_ms, timings.prefill_compute_ms) == (0.25, 1.75)
        assert all(e.timings is None for e in events[1:]) and events[-1].finish.reason == FinishReason.STOP
        assert a.prefill.received == [] and b.prefill.received == []   # no prefill worker was asked
        assert [type(r).__name__ for r in b.decode.received] == ["PrefillAndGenerateRequest"]
        assert b.aborts() == []
        with_logprobs = run_handoff(pool, config, GatewayMetrics(), "r2", PROMPT, SAMPLING, prompt_logprob_start=1)
        assert (await anext(with_logprobs)).timings.prefill_path is PrefillPath.DISAGGREGATED   # scored by prefill
        await with_logprobs.aclose()

    _run_pair(tmp_path, scenario, RoutingConfig(policy=RouterPolicy.ROUND_ROBIN, local_prefill_threshold=8))


def test_the_adapter_name_reaches_every_worker_call_of_the_trip(tmp_path: Path) -> None:
    async def scenario(pool: WorkerPool, config: GatewayConfig, a: FakeWorker, b: FakeWorker) -> None:
        for worker in (a, b):
            worker.control.adapters.append("sql")
        await pool.probe_all()
        [e async for e in run_handoff(pool, config, GatewayMetrics(), "r1", list(range(20)), SAMPLING, lora_name="sql")]
        [e async for e in run_handoff(pool, config, GatewayMetrics(), "r2", PROMPT, SAMPLING, lora_name="sql")]
        calls = [r for w in (a, b) for r in w.prefill.received + w.decode.received if hasattr(r, "lora_name")]
        names = sorted(type(r).__name__ for r in calls)
        assert names == ["GenerateRequest", "PrefillAndGenerateRequest", "PrefillRequest", "ReserveRequest"]
        assert {r.lora_name for r in calls} == {"sql"}

    _run_pair(tmp_path, scenario, RoutingConfig(policy=RouterPolicy.ROUND_ROBIN, local_prefill_threshold=8))


def test_the_prefix_index_learns_a_prompt_only_from_the_route_its_prefill_went_on(tmp_path: Path) -> None:
    async def scenario(pool: WorkerPool, config: GatewayConfig, a: FakeWorker, b: FakeWorker) -> None:
        b.decode.num_full_reserves = 2   # two routes chosen and dropped before a third holds a reservation
        metrics = GatewayMetrics()
        prompt = list(range(40))   # two full pages of 16

        def estimated() -> float:
            return sum(metrics.route_cached_tokens.labels(w.address, "estimated")._value.get() for w in (a, b))

        events = [e async for e in run_handoff(pool, config, metrics, "r1", prompt, SAMPLING)]
        assert events[-1].finish.reason == FinishReason.STOP
        assert sum(isinstance(r, decode_pb2.ReserveRequest) for r in b.decode.received) == 3
        assert estimated() == 0   # the dropped routes taught no index
        [e async for e in run_handoff(pool, config, metrics, "r2", prompt, SAMPLING)]
        assert estimated() == 32   # the prefill sent did

    _run_pair(tmp_path, scenario, RoutingConfig(policy=RouterPolicy.PREFIX_AWARE))


def test_every_trip_wakes_the_admission_queue_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(pool: WorkerPool, config: GatewayConfig, a: FakeWorker, b: FakeWorker) -> None:
        wakes: list[str] = []
        monkeypatch.setattr(pool.admission, "released", lambda: wakes.append("woken"))
        [e async for e in run_handoff(pool, config, GatewayMetrics(), "r1", PROMPT, SAMPLING)]   # local
        assert len(wakes) == 1
        [e async for e in run_handoff(pool, config, GatewayMetrics(), "r2", PROMPT, SAMPLING, prompt_logprob_start=1)]
        assert len(wakes) == 2   # disaggregated: once too

    _run_pair(tmp_path, scenario, RoutingConfig(policy=RouterPolicy.ROUND_ROBIN, local_prefill_threshold=8))


def test_the_decode_workers_cache_is_reported_learnt_and_decides_a_local_prefill(tmp_path: Path) -> None:
    """Reserve names the prompt; what the decode worker held comes back in the timings and the metric,
    its KV target (skip_tokens) reaches the prefill worker as sent; the finished sequence teaches the
    router, so a next turn that lacks little of it is prefilled by that decode worker."""
    async def scenario(pool: WorkerPool, config: GatewayConfig, a: FakeWorker, b: FakeWorker) -> None:
        target = decode_pb2.ReserveResponse(kv_target=KV_TARGET).kv_target
        target.skip_tokens = 16
        b.decode.kv_target, b.decode.cached_tokens = target, 16
        metrics = GatewayMetrics()
        prompt = list(range(100, 147))   # 47 tokens: over the threshold, and nothing held yet
        events = [e async for e in run_handoff(pool, config, metrics, "r1", prompt, SAMPLING, lora_name="")]
        assert events[0].timings.prefill_path is PrefillPath.DISAGGREGATED
        assert events[0].timings.decode_cached_tokens == 16
        assert metrics.decode_cached_prompt_tokens._value.get() == 16
        reserve = next(r for r in b.decode.received if isinstance(r, decode_pb2.ReserveRequest))
        assert (reserve.prompt_len, list(reserve.prompt_token_ids)) == (47, prompt)
        prefill = next(r for w in (a, b) for r in w.prefill.received)
        assert prefill.kv_target.SerializeToString() == target.SerializeToString()
        assert prefill.kv_target.skip_tokens == 16

        b.decode.cached_tokens = 48   # prompt + [7, 8] (the last output, 2, never computed): 3 pages
        turn = prompt + [7, 8, 2] + [9] * 10   # 60 tokens, 12 of them past what decode holds
        events = [e async for e in run_handoff(pool, config, metrics, "r2", turn, SAMPLING)]
        assert events[0].timings.prefill_path is PrefillPath.LOCAL and events[0].timings.decode_cached_tokens == 48
        assert metrics.prefill_path.labels("local", "decode_cached")._value.get() == 1
        assert metrics.decode_cached_prompt_tokens._value.get() == 64

    _run_pair(tmp_path, scenario, RoutingConfig(policy=RouterPolicy.PREFIX_AWARE, local_prefill_threshold=20))
