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

from gateway.text.json_text import check_unicode

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class JSONRoute(APIRoute):
    """An APIRoute that checks a JSON body's strings before FastAPI parses it into the route's model."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if request.headers.get("content-type", "").startswith("application/json"):
                body = await request.body()  # read once: FastAPI reuses it
                if _SURROGATE_ESCAPE.search(body):
                    check_unicode(await _parsed(request))
            return await handle(request)

        return checked


async def _parsed(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:  # not JSON: FastAPI's own parse answers that with a 400
        return None
