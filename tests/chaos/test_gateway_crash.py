"""The gateway SIGKILLed mid-stream (reliability.md scenario 7): the workers see their gRPC streams
cancelled and drop every request within 2 s (no orphan generation runs on to max_new_tokens, no page
stays held); a new gateway serves the canary byte for byte."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.chaos.checks import assert_nothing_leaked, assert_still_serving, canary, leaks, worker_load
from tests.e2e.stack import Services, running_services

pytestmark = [pytest.mark.slow, pytest.mark.chaos_extended]

NUM_STREAMS = 4
LONG = {"stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True}}
MAX_SECONDS_TO_DROP = 2.0


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    with running_services(tmp_path, "--dtype", "bfloat16", "--max-total-tokens", "8192", "--torch-threads",
                          "1") as services:
        yield services


def _read_until_cut(url: str, i: int) -> int:
    """Stream a long generation until the connection breaks; returns the events read."""
    num_events = 0
    try:
        with httpx.stream("POST", f"{url}/generate", json={**LONG, "text": f"Tell me story number {i}."},
                          timeout=120) as response:
            for line in response.iter_lines():
                num_events += line.startswith("data:")
    except httpx.HTTPError:
        pass
    return num_events


def test_workers_drop_every_request_of_a_killed_gateway_within_2_s(services: Services) -> None:
    baseline = canary(services.url)
    with ThreadPoolExecutor(NUM_STREAMS) as pool:
        futures = [pool.submit(_read_until_cut, services.url, i) for i in range(NUM_STREAMS)]
        deadline = time.monotonic() + 120
        while worker_load(services.decode_port).num_running < NUM_STREAMS:   # every one decoding
            assert time.monotonic() < deadline, "the streams never all reached the decode worker"
            time.sleep(0.1)
        time.sleep(1.0)
        services.kill_gateway()
        killed_at = time.monotonic()
        while found := leaks(services):   # (the gateway is dead: the workers alone are checked)
            assert time.monotonic() - killed_at < MAX_SECONDS_TO_DROP, found
            time.sleep(0.05)
        seconds_to_drop = time.monotonic() - killed_at
        events = [future.result() for future in futures]
    print(f"kill -> workers idle, pages free: {seconds_to_drop:.2f} s (events per stream before: {events})")
    assert all(n >= 1 for n in events), events

    services.start_gateway("--data-dir", str(services.log_dir / "data"), timeout_s=60)
    assert_still_serving(services.url, baseline)
    assert_nothing_leaked(services)
