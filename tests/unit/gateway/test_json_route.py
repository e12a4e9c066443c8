"""Every JSON route of the gateway goes through `JSONRoute`, so no route can miss its body checks."""

from __future__ import annotations

from fastapi.routing import APIRoute

from gateway import (admin_api, batches_api, embeddings_api, expert_api, files_api, metrics, native_api, openai_api,
                     vllm_api)
from gateway.json_route import JSONRoute

ROUTERS = (openai_api, native_api, admin_api, vllm_api, files_api, batches_api, embeddings_api, expert_api, metrics)


def test_every_route_that_takes_a_body_is_a_json_route() -> None:
    routes = [r for module in ROUTERS for r in module.router.routes
              if isinstance(r, APIRoute) and r.methods & {"POST", "PUT", "PATCH"}]
    assert len(routes) > 15
    assert [r.path for r in routes if not isinstance(r, JSONRoute)] == []
