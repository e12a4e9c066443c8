"""`WorkerClient` against a real gRPC server on loopback whose servicers stand in for a worker: records
cross the wire with the proto's presence rules, the proto's enums come back as `FinishReason`/`Role`,
and every failure (an error the worker answers, a deadline, a worker that is not there) is the one
table's `WorkerError`: an `APIError` naming the role only."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import Awaitable, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2

from gateway.cluster.client import WorkerClient
from gateway.cluster.convert import kv_target_to_proto, sampling_to_proto
from gateway.cluster.worker_errors import WorkerError
from gateway.cluster.worker_records import ExpertCounts, ExpertRecordOp, FlushResult, Health, KvTarget
from gateway.records import Finish, FinishReason, GeneratedToken, Role
from tandem.sampling import GrammarKind, GrammarSpec, SamplingSpec
from tandem.v1 import common_pb2, decode_pb2
from tests.unit.gateway.cluster.fake_worker import KV_TARGET, FakeWorker, serve_fake_worker, token


def _run(scenario: Callable[[WorkerClient, FakeWorker], Awaitable[None]], role: Role = Role.DECODE) -> None:
    """`scenario` with a client of a fake worker served on a loopback port."""
    async def main() -> None:
        async with serve_fake_worker() as worker:
            client = WorkerClient(role, worker.address)
            try:
                await scenario(client, worker)
            finally:
                await client.close()

    asyncio.run(main())


def test_the_sampling_spec_has_exactly_the_protos_fields_and_presence() -> None:
    proto = common_pb2.SamplingParams.DESCRIPTOR
    constraint = [f.name for f in proto.oneofs_by_name["constraint"].fields]
    spec_fields = [f.name for f in dataclasses.fields(SamplingSpec)]
    assert spec_fields[:-1] + constraint == list(proto.fields_by_name) and spec_fields[-1] == "grammar"
    assert constraint == [kind.value for kind in GrammarKind]
    for name in spec_fields[:-1]:
        field = proto.fields_by_name[name]
        assert field.is_repeated or field.has_presence, name   # None <-> unset
    assert sampling_to_proto(SamplingSpec()).ListFields() == []


@pytest.mark.parametrize("grammar", [GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "object"}'),
                                     GrammarSpec(GrammarKind.JSON_OBJECT), GrammarSpec(GrammarKind.REGEX, "a+"),
                                     GrammarSpec(GrammarKind.EBNF, 'root ::= "a"')])
def test_the_grammar_is_the_protos_constraint(grammar: GrammarSpec) -> None:
    params = sampling_to_proto(SamplingSpec(grammar=grammar))
    assert params.WhichOneof("constraint") == grammar.kind.value
    assert getattr(params, grammar.kind.value) == (grammar.text or True)


def test_a_trip_crosses_the_wire_as_records() -> None:
    async def scenario(client: WorkerClient, worker: FakeWorker) -> None:
        worker.decode.cached_tokens = 16
        reservation = await client.reserve("r1", list(range(20)), timeout_s=5, priority=3, lora_name="sql")
        assert (reservation.ttl_ms, reservation.cached_tokens, reservation.kv_target.grant) == (5000, 16, "g-1")
        assert kv_target_to_proto(reservation.kv_target) == KV_TARGET
        reserve = worker.decode.received[0]
        assert (reserve.prompt_len, list(reserve.prompt_token_ids)) == (20, list(range(20)))
        assert (reserve.priority, reserve.lora_name) == (3, "sql")
        sampling = SamplingSpec(temperature=0.0, max_new_tokens=8, ignore_eos=False, logit_bias=((5, 1.5),),
                                grammar=GrammarSpec(GrammarKind.JSON_OBJECT))
        first = await client.prefill("r1", [1, 2, 3], sampling, reservation.kv_target, None, timeout_s=5)
        assert first.first_token == GeneratedToken(7, -0.5, ((7, -0.5),))
        assert (first.cached_tokens, first.kv_bytes, first.weights_id) == (16, 4096, "w-1")
        assert first.prompt_logprobs == (GeneratedToken(5, -1.25, ((5, -1.25),)),)
        sent = worker.prefill.received[0]
        assert sent.kv_target == KV_TARGET and not sent.HasField("logprob_start_len")
        params = sent.sampling_params
        assert params.HasField("temperature") and params.temperature == 0.0 and params.HasField("ignore_eos")
        assert not params.HasField("top_p") and not params.HasField("seed") and params.json_object
        assert dict(params.logit_bias) == {5: 1.5} and params.WhichOneof("constraint") == "json_object"
        await client.prefill("r2", [1], SamplingSpec(), reservation.kv_target, 0, timeout_s=5)
        assert worker.prefill.received[1].HasField("logprob_start_len")

        stream = client.generate("r1", [1, 2, 3], first.first_token, sampling, first.weights_id,
                                 reservation.kv_target.grant, timeout_s=5)
        chunks = [chunk async for chunk in stream]
        assert [c.finish for c in chunks] == [None, Finish(FinishReason.STOP, 2)]
        assert (chunks[0].queue_ms, chunks[1].queue_ms) == (0.75, None)
        generate = worker.decode.received[-1]   # after the Reserve
        assert generate.first_token == token(7) and generate.kv_grant == "g-1" and generate.weights_id == "w-1"

        assert await client.cancel_prefill("r1", reservation.kv_target, timeout_s=5)
        assert worker.prefill.received[-1].kv_target == KV_TARGET
        assert await client.abort("known", kv_write_settled=True, timeout_s=5)
        assert not await client.abort("other", kv_write_settled=False, timeout_s=5)
        assert worker.aborts() == [("known", True), ("other", False)]

    _run(scenario)


def test_the_kv_target_reaches_the_prefill_worker_as_the_decode_worker_sent_it() -> None:
    """The gateway never rebuilds the target: skip_tokens and the page ids, and a field its stubs do not
    know (number 100 here, as a newer decode worker might add), arrive byte-identical, on Prefill and
    on CancelPrefill."""
    async def scenario(client: WorkerClient, worker: FakeWorker) -> None:
        known = common_pb2.KvTarget()
        known.CopyFrom(KV_TARGET)
        known.skip_tokens = 32
        wire = known.SerializeToString() + b"\xa0\x06\x2a"   # field 100, varint 42
        worker.decode.kv_target = common_pb2.KvTarget.FromString(wire)
        worker.decode.cached_tokens = 32
        reservation = await client.reserve("r1", list(range(50)), timeout_s=5)
        assert reservation.cached_tokens == 32 and reservation.kv_target.wire == wire
        await client.prefill("r1", list(range(50)), SamplingSpec(), reservation.kv_target, None, timeout_s=5)
        await client.cancel_prefill("r1", reservation.kv_target, timeout_s=5)
        sent = [r.kv_target for r in worker.prefill.received]
        assert [t.SerializeToString() for t in sent] == [wire, wire]
        assert sent[0].skip_tokens == 32 and list(sent[0].page_ids) == [3, 4] and sent[0].grant == "g-1"

    _run(scenario)


def test_a_reserve_without_a_prompt_sends_none() -> None:
    """Reserve's prompt is what the worker matches in its cache; an empty one is matched against nothing."""
    async def scenario(client: WorkerClient, worker: FakeWorker) -> None:
        reservation = await client.reserve("r1", [], timeout_s=5)
        assert reservation.cached_tokens == 0
        assert worker.decode.received[0] == decode_pb2.ReserveRequest(request_id="r1")

    _run(scenario)


