"""What the routing benchmarks share: a cluster of prefill and decode workers (each its own process, on
free loopback ports, flags per role) with one gateway per configuration under test over the same
workers, and a client that sends token-id prompts to /generate and keeps each answer's meta_info.

Configurations are compared in the same run on the same workers, one phase at a time, each phase
starting from empty prefix caches (/flush_cache), so that what differs is the gateway's routing alone.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.cluster_stack import ClusterServices, assert_no_pages_held, wait_workers_ready  # noqa: E402
from tests.e2e.stack import _launch, free_port, stop_processes  # noqa: E402


@dataclass
class Cluster:
    """Workers (`services`) and a gateway URL per configuration name."""

    services: ClusterServices
    gateways: dict[str, str] = field(default_factory=dict)
    procs: list = field(default_factory=list)

    def stop(self) -> None:
        """SIGTERM the gateways, then the workers; any process not gone within 30 s is killed."""
        stop_processes(self.procs, grace_s=30)
        self.services.stop()


@contextlib.contextmanager
def kv_store(run_dir: Path, memory_gib: float = 4.0) -> Iterator[str]:
    """`tandem kv-store` on a free loopback port while the block runs; yields its address for --kv-store."""
    port = free_port()
    log = run_dir / "kv-store.log"
    proc = _launch(["kv-store", "--port", str(port), "--memory-gb", str(memory_gib)], log)
    try:
        deadline = time.monotonic() + 60
        while b"KV store ready" not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tandem kv-store did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        stop_processes([proc], grace_s=10)


def start_cluster(run_dir: Path, num_prefill: int, num_decode: int, common: list[str], prefill_flags: list[str],
                  decode_flags: list[str], gateways: dict[str, list[str]]) -> Cluster:
    """`num_prefill` + `num_decode` workers (`common` flags plus their role's) and a gateway per entry of
    `gateways` (name -> its flags), all ready."""
    services = ClusterServices(run_dir, tuple(common), [free_port() for _ in range(num_prefill)],
                               [free_port() for _ in range(num_decode)])
    for port in services.prefill_ports:
        services.extra_flags[port] = tuple(prefill_flags)
    for port in services.decode_ports:
        services.extra_flags[port] = tuple(decode_flags)
    for port in services.worker_ports:
        services.start_worker(port)
    cluster = Cluster(services)
    addresses = [a for p in services.prefill_ports for a in ("--prefill", f"127.0.0.1:{p}")]
    addresses += [a for p in services.decode_ports for a in ("--decode", f"127.0.0.1:{p}")]
    try:
        for name, flags in gateways.items():
            port = free_port()
            cluster.procs.append(_launch(["gateway", "--port", str(port), "--grpc-port", "0", "--data-dir",
                                          str(run_dir / f"data-{name}"), *addresses, *flags],
                                         run_dir / f"gateway-{name}.log"))
            cluster.gateways[name] = f"http://127.0.0.1:{port}"
        for url in cluster.gateways.values():
            wait_workers_ready(url, services.worker_ports, 600)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def fresh(cluster: Cluster, url: str) -> None:
    """Before a phase: no page held anywhere, every prefix cache empty (and the gateway's view of them)."""
    assert_no_pages_held(cluster.services.worker_ports, within_s=30)
    reply = httpx.post(f"{url}/flush_cache", timeout=60)
    assert reply.status_code == 200, reply.text


def generate_reply(url: str, input_ids: list[int], max_new_tokens: int) -> dict:
    """One greedy /generate of `input_ids` (exactly `max_new_tokens` out: eos ignored); the whole JSON
    answer, with the client's own seconds added to its meta_info. RuntimeError on any status but 200."""
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                                        "ignore_eos": True}}
    started = time.perf_counter()
    reply = httpx.post(f"{url}/generate", json=body, timeout=900)
    if reply.status_code != 200:
        raise RuntimeError(f"/generate of a {len(input_ids)}-token prompt answered {reply.status_code}: "
                           f"{reply.text[:2000]}")
    answer = reply.json()
    answer["meta_info"]["client_seconds"] = time.perf_counter() - started
    return answer


def generate(url: str, input_ids: list[int], max_new_tokens: int) -> dict:
    """One greedy /generate of `input_ids`; its meta_info, with the client's own seconds added."""
    return generate_reply(url, input_ids, max_new_tokens)["meta_info"]


def closed_loop(url: str, prompts: list[list[int]], concurrency: int, max_new_tokens: int) -> list[dict]:
    """Every prompt, `concurrency` at a time in order; the metas in prompt order."""
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda ids: generate(url, ids, max_new_tokens), prompts))


def open_loop(url: str, prompts: list[list[int]], arrivals: list[float], max_new_tokens: int) -> list[dict]:
    """Each prompt sent at its arrival time (seconds from the start), whatever is still running."""
    started = time.perf_counter()

    def send(i: int) -> dict:
        time.sleep(max(0.0, started + arrivals[i] - time.perf_counter()))
        return generate(url, prompts[i], max_new_tokens)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(send, range(len(prompts))))


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def ttft_ms(metas: list[dict]) -> list[float]:
    """Each answer's time to first token at the gateway, from its HTTP arrival (meta_info.tandem_timings)."""
    return [m["tandem_timings"]["first_token_ms"] for m in metas]
