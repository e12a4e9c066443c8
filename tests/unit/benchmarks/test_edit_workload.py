"""benchmarks/data/edit_workload.jsonl, the code-editing prompts for n-gram speculation: every line is
a chat request whose user message carries a piece of code to rewrite, under a unique id."""

from __future__ import annotations

import json
from pathlib import Path

WORKLOAD = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "edit_workload.jsonl"
FENCE = "`" * 3


def _requests() -> list[dict]:
    lines = WORKLOAD.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_every_line_is_a_chat_request_with_code_to_edit() -> None:
    requests = _requests()
    assert len(requests) >= 20
    for request in requests:
        assert set(request) == {"id", "messages", "max_tokens"}, request.get("id")
        assert isinstance(request["max_tokens"], int) and request["max_tokens"] > 0
        [message] = request["messages"]
        assert message["role"] == "user"
        content = message["content"]
        assert len(content) >= 400, request["id"]
        # one fenced block of code, most of the message: the answer is mostly copied from it
        assert content.count(FENCE) == 2, request["id"]
        code = content.split(FENCE)[1]
        assert code.count("\n") >= 20 and len(code) > len(content) / 2, request["id"]


def test_ids_are_unique() -> None:
    ids = [request["id"] for request in _requests()]
    assert len(ids) == len(set(ids))
