"""The routing policies over workers whose load, model info and KV events are set by hand (no process
behind them: the router only reads what the pool's probes and event streams would have recorded)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import Callable

import pytest

from gateway.cluster.pool import WorkerPool
from gateway.cluster.prefix_index import PromptPages
from gateway.cluster.routing import Route, Router, RouteReason
from gateway.cluster.worker import Worker
from gateway.cluster.worker_records import KvEvents, KvLayout, LoraAdapterInfo, ModelInfo, WorkerLoad
from gateway.config import RouterPolicy, RoutingConfig
from gateway.errors import APIError
from gateway.records import Role

LAYOUT = KvLayout(num_layers=2, page_size=16, num_kv_heads=2, head_dim=8, dtype="float32", page_bytes=4096,
                  order="page,layer,kv,offset,kv_head,head_dim")


def _info(role: Role, num_pages: int = 64) -> ModelInfo:
    return ModelInfo("m", "LlamaForCausalLM", 2048, 100, (2,), LAYOUT, num_pages, role, "1", False, 0, False, (),
                     "w", 4)


def _workers(role: Role, count: int) -> list[Worker]:
    workers = []
    for i in range(count):
        worker = Worker(role, f"10.0.0.{i + 1}:3000{i}")
        worker.info, worker.is_ready = _info(role), True
        worker.load = WorkerLoad(0, 0, 64, 64, 0)
        workers.append(worker)
    return workers


def _in_loop(test: Callable[[], None]) -> None:
    """Run `test` where a gRPC channel may be opened (each `Worker` opens one, never connected here)."""
    async def main() -> None:
        test()

    asyncio.run(main())


def _prompt(prefix: int, question: int, num_prefix_tokens: int = 64) -> PromptPages:
    return PromptPages([prefix] * num_prefix_tokens + [1000 + question] * 8)


def test_one_prefix_stays_on_one_prefill_worker_and_new_prefixes_spread() -> None:
    def test() -> None:
        router, prefills = Router(RoutingConfig(RouterPolicy.PREFIX_AWARE)), _workers(Role.PREFILL, 2)
        first = {}
        for prefix in (1, 2, 3, 4):
            for question in range(3):
                choice = router.choose_prefill(_prompt(prefix, question), prefills)
                router.routed(Route(choice.worker, prefills[0], RouterPolicy.PREFIX_AWARE, choice.reason,
                                    RouteReason.LEAST_LOAD, choice.estimated_cached_tokens, choice.page_hashes))
                first.setdefault(prefix, choice.worker)
                assert choice.worker is first[prefix]
                assert choice.reason is (RouteReason.LEAST_LOAD if question == 0 else RouteReason.PREFIX_MATCH)
                assert choice.estimated_cached_tokens == (0 if question == 0 else 64)
        assert Counter(w.address for w in first.values()) == Counter({prefills[0].address: 2, prefills[1].address: 2})

    _in_loop(test)


def test_the_load_guard_sends_a_prefix_elsewhere_when_its_worker_is_too_busy() -> None:
    def test() -> None:
        router, prefills = Router(RoutingConfig(RouterPolicy.PREFIX_AWARE, prefix_load_guard=2)), _workers(
            Role.PREFILL, 2)
        holder = router.choose_prefill(_prompt(7, 0), prefills)
        router.routed(Route(holder.worker, prefills[0], RouterPolicy.PREFIX_AWARE, holder.reason,
                            RouteReason.LEAST_LOAD, 0, holder.page_hashes))
        holder.worker.num_in_flight = 2   # within the guard: the prefix stays
        assert router.choose_prefill(_prompt(7, 1), prefills).worker is holder.worker
        holder.worker.num_in_flight = 3   # past it
        moved = router.choose_prefill(_prompt(7, 2), prefills)
        assert moved.worker is not holder.worker and moved.reason is RouteReason.LOAD_GUARD
        # requests other gateways put there count too (the worker's last report, beyond our own)
        holder.worker.num_in_flight, holder.worker.load = 0, WorkerLoad(2, 2, 64, 64, 0)
        assert router.choose_prefill(_prompt(7, 3), prefills).reason is RouteReason.LOAD_GUARD

    _in_loop(test)


def test_a_route_chosen_but_never_used_leaves_the_index_alone() -> None:
    """The pool's decision does not teach the index (an admission retry or a failover may drop the
    route); the trip's `routed`, once the prefill is sent, does."""
    def test() -> None:
        pool = WorkerPool((), (), routing=RoutingConfig(RouterPolicy.PREFIX_AWARE))
        pool.workers = {"prefill": _workers(Role.PREFILL, 2), "decode": _workers(Role.DECODE, 1)}
        dropped = pool.route(_prompt(5, 0))
        dropped.end()
        used = pool.route(_prompt(5, 1))
        assert (used.estimated_cached_tokens, used.prefill_reason) == (0, RouteReason.LEAST_LOAD)
        pool.router.routed(used)
        used.end()
        again = pool.route(_prompt(5, 2))
        assert again.prefill is used.prefill and again.estimated_cached_tokens == 64
        assert again.prefill_reason is RouteReason.PREFIX_MATCH

    _in_loop(test)


