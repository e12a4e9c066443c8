"""Input that used to stall the gateway or reach a 500: each is now a 4xx with an OpenAI body naming
what was wrong, and the server keeps serving (the shared stack: context 1024, default limits)."""

from __future__ import annotations

import json

import httpx
import pytest

from gateway.config import DEFAULT_MAX_REQUEST_BODY_BYTES
from gateway.service.sampling import MAX_SCHEMA_DEPTH
from tests.e2e.conftest import CONTEXT_LEN, MODEL
from tests.e2e.stack import Stack

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "hi"}]


def _post(stack: Stack, path: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{stack.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(f"{stack.url}{path}", json=body, timeout=60)


def _error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_a_body_over_the_limit_is_413_unread_whether_sized_or_chunked(stack: Stack) -> None:
    big = b'{"model": "m", "prompt": "' + b"x" * DEFAULT_MAX_REQUEST_BODY_BYTES + b'"}'
    error = _error(_post(stack, "/v1/completions", big), 413)
    assert error["code"] == "request_too_large" and str(DEFAULT_MAX_REQUEST_BODY_BYTES) in error["message"]

    def chunks():   # no Content-Length: counted as it arrives
        yield b'{"model": "m", "prompt": "'
        for _ in range(DEFAULT_MAX_REQUEST_BODY_BYTES // 65536 + 1):
            yield b"x" * 65536
        yield b'"}'
    chunked = httpx.post(f"{stack.url}/v1/completions", content=chunks(), timeout=60,
                         headers={"content-type": "application/json"})
    assert _error(chunked, 413)["code"] == "request_too_large"
    assert httpx.get(f"{stack.url}/health", timeout=5).status_code == 200


def test_a_text_longer_than_the_context_could_hold_is_refused_before_tokenizing(stack: Stack) -> None:
    tokens_worth = "hello " * CONTEXT_LEN          # fits the character bound; too many tokens once tokenized
    chars_worth = "#" * (CONTEXT_LEN * 81 + 1)       # SmolLM2's longest token has 81 characters
    for path, body, param in (
            ("/generate", {"text": chars_worth}, "text"),
            ("/v1/completions", {"model": MODEL, "prompt": chars_worth}, "prompt"),
            ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": chars_worth}]},
             "messages"),
            ("/tokenize", {"prompt": chars_worth}, "prompt")):
        error = _error(_post(stack, path, body))
        assert error["code"] == "context_length_exceeded" and error["param"] == param, error
        assert "characters" in error["message"]
    error = _error(_post(stack, "/generate", {"text": tokens_worth}))
    assert error["code"] == "context_length_exceeded" and "tokens" in error["message"]


def test_text_that_is_not_unicode_is_a_400_naming_its_field(stack: Stack) -> None:
    for path, raw, param in (
            ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
             "messages.0.content"),
            ("/v1/completions", b'{"model": "%s", "prompt": ["ok", "\\udfff"]}', "prompt.1"),
            ("/v1/completions", b'{"model": "%s", "prompt": "a", "stop": "\\ud83d"}', "stop"),
            ("/generate", b'{"text": "\\ud800", "model": "%s"}', "text"),
            ("/tokenize", b'{"prompt": "x\\uDC00", "model": "%s"}', "prompt")):
        error = _error(_post(stack, path, raw.replace(b"%s", MODEL.encode())))
        assert error["param"] == param and "lone surrogate" in error["message"], error
    # a surrogate pair is one valid character
    pair = b'{"model": "%s", "prompt": "\\ud83d\\ude00", "max_tokens": 1}' % MODEL.encode()
    assert _post(stack, "/v1/completions", pair).status_code == 200
    invalid_bytes = b'{"model": "%s", "prompt": "a\xff\xfe"}' % MODEL.encode()
    assert _post(stack, "/v1/completions", invalid_bytes).status_code == 400
    not_json = _error(_post(stack, "/v1/completions", b"{not json"))
    assert not_json["code"] == "invalid_json"


def test_chat_template_kwargs_may_not_override_what_the_server_sets(stack: Stack) -> None:
    for key, value in (("add_generation_prompt", False), ("messages", []), ("chat_template", "{{ 7 * 7 }}"),
                       ("tokenize", True)):
        body = {"model": MODEL, "messages": HI, "chat_template_kwargs": {key: value}}
        error = _error(_post(stack, "/v1/chat/completions", body))
        assert error["param"] == "chat_template_kwargs" and key in error["message"], error
    fine = {"model": MODEL, "messages": HI, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}
    assert _post(stack, "/v1/chat/completions", fine).status_code == 200


def test_degenerate_json_schemas_are_refused_before_any_worker(stack: Stack) -> None:
    deep: dict = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    for schema, says in ((False, "matches nothing"), (True, "any JSON value"), (deep, "levels deep")):
        chat = {"model": MODEL, "messages": HI,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        error = _error(_post(stack, "/v1/chat/completions", chat))
        assert error["param"] == "response_format" and says in error["message"], error
        native = {"text": "hi", "sampling_params": {"json_schema": json.dumps(schema)}}
        assert _error(_post(stack, "/generate", native))["param"] == "sampling_params.json_schema"


def test_no_malformed_or_out_of_range_request_reaches_a_500(stack: Stack) -> None:
    """reliability.md scenarios 13 and 14: each of these is a 4xx with an OpenAI error body."""
    def chat(**fields):
        return "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 2, **fields}

    def completion(**fields):
        return "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}

    def native(**params):
        return "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, **params}}
    cases = {
        "n huge": chat(n=10**9), "best_of huge": completion(best_of=10**6), "max_tokens 2^63": completion(max_tokens=2**63),
        "max_tokens -1": completion(max_tokens=-1), "temperature NaN": ("/v1/completions", b'{"model": "%s", '
                                                                        b'"prompt": "hi", "temperature": NaN}'),
        "temperature 1e309": ("/v1/completions", b'{"model": "%s", "prompt": "hi", "temperature": 1e309}'),
        "top_p 2": completion(top_p=2), "top_k -5": completion(top_k=-5),
        "top_logprobs 1000": chat(logprobs=True, top_logprobs=1000),
        "logit_bias id": completion(logit_bias={"999999999": 1}), "logit_bias key": completion(logit_bias={"x": 1}),
        "logit_bias value": completion(logit_bias={"5": 1e9}), "stop 10000": completion(stop=[str(i) for i in range(10000)]),
        "stop empty": completion(stop=""), "min_tokens over max": completion(min_tokens=10, max_tokens=2),
        "seed negative": completion(seed=-1), "native temperature text": native(temperature="hot"),
        "native n text": native(n="many"), "native stop number": native(stop=5), "native flag text": native(ignore_eos=[1]),
        "native unknown key": native(token_ids_logprob=[[1, 2]]), "native regex bad": native(regex="(a|"),
        "tool_calls junk": chat(messages=[{"role": "assistant", "content": "x", "tool_calls": [{"function": {}}]}, *HI]),
        "tool_calls text": chat(messages=[{"role": "assistant", "content": "x", "tool_calls": "junk"}, *HI]),
        "tools not a list": chat(tools={"a": 1}), "deep arrays": ("/v1/completions", b"[" * 100000 + b"]" * 100000),
        "array body": ("/v1/completions", b"[1, 2]"), "input_ids negative": ("/generate", {"input_ids": [-1, 5]}),
        "detokenize huge id": ("/detokenize", {"tokens": [10**12]}),
    }
    for name, (path, body) in cases.items():
        response = _post(stack, path, body.replace(b"%s", MODEL.encode()) if isinstance(body, bytes) else body)
        assert 400 <= response.status_code < 500, (name, response.status_code, response.text[:300])
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}, name
    assert _post(stack, *native(temperature=0)).status_code == 200
