"""Start `tandem serve` (three real processes) on free loopback ports for a test module."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx

from tandem.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@dataclass
class Stack:
    proc: subprocess.Popen
    port: int
    prefill_port: int
    decode_port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def load(self) -> dict[str, common_pb2.GetLoadResponse]:
        loads = {}
        for role, port, stub_cls in (("prefill", self.prefill_port, prefill_pb2_grpc.PrefillServiceStub),
                                     ("decode", self.decode_port, decode_pb2_grpc.DecodeServiceStub)):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                loads[role] = stub_cls(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=5)
        return loads

    def assert_no_pages_held(self, within_s: float = 5.0) -> None:
        """Every KV page on both workers is free (allowing a moment for in-flight aborts)."""
        deadline = time.monotonic() + within_s
        while True:
            loads = self.load()
            held = {role: l.num_total_pages - l.num_free_pages for role, l in loads.items()}
            if not any(held.values()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"KV pages still held after the test: {held}")
            time.sleep(0.1)

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
    port, prefill_port, decode_port = free_port(), free_port(), free_port()
    log_path = tmp_dir / "stack.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher", "serve", "--port", str(port), "--prefill-port", str(prefill_port),
         "--decode-port", str(decode_port), *flags],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    stack = Stack(proc, port, prefill_port, decode_port, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tandem serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        if "Tandem is ready" in log_path.read_text():
            return stack
        time.sleep(0.5)
    stack.stop()
    raise RuntimeError(f"tandem serve not ready in {timeout_s} s:\n{log_path.read_text()[-4000:]}")


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
