"""Batch input and output lines: parse a JSONL input file, build OpenAI batch output lines.

Input line: `{"custom_id": str, "method": "POST", "url": <the batch's endpoint>, "body": {...}}`; the
url may leave out `/v1` (`/chat/completions`, as SGLang's batch example writes it). A line that
cannot be run (bad JSON, no custom_id, wrong url or method, no body, `stream: true`) becomes an
error-file line; the batch still runs the others. Two lines with the same custom_id, an empty file
or more than `MAX_LINES` lines fail the whole batch, since then not every custom_id could be answered
exactly once.

Output line: `{"id", "custom_id", "response": {"status_code", "request_id", "body"} | null,
"error": {"code", "message"} | null}`. A 2xx answer goes to the output file; anything else to the
error file.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_LINES = 50_000


@dataclass(frozen=True, slots=True)
class LineError:
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class InputLine:
    """One non-blank line of an input file. Exactly one of `body` (JSON text) and `error` is set.

    `line_index` is the 0-based position in the file, blank lines included (file line `line_index + 1`).
    """

    line_index: int
    custom_id: str | None
    body: str | None = None
    error: LineError | None = None


@dataclass(frozen=True, slots=True)
class BatchError:
    """Why a whole batch failed validation (OpenAI's `Batch.errors.data[]`)."""

    code: str
    message: str
    line: int | None = None  # 1-based file line
    param: str | None = None

    def to_dict(self) -> dict:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass(frozen=True, slots=True)
class ParsedInput:
    lines: tuple[InputLine, ...]
    errors: tuple[BatchError, ...]  # non-empty: the batch fails


def parse_input(raw_lines: Iterable[bytes], endpoint: str) -> ParsedInput:
    """Parse an input file's lines (as read from disk) for a batch on `endpoint`."""
    lines: list[InputLine] = []
    errors: list[BatchError] = []
    first_line_of: dict[str, int] = {}
    for index, raw in enumerate(raw_lines):
        if not raw.strip():
            continue
        line = parse_line(index, raw, endpoint)
        lines.append(line)
        if line.custom_id is None:
            continue
        if line.custom_id in first_line_of:
            errors.append(
                BatchError(
                    "duplicate_custom_id",
                    f"custom_id {line.custom_id!r} is also on line {first_line_of[line.custom_id]}",
                    index + 1,
                    "custom_id",
                )
            )
        else:
            first_line_of[line.custom_id] = index + 1
    if not lines:
        errors.append(BatchError("empty_file", "the input file has no requests"))
    elif len(lines) > MAX_LINES:
        errors.append(
            BatchError(
                "too_many_requests", f"the input file has {len(lines)} requests; at most {MAX_LINES} are allowed"
            )
        )
    return ParsedInput(tuple(lines), tuple(errors[:100]))


def parse_line(index: int, raw: bytes, endpoint: str) -> InputLine:
    try:
        request = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return InputLine(index, None, error=LineError("invalid_json_line", f"line {index + 1} is not JSON: {exc}"))
    if not isinstance(request, dict):
        return InputLine(index, None, error=LineError("invalid_json_line", f"line {index + 1} is not a JSON object"))
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return InputLine(index, None, error=LineError("missing_custom_id", f"line {index + 1} has no custom_id string"))
    error = _request_error(request, endpoint)
    if error is not None:
        return InputLine(index, custom_id, error=error)
    return InputLine(index, custom_id, body=json.dumps(request["body"], ensure_ascii=False))


def _request_error(request: dict, endpoint: str) -> LineError | None:
    method = request.get("method", "POST")
    if method != "POST":
        return LineError("invalid_method", f"method must be POST, got {method!r}")
    url = request.get("url")
    if url not in (endpoint, endpoint.removeprefix("/v1")):
        return LineError("invalid_url", f"url {url!r} does not match the batch's endpoint {endpoint!r}")
    body = request.get("body")
    if not isinstance(body, dict):
        return LineError("missing_body", "body must be a JSON object")
    if body.get("stream"):
        return LineError("invalid_request", "stream is not supported in a batch")
    return None


def response_line(custom_id: str, request_id: str, status_code: int, body: dict) -> tuple[str, bool]:
    """The output line for an answered request and whether it belongs in the error file."""
    is_error = not 200 <= status_code < 300
    error = None
    if is_error:
        found = body.get("error")
        detail: dict = found if isinstance(found, dict) else {}
        code = detail.get("code") if isinstance(detail.get("code"), str) else detail.get("type")
        error = {"code": str(code or status_code), "message": str(detail.get("message") or f"HTTP {status_code}")}
    line = {
        "id": _line_id(),
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body},
        "error": error,
    }
    return json.dumps(line, ensure_ascii=False), is_error


def error_line(custom_id: str | None, error: LineError) -> str:
    """The error-file line for a request that could not be run."""
    line = {
        "id": _line_id(),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": error.code, "message": error.message},
    }
    return json.dumps(line, ensure_ascii=False)


def _line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"