def _with_adapters(worker: Worker, *names: str) -> Worker:
    worker.info = dataclasses.replace(worker.info, lora_adapters=tuple(LoraAdapterInfo(n, 8) for n in names))
    return worker


def test_a_request_under_an_adapter_goes_only_to_workers_that_hold_it_on_both_legs() -> None:
    def test() -> None:
        pool = WorkerPool((), (), routing=RoutingConfig(RouterPolicy.LEAST_LOAD, local_prefill_threshold=8))
        prefills, decodes = _workers(Role.PREFILL, 3), _workers(Role.DECODE, 3)
        _with_adapters(prefills[1], "sql")
        _with_adapters(decodes[2], "sql", "chat")
        pool.workers = {"prefill": prefills, "decode": decodes}
        for _ in range(4):
            route = pool.route(PromptPages(list(range(40)), "sql"))
            assert (route.prefill, route.decode) == (prefills[1], decodes[2])   # the only holders, however busy
        local = pool.route(PromptPages([1, 2, 3], "sql"))
        assert (local.prefill, local.decode) == (None, decodes[2])   # a local prefill too
        base = [pool.route(PromptPages(list(range(40)))) for _ in range(3)]
        assert {r.decode for r in base} == {decodes[0], decodes[1]}   # the base model anywhere: the least busy
        with pytest.raises(APIError) as refused:
            pool.route(PromptPages(list(range(40)), "chat"))   # no prefill worker holds it
        assert refused.value.status == 503 and "`chat`" in refused.value.message
        assert pool.can_route(frozenset(), "sql") and not pool.can_route(frozenset({decodes[2].address}), "sql")

    _in_loop(test)


def test_prefix_aware_routing_never_counts_another_adapters_pages() -> None:
    def test() -> None:
        pool = WorkerPool((), (), routing=RoutingConfig(RouterPolicy.PREFIX_AWARE))
        prefills = [_with_adapters(w, "a", "b") for w in _workers(Role.PREFILL, 2)]
        pool.workers = {"prefill": prefills, "decode": [_with_adapters(_workers(Role.DECODE, 1)[0], "a", "b")]}
        tokens = [5] * 64 + [7] * 8
        first = pool.route(PromptPages(tokens, "a"))
        pool.router.routed(first)
        first.end()
        same = pool.route(PromptPages(tokens, "a"))
        assert same.prefill is first.prefill and same.estimated_cached_tokens == 64
        same.end()
        for other in ("b", ""):
            route = pool.route(PromptPages(tokens, other))
            assert route.estimated_cached_tokens == 0 and route.prefill_reason is RouteReason.LEAST_LOAD
            route.end()

    _in_loop(test)


