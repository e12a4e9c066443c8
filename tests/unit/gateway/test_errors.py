"""Error bodies name no internal address, path or exception: `public_message`, `APIError.body` and
the one gRPC-error mapping, `APIError.from_grpc`."""

from __future__ import annotations

import contextvars
import logging

import grpc
import pytest

from gateway.errors import APIError, public_message
from tandem.request_log import bind_request_id

LEAKY = ("decode worker 127.0.0.1:31002: boom", "failed to connect to all addresses; last error: UNKNOWN: "
         "ipv4:10.0.0.7:31002: Failed to connect to remote host: Connection refused", "peer [::1]:31002 went away", "from [2001:db8:0:0:0:0:0:1]",
         "from [fe80::1] and [2001:db8:1:2:3:4:5:6]:443",
         "dns:///decode.tandem.svc:31002 unreachable", "decode-0.tandem.svc:31002 reset the stream",
         "localhost:31002 said no", "cannot read /tmp/pytest-7/tiny/config.json: bad JSON",
         "Failed to open /home/me/models/x: [Errno 13] Permission denied: '/home/me/models/x/config.json'",
         "Unexpected <class 'RuntimeError'>: boom", "cannot read the weight_map: JSONDecodeError('Expecting value')",
         "invalid regex: [19:08:57] /project/cpp/regex_converter.cc:83: Regex parsing error at position 4")
KEPT = ("This model's maximum context length is 1024 tokens. However, your prompt has 2000 tokens, leaving no "
        "room for a completion.",
        "Failed to get weights iterator: meta-llama/Llama-3.2-1B-wrong (repository not found).",
        "`m` is an embedding model: use /v1/embeddings or /encode", "invalid regex: missing ), unterminated "
        "subpattern at position 0", "the JSON schema is not valid JSON: Expecting value: line 1 column 2 (char 1)",
        "at most 32 tokens/s", "limit must be between 1 and 100, got 0")


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@pytest.mark.parametrize("text", LEAKY)
def test_public_message_drops_addresses_paths_and_exception_reprs(text: str) -> None:
    scrubbed = public_message(text)
    for secret in ("127.0.0.1", "10.0.0.7", "::1", "db8", "fe80", "31002", "tandem.svc", "localhost", "/tmp", "/home", "<class",
                   "Error(", "/project", "regex_converter"):
        assert secret not in scrubbed, (text, scrubbed)
    assert public_message(scrubbed) == scrubbed


@pytest.mark.parametrize("text", KEPT)
def test_public_message_keeps_messages_about_the_request(text: str) -> None:
    assert public_message(text) == text


def test_the_body_is_scrubbed_and_the_log_keeps_the_whole_message(caplog) -> None:
    error = APIError(500, "decode worker 127.0.0.1:31002 crashed reading /srv/models/a.gguf", "internal_error")
    with caplog.at_level(logging.WARNING, logger="gateway.errors"):
        body = error.body()
    assert "127.0.0.1" not in body["error"]["message"] and "/srv" not in body["error"]["message"]
    assert body["error"]["type"] == "internal_error" and body["error"]["code"] == 500
    assert "127.0.0.1:31002" in caplog.text and "/srv/models/a.gguf" in caplog.text


def test_from_grpc_names_the_role_only_and_logs_the_address(caplog) -> None:
    details = "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:31002: Connection refused"
    with caplog.at_level(logging.INFO, logger="gateway.errors"):
        error = APIError.from_grpc(_rpc_error(grpc.StatusCode.UNAVAILABLE, details), "decode", "127.0.0.1:31002")
    assert (error.status, error.code) == (503, "worker_unavailable")
    assert error.message == "the decode worker is unavailable"
    assert error.headers == {"Retry-After": "1"}   # every 503 from a worker says when to try again
    assert "decode worker 127.0.0.1:31002" in caplog.text and "Connection refused" in caplog.text


def test_from_grpc_points_at_the_request_id_when_one_is_bound() -> None:
    def inside_a_request() -> APIError:
        bind_request_id("req-42")
        return APIError.from_grpc(_rpc_error(grpc.StatusCode.UNKNOWN, "Unexpected <class 'KeyError'>: 'x'"),
                                  "prefill", "10.0.0.7:31001")
    error = contextvars.copy_context().run(inside_a_request)
    assert error.status == 500 and error.type == "internal_error" and error.headers is None
    assert error.message == "the prefill worker failed (request req-42; details in the gateway log)"


def test_from_grpc_keeps_the_workers_own_words_without_internals() -> None:
    context = APIError.from_grpc(_rpc_error(grpc.StatusCode.OUT_OF_RANGE, KEPT[0]), "prefill", "127.0.0.1:1")
    assert (context.status, context.code, context.message) == (400, "context_length_exceeded", KEPT[0])
    full = APIError.from_grpc(_rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free pages on 127.0.0.1:31002"),
                              "decode", "127.0.0.1:31002")
    assert full.status == 503 and full.message == "the decode worker: no free pages on <address>"
    assert full.retry_after_s == 1
    bad = APIError.from_grpc(_rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "cannot read /tmp/x/grammar.json"),
                             "prefill", "127.0.0.1:1")
    assert bad.status == 400 and bad.message == "cannot read <path>"


def test_public_message_keeps_what_the_client_sent() -> None:
    text = "Failed to open /srv/m: [Errno 13] Permission denied: '/srv/m/config.json' (on 127.0.0.1:31002)"
    assert public_message(text, keep=("/srv/m",)) == (
        "Failed to open /srv/m: [Errno 13] Permission denied: '/srv/m/config.json' (on <address>)")
    assert public_message(text, keep=("",)) == public_message(text)


@pytest.mark.parametrize("code, status, message", [
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "the decode worker did not answer in time"),
    (grpc.StatusCode.CANCELLED, 503, "the call to the decode worker was cancelled"),
    (grpc.StatusCode.INTERNAL, 500, "the decode worker failed"),
    (grpc.StatusCode.UNIMPLEMENTED, 500, "the decode worker failed")])
def test_from_grpc_answers_a_fixed_line_where_grpc_or_an_exception_wrote_the_details(code, status, message) -> None:
    error = APIError.from_grpc(_rpc_error(code, "Deadline on ipv4:127.0.0.1:31002 at /srv/x.py"), "decode", "x:1")
    assert (error.status, error.message) == (status, message)


def test_a_path_with_its_line_reads_as_one_path() -> None:
    assert public_message("invalid regex: [19:08:57] /project/cpp/regex_converter.cc:83: Regex parsing error") == (
        "invalid regex: [19:08:57] <path>: Regex parsing error")
