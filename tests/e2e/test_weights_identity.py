"""Workers name their weights by the checkpoint's content: a worker restarted after a weights update
pairs again once its weights agree, and until then the gateway uses no mismatched pair and /health
says so (three processes started apart, two tiny random models of the same shapes)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.stack import Services, start_services, wait_health
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.slow

_BODY = {"input_ids": [5, 17, 42, 99, 7], "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}


def _generate(services: Services) -> list[int]:
    reply = httpx.post(f"{services.url}/generate", json=_BODY, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["output_ids"]


def _update(services: Services, model: Path) -> None:
    reply = httpx.post(f"{services.url}/update_weights_from_disk", json={"model_path": str(model)}, timeout=120)
    assert reply.status_code == 200 and reply.json()["success"], reply.text


def _restart_decode(services: Services) -> None:
    services.kill_decode()
    services.start_decode()
    wait_health(services.url, 503, timeout_s=10)   # the gateway notices the dead worker


def _health_once_both_ready(services: Services, timeout_s: float = 120) -> httpx.Response:
    """/health as soon as both workers report ready (its body lists them only while it is 503)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reply = httpx.get(f"{services.url}/health", timeout=5)
        if reply.status_code == 200 or all(w["ready"] for w in reply.json()["workers"]):
            return reply
        time.sleep(0.2)
    raise AssertionError(f"the workers were not ready in {timeout_s} s:\n{services.logs()}")


def test_a_restarted_worker_pairs_again_only_with_the_same_weights(tmp_path: Path) -> None:
    first, second = save_tiny_llama(tmp_path / "first", seed=1), save_tiny_llama(tmp_path / "second", seed=5)
    services = start_services(tmp_path, "--model-path", str(first), "--weights-dir", str(tmp_path), "--dtype",
                              "float32", "--max-total-tokens", "512", "--torch-threads", "1")
    try:
        services.start_gateway("--model-path", str(first), "--skip-tokenizer-init", "--data-dir", str(tmp_path / "data"),
                               timeout_s=300)
        before = _generate(services)

        # restarted with the same weights: it pairs again by itself
        _restart_decode(services)
        wait_health(services.url, 200, timeout_s=120)
        assert _generate(services) == before

        # both updated to other weights; then the decode worker restarts with its --model-path's weights
        _update(services, second)
        updated = _generate(services)
        assert updated != before
        _restart_decode(services)
        reply = _health_once_both_ready(services)
        assert reply.status_code == 503   # a ready but mismatched pair is no pair
        weights = {w["role"]: w["weights"] for w in reply.json()["workers"]}
        assert weights["prefill"] != weights["decode"]
        refused = httpx.post(f"{services.url}/generate", json=_BODY, timeout=60)
        assert refused.status_code == 503
        assert "same model weights" in refused.json()["error"]["message"]

        # updating it to the same weights makes a pair again, with the updated model's output
        _update(services, second)
        wait_health(services.url, 200, timeout_s=10)
        assert _generate(services) == updated
    finally:
        services.stop()
