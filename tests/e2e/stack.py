"""Start `tandem serve` (three real processes) on free loopback ports for a test module; or the three
services as separate processes (`start_services`), so that one can be killed and restarted alone."""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx

from tandem.v1 import common_pb2, worker_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
# Every stack and service this test process starts shares one internal token (by environment, as
# `tandem serve` hands its own down); tests that call a worker directly send WORKER_METADATA.
INTERNAL_TOKEN = secrets.token_urlsafe(24)
WORKER_METADATA = (("authorization", f"Bearer {INTERNAL_TOKEN}"),)
_CHILD_ENV = {"PYTHONUNBUFFERED": "1", "TANDEM_INTERNAL_TOKEN": INTERNAL_TOKEN}
# Workers started alone share a KV grant secret, as `tandem serve` hands its own to its workers; a gateway gets none.
_WORKER_ENV = {"TANDEM_KV_GRANT_SECRET": secrets.token_urlsafe(24)}


# Every port this test process has handed out: a port is released once chosen, and the kernel may offer it
# again before the server it was chosen for binds it (two of one stack's ports then collide).
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free loopback port that no earlier call in this test process returned."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            return hand_out(port)


def hand_out(*ports: int) -> int:
    """Record `ports` as taken (free_port will not return them); the first."""
    _HANDED_OUT.update(ports)
    return ports[0]


def child_pids(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def wait_until_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP is delivered to each thread as it next runs; under load a thread may still answer a
    request right after os.kill. Wait until every thread of `pid` reports state T (stopped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
        if all(state in ("T", "t") for state in states):
            return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} did not stop within {timeout_s} s")


class WorkerPages:
    """Page checks over a prefill and a decode worker's gRPC ports (`prefill_port`, `decode_port`)."""

    prefill_port: int
    decode_port: int

    def load(self) -> dict[str, common_pb2.GetLoadResponse]:
        loads = {}
        for role, port in (("prefill", self.prefill_port), ("decode", self.decode_port)):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                loads[role] = worker_pb2_grpc.WorkerServiceStub(channel).GetLoad(
                    common_pb2.GetLoadRequest(), timeout=30, metadata=WORKER_METADATA
                )  # waits for a step to end
        return loads

    def assert_no_pages_held(self, within_s: float = 5.0) -> None:
        """No request holds a KV page on either worker: every page is free or kept only by the prefix
        cache (allowing a moment for in-flight aborts)."""
        deadline = time.monotonic() + within_s
        while True:
            loads = self.load()
            held = {
                role: load.num_total_pages - load.num_free_pages - load.num_cached_pages for role, load in loads.items()
            }
            if not any(held.values()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"KV pages still held after the test: {held}\n{self.warnings()}")
            time.sleep(0.1)

    def log_files(self) -> list[Path]:
        return []

    def warnings(self, num_lines: int = 30) -> str:
        """The last `num_lines` WARNING and ERROR lines of the services' logs: why a page may be held."""
        lines = [
            f"{path.name}: {line}"
            for path in self.log_files()
            for line in path.read_text(errors="replace").splitlines()
            if " WARNING " in line or " ERROR " in line
        ]
        return "\n".join(lines[-num_lines:])


@dataclass
class Stack(WorkerPages):
    proc: subprocess.Popen
    port: int
    prefill_port: int
    decode_port: int
    log_path: Path
    prefill_metrics_port: int = 0
    decode_metrics_port: int = 0
    grpc_port: int = 0  # the gateway's gRPC API (tandem.api.v1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def worker_metrics(self, role: str) -> str:
        """The Prometheus text of the `role` worker's metrics endpoint."""
        port = self.prefill_metrics_port if role == "prefill" else self.decode_metrics_port
        reply = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        reply.raise_for_status()
        return reply.text

    def log_files(self) -> list[Path]:
        return [self.log_path]

    def stop(self) -> list[int]:
        """SIGINT the supervisor (as Ctrl-C would); returns child pids still alive after it exits."""
        children = child_pids(self.proc.pid)
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        time.sleep(0.5)
        return [pid for pid in children if is_alive(pid)]


def start_stack(tmp_dir: Path, *flags: str, timeout_s: float = 300) -> Stack:
    """`tandem serve` with `flags`; its gateway keeps files and batches under `tmp_dir/data` unless
    `flags` has a --data-dir. The workers serve their metrics on free ports (`Stack.worker_metrics`), the
    gateway its gRPC API on one too (`Stack.grpc_port`) unless `flags` has a --grpc-port."""
    port, prefill_port, decode_port = free_port(), free_port(), free_port()
    prefill_metrics_port, decode_metrics_port = free_port(), free_port()
    if "--data-dir" not in flags:
        flags = (*flags, "--data-dir", str(tmp_dir / "data"))
    if "--grpc-port" not in flags:
        flags = (*flags, "--grpc-port", str(free_port()))
    grpc_port = int(flags[flags.index("--grpc-port") + 1])
    flags = (
        *flags,
        "--prefill-metrics-port",
        str(prefill_metrics_port),
        "--decode-metrics-port",
        str(decode_metrics_port),
    )
    log_path = tmp_dir / "stack.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher",
            "serve",
            "--port",
            str(port),
            "--prefill-port",
            str(prefill_port),
            "--decode-port",
            str(decode_port),
            *flags,
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **_CHILD_ENV},
    )
    stack = Stack(proc, port, prefill_port, decode_port, log_path, prefill_metrics_port, decode_metrics_port, grpc_port)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tandem serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        if "Tandem is ready" in log_path.read_text():
            return stack
        time.sleep(0.2)
    stack.stop()
    raise RuntimeError(f"tandem serve not ready in {timeout_s} s:\n{log_path.read_text()[-4000:]}")


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll until `condition()` holds; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what}")
        time.sleep(0.05)


