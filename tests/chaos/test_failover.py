"""Two prefill and two decode workers (plus a decode worker with another page size), each its own
process, under one gateway: the odd decode worker is never paired; a rolling restart of every worker
in turn under steady load fails no request (each drains: NOT_SERVING, the gateway routes around it, its
requests in flight finish, it exits 0, comes back and is used again); a prefill worker killed under load
fails no request that had not yet produced a token (each is sent again to the other prefill worker).
After every test no worker holds a KV page."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.chaos.checks import gateway_metrics
from tests.chaos.clients import Reply, completion
from tests.e2e.cluster_stack import (
    ClusterServices,
    assert_no_pages_held,
    per_worker,
    route_counts,
    start_cluster_services,
    worker_load,
)
from tests.e2e.stack import wait_for

pytestmark = pytest.mark.slow

WRITE_GRACE_S = 3  # a killed prefill worker's unconfirmed writes: the decode pages rest this long
WORKER_FLAGS = (
    "--dtype",
    "float32",
    "--quantization",
    "none",
    "--torch-threads",
    "1",
    "--max-total-tokens",
    "4096",
    "--context-length",
    "1024",
    "--chunked-prefill-size",
    "64",
    "--drain-timeout",
    "20",
    "--transfer-timeout",
    str(WRITE_GRACE_S),
    "--kv-write-grace",
    str(WRITE_GRACE_S),
)
ODD_PAGE_SIZE = ("--page-size", "32")
PROMPT = "Here is a list of facts about rivers, mountains and cities. " * 20  # about 240 tokens


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[ClusterServices]:
    services = start_cluster_services(
        tmp_path_factory.mktemp("failover"), 2, 2, *WORKER_FLAGS, extra_decode_flags=(ODD_PAGE_SIZE,)
    )
    try:
        services.start_gateway("--data-dir", str(services.log_dir / "data"))
        yield services
    finally:
        services.stop()


@pytest.fixture
def paired(cluster: ClusterServices) -> list[int]:
    """The workers that serve (the odd decode worker aside); none holds a page after the test."""
    ports = cluster.prefill_ports + cluster.decode_ports[:2]
    yield ports
    assert_no_pages_held(cluster.worker_ports, within_s=WRITE_GRACE_S + 5)


def _ok(reply: Reply) -> bool:
    """A 200 whose answer finished: a JSON body with a choice, or a stream with its finish and [DONE]."""
    if reply.status != 200 or not reply.lines:
        return False
    if reply.lines[-1] != "data: [DONE]":
        return '"finish_reason"' in reply.lines[0] and '"error"' not in reply.lines[0]
    events = reply.events
    return not any("error" in e for e in events) and any(
        c.get("finish_reason") for e in events for c in e.get("choices", [])
    )


def test_a_decode_worker_with_another_page_size_is_never_paired(cluster: ClusterServices, paired: list[int]) -> None:
    odd = f"127.0.0.1:{cluster.decode_ports[2]}"
    info = httpx.get(f"{cluster.url}/get_server_info", timeout=10).json()
    pairs = info["incompatible_pairs"]
    assert sorted(p["prefill"] for p in pairs) == sorted(f"127.0.0.1:{p}" for p in cluster.prefill_ports)
    for pair in pairs:
        assert pair["decode"] == odd
        assert {"field": "page_size", "prefill": "16", "decode": "32"} in pair["mismatches"]
    assert [w["page_size"] for w in info["workers"] if w["address"] == odd] == [32]
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda i: completion(cluster.url, f"{i}: {PROMPT[:80]}", 4, False, Reply()), range(8)))
    assert all(_ok(r) for r in replies)
    assert odd not in per_worker(route_counts(cluster.url), "decode")
    load = worker_load(cluster.decode_ports[2])
    assert load.num_free_pages == load.num_total_pages  # no reservation, no KV, ever
    log = (cluster.log_dir / "gateway.log").read_text()
    for prefill in cluster.prefill_ports:  # logged once per pair, with both sides' values
        line = f"prefill worker 127.0.0.1:{prefill} and decode worker {odd} are never paired"
        assert log.count(line) == 1 and "page_size: prefill 16, decode 32" in log


def test_a_rolling_restart_under_steady_load_fails_no_request(cluster: ClusterServices, paired: list[int]) -> None:
    stop = threading.Event()
    replies: list[Reply] = []

    def client(index: int) -> None:
        turn = 0
        while not stop.is_set():
            reply = Reply()
            replies.append(reply)
            completion(cluster.url, f"Client {index}, request {turn}: tell me about rivers.", 6, turn % 2 == 0, reply)
            turn += 1

    def answered_since(first: int) -> int:
        return sum(r.is_done for r in replies[first:])

    def decisions(port: int) -> float:
        role = "prefill" if port in cluster.prefill_ports else "decode"
        return per_worker(route_counts(cluster.url), role).get(f"127.0.0.1:{port}", 0)

    failovers_before = gateway_metrics(cluster.url).get("tandem_gateway_failovers_total", 0)
    with ThreadPoolExecutor(2) as pool:
        clients = [pool.submit(client, i) for i in range(2)]
        try:
            for port in paired:  # every serving worker in turn: drain (SIGTERM), start again, serving again
                wait_for(lambda: answered_since(0) >= 2, 60, "steady load")
                cluster.drain(port)
                cluster.start_worker(port)
                cluster.wait_all_ready(timeout_s=300, ports=paired)
                first, used = len(replies), decisions(port)
                # Requests sent after the restart are answered, and some of them are routed to the new process.
                wait_for(lambda first=first: answered_since(first) >= 2, 60, "requests answered after the restart")
                wait_for(
                    lambda port=port, used=used: decisions(port) > used,
                    120,
                    f"a request routed to 127.0.0.1:{port} again",
                )
        finally:
            stop.set()
            for future in clients:
                future.result()
    failed = [(r.status, r.lines[-2:]) for r in replies if not _ok(r)]
    print(
        f"{len(replies)} requests over four restarts; failovers: "
        f"{gateway_metrics(cluster.url).get('tandem_gateway_failovers_total', 0) - failovers_before:g}"
    )
    assert failed == []
    assert len(replies) >= 8


def test_a_killed_prefill_worker_fails_no_request_that_had_no_token(
    cluster: ClusterServices, paired: list[int]
) -> None:
    victim = cluster.prefill_ports[0]
    before = per_worker(route_counts(cluster.url), "prefill")
    failovers_before = gateway_metrics(cluster.url).get("tandem_gateway_failovers_total", 0)
    replies = [Reply() for _ in range(6)]
    with ThreadPoolExecutor(len(replies)) as pool:
        futures = [
            pool.submit(completion, cluster.url, f"{i}. {PROMPT}", 4, i % 2 == 1, reply)
            for i, reply in enumerate(replies)
        ]
        wait_for(
            lambda: worker_load(victim).num_waiting + worker_load(victim).num_running >= 2,
            60,
            "prompts prefilling on the victim",
        )
        cluster.kill(victim)
        for future in futures:
            future.result()
    failovers = gateway_metrics(cluster.url).get("tandem_gateway_failovers_total", 0) - failovers_before
    routed = {k: v - before.get(k, 0) for k, v in per_worker(route_counts(cluster.url), "prefill").items()}
    print(f"prefill decisions: {routed}; failovers: {failovers:g}")
    assert [r.status for r in replies] == [200] * len(replies)
    assert all(_ok(r) for r in replies), [r.lines[-2:] for r in replies if not _ok(r)]
    assert failovers >= 2  # those the victim held went to the other prefill worker
    cluster.start_worker(victim)  # the cluster whole again for whatever runs next
    cluster.wait_all_ready(timeout_s=300, ports=paired)
