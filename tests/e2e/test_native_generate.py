"""SGLang's /generate beyond the quick start: batches, n, stop reasons, timings, logprob consistency."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from gateway.tokenizer import load_tokenizer
from tests.e2e.stack import Stack

pytestmark = pytest.mark.slow


def _generate(stack: Stack, **body):
    response = httpx.post(f"{stack.url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_batches_of_text_and_input_ids_answer_lists_in_order(stack: Stack, smollm2_path: Path) -> None:
    tokenizer = load_tokenizer(str(smollm2_path))
    greedy = {"temperature": 0, "max_new_tokens": 6}
    texts = ["The capital of France is", "One, two, three,"]
    singles = [_generate(stack, text=t, sampling_params=greedy)["text"] for t in texts]
    batch = _generate(stack, text=texts, sampling_params=greedy)
    assert [r["text"] for r in batch] == singles
    by_ids = _generate(stack, input_ids=[tokenizer.encode(t) for t in texts], sampling_params=greedy)
    assert [r["text"] for r in by_ids] == singles
    assert len({r["meta_info"]["id"] for r in batch}) == 2


def test_n_samples_and_a_stream_of_several_generations_carries_indexes(stack: Stack) -> None:
    params = {"temperature": 1.0, "max_new_tokens": 6, "n": 3, "seed": 11}
    answers = _generate(stack, text="Once upon a time", sampling_params=params)
    assert len(answers) == 3
    with httpx.stream("POST", f"{stack.url}/generate", timeout=120, json={
            "text": ["Hello", "Goodbye"], "sampling_params": {"temperature": 0, "max_new_tokens": 4},
            "stream": True}) as response:
        events = [json.loads(line[5:]) for line in response.iter_lines()
                  if line.startswith("data:") and line != "data: [DONE]"]
    assert {e["index"] for e in events} == {0, 1}
    finals = {e["index"]: e for e in events if e["meta_info"]["finish_reason"]}
    assert set(finals) == {0, 1} and all(f["meta_info"]["completion_tokens"] == 4 for f in finals.values())


def test_finish_reasons_and_phase_timings(stack: Stack) -> None:
    stopped = _generate(stack, text="Count: 1, 2, 3,", sampling_params={"temperature": 0, "max_new_tokens": 12,
                                                                         "stop": [" 5"]})
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 5"}
    assert " 5" not in stopped["text"]
    length = _generate(stack, text="Count: 1, 2, 3,", sampling_params={"temperature": 0, "max_new_tokens": 3})
    assert length["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    timings = length["meta_info"]["tandem_timings"]
    assert timings["kv_bytes"] > 0 and timings["kv_transfer_ms"] >= 0
    assert timings["first_token_ms"] >= timings["prefill_compute_ms"] > 0
    assert length["meta_info"]["e2e_latency"] * 1000 >= timings["first_token_ms"]


def test_unknown_sampling_params_and_bad_shapes_are_400(stack: Stack) -> None:
    for body in ({"text": "x", "sampling_params": {"temprature": 0}},
                 {"text": ["a", "b"], "sampling_params": [{}]},
                 {"text": "x", "input_ids": [1]},
                 {"text": "x", "sampling_params": {"n": 0}}):
        response = httpx.post(f"{stack.url}/generate", json=body)
        assert response.status_code == 400, body
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