def test_decisions_counted_in_flight_spread_a_burst_over_decode_workers() -> None:
    def test() -> None:
        router, decodes = Router(RoutingConfig(RouterPolicy.LEAST_LOAD)), _workers(Role.DECODE, 2)
        picks = []
        for _ in range(16):   # all decided before any worker reports again
            choice = router.choose_decode(_prompt(1, 0), decodes)
            choice.worker.num_in_flight += 1
            picks.append(choice.worker.address)
        assert Counter(picks) == Counter({decodes[0].address: 8, decodes[1].address: 8})
        assert picks[:4] == [decodes[0].address, decodes[1].address] * 2   # ties: the pool's order
        decodes[0].num_in_flight = decodes[1].num_in_flight = 0
        decodes[0].load = WorkerLoad(0, 0, 10, 64, 0)   # same requests, fewer free pages
        assert router.choose_decode(_prompt(1, 0), decodes).worker is decodes[1]

    _in_loop(test)


def test_round_robin_takes_each_worker_in_turn_whatever_the_load() -> None:
    def test() -> None:
        router, prefills = Router(RoutingConfig(RouterPolicy.ROUND_ROBIN)), _workers(Role.PREFILL, 3)
        prefills[0].num_in_flight = 10
        picks = [router.choose_prefill(_prompt(1, 0), prefills).worker for _ in range(6)]
        assert picks == prefills * 2

    _in_loop(test)


def test_short_prompts_and_a_busy_prefill_pool_prefill_on_decode() -> None:
    def test() -> None:
        prefills = _workers(Role.PREFILL, 2)
        router = Router(RoutingConfig(local_prefill_threshold=32, prefill_busy_threshold=3))
        assert router.local_reason(31, 0, prefills) is RouteReason.SHORT_PROMPT
        assert router.local_reason(32, 0, prefills) is None
        assert router.local_reason(40, 16, prefills) is RouteReason.DECODE_CACHED   # decode lacks only 24
        prefills[0].num_in_flight = 3
        assert router.local_reason(500, 0, prefills) is None   # one prefill worker still has room
        prefills[1].num_in_flight = 3
        assert router.local_reason(500, 0, prefills) is RouteReason.PREFILL_BUSY
        assert Router(RoutingConfig()).local_reason(1, 0, prefills) is None   # both off by default

    _in_loop(test)


def test_a_restarted_worker_starts_with_an_empty_index() -> None:
    def test() -> None:
        router, prefills = Router(RoutingConfig(RouterPolicy.PREFIX_AWARE)), _workers(Role.PREFILL, 1)
        choice = router.choose_prefill(_prompt(3, 0), prefills)
        router.routed(Route(choice.worker, prefills[0], RouterPolicy.PREFIX_AWARE, choice.reason,
                            RouteReason.LEAST_LOAD, 0, choice.page_hashes))
        assert router.choose_prefill(_prompt(3, 1), prefills).estimated_cached_tokens == 64
        prefills[0].num_ready_changes += 1   # it went away and came back: its cache is empty
        assert router.choose_prefill(_prompt(3, 2), prefills).estimated_cached_tokens == 0

    _in_loop(test)


def test_a_route_counts_its_request_in_flight_until_each_part_ends() -> None:
    def test() -> None:
        prefill, decode = _workers(Role.PREFILL, 1)[0], _workers(Role.DECODE, 1)[0]
        route = Route(prefill, decode, RouterPolicy.LEAST_LOAD, RouteReason.LEAST_LOAD, RouteReason.LEAST_LOAD)
        route.begin()
        assert (prefill.num_in_flight, decode.num_in_flight) == (1, 1)
        route.end_prefill()
        route.end_prefill()
        assert (prefill.num_in_flight, decode.num_in_flight) == (0, 1)
        route.end()
        route.end()
        assert (prefill.num_in_flight, decode.num_in_flight) == (0, 0)

    _in_loop(test)