def _target(session_id: str, page_ids: list[int], grant: str) -> KvTarget:
    return KvTarget(common_pb2.KvTarget(session_id=session_id, page_ids=page_ids, grant=grant).SerializeToString(),
                    grant)


def test_probes_and_admin_calls_answer_records() -> None:
    async def scenario(client: WorkerClient, worker: FakeWorker) -> None:
        info = await client.model_info(timeout_s=5)
        assert info is not None and info.role is Role.DECODE and info.kv_layout.page_size == 16
        assert (info.context_len, info.eos_token_ids, info.weights_id) == (2048, (2,), "w-1")
        assert await client.flush_cache(timeout_s=5) == FlushResult(True, "no cache")   # UNIMPLEMENTED: no cache
        assert await client.expert_record(ExpertRecordOp.START, timeout_s=5) is None
        assert await client.expert_record(ExpertRecordOp.DUMP, timeout_s=5) == ExpertCounts((0, 2), 2, (1, 2, 3, 4), 1)
        await worker.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert await client.health(timeout_s=5) is Health.NOT_SERVING
        assert await client.model_info(timeout_s=5) is None and await client.responds(timeout_s=5)

    _run(scenario)


def test_errors_the_worker_answers_are_the_tables_api_errors() -> None:
    async def scenario(client: WorkerClient, worker: FakeWorker) -> None:
        worker.decode.failure = (grpc.StatusCode.RESOURCE_EXHAUSTED, "no free pages on 127.0.0.1:31002")
        with pytest.raises(WorkerError) as full:
            await client.reserve("r1", [1] * 20, timeout_s=5)
        assert (full.value.status, full.value.code) == (503, "capacity_exceeded")
        assert full.value.headers == {"Retry-After": "1"}
        assert full.value.message == "the decode worker: no free pages on <address>" and full.value.is_settled

        worker.prefill.failure = (grpc.StatusCode.OUT_OF_RANGE, "the prompt has 3000 tokens")
        target = _target("s", [1], "g")
        with pytest.raises(WorkerError) as long:
            await client.prefill("r1", [1], SamplingSpec(), target, None, timeout_s=5)
        assert (long.value.status, long.value.code, long.value.message) == (
            400, "context_length_exceeded", "the prompt has 3000 tokens")
        assert long.value.is_settled and not worker.prefill.received[0].kv_target.HasField("layout")

        worker.decode.failure = (grpc.StatusCode.DATA_LOSS, "non-finite logits")
        stream = client.generate("r1", [1], GeneratedToken(7, -0.5), SamplingSpec(), "w", "g", timeout_s=5)
        assert (await stream.read()).tokens[0].token_id == 8    # the chunk before the failure arrives
        with pytest.raises(WorkerError) as lost:
            await stream.read()
        assert (lost.value.status, lost.value.message) == (500, "the decode worker: non-finite logits")

        with pytest.raises(WorkerError) as failed:
            await client.update_weights("/srv/models/x", timeout_s=5)
        assert (failed.value.status, failed.value.message) == (500, "the decode worker failed")
        assert "10.0.0.7" in failed.value.detail   # the worker's own words stay for the log and admin views

    _run(scenario)


