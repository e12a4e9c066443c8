"""Text in a parsed JSON document that no tokenizer can take: a lone UTF-16 surrogate, which JSON may
escape (`"a\\ud800b"`) and Python parses into a string that cannot be encoded as UTF-8. The HTTP
routes (`gateway/api/json_route.py`) and the batch lines check their bodies with `check_unicode`."""

from __future__ import annotations

from typing import Any

from gateway.errors import bad_request
from gateway.text.tokenizer import unicode_problem


def check_unicode(document: Any) -> None:
    """400 naming the first field (dotted path, as validation errors name it) whose text is not
    valid Unicode."""
    pending: list[tuple[str, Any]] = [("", document)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            problem = unicode_problem(value)
            if problem is not None:
                raise bad_request(
                    f"`{path or 'body'}` is not valid Unicode text: {problem}", path or None, "invalid_value"
                )
        elif isinstance(value, dict):
            bad_key = next((k for k in value if unicode_problem(k) is not None), None)
            if bad_key is not None:
                raise bad_request(
                    f"a key in `{path or 'body'}` is not valid Unicode text: {unicode_problem(bad_key)}",
                    path or None,
                    "invalid_value",
                )
            pending += reversed([(_join(path, k), v) for k, v in value.items()])
        elif isinstance(value, list):
            pending += reversed([(_join(path, str(i)), v) for i, v in enumerate(value)])


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
