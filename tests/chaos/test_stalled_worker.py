"""A frozen decode worker (SIGSTOP): open streams end with an error event within the stall timeout,
the gateway stops using the worker and /health says so; once it runs again (SIGCONT) it serves again,
byte-identical, and no page stays held."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.e2e.stack import Services, running_services, wait_health

pytestmark = [pytest.mark.slow, pytest.mark.chaos_extended]

STALL_TIMEOUT_S = 3.0
CANARY = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
LONG = {"text": "Tell me a very long story.", "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}}


def _canary(services: Services) -> str:
    reply = httpx.post(f"{services.url}/generate", json=CANARY, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["text"]


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    with running_services(tmp_path, "--dtype", "bfloat16", "--max-total-tokens", "4096", "--torch-threads", "1",
                          gateway_flags=("--stall-timeout", str(STALL_TIMEOUT_S))) as services:
        try:
            yield services
        finally:
            if services.decode.poll() is None:
                os.kill(services.decode.pid, signal.SIGCONT)   # a stopped process would ignore SIGTERM


def test_a_frozen_decode_worker_ends_open_streams_and_leaves_the_pool(services: Services) -> None:
    baseline = _canary(services)
    with httpx.stream("POST", f"{services.url}/generate", json=LONG, timeout=120) as stream:
        events = (line for line in stream.iter_lines() if line.startswith("data:"))
        for _ in range(3):
            assert "error" not in json.loads(next(events)[5:])
        os.kill(services.decode.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        tail = [line for line in events]
    waited = time.monotonic() - frozen_at
    errors = [json.loads(line[5:])["error"] for line in tail if line != "data: [DONE]" and "error" in line]
    assert errors and "stopped responding" in errors[-1]["message"], tail[-3:]
    assert tail[-1] == "data: [DONE]"
    assert waited < STALL_TIMEOUT_S + 8, waited   # the stall timeout, one health check (2 s), slack

    health = httpx.get(f"{services.url}/health", timeout=5)
    assert health.status_code == 503
    assert {w["role"]: w["ready"] for w in health.json()["workers"]}["decode"] is False
    refused = httpx.post(f"{services.url}/generate", json=CANARY, timeout=30)
    assert refused.status_code == 503

    os.kill(services.decode.pid, signal.SIGCONT)
    wait_health(services.url, 200, timeout_s=30)
    assert _canary(services) == baseline
    services.assert_no_pages_held(within_s=10)