def test_a_deadline_is_a_504_and_leaves_the_call_unsettled() -> None:
    async def scenario(client: WorkerClient, worker: FakeWorker) -> None:
        worker.prefill.delay_s = 5.0
        with pytest.raises(WorkerError) as late:
            await client.prefill("r1", [1], SamplingSpec(), _target("s", [1], "g"), None, timeout_s=0.2)
        assert (late.value.status, late.value.message) == (504, "the prefill worker did not answer in time")
        assert not late.value.is_settled   # the prefill may still be writing

    _run(scenario, Role.PREFILL)


def test_a_worker_that_is_not_there_is_a_503_naming_the_role_only() -> None:
    async def main() -> None:
        with socket.socket() as s:   # a port nothing listens on: connections are refused
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        client = WorkerClient("decode", f"127.0.0.1:{port}")
        try:
            assert await client.health(timeout_s=2) is Health.NO_ANSWER
            assert await client.model_info(timeout_s=2) is None and not await client.responds(timeout_s=2)
            with pytest.raises(WorkerError) as gone:
                await client.reserve("r1", [1] * 20, timeout_s=2)
            assert (gone.value.status, gone.value.code) == (503, "worker_unavailable")
            assert gone.value.message == "the decode worker is unavailable" and gone.value.retry_after_s == 1
            assert not gone.value.is_settled and str(port) not in gone.value.body()["error"]["message"]
        finally:
            await client.close()

    asyncio.run(main())