def stop_processes(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every process still running, then wait for each; one not gone within `grace_s` is killed."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def log_tails(log_dir: Path, num_chars: int) -> str:
    """The last `num_chars` of every *.log file in `log_dir`, each under its name."""
    return "\n".join(f"--- {p.name}\n{p.read_text()[-num_chars:]}" for p in sorted(log_dir.glob("*.log")))


def wait_health(url: str, status: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == status:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"/health never returned {status}")


@dataclass
class Services(WorkerPages):
    """Prefill, decode and gateway as three separate processes (`tandem prefill|decode|gateway`), unlike
    `tandem serve`, which stops everything when one child dies: here the gateway or either worker can be
    killed and started again on its own."""

    prefill: subprocess.Popen
    decode: subprocess.Popen
    port: int
    prefill_port: int
    decode_port: int
    log_dir: Path
    gateway: subprocess.Popen | None = None
    num_gateway_starts: int = 0
    worker_flags: tuple[str, ...] = ()
    num_decode_starts: int = 1
    num_prefill_starts: int = 1
    prefill_env: dict[str, str] | None = None  # extra environment of the prefill worker (fault hooks)
    decode_env: dict[str, str] | None = None
    grpc_port: int = field(default_factory=free_port)  # the gateway's gRPC API, the same across restarts

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start_gateway(self, *flags: str, timeout_s: float = 120) -> None:
        """Start a gateway with `flags` (e.g. --data-dir), its gRPC API on `grpc_port`, and wait until
        /health answers 200."""
        self.num_gateway_starts += 1
        log_path = self.log_dir / f"gateway-{self.num_gateway_starts}.log"
        self.gateway = _launch(
            [
                "gateway",
                "--port",
                str(self.port),
                "--grpc-port",
                str(self.grpc_port),
                "--prefill",
                f"127.0.0.1:{self.prefill_port}",
                "--decode",
                f"127.0.0.1:{self.decode_port}",
                *flags,
            ],
            log_path,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in (("gateway", self.gateway), ("prefill", self.prefill), ("decode", self.decode)):
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the gateway was not ready in {timeout_s} s:\n{self.logs()}")

    def kill_gateway(self) -> None:
        """SIGKILL the gateway, as a crash would: no shutdown code runs."""
        assert self.gateway is not None
        self.gateway.kill()
        self.gateway.wait()

    def kill_decode(self) -> None:
        """SIGKILL the decode worker, as a crash would."""
        self.decode.kill()
        self.decode.wait()

    def start_decode(self) -> None:
        """Start a decode worker again, on the same ports and flags (it loads in the background)."""
        self.num_decode_starts += 1
        self.decode = _launch(
            _decode_args(self.decode_port, self.worker_flags),
            self.log_dir / f"decode-{self.num_decode_starts}.log",
            self.decode_env,
        )

    def kill_prefill(self) -> None:
        """SIGKILL the prefill worker, as a crash would."""
        self.prefill.kill()
        self.prefill.wait()

    def start_prefill(self) -> None:
        """Start a prefill worker again, on the same ports and flags (it loads in the background)."""
        self.num_prefill_starts += 1
        self.prefill = _launch(
            _prefill_args(self.prefill_port, self.worker_flags),
            self.log_dir / f"prefill-{self.num_prefill_starts}.log",
            self.prefill_env,
        )

    def stop(self) -> None:
        stop_processes([p for p in (self.gateway, self.prefill, self.decode) if p is not None], grace_s=20)

    def logs(self, num_chars: int = 3000) -> str:
        return log_tails(self.log_dir, num_chars)

    def log_files(self) -> list[Path]:
        return sorted(self.log_dir.glob("*.log"))


@contextlib.contextmanager
def running_services(
    tmp_dir: Path,
    *worker_flags: str,
    gateway_flags: tuple[str, ...] = (),
    prefill_env: dict[str, str] | None = None,
    decode_env: dict[str, str] | None = None,
) -> Iterator[Services]:
    """Workers started with `worker_flags`, and a gateway with `gateway_flags` (data in tmp_dir/data),
    all ready; stopped on the way out."""
    services = start_services(tmp_dir, *worker_flags, prefill_env=prefill_env, decode_env=decode_env)
    try:
        services.start_gateway("--data-dir", str(tmp_dir / "data"), *gateway_flags, timeout_s=300)
        yield services
    finally:
        services.stop()


def start_services(
    tmp_dir: Path,
    *worker_flags: str,
    prefill_env: dict[str, str] | None = None,
    decode_env: dict[str, str] | None = None,
) -> Services:
    """Start a prefill and a decode worker with `worker_flags` (and each with its extra environment, if
    given: e.g. a TANDEM_FAULT_* hook); call `start_gateway` next."""
    port, prefill_port, decode_port = free_port(), free_port(), free_port()
    prefill = _launch(_prefill_args(prefill_port, worker_flags), tmp_dir / "prefill.log", prefill_env)
    decode = _launch(_decode_args(decode_port, worker_flags), tmp_dir / "decode.log", decode_env)
    return Services(
        prefill,
        decode,
        port,
        prefill_port,
        decode_port,
        tmp_dir,
        worker_flags=tuple(worker_flags),
        prefill_env=prefill_env,
        decode_env=decode_env,
    )


def _prefill_args(port: int, worker_flags: tuple[str, ...]) -> list[str]:
    return ["prefill", "--port", str(port), "--metrics-port", "0", *worker_flags]


def _decode_args(port: int, worker_flags: tuple[str, ...]) -> list[str]:
    return ["decode", "--port", str(port), "--metrics-port", "0", *worker_flags]


def _launch(args: list[str], log_path: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    log = open(log_path, "w")
    return subprocess.Popen(
        [sys.executable, "-m", "launcher", *args],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **_CHILD_ENV, **(_WORKER_ENV if args[0] != "gateway" else {}), **(extra_env or {})},
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: the services die with the test process, even if it is killed."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass
