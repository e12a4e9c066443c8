"""Stacks with several prefill and decode workers on loopback: `tandem serve --prefill-workers N
--decode-workers M` (`start_cluster`), or each worker and the gateway as its own process
(`start_cluster_services`), so that one can be drained, restarted or killed alone. Helpers read the
gateway's routing metrics and check that no worker holds a KV page."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx

from tandem.v1 import common_pb2, worker_pb2_grpc
from tests.e2e.stack import (
    _CHILD_ENV,
    _HANDED_OUT,
    ROOT,
    WORKER_METADATA,
    _decode_args,
    _launch,
    _prefill_args,
    free_port,
    hand_out,
    log_tails,
    stop_processes,
)


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """The first of `count` consecutive free ports (worker i of a role listens on the first + i)."""
    for _ in range(200):
        base = random.randrange(20000, 60000 - count)
        if _HANDED_OUT.intersection(range(base, base + count)):
            continue
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind((host, port))
            return hand_out(*range(base, base + count))
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports")


def worker_load(port: int) -> common_pb2.GetLoadResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return worker_pb2_grpc.WorkerServiceStub(channel).GetLoad(
            common_pb2.GetLoadRequest(), timeout=30, metadata=WORKER_METADATA
        )


def pages_held(ports: list[int]) -> dict[int, int]:
    """Pages held by requests (not free, not only cached) on each worker, by gRPC port."""
    loads = {port: worker_load(port) for port in ports}
    return {port: load.num_total_pages - load.num_free_pages - load.num_cached_pages for port, load in loads.items()}


def assert_no_pages_held(ports: list[int], within_s: float = 5.0) -> None:
    """No worker holds a KV page for a request (allowing a moment for aborts in flight)."""
    deadline = time.monotonic() + within_s
    while True:
        held = pages_held(ports)
        if not any(held.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV pages still held: {held}")
        time.sleep(0.1)


def route_counts(url: str) -> dict[tuple[str, str, str], float]:
    """tandem_gateway_route_decisions_total by (role, worker, reason)."""
    counts: dict[tuple[str, str, str], float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("tandem_gateway_route_decisions_total{"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(","))
            labels = {k: v.strip('"') for k, v in labels.items()}
            key = (labels["role"], labels["worker"], labels["reason"])
            counts[key] = counts.get(key, 0) + float(line.split()[-1])
    return counts


def per_worker(counts: dict[tuple[str, str, str], float], role: str) -> dict[str, float]:
    """Decisions for `role`'s workers, by address, whatever the reason."""
    found: dict[str, float] = {}
    for (r, worker, _), value in counts.items():
        if r == role:
            found[worker] = found.get(worker, 0) + value
    return found


def difference(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def wait_workers_ready(url: str, ports: list[int], timeout_s: float) -> None:
    """Until the gateway at `url` reports the worker on each of `ports` ready."""
    wanted = {f"127.0.0.1:{p}" for p in ports}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            info = httpx.get(f"{url}/get_server_info", timeout=5).json()
            if wanted <= {w["address"] for w in info["workers"] if w["ready"]}:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.3)
    raise AssertionError(f"workers {sorted(wanted)} not ready within {timeout_s:g} s")


