"""The two servers under test, started on free loopback ports and stopped after: `tandem serve` and
llama.cpp's llama-server. A server given by URL is measured as it is and left running."""

from __future__ import annotations

import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from peer_setup import say

ROOT = Path(__file__).resolve().parents[1]
TANDEM = "Tandem"
PEER = "llama.cpp"
# Tokens of KV per llama-server slot: a 256-token prompt and 128 output tokens, with room for prompts that
# tokenize longer than the client's count. bench_serving sends random ids as text; on Qwen's vocabulary one
# of its 256-id prompts comes back as 1990 tokens (Tandem's context is the model's own, 32768).
SLOT_TOKENS = 2560


@dataclass(slots=True)
class Server:
    """A server under test; `proc` is None when it was already running (given by URL)."""
    name: str
    url: str
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    stop_signal: int = signal.SIGTERM
    decode_metrics_url: str | None = None  # Tandem's decode worker's /metrics, when started here

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        say(f"{self.name}: stopping")
        self.proc.send_signal(self.stop_signal)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ServerFailed(RuntimeError):
    """A server did not start, or answered the benchmark wrongly."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_tandem(serve_args: list[str], run_dir: Path) -> Server:
    """`tandem serve` on free loopback ports, its output in run_dir/tandem.log."""
    port, decode_metrics_port = free_port(), free_port()
    cmd = [str(Path(sys.executable).with_name("tandem")), "serve", "--port", str(port),
           "--prefill-port", str(free_port()), "--decode-port", str(free_port()),
           "--prefill-metrics-port", str(free_port()), "--decode-metrics-port", str(decode_metrics_port),
           "--grpc-port", str(free_port()), "--data-dir", str(run_dir / "tandem-data"), *serve_args]
    server = launch(TANDEM, cmd, port, run_dir / "tandem.log", signal.SIGINT)
    server.decode_metrics_url = f"http://127.0.0.1:{decode_metrics_port}/metrics"
    return server


def start_llama_server(binary: Path, gguf: Path, model_name: str, num_slots: int, extra_args: list[str],
                       run_dir: Path) -> Server:
    """llama-server on `gguf` as `model_name`, with two threads and `num_slots` slots of SLOT_TOKENS each
    (one per concurrent stream), its output in run_dir/llama-server.log.

    SSE pings are off: llama-server sends a `:` comment line after 30 s without a token, which
    bench_serving's completions parser takes for JSON, failing the request."""
    port = free_port()
    cmd = [str(binary), "--model", str(gguf), "--alias", model_name, "--host", "127.0.0.1", "--port", str(port),
           "--threads", "2", "--threads-batch", "2", "--parallel", str(num_slots),
           "--ctx-size", str(num_slots * SLOT_TOKENS), "--sse-ping-interval", "-1", *extra_args]
    return launch(PEER, cmd, port, run_dir / "llama-server.log", signal.SIGTERM)


def launch(name: str, cmd: list[str], port: int, log_path: Path, stop_signal: int) -> Server:
    say(f"{name}: starting ({shlex.join(cmd)}); log {log_path}")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    return Server(name, f"http://127.0.0.1:{port}", proc, log_path, stop_signal)


def wait_ready(server: Server, timeout_s: float) -> None:
    """Poll /health until it answers 200; raises ServerFailed when the process exits or time runs out."""
    start = time.monotonic()
    next_note = start + 15
    while time.monotonic() - start < timeout_s:
        if server.proc is not None and server.proc.poll() is not None:
            raise ServerFailed(f"{server.name} exited with {server.proc.returncode}:\n{log_tail(server)}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                say(f"{server.name}: ready after {time.monotonic() - start:.0f} s at {server.url}")
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > next_note:
            say(f"{server.name}: waiting for /health ({time.monotonic() - start:.0f} s)")
            next_note += 15
        time.sleep(0.5)
    raise ServerFailed(f"{server.name} not ready in {timeout_s:.0f} s:\n{log_tail(server)}")


def log_tail(server: Server) -> str:
    return server.log_path.read_text(errors="replace")[-3000:] if server.log_path else ""
