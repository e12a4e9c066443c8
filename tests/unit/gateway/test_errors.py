"""Error bodies name no internal address, path or exception: `public_message` and `APIError.body`
(the gRPC-error table is tested beside it, in tests/unit/gateway/cluster/test_worker_errors.py)."""

from __future__ import annotations

import logging

import pytest

from gateway.errors import APIError, public_message

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


def test_public_message_keeps_what_the_client_sent() -> None:
    text = "Failed to open /srv/m: [Errno 13] Permission denied: '/srv/m/config.json' (on 127.0.0.1:31002)"
    assert public_message(text, keep=("/srv/m",)) == (
        "Failed to open /srv/m: [Errno 13] Permission denied: '/srv/m/config.json' (on <address>)")
    assert public_message(text, keep=("",)) == public_message(text)


def test_a_path_with_its_line_reads_as_one_path() -> None:
    assert public_message("invalid regex: [19:08:57] /project/cpp/regex_converter.cc:83: Regex parsing error") == (
        "invalid regex: [19:08:57] <path>: Regex parsing error")
