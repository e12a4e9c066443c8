"""Following a worker's KV events over a real gRPC server on loopback whose WorkerService plays a script
of SubscribeKvEvents streams: the snapshot and the deltas reach the worker's index, a broken stream is
opened again and its new snapshot replaces the index, a worker that does not know the RPC is left to
the guess, the calls carry the internal token, and the pool stops following a worker when it closes or
the worker leaves."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.cluster import discovery
from gateway.cluster.client import WorkerClient
from gateway.cluster.kv_events import follow_kv_events
from gateway.cluster.pool import WorkerPool
from gateway.cluster.prefix_index import EventIndex, PromptPages
from gateway.cluster.worker_records import KvEvents
from gateway.config import RouterPolicy, RoutingConfig
from gateway.metrics import GatewayMetrics
from gateway.records import Role
from tandem.internal_auth import InternalCredentials
from tandem.page_keys import page_keys
from tandem.v1 import common_pb2, worker_pb2, worker_pb2_grpc

PAGE = 16
LAYOUT = common_pb2.KvLayout(num_layers=2, page_size=PAGE, num_kv_heads=2, head_dim=8, dtype="bfloat16",
                             page_bytes=2048)
PROMPT_A = [5] * 48 + [1, 2, 3]   # three full pages
PROMPT_B = [6] * 48 + [1, 2, 3]
KEYS_A, KEYS_B = page_keys(PROMPT_A, PAGE), page_keys(PROMPT_B, PAGE)
HANG = None   # a stream's ending: stay open until the subscriber cancels


@dataclass
class Stream:
    """One SubscribeKvEvents call's script: its messages, then how it ends (HANG, or a status code)."""

    messages: Sequence[worker_pb2.KvEvents]
    ending: grpc.StatusCode | None = HANG


@dataclass
class Publisher(worker_pb2_grpc.WorkerServiceServicer):
    """Each SubscribeKvEvents call plays the next stream of `streams` (the last one again once they run
    out); an empty `streams`: UNIMPLEMENTED, as from a worker older than the RPC."""

    streams: list[Stream] = field(default_factory=list)
    role: int = common_pb2.WORKER_ROLE_PREFILL
    num_calls: int = 0
    num_open: int = 0
    tokens: list[str] = field(default_factory=list)   # each call's authorization header

    async def GetModelInfo(self, request, context):
        return common_pb2.GetModelInfoResponse(model_path="m", architecture="LlamaForCausalLM", context_len=2048,
                                               vocab_size=100, eos_token_ids=[2], kv_layout=LAYOUT, num_pages=64,
                                               role=self.role, weights_id="w")

    async def GetLoad(self, request, context):
        return common_pb2.GetLoadResponse(num_free_pages=64, num_total_pages=64)

    async def SubscribeKvEvents(self, request, context):
        self.num_calls += 1
        self.tokens.append(dict(context.invocation_metadata()).get("authorization", ""))
        if not self.streams:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        stream = self.streams[min(self.num_calls, len(self.streams)) - 1]
        self.num_open += 1
        try:
            for message in stream.messages:
                yield message
            if stream.ending is HANG:
                await asyncio.Event().wait()
            await context.abort(stream.ending, "worker going away")
        finally:
            self.num_open -= 1


def snapshot(*keys: int) -> worker_pb2.KvEvents:
    return worker_pb2.KvEvents(is_snapshot=True, stored=keys)


def delta(stored: Sequence[int] = (), removed: Sequence[int] = ()) -> worker_pb2.KvEvents:
    return worker_pb2.KvEvents(stored=stored, removed=removed)


