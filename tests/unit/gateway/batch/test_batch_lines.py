"""Parsing batch input lines and building output lines."""

from __future__ import annotations

import json

from gateway.batch.lines import InputLine, parse_input, response_line

ENDPOINT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def line(**fields) -> bytes:
    return json.dumps({"custom_id": "a", "method": "POST", "url": ENDPOINT, "body": BODY, **fields}).encode()


def test_good_lines_keep_their_body_and_file_position() -> None:
    parsed = parse_input([line(), b"\n", b"  \n", line(custom_id="b", url="/chat/completions")], ENDPOINT)
    assert parsed.errors == ()
    assert parsed.lines == (InputLine(0, "a", json.dumps(BODY)), InputLine(3, "b", json.dumps(BODY)))


def test_bad_lines_become_line_errors() -> None:
    raw = [b"{not json", b"[1, 2]", json.dumps({"url": ENDPOINT, "body": BODY}).encode(),
           line(custom_id="u", url="/v1/completions"), line(custom_id="m", method="GET"),
           line(custom_id="b", body="text"), line(custom_id="s", body={**BODY, "stream": True})]
    parsed = parse_input(raw, ENDPOINT)
    assert parsed.errors == ()
    assert [(ln.custom_id, ln.error.code) for ln in parsed.lines] == [
        (None, "invalid_json_line"), (None, "invalid_json_line"), (None, "missing_custom_id"),
        ("u", "invalid_url"), ("m", "invalid_method"), ("b", "missing_body"), ("s", "invalid_request")]
    assert all(ln.body is None for ln in parsed.lines)


def test_duplicate_custom_ids_and_empty_files_fail_the_batch() -> None:
    duplicate = parse_input([line(), line(), line()], ENDPOINT)
    assert [(e.code, e.line) for e in duplicate.errors] == [("duplicate_custom_id", 2), ("duplicate_custom_id", 3)]
    assert [e.code for e in parse_input([b"\n", b""], ENDPOINT).errors] == ["empty_file"]


def test_response_lines_split_success_from_error() -> None:
    text, is_error = response_line("a", "rid", 200, {"id": "chatcmpl-1"})
    assert not is_error
    parsed = json.loads(text)
    assert parsed["id"].startswith("batch_req_") and parsed["custom_id"] == "a" and parsed["error"] is None
    assert parsed["response"] == {"status_code": 200, "request_id": "rid", "body": {"id": "chatcmpl-1"}}
    body = {"error": {"message": "temperature: must be >= 0", "type": "invalid_request_error", "code": 400}}
    text, is_error = response_line("b", "rid", 400, body)
    assert is_error
    assert json.loads(text)["error"] == {"code": "invalid_request_error", "message": "temperature: must be >= 0"}
    assert json.loads(text)["response"]["body"] == body
    body = {"error": {"message": "no such model", "type": "not_found_error", "code": "model_not_found"}}
    assert json.loads(response_line("c", "rid", 404, body)[0])["error"]["code"] == "model_not_found"
    assert json.loads(response_line("d", "rid", 502, {"detail": "?"})[0])["error"] == {"code": "502",
                                                                                   "message": "HTTP 502"}
