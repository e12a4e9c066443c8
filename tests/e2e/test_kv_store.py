"""The cluster's KV store through `tandem serve --kv-store` (real processes, the bundled SmolLM2, two prefill
workers, round robin): a prompt one prefill worker computed is read from the store by the other, with the
same greedy tokens; and when the store dies, the stack serves on, recomputing, with no error to a client."""

from __future__ import annotations

import os
import random
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("mooncake.store", reason="Mooncake Store is not installed")

from tests.e2e.cluster_stack import assert_no_pages_held, free_port_run, start_cluster  # noqa: E402 - after the skip
from tests.e2e.stack import child_pids, is_alive  # noqa: E402

PAGE = 16
NEW_TOKENS = 12


def _generate(url: str, ids: list[int]) -> dict:
    reply = httpx.post(
        f"{url}/generate",
        timeout=120,
        json={
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        },
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def _store_pages(port: int, state: str) -> float:
    """The `store` tier's pages in `state` on the worker whose gRPC port is `port` (metrics 100 above)."""
    text = httpx.get(f"http://127.0.0.1:{port + 100}/metrics", timeout=5).text
    found = re.search(rf'tandem_worker_kv_tier_pages{{state="{state}",tier="store"}} (\S+)', text)
    found = found or re.search(rf'tandem_worker_kv_tier_pages{{tier="store",state="{state}"}} (\S+)', text)
    assert found, f"no store/{state} gauge on worker {port}"
    return float(found.group(1))


def _puts_landed(ports: list[int], num_pages: int) -> bool:
    """Whether the workers have put `num_pages` pages between them and none is still on its way."""
    saved = sum(_store_pages(port, "saved") for port in ports)
    return saved >= num_pages and not any(_store_pages(port, "pending") for port in ports)


def _store_process(serve_pid: int) -> int:
    for pid in child_pids(serve_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"kv-store" in f.read():
                return pid
    raise AssertionError("tandem serve runs no kv-store child")


def test_a_prefix_one_prefill_worker_computed_the_other_reads_from_the_store_and_a_dead_store_costs_no_request(
    tmp_path: Path,
) -> None:
    rng = random.Random(4)
    prompt = [rng.randrange(100, 40000) for _ in range(200)]
    flags = (
        "--kv-store",
        "--kv-store-port",
        str(free_port_run(2)),  # the store's metrics listen on the next port
        "--kv-store-gb",
        "0.5",
        "--router-policy",
        "round_robin",
        "--local-prefill-threshold",
        "0",  # every prompt goes to a prefill worker
        "--disable-decode-prefix-cache",  # so the second one is not held on decode already
    )
    cluster = start_cluster(tmp_path, 2, 1, *flags)
    try:
        computed = _generate(cluster.url, prompt)  # on one prefill worker, its pages put in the store
        full_pages = (len(prompt) - 1) // PAGE  # every full page but the one with the last token
        deadline = time.monotonic() + 30  # the puts run in the background: wait until they are in the store
        while not _puts_landed(cluster.prefill_ports, full_pages):
            assert time.monotonic() < deadline, "the first worker's puts did not reach the store"
            time.sleep(0.1)
        from_store = _generate(cluster.url, prompt)  # on the other, which never saw it
        assert computed["meta_info"]["cached_tokens"] == 0
        failed = [_store_pages(port, "failed") for port in cluster.prefill_ports]
        assert from_store["meta_info"]["cached_tokens"] == full_pages * PAGE, f"lookups that failed: {failed}"
        assert from_store["output_ids"] == computed["output_ids"]
        deadline = time.monotonic() + 10  # the gauges follow the engine's stats a moment later
        while sorted(loaded := [_store_pages(p, "loaded") for p in cluster.prefill_ports]) != [0, full_pages]:
            assert time.monotonic() < deadline, loaded
            time.sleep(0.2)
        assert sum(_store_pages(port, "dropped") for port in cluster.prefill_ports) == 0

        store = _store_process(cluster.proc.pid)
        with open(f"/proc/{store}/task/{store}/children") as f:
            master = [int(pid) for pid in f.read().split()]
        os.kill(store, signal.SIGKILL)  # a crash: its master goes with it
        deadline = time.monotonic() + 10
        while any(is_alive(pid) for pid in [store, *master]) and time.monotonic() < deadline:
            time.sleep(0.1)
        other = [rng.randrange(100, 40000) for _ in range(200)]
        answers = [_generate(cluster.url, ids) for ids in (other, other, prompt)]  # each 200 (checked)
        assert answers[0]["output_ids"] == answers[1]["output_ids"]
        assert answers[2]["output_ids"] == computed["output_ids"]
        assert cluster.proc.poll() is None  # the stack serves on without its store
        assert "kv-store exited" in cluster.log_path.read_text()
        assert_no_pages_held(cluster.worker_ports)
    finally:
        cluster.stop()
