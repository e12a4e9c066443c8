"""The /v1/responses routes that read the store (retrieve, delete, cancel, input items), on a bare app
with a real ResponseStore: pagination, 404s and 400s as OpenAI-style bodies; a restart fails what a
former gateway left running."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI
from fastapi.testclient import TestClient

from gateway.api.openai_responses_routes import router
from gateway.app import _api_error
from gateway.errors import APIError
from gateway.service.openai_responses import record_of, serving_responses
from gateway.service.openai_responses_convert import base_response, input_items
from gateway.service.openai_responses_schemas import CreateResponseRequest
from gateway.service.responses_store import ResponseStore

INPUT = [{"role": "user", "content": f"turn {i}"} for i in range(5)]


def _app(tmp_path: Path, background: bool = False, status: str = "completed") -> tuple[FastAPI, str]:
    """An app whose store holds one response with five input items."""
    body = CreateResponseRequest.model_validate({"model": "smol", "input": INPUT, "background": background})
    response = base_response(body, "resp_1", status)  # type: ignore[arg-type]
    store = ResponseStore(tmp_path)
    store.put(record_of(response, input_items(body)))
    store.close()
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with serving_responses(app, tmp_path):
            yield

    app = FastAPI(lifespan=lifespan)
    app.include_router(router)
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.state.gateway = None
    return app, response.id


def _texts(page: dict) -> list[str]:
    return [item["content"][0]["text"] for item in page["data"]]


def test_input_items_pages(tmp_path: Path) -> None:
    app, rid = _app(tmp_path)
    with TestClient(app) as client:
        newest = client.get(f"/v1/responses/{rid}/input_items", params={"limit": 2}).json()
        assert _texts(newest) == ["turn 4", "turn 3"] and newest["has_more"] and newest["object"] == "list"
        rest = client.get(f"/v1/responses/{rid}/input_items", params={"after": newest["last_id"]}).json()
        assert _texts(rest) == ["turn 2", "turn 1", "turn 0"] and not rest["has_more"]
        oldest = client.get(f"/v1/responses/{rid}/input_items", params={"order": "asc", "limit": 1}).json()
        assert _texts(oldest) == ["turn 0"] and oldest["first_id"] == oldest["last_id"]
        bad = client.get(f"/v1/responses/{rid}/input_items", params={"limit": 0})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
        unknown = client.get("/v1/responses/resp_nope/input_items")
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "response_not_found"


def test_retrieve_delete_and_cancel(tmp_path: Path) -> None:
    app, rid = _app(tmp_path)
    with TestClient(app) as client:
        assert client.get(f"/v1/responses/{rid}").json()["id"] == rid
        refused = client.post(f"/v1/responses/{rid}/cancel")
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_id"
        assert client.delete(f"/v1/responses/{rid}").json() == {"id": rid, "object": "response", "deleted": True}
        assert client.get(f"/v1/responses/{rid}").status_code == 404
        assert client.delete(f"/v1/responses/{rid}").status_code == 404
        assert client.post(f"/v1/responses/{rid}/cancel").status_code == 404


def test_a_restart_fails_a_background_response_left_running(tmp_path: Path) -> None:
    app, rid = _app(tmp_path, background=True, status="in_progress")
    with TestClient(app) as client:
        response = client.get(f"/v1/responses/{rid}").json()
        assert response["status"] == "failed" and response["error"]["code"] == "server_error"
        assert client.post(f"/v1/responses/{rid}/cancel").json()["status"] == "failed"  # finished: as it is