@dataclass
class Cluster:
    """`tandem serve` with several workers of each role: their gRPC ports and the gateway's URL."""

    proc: subprocess.Popen
    port: int
    prefill_ports: list[int]
    decode_ports: list[int]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def worker_ports(self) -> list[int]:
        return self.prefill_ports + self.decode_ports

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_cluster(tmp_dir: Path, num_prefill: int, num_decode: int, *flags: str, timeout_s: float = 300) -> Cluster:
    """`tandem serve --prefill-workers num_prefill --decode-workers num_decode` with `flags`, each role's
    workers on consecutive free ports (worker metrics on the ports 100 above), files under `tmp_dir`."""
    first, port = free_port_run(num_prefill + num_decode), free_port()
    log_path = tmp_dir / "cluster.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher",
            "serve",
            "--port",
            str(port),
            "--grpc-port",
            "0",
            "--prefill-workers",
            str(num_prefill),
            "--decode-workers",
            str(num_decode),
            "--prefill-port",
            str(first),
            "--decode-port",
            str(first + num_prefill),
            "--data-dir",
            str(tmp_dir / "data"),
            *flags,
        ],
        cwd=ROOT,
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **_CHILD_ENV},
    )
    cluster = Cluster(
        proc,
        port,
        list(range(first, first + num_prefill)),
        list(range(first + num_prefill, first + num_prefill + num_decode)),
        log_path,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tandem serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        if "Tandem is ready" in log_path.read_text():  # one pair; the others may still load
            wait_workers_ready(cluster.url, cluster.worker_ports, max(1.0, deadline - time.monotonic()))
            return cluster
        time.sleep(0.5)
    cluster.stop()
    raise RuntimeError(f"tandem serve not ready in {timeout_s} s:\n{log_path.read_text()[-4000:]}")


@dataclass
class ClusterServices:
    """Each worker and the gateway as its own process: drain (SIGTERM), kill or restart any one."""

    log_dir: Path
    worker_flags: tuple[str, ...]
    prefill_ports: list[int]
    decode_ports: list[int]
    port: int = field(default_factory=free_port)
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)  # by gRPC port
    gateway: subprocess.Popen | None = None
    extra_flags: dict[int, tuple[str, ...]] = field(default_factory=dict)  # a worker's own flags, by port
    num_starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def worker_ports(self) -> list[int]:
        return self.prefill_ports + self.decode_ports

    def start_worker(self, port: int) -> None:
        self.num_starts += 1
        role = "prefill" if port in self.prefill_ports else "decode"
        args = (_prefill_args if role == "prefill" else _decode_args)(
            port, (*self.worker_flags, *self.extra_flags.get(port, ()))
        )
        self.procs[port] = _launch(args, self.log_dir / f"{role}-{port}-{self.num_starts}.log")

    def start_gateway(self, *flags: str, timeout_s: float = 300) -> None:
        addresses = [arg for port in self.prefill_ports for arg in ("--prefill", f"127.0.0.1:{port}")]
        addresses += [arg for port in self.decode_ports for arg in ("--decode", f"127.0.0.1:{port}")]
        self.gateway = _launch(
            ["gateway", "--port", str(self.port), "--grpc-port", "0", *addresses, *flags], self.log_dir / "gateway.log"
        )
        self.wait_all_ready(timeout_s)

    def wait_all_ready(self, timeout_s: float = 300, ports: list[int] | None = None) -> None:
        """Until the gateway reports every worker of `ports` (default: all) ready."""
        try:
            wait_workers_ready(self.url, ports or self.worker_ports, timeout_s)
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{self.logs()}") from None

    def drain(self, port: int, timeout_s: float = 60) -> None:
        """SIGTERM the worker on `port` and wait until it exits (it drains first)."""
        proc = self.procs[port]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout_s)
        assert proc.returncode == 0, f"the worker on {port} exited with {proc.returncode}"

    def kill(self, port: int) -> None:
        self.procs[port].kill()
        self.procs[port].wait()

    def stop(self) -> None:
        stop_processes([p for p in (self.gateway, *self.procs.values()) if p is not None], grace_s=30)

    def logs(self, num_chars: int = 2000) -> str:
        return log_tails(self.log_dir, num_chars)


def start_cluster_services(
    tmp_dir: Path,
    num_prefill: int,
    num_decode: int,
    *worker_flags: str,
    extra_decode_flags: tuple[tuple[str, ...], ...] = (),
) -> ClusterServices:
    """`num_prefill` prefill and `num_decode` decode workers with `worker_flags`, plus one more decode
    worker per entry of `extra_decode_flags` (with those flags too); call `start_gateway` next."""
    services = ClusterServices(
        tmp_dir,
        tuple(worker_flags),
        [free_port() for _ in range(num_prefill)],
        [free_port() for _ in range(num_decode + len(extra_decode_flags))],
    )
    for port, flags in zip(services.decode_ports[num_decode:], extra_decode_flags):
        services.extra_flags[port] = flags
    for port in services.worker_ports:
        services.start_worker(port)
    return services
