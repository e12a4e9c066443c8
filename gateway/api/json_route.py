"""The route class of every JSON route: text that no tokenizer can take is a 400 naming its field.

JSON may escape a lone UTF-16 surrogate (`"a\\ud800b"`); Python parses it into a string that
cannot be encoded as UTF-8, which the tokenizer, the detokenizer and the worker protocol all
refuse, each in its own way. One scan of the raw body (a lone escape is rare, so the parsed body is
searched only when the bytes hold one) turns that into a 400 before any route code runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from gateway.errors import bad_request
from gateway.text.tokenizer import unicode_problem

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class JSONRoute(APIRoute):
    """An APIRoute that checks a JSON body's strings before FastAPI parses it into the route's model."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if request.headers.get("content-type", "").startswith("application/json"):
                body = await request.body()  # read once: FastAPI reuses it
                if _SURROGATE_ESCAPE.search(body):
                    _check_unicode(await _parsed(request))
            return await handle(request)

        return checked


async def _parsed(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:  # not JSON: FastAPI's own parse answers that with a 400
        return None


def _check_unicode(document: Any) -> None:
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
