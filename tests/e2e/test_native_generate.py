"""SGLang's /generate beyond the quick start: batches, n, stop reasons, timings, logprob consistency."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from gateway.text.tokenizer import load_tokenizer
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
    assert set(timings) == {"gateway_queue_ms", "reserve_ms", "prefill_queue_ms", "prefill_compute_ms",
                            "kv_transfer_ms", "kv_bytes", "decode_queue_ms", "first_token_ms", "prefill_path",
                            "decode_cached_tokens"}
    assert timings["decode_cached_tokens"] == 0   # a prompt shorter than a page: nothing to hold
    assert timings["prefill_path"] == "disaggregated"   # the default: every prompt through a prefill worker
    assert timings["kv_bytes"] > 0 and timings["kv_transfer_ms"] >= 0
    assert timings["gateway_queue_ms"] > 0 and timings["prefill_queue_ms"] > 0 and timings["decode_queue_ms"] > 0
    phases = (timings["gateway_queue_ms"] + timings["reserve_ms"] + timings["prefill_queue_ms"]
              + timings["prefill_compute_ms"] + timings["kv_transfer_ms"])
    assert timings["first_token_ms"] >= phases
    assert timings["first_token_ms"] >= timings["prefill_compute_ms"] > 0
    assert length["meta_info"]["e2e_latency"] * 1000 >= timings["first_token_ms"]


def test_prompt_logprobs_from_logprob_start_len_agree_with_the_output_logprobs(stack: Stack,
                                                                               smollm2_path: Path) -> None:
    """Score a greedy answer as part of the prompt: its tokens' input logprobs are the logprobs they
    had when generated (one forward pass over the whole sequence against step-by-step decoding)."""
    tokenizer = load_tokenizer(str(smollm2_path))
    prompt = tokenizer.encode("The capital of France is")
    first = _generate(stack, input_ids=prompt, return_logprob=True, top_logprobs_num=2, token_ids_logprob=[11],
                      sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
    answer = first["output_ids"]
    meta = _generate(stack, input_ids=prompt + answer, return_logprob=True, logprob_start_len=len(prompt),
                     top_logprobs_num=2, token_ids_logprob=[11], return_text_in_logprobs=True,
                     sampling_params={"temperature": 0, "max_new_tokens": 1})["meta_info"]
    scored = meta["input_token_logprobs"]
    assert [t[1] for t in scored] == answer and len(meta["input_top_logprobs"]) == len(answer)
    assert [t[0] for t in scored] == pytest.approx([t[0] for t in first["meta_info"]["output_token_logprobs"]],
                                                   abs=2e-3)
    assert [t[2] for t in scored] == [tokenizer.decode([i], skip_special_tokens=False) for i in answer]
    for top, generated in zip(meta["input_top_logprobs"], answer):
        assert top[0][1] == generated                               # greedy: each answer token was the top one
    assert [e[0][0] for e in meta["input_token_ids_logprobs"]] == pytest.approx(
        [e[0][0] for e in first["meta_info"]["output_token_ids_logprobs"]], abs=2e-3)
    # from position 0: the first token has no distribution
    whole = _generate(stack, input_ids=prompt, return_logprob=True, logprob_start_len=0, top_logprobs_num=1,
                      sampling_params={"temperature": 0, "max_new_tokens": 1})["meta_info"]
    assert len(whole["input_token_logprobs"]) == len(prompt)
    assert whole["input_token_logprobs"][0] == [None, prompt[0], None] and whole["input_top_logprobs"][0] is None
    assert all(t[0] <= 0 for t in whole["input_token_logprobs"][1:])
    # the default (-1) returns output logprobs only; a start past the prompt is a 400
    default = _generate(stack, input_ids=prompt, return_logprob=True, sampling_params={"max_new_tokens": 1})
    assert default["meta_info"]["input_token_logprobs"] == []
    bad = httpx.post(f"{stack.url}/generate", json={"input_ids": prompt, "return_logprob": True,
                                                    "logprob_start_len": len(prompt)})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprob_start_len"


def test_no_stop_trim_keeps_the_stop_and_spaces_between_special_tokens_is_accepted(stack: Stack,
                                                                                   smollm2_path: Path) -> None:
    tokenizer = load_tokenizer(str(smollm2_path))
    params = {"temperature": 0, "max_new_tokens": 12, "stop": [" 5"]}
    trimmed = _generate(stack, text="Count: 1, 2, 3,", sampling_params=params)
    kept = _generate(stack, text="Count: 1, 2, 3,", sampling_params={**params, "no_stop_trim": True})
    assert kept["text"] == trimmed["text"] + " 5" and kept["meta_info"]["finish_reason"]["matched"] == " 5"
    # a stop token id: its text is trimmed by default, kept with no_stop_trim (output_ids hold it either way)
    [comma] = tokenizer.encode(",")
    params = {"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [comma]}
    by_id = _generate(stack, text="Count: 1, 2, 3", sampling_params=params)
    by_id_kept = _generate(stack, text="Count: 1, 2, 3", sampling_params={**params, "no_stop_trim": True})
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": comma}
    assert by_id["output_ids"][-1] == comma and by_id_kept["output_ids"] == by_id["output_ids"]
    assert by_id_kept["text"] == by_id["text"] + "," and not by_id["text"].endswith(",")
    # SmolLM2's byte-level BPE puts no spaces around special tokens, so both settings give the same text
    chat = {"temperature": 0, "max_new_tokens": 8, "skip_special_tokens": False}
    question = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    spaced = _generate(stack, text=question, sampling_params=chat)
    joined = _generate(stack, text=question, sampling_params={**chat, "spaces_between_special_tokens": False})
    assert spaced["text"] == joined["text"] and spaced["output_ids"] == joined["output_ids"]
    for bad in ({"no_stop_trim": "yes"}, {"spaces_between_special_tokens": 1}):
        response = httpx.post(f"{stack.url}/generate", json={"text": "x", "sampling_params": bad})
        assert response.status_code == 400 and response.json()["error"]["param"] == f"sampling_params.{next(iter(bad))}"


def test_unknown_sampling_params_and_bad_shapes_are_400(stack: Stack) -> None:
    for body in ({"text": "x", "sampling_params": {"temprature": 0}},
                 {"text": ["a", "b"], "sampling_params": [{}]},
                 {"text": "x", "input_ids": [1]},
                 {"text": "x", "sampling_params": {"n": 0}}):
        response = httpx.post(f"{stack.url}/generate", json=body)
        assert response.status_code == 400, body
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_batch_above_the_limit_is_400_and_starts_nothing(stack: Stack) -> None:
    for url, body, param in (("/generate", {"text": ["x"] * 257}, "text"),
                             ("/generate", {"input_ids": [[1, 2]] * 129, "sampling_params": {"n": 2}}, "input_ids"),
                             ("/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": ["x"] * 257}, "prompt")):
        response = httpx.post(f"{stack.url}{url}", json=body)
        assert response.status_code == 400, url
        error = response.json()["error"]
        assert error["param"] == param and "at most 256" in error["message"]
    # the limit counts generations: 256 are fine (one token each)
    answer = httpx.post(f"{stack.url}/generate", json={"input_ids": [[1, 2]] * 128,
                                                       "sampling_params": {"n": 2, "max_new_tokens": 1}}, timeout=300)
    assert answer.status_code == 200 and len(answer.json()) == 256


def test_logprob_options_may_differ_per_prompt_in_a_batch(stack: Stack, smollm2_path: Path) -> None:
    tokenizer = load_tokenizer(str(smollm2_path))
    prompts = [tokenizer.encode("One, two, three,"), tokenizer.encode("The capital of France is")]
    answers = _generate(stack, input_ids=prompts, return_logprob=[True, False], logprob_start_len=[1, -1],
                        top_logprobs_num=[2, 0], token_ids_logprob=[[11], []],
                        sampling_params={"temperature": 0, "max_new_tokens": 2})
    first, second = (a["meta_info"] for a in answers)
    assert [t[1] for t in first["input_token_logprobs"]] == prompts[0][1:]
    assert all(len(top) == 2 for top in first["input_top_logprobs"] + first["output_top_logprobs"])
    assert all(e[0][1] == 11 for e in first["input_token_ids_logprobs"])
    assert "output_token_logprobs" not in second and "input_token_logprobs" not in second
    for bad, param in (({"return_logprob": [True]}, "return_logprob"),
                       ({"return_logprob": True, "logprob_start_len": [0, 99]}, "logprob_start_len"),
                       ({"return_logprob": True, "top_logprobs_num": [1, 21]}, "top_logprobs_num"),
                       ({"return_logprob": True, "token_ids_logprob": [[1]]}, "token_ids_logprob")):
        response = httpx.post(f"{stack.url}/generate", json={"input_ids": prompts, **bad})
        assert response.status_code == 400, bad
        assert response.json()["error"]["param"] == param
