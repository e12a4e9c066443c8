"""Every JSON route of the gateway goes through `JSONRoute`, so no route can miss its body checks."""

from __future__ import annotations

from fastapi.routing import APIRoute

from gateway.api.json_route import JSONRoute
from gateway.app import ROUTERS


def test_every_route_that_takes_a_body_is_a_json_route() -> None:
    routes = [r for router in ROUTERS for r in router.routes
              if isinstance(r, APIRoute) and r.methods & {"POST", "PUT", "PATCH"}]
    assert len(routes) > 15
    assert [r.path for r in routes if not isinstance(r, JSONRoute)] == []
