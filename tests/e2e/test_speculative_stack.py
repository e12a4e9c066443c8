"""Speculative decoding through the three processes. The decode worker started with
`--speculative-algorithm ngram` gives exactly the greedy text of the shared stack (the same settings
without it) for a prompt from the edit workload, accepts drafts, and says so in `/metrics`. One started
with `--speculative-algorithm draft` and the model itself as its draft model builds the draft KV of a
prompt the prefill worker handed over, and has nearly every draft accepted, with the same text."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from launcher.defaults import default_model_path
from tandem.api.v1 import generate_pb2
from tests.e2e.grpc_client import inference_api
from tests.e2e.conftest import CONTEXT_LEN, MODEL
from tests.e2e.stack import Stack, start_stack

WORKLOAD = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "edit_workload.jsonl"
MAX_TOKENS = 32

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def speculative_stack(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    weights_dirs = ("--weights-dir", str(Path(default_model_path()).parent))
    stack = start_stack(tmp_path_factory.mktemp("speculative-stack"), *weights_dirs, "--dtype", "float32",
                        "--quantization", "none", "--context-length", str(CONTEXT_LEN), "--max-total-tokens", "8192",
                        "--torch-threads", "1", "--speculative-algorithm", "ngram",
                        "--speculative-num-draft-tokens", "4", "--speculative-draft-policy", "always")
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def draft_stack(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    stack = start_stack(tmp_path_factory.mktemp("draft-stack"), "--dtype", "float32", "--quantization", "none",
                        "--context-length", str(CONTEXT_LEN), "--max-total-tokens", "8192", "--torch-threads", "1",
                        "--speculative-algorithm", "draft", "--speculative-draft-model-path", default_model_path(),
                        "--speculative-num-draft-tokens", "3", "--speculative-draft-policy", "always")
    yield stack
    stack.stop()


def _greedy_text(url: str, messages: list[dict]) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    reply.raise_for_status()
    return reply.json()["choices"][0]["message"]["content"]


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_ngram_speculation_keeps_the_greedy_text_and_accepts_drafts(stack: Stack, speculative_stack: Stack) -> None:
    messages = json.loads(WORKLOAD.read_text().splitlines()[0])["messages"]
    assert _greedy_text(speculative_stack.url, messages) == _greedy_text(stack.url, messages)
    metrics = speculative_stack.worker_metrics("decode")
    drafts, accepted = _metric(metrics, "tandem_worker_spec_draft_tokens"), _metric(metrics, "tandem_worker_spec_accepted_tokens")
    assert drafts > 0 and 0 < accepted <= drafts
    assert _metric(metrics, "tandem_worker_spec_acceptance_rate") == pytest.approx(accepted / drafts)
    speculative_stack.assert_no_pages_held()


def test_generate_meta_info_says_how_many_steps_verified_drafts(stack: Stack, speculative_stack: Stack) -> None:
    body = {"text": "Count: one two three one two three one two three one two three",
            "sampling_params": {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}}
    meta = httpx.post(f"{speculative_stack.url}/generate", json=body, timeout=300).json()["meta_info"]
    assert meta["completion_tokens"] == 32
    assert 0 < meta["spec_verify_ct"] < 32 and 0 <= meta["spec_accepted_tokens"] < 32
    plain = httpx.post(f"{stack.url}/generate", json=body, timeout=300).json()["meta_info"]
    assert "spec_verify_ct" not in plain and "spec_accepted_tokens" not in plain
    # the gRPC API's MetaInfo says the same
    request = generate_pb2.GenerateRequest(
        text=[body["text"]], sampling_params=generate_pb2.SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True))
    with inference_api(speculative_stack.grpc_target) as api:
        (output,) = api.Generate(request, timeout=120).outputs
    assert (output.meta_info.spec_verify_ct, output.meta_info.spec_accepted_tokens) == (
        meta["spec_verify_ct"], meta["spec_accepted_tokens"])


def test_the_model_drafting_for_itself_keeps_the_text_and_has_its_drafts_accepted(
    stack: Stack, draft_stack: Stack
) -> None:
    messages = json.loads(WORKLOAD.read_text().splitlines()[1])["messages"]
    assert _greedy_text(draft_stack.url, messages) == _greedy_text(stack.url, messages)
    metrics = draft_stack.worker_metrics("decode")
    drafts, accepted = _metric(metrics, "tandem_worker_spec_draft_tokens"), _metric(metrics, "tandem_worker_spec_accepted_tokens")
    assert drafts >= 3 * (MAX_TOKENS // 4 - 1) and accepted >= 0.9 * drafts
    draft_stack.assert_no_pages_held()
