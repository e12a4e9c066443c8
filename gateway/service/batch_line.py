"""One batch line, answered by its endpoint's operation: the batch runner's way into the service
layer, as the routes and the gRPC API have theirs. A line gets what an HTTP client of that route
gets (the same checks, the same 400s naming the field, the same answer), without a trip through the
gateway's own HTTP stack."""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import BaseModel, ValidationError

from gateway.errors import APIError, validation_error
from gateway.service.chat import chat_completion
from gateway.service.completion import completion
from gateway.service.guard import unguarded
from gateway.service.request_schemas import ChatCompletionRequest, CompletionRequest
from gateway.service.state import GatewayState
from gateway.text.json_text import check_unicode

logger = logging.getLogger(__name__)


async def answer_line(state: GatewayState, endpoint: str, body: str) -> tuple[int, dict[str, Any]]:
    """The status and JSON body an HTTP client of `endpoint` would get for `body` (a JSON object's
    text); an unexpected failure is a 500 line with no details (they are in the gateway's log)."""
    try:
        values = json.loads(body)
        check_unicode(values)
        answer = await _run(state, endpoint, values)
    except ValidationError as exc:
        error = validation_error(exc)
        return error.status, error.body()
    except APIError as exc:
        return exc.status, exc.body()
    except Exception:
        logger.exception("a batch line for %s failed", endpoint)
        return 500, APIError(500, "internal server error", "internal_error").body()
    return 200, answer.model_dump(mode="json", by_alias=True)


async def _run(state: GatewayState, endpoint: str, values: dict[str, Any]) -> BaseModel:
    if endpoint == "/v1/chat/completions":
        answer: Any = await chat_completion(state, ChatCompletionRequest.model_validate(values), unguarded)
    elif endpoint == "/v1/completions":
        answer = await completion(state, CompletionRequest.model_validate(values), unguarded)
    else:
        raise APIError(400, f"batches do not run {endpoint}", param="endpoint")
    if not isinstance(answer, BaseModel):  # a stream: the line parser refuses `stream` before this
        raise APIError(400, "stream is not supported in a batch", param="stream")
    return answer