@contextlib.asynccontextmanager
async def serving(publisher: Publisher, credentials: InternalCredentials = InternalCredentials()
                  ) -> AsyncIterator[str]:
    """`publisher` (and a SERVING health service) on a free loopback port; yields its address."""
    server, status = grpc.aio.server(interceptors=credentials.server_interceptors()), health.aio.HealthServicer()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(publisher, server)
    health_pb2_grpc.add_HealthServicer_to_server(status, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await status.set("", health_pb2.HealthCheckResponse.SERVING)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def follow(address: str, index: EventIndex, seen: list[KvEvents]) -> tuple[WorkerClient, asyncio.Task]:
    client = WorkerClient(Role.PREFILL, address)
    return client, asyncio.create_task(follow_kv_events(client, index, seen.append))


async def stop(client: WorkerClient, task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await client.close()


def test_the_snapshot_then_the_deltas_reach_the_index() -> None:
    async def main() -> None:
        publisher = Publisher([Stream([snapshot(KEYS_A[0]), delta(stored=KEYS_A[1:]), delta(removed=KEYS_A[2:])])])
        index, seen = EventIndex(), []
        async with serving(publisher) as address:
            client, task = await follow(address, index, seen)
            await until(lambda: len(seen) == 3)
            assert index.is_live and index.match(KEYS_A) == 2 and index.match(KEYS_B) == 0
            assert seen[0] == KvEvents(True, (KEYS_A[0],)) and seen[2] == KvEvents(False, (), (KEYS_A[2],))
            await stop(client, task)
            assert not index.is_live   # no stream: the router guesses
            await until(lambda: publisher.num_open == 0)   # cancelling ends the call on the worker too

    asyncio.run(main())


def test_a_broken_stream_is_opened_again_and_its_snapshot_replaces_the_index() -> None:
    async def main() -> None:
        publisher = Publisher([Stream([snapshot(*KEYS_A)], grpc.StatusCode.UNAVAILABLE),   # the worker restarts
                               Stream([], grpc.StatusCode.UNAVAILABLE),                     # still starting
                               Stream([snapshot(*KEYS_B)])])
        index, seen = EventIndex(), []
        async with serving(publisher) as address:
            client, task = await follow(address, index, seen)
            await until(lambda: len(seen) == 2)
            assert publisher.num_calls == 3 and [e.is_snapshot for e in seen] == [True, True]
            assert index.is_live and index.match(KEYS_A) == 0 and index.match(KEYS_B) == 3
            await stop(client, task)

    asyncio.run(main())


def test_a_worker_without_the_rpc_is_asked_once_and_left_to_the_guess() -> None:
    async def main() -> None:
        publisher, index = Publisher(), EventIndex()
        async with serving(publisher) as address:
            client, task = await follow(address, index, [])
            await asyncio.wait_for(task, timeout=5)   # it returns: no reconnecting
            assert publisher.num_calls == 1 and not index.is_live
            await client.close()

    asyncio.run(main())


def test_the_pool_follows_ready_workers_with_the_token_and_routes_by_their_events() -> None:
    """Two prefill workers: an older one (UNIMPLEMENTED) and one whose events say it holds prompt A,
    which this gateway never sent anywhere. A prompt A goes to the second; the first is not asked
    again on later probes until it turns ready again; closing the pool ends the streams."""
    async def main() -> None:
        credentials = InternalCredentials(token="t" * 16)
        old, new = Publisher(), Publisher([Stream([snapshot(*KEYS_A)])])
        decode = Publisher([Stream([snapshot()])], role=common_pb2.WORKER_ROLE_DECODE)
        async with serving(old, credentials) as a, serving(new, credentials) as b, \
                serving(decode, credentials) as d:
            metrics = GatewayMetrics()
            pool = WorkerPool((a, b), (d,), credentials=credentials, metrics=metrics,
                              routing=RoutingConfig(RouterPolicy.PREFIX_AWARE))
            metrics.watch_kv_events(pool.num_kv_events_live)
            try:
                await pool.probe_all()
                await until(lambda: pool.num_kv_events_live(Role.PREFILL) == 1
                            and pool.num_kv_events_live(Role.DECODE) == 1)
                await pool.probe_all()
                assert old.num_calls == 1 and new.num_calls == decode.num_calls == 1
                assert new.tokens == decode.tokens == [f"Bearer {credentials.token}"]
                route = pool.route(PromptPages(PROMPT_A))
                assert route.prefill.address == b and route.estimated_cached_tokens == 48
                route.end()
                older = next(w for w in pool.workers["prefill"] if w.address == a)
                older.num_ready_changes += 1   # it turned ready again (a restart may bring a newer version)
                await pool.probe_all()
                await until(lambda: old.num_calls == 2)   # asked once more, then left alone again
                sample = metrics.registry.get_sample_value
                assert sample("tandem_gateway_kv_events_total", {"kind": "snapshot"}) == 2
                assert sample("tandem_gateway_kv_events_total", {"kind": "stored"}) == 3
                assert sample("tandem_gateway_kv_events_live_workers", {"role": "prefill"}) == 1
            finally:
                await pool.close()
            await until(lambda: new.num_open == decode.num_open == 0)   # the streams ended on the workers

    asyncio.run(main())


def test_the_pool_stops_following_a_worker_that_left_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        publisher = Publisher([Stream([snapshot(*KEYS_A)])])
        async with serving(publisher) as address:
            host, port = address.rsplit(":", 1)
            answers = {"now": (address,)}

            async def resolve(name: str, port: int) -> tuple[str, ...]:
                return answers["now"]

            monkeypatch.setattr(discovery, "resolve_all", resolve)
            pool = WorkerPool((f"dns:///workers:{port}",), (), refresh_interval_s=0.01)
            try:
                await pool.probe_all()
                await until(lambda: pool.num_kv_events_live(Role.PREFILL) == 1)
                answers["now"] = ()
                await asyncio.sleep(0.02)
                await pool.probe_all()
                await until(lambda: publisher.num_open == 0)
                assert publisher.num_calls == 1
            finally:
                await pool.close()

    asyncio.run(main())