def _routed(router: Router, choice, decode: Worker) -> None:
    router.routed(Route(choice.worker, decode, RouterPolicy.PREFIX_AWARE, choice.reason, RouteReason.LEAST_LOAD,
                        choice.estimated_cached_tokens, choice.page_hashes))


def test_a_worker_whose_events_hold_a_prefix_gets_it_though_this_gateway_never_sent_it_there() -> None:
    def test() -> None:
        pool = WorkerPool((), (), routing=RoutingConfig(RouterPolicy.PREFIX_AWARE))
        prefills, decodes = _workers(Role.PREFILL, 2), _workers(Role.DECODE, 2)
        pool.workers = {"prefill": prefills, "decode": decodes}
        prompt = _prompt(9, 0)
        for worker in prefills + decodes:
            worker.event_index.apply(KvEvents(True))
        for worker in (prefills[1], decodes[1]):   # another gateway sent the prefix to the second of each role
            worker.event_index.apply(KvEvents(False, stored=prompt.hashes(16)))
        route = pool.route(prompt)
        assert (route.prefill, route.decode) == (prefills[1], decodes[1])
        assert route.estimated_cached_tokens == route.estimated_decode_cached_tokens == 64
        assert route.prefill_reason is route.decode_reason is RouteReason.PREFIX_MATCH
        route.end()

    _in_loop(test)


def test_live_events_overrule_the_guess_and_the_guess_returns_when_they_stop() -> None:
    def test() -> None:
        router, prefills = Router(RoutingConfig(RouterPolicy.PREFIX_AWARE)), _workers(Role.PREFILL, 2)
        first = router.choose_prefill(_prompt(3, 0), prefills)   # no stream yet: the guess learns it
        _routed(router, first, prefills[0])
        guessed = first.worker
        other = prefills[1] if guessed is prefills[0] else prefills[0]
        guessed.event_index.apply(KvEvents(True))   # its cache holds none of it (evicted, or never run)
        other.event_index.apply(KvEvents(True, stored=_prompt(3, 0).hashes(16)))
        live = router.choose_prefill(_prompt(3, 1), prefills)
        assert live.worker is other and live.estimated_cached_tokens == 64
        route = Route(other, prefills[0], RouterPolicy.PREFIX_AWARE, live.reason, RouteReason.LEAST_LOAD,
                      live.estimated_cached_tokens, live.page_hashes)
        router.prefilled(route, cached_tokens=0)   # a report does not correct an exact index
        assert router.choose_prefill(_prompt(3, 2), prefills).worker is other
        for worker in prefills:
            worker.event_index.lose()   # the streams broke: back to what this gateway routed
        back = router.choose_prefill(_prompt(3, 3), prefills)
        assert back.worker is guessed and back.estimated_cached_tokens == 64

    _in_loop(test)


def test_a_burst_of_one_new_prefix_stays_on_one_worker_while_its_events_lag() -> None:
    def test() -> None:
        router, prefills = Router(RoutingConfig(RouterPolicy.PREFIX_AWARE)), _workers(Role.PREFILL, 3)
        for worker in prefills:
            worker.event_index.apply(KvEvents(True))
        choices = []
        for question in range(6):   # decided before any stored event arrives
            choice = router.choose_prefill(_prompt(11, question), prefills)
            _routed(router, choice, prefills[0])
            choices.append(choice)
        assert len({c.worker.address for c in choices}) == 1
        assert [c.reason for c in choices] == [RouteReason.LEAST_LOAD] + [RouteReason.PREFIX_MATCH] * 5

    _in_loop(test)


def test_a_policy_is_named_and_bad_thresholds_are_refused() -> None:
    assert RoutingConfig(policy="least_load").policy is RouterPolicy.LEAST_LOAD   # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RoutingConfig(policy="fastest")   # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RoutingConfig(local_prefill_threshold=-1)
