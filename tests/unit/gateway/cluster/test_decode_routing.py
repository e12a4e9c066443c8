"""The decode side of routing under prefix_aware: a decode worker is chosen by the prompt's prefix it
likely holds (its own index, apart from the prefill workers'), within the load guard, else by load;
its index learns from routing, from Reserve's `cached_tokens` and from each finished request's
sequence; and the local-or-not decision counts only what that worker lacks. Workers' load and model
info are set by hand (no process behind them: the router only reads what the pool's probes record)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from gateway.cluster.pool import WorkerPool
from gateway.cluster.prefix_index import PromptPages
from gateway.cluster.routing import Route, RouteReason
from gateway.cluster.worker import Worker
from gateway.cluster.worker_records import KvLayout, ModelInfo, WorkerLoad
from gateway.config import RouterPolicy, RoutingConfig
from gateway.records import Role

LAYOUT = KvLayout(num_layers=2, page_size=16, num_kv_heads=2, head_dim=8, dtype="float32", page_bytes=4096)
SYSTEM = [5] * 64   # four full pages


def _workers(role: Role, count: int, first: int = 1) -> list[Worker]:
    workers = []
    for i in range(count):
        worker = Worker(role, f"10.0.0.{first + i}:3000{i}")
        worker.info = ModelInfo("m", "LlamaForCausalLM", 2048, 100, (2,), LAYOUT, 64, role, "1", False, 0, False, (),
                                "w", 4)
        worker.is_ready, worker.load = True, WorkerLoad(0, 0, 64, 64, 0)
        workers.append(worker)
    return workers


def _pool(routing: RoutingConfig, num_prefills: int = 1, num_decodes: int = 2, first_decode: int = 50) -> WorkerPool:
    pool = WorkerPool((), (), routing=routing)
    pool.workers = {"prefill": _workers(Role.PREFILL, num_prefills),
                    "decode": _workers(Role.DECODE, num_decodes, first_decode)}
    return pool


def _in_loop(test: Callable[[], None]) -> None:
    """Run `test` where a gRPC channel may be opened (each `Worker` opens one, never connected here)."""
    async def main() -> None:
        test()

    asyncio.run(main())


def _sent(pool: WorkerPool, prompt: PromptPages) -> Route:
    """A route whose first call went out (the router learns it), already ended."""
    route = pool.route(prompt)
    pool.router.routed(route)
    route.end()
    return route


def test_a_prefix_goes_back_to_the_decode_worker_that_holds_it() -> None:
    def test() -> None:
        pool = _pool(RoutingConfig(RouterPolicy.PREFIX_AWARE))
        first = _sent(pool, PromptPages(SYSTEM + [1] * 8))
        assert (first.decode_reason, first.estimated_decode_cached_tokens) == (RouteReason.LEAST_LOAD, 0)
        assert first.decode is pool.workers["decode"][0]   # a tie: the pool's order
        other = pool.workers["decode"][1]
        first.decode.num_in_flight = 1   # busier, but within the guard
        again = pool.route(PromptPages(SYSTEM + [2] * 8))
        assert (again.decode, again.decode_reason) == (first.decode, RouteReason.PREFIX_MATCH)
        assert again.estimated_decode_cached_tokens == 64
        again.end()
        fresh = pool.route(PromptPages([9] * 72))
        assert (fresh.decode, fresh.decode_reason) == (other, RouteReason.LEAST_LOAD)   # no match: least loaded

    _in_loop(test)


def test_the_load_guard_and_free_pages_decide_between_decode_workers() -> None:
    def test() -> None:
        pool = _pool(RoutingConfig(RouterPolicy.PREFIX_AWARE, prefix_load_guard=2))
        holder = _sent(pool, PromptPages(SYSTEM + [1] * 8)).decode
        other = next(d for d in pool.workers["decode"] if d is not holder)
        holder.num_in_flight = 3   # past the guard
        moved = pool.route(PromptPages(SYSTEM + [2] * 8))
        assert (moved.decode, moved.decode_reason, moved.estimated_decode_cached_tokens) == (
            other, RouteReason.LOAD_GUARD, 0)
        moved.end()
        holder.num_in_flight = 0
        holder.load = WorkerLoad(0, 0, 10, 64, 0)   # as loaded as the other, fewer free pages
        assert pool.route(PromptPages([8] * 72)).decode is other   # no match: the most free pages
        assert pool.route(PromptPages(SYSTEM + [3] * 8)).decode is holder   # a match beats free pages

    _in_loop(test)


def test_prefill_and_decode_indexes_are_kept_apart_for_one_address() -> None:
    def test() -> None:
        pool = _pool(RoutingConfig(RouterPolicy.PREFIX_AWARE), num_decodes=1, first_decode=1)
        prefill, decode = pool.workers["prefill"][0], pool.workers["decode"][0]
        assert prefill.address == decode.address   # one process serving both roles
        chosen = pool.route(PromptPages(SYSTEM + [1] * 8))
        chosen.end()
        prefill_only = Route(prefill, decode, RouterPolicy.PREFIX_AWARE, RouteReason.LEAST_LOAD,
                             RouteReason.LEAST_LOAD, 0, chosen.page_hashes)
        pool.router.routed(prefill_only)   # the prefill leg learnt, not the decode one
        again = pool.route(PromptPages(SYSTEM + [2] * 8))
        assert (again.estimated_cached_tokens, again.estimated_decode_cached_tokens) == (64, 0)
        again.end()
        pool.router.finished(again, [6] * 40, "")   # the decode worker's sequence: its index alone
        other = pool.route(PromptPages([6] * 40))
        assert (other.estimated_cached_tokens, other.estimated_decode_cached_tokens) == (0, 32)

    _in_loop(test)


def test_the_decode_index_is_corrected_by_reserve_and_learns_finished_sequences() -> None:
    def test() -> None:
        pool = _pool(RoutingConfig(RouterPolicy.PREFIX_AWARE), num_decodes=1)
        decode = pool.workers["decode"][0]
        prompt = SYSTEM + [1] * 8
        route = _sent(pool, PromptPages(prompt))
        pool.router.decode_matched(route, 0)   # as estimated: nothing held yet
        assert pool.route(PromptPages(prompt + [3])).estimated_decode_cached_tokens == 64   # once this prompt ran
        output = [40 + i for i in range(25)]   # prompt + output = 97 tokens: the worker computed 96, 6 pages
        pool.router.finished(route, prompt + output, "")
        turn = _sent(pool, PromptPages(prompt + output + [7] * 10))
        assert turn.estimated_decode_cached_tokens == 96
        pool.router.finished(turn, [6] * 40, "sql")   # under an adapter: the base model shares none of it
        assert pool.route(PromptPages([6] * 40)).estimated_decode_cached_tokens == 0
        shorter = PromptPages(prompt + output[:23] + [6] * 20)   # shares 95 tokens: 5 full pages
        assert pool.route(shorter).estimated_decode_cached_tokens == 80
        index = pool.router._index(decode)
        assert index.capacity == 64
        pool.router.decode_matched(turn, 64)   # Reserve found 4 of the 6 pages: it evicted 2
        assert index.capacity == 62

    _in_loop(test)


def test_the_local_decision_counts_only_what_the_decode_worker_lacks() -> None:
    def test() -> None:
        pool = _pool(RoutingConfig(RouterPolicy.PREFIX_AWARE, local_prefill_threshold=32), num_decodes=1)
        prompt = SYSTEM + [1] * 20   # 84 tokens: over the threshold
        first = _sent(pool, PromptPages(prompt))
        assert first.prefill is not None and first.prefill_reason is RouteReason.LEAST_LOAD
        second = pool.route(PromptPages(SYSTEM + [2] * 20))   # lacks 20 tokens
        assert (second.prefill, second.prefill_reason) == (None, RouteReason.DECODE_CACHED)
        assert second.estimated_decode_cached_tokens == 64 and second.decode_page_hashes
        second.end()
        third = pool.route(PromptPages(SYSTEM + [3] * 40))   # lacks 40: a prefill worker
        assert third.prefill is not None and third.decode_reason is RouteReason.PREFIX_MATCH
        third.end()
        short = pool.route(PromptPages([4] * 20))
        assert (short.prefill, short.prefill_reason) == (None, RouteReason.SHORT_PROMPT)

    _in_loop(test)


def test_a_decode_worker_without_a_prefix_cache_is_never_expected_to_hold_a_prompt() -> None:
    def test() -> None:
        pool = _pool(RoutingConfig(RouterPolicy.PREFIX_AWARE, local_prefill_threshold=32), num_decodes=1)
        [decode] = pool.workers["decode"]
        assert decode.info is not None
        decode.info = dataclasses.replace(decode.info, prefix_cache_disabled=True)   # --disable-decode-prefix-cache
        first = _sent(pool, PromptPages(SYSTEM + [1] * 20))
        pool.router.finished(first, SYSTEM + [1] * 30, "")
        again = pool.route(PromptPages(SYSTEM + [2] * 20))   # would go local if the worker cached SYSTEM
        assert again.prefill is not None and again.estimated_decode_cached_tokens == 0
        assert again.decode_reason is RouteReason.LEAST_LOAD

    _in_loop(test)


def test_round_robin_and_least_load_decode_as_before_and_learn_nothing() -> None:
    def test() -> None:
        for policy in (RouterPolicy.ROUND_ROBIN, RouterPolicy.LEAST_LOAD):
            pool = _pool(RoutingConfig(policy, local_prefill_threshold=32))
            prompt = SYSTEM + [1] * 20
            route = _sent(pool, PromptPages(prompt))
            pool.router.finished(route, prompt + [2] * 40, "")
            routes = [pool.route(PromptPages(prompt)) for _ in range(2)]
            assert {r.decode for r in routes} == set(pool.workers["decode"])   # in turn, or the least loaded
            for r in routes:
                assert (r.decode_page_hashes, r.estimated_decode_cached_tokens) == ((), 0)
                assert r.prefill is not None and r.decode_reason.value == policy.value   # never local: 84 >= 32
            assert pool.router._indexes[Role.DECODE] == {}   # no decode index was ever made

    _in_loop(test)
