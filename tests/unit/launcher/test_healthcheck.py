"""`tandem healthcheck` against real servers on loopback: a gRPC health service and an HTTP endpoint."""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from launcher.cli import main

REPO_ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def grpc_health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def http_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_grpc_serving_not_serving_and_unknown_service(grpc_health_server, capsys):
    address, servicer = grpc_health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert main(["healthcheck", "--grpc", address]) == 0
    assert "healthy" in capsys.readouterr().out
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert main(["healthcheck", "--grpc", address]) == 1
    assert "NOT_SERVING" in capsys.readouterr().err
    assert main(["healthcheck", "--grpc", address, "--service", "tandem.v1.NoSuchService"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_grpc_nothing_listening_is_unhealthy(capsys):
    assert main(["healthcheck", "--grpc", f"127.0.0.1:{free_port()}", "--timeout", "0.5"]) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err or "DEADLINE_EXCEEDED" in err


def test_http_status_decides(http_server, capsys):
    assert main(["healthcheck", "--http", f"{http_server}/health"]) == 0
    assert main(["healthcheck", "--http", f"{http_server}/other"]) == 1
    assert "HTTP 503" in capsys.readouterr().err
    assert main(["healthcheck", "--http", f"http://127.0.0.1:{free_port()}/health", "--timeout", "0.5"]) == 1


def test_one_target_is_required():
    with pytest.raises(SystemExit):
        main(["healthcheck"])
    with pytest.raises(SystemExit):
        main(["healthcheck", "--grpc", "a:1", "--http", "http://a"])


def test_the_command_imports_no_torch(grpc_health_server):
    """Container health checks run it every few seconds: it must stay light."""
    address, servicer = grpc_health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    code = ("import sys; from launcher.cli import main; rc = main(['healthcheck', '--grpc', sys.argv[1]]); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'; sys.exit(rc)")
    result = subprocess.run([sys.executable, "-c", code, address], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
