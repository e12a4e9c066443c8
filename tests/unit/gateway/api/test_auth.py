"""The public edge (gateway/api/auth.py) on the real app, in-process: which key opens which route,
duplicate Authorization headers, and the start-up warnings. No worker is reachable, so a request the
key lets through gets a 503 or a 400 from the route, never a 401."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gateway.api.auth import ADMIN_PATHS, OPEN_PATHS, log_key_policy
from gateway.app import create_app
from gateway.config import GatewayConfig

USER_KEY, ADMIN_KEY = "user-sekret", "admin-sekret"
USER, ADMIN = {"Authorization": f"Bearer {USER_KEY}"}, {"Authorization": f"Bearer {ADMIN_KEY}"}
# One request per admin route; bodies valid enough to get past validation.
ADMIN_REQUESTS = (("POST", "/flush_cache", None), ("GET", "/flush_cache", None),
                  ("POST", "/update_weights_from_disk", {"model_path": "nowhere"}), ("GET", "/get_server_info", None),
                  ("POST", "/start_expert_distribution_record", None),
                  ("GET", "/stop_expert_distribution_record", None), ("POST", "/dump_expert_distribution_record", None),
                  ("POST", "/load_lora_adapter", {"lora_name": "a", "lora_path": "a"}),
                  ("POST", "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "a"}),
                  ("POST", "/unload_lora_adapter", {"lora_name": "a"}),
                  ("POST", "/v1/unload_lora_adapter", {"lora_name": "a"}))


def _config(tmp_path_factory, smollm2_path: Path, **keys) -> GatewayConfig:
    return GatewayConfig(grpc_port=0, model_path=str(smollm2_path), served_model_name="m", prefill_addrs=("127.0.0.1:1",),
                         decode_addrs=("127.0.0.1:1",), data_dir=str(tmp_path_factory.mktemp("data")), **keys)


@pytest.fixture(scope="module")
def both_keys(smollm2_path: Path, tmp_path_factory):
    with TestClient(create_app(_config(tmp_path_factory, smollm2_path, api_key=USER_KEY,
                                       admin_api_key=ADMIN_KEY))) as client:
        yield client


@pytest.fixture(scope="module")
def user_key_only(smollm2_path: Path, tmp_path_factory):
    with TestClient(create_app(_config(tmp_path_factory, smollm2_path, api_key=USER_KEY))) as client:
        yield client


@pytest.fixture(scope="module")
def no_keys(smollm2_path: Path, tmp_path_factory):
    with TestClient(create_app(_config(tmp_path_factory, smollm2_path))) as client:
        yield client


def test_admin_routes_refuse_the_user_key_and_take_the_admin_key(both_keys: TestClient) -> None:
    for method, path, body in ADMIN_REQUESTS:
        for headers in ({}, USER, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN_KEY}):
            refused = both_keys.request(method, path, headers=headers, json=body)
            assert refused.status_code == 401, (path, headers)
            assert refused.json() == {"error": {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                                                "param": None, "code": "invalid_api_key"}}
        assert both_keys.request(method, path, headers=ADMIN, json=body).status_code != 401, path
    # a path the router would redirect to an admin route is only redirected, never served, with the user key
    assert both_keys.post("/flush_cache/", headers=USER).status_code == 401
    assert both_keys.post("/flush_cache/", headers=USER, follow_redirects=False).status_code == 307
    info = both_keys.get("/get_server_info", headers=ADMIN)
    assert info.status_code == 200 and USER_KEY not in info.text and ADMIN_KEY not in info.text


def test_user_routes_take_either_key_and_refuse_none(both_keys: TestClient) -> None:
    for headers in (USER, ADMIN):
        assert both_keys.get("/version", headers=headers).status_code == 200
    unauthorized = both_keys.get("/version")
    # the same body as an admin route's refusal: nothing tells which key a route wanted
    assert unauthorized.status_code == 401
    assert unauthorized.json() == both_keys.post("/flush_cache", headers=USER).json()


def test_health_generate_needs_the_user_key_and_the_probes_none(both_keys: TestClient) -> None:
    assert both_keys.get("/health_generate").status_code == 401
    assert both_keys.get("/health_generate", headers=USER).status_code == 503   # no worker: not a 401
    for path in OPEN_PATHS:
        assert both_keys.get(path).status_code != 401, path


def test_duplicate_authorization_headers_are_refused_before_anything_else(both_keys: TestClient,
                                                                          no_keys: TestClient) -> None:
    for client, path in ((both_keys, "/flush_cache"), (both_keys, "/version"), (both_keys, "/health"),
                         (no_keys, "/version")):
        for values in ((ADMIN["Authorization"], ADMIN["Authorization"]), (USER["Authorization"], "Bearer x")):
            response = client.get(path, headers=[("Authorization", v) for v in values])
            assert response.status_code == 400, (path, values)
            assert response.json()["error"]["code"] == "duplicate_authorization_header"
            assert response.json()["error"]["type"] == "invalid_request_error"


def test_with_the_user_key_alone_it_opens_the_admin_routes_too(user_key_only: TestClient) -> None:
    for method, path, body in ADMIN_REQUESTS:
        assert user_key_only.request(method, path, json=body).status_code == 401, path
        assert user_key_only.request(method, path, headers=USER, json=body).status_code != 401, path


def test_with_no_key_everything_is_open(no_keys: TestClient) -> None:
    for method, path, body in ADMIN_REQUESTS:
        assert no_keys.request(method, path, json=body).status_code != 401, path
    assert no_keys.get("/version").status_code == 200


def test_every_guarded_or_open_path_is_a_route_of_the_app(no_keys: TestClient) -> None:
    """A renamed route must not silently leave the admin set (and so fall back to the user key)."""
    assert no_keys.get("/no_such_route").status_code == 404
    for path in ADMIN_PATHS | OPEN_PATHS:
        assert no_keys.get(path).status_code != 404, path   # 405 for a POST-only route still means it exists


def test_start_up_says_what_the_keys_leave_open(smollm2_path: Path, tmp_path_factory, caplog) -> None:
    config = _config(tmp_path_factory, smollm2_path)
    cases = ((dataclasses.replace(config, api_key=USER_KEY), "share the user API key"),
             (dataclasses.replace(config, host="0.0.0.0"), "no --api-key: anyone who can reach it can use every route"),
             (dataclasses.replace(config, host="0.0.0.0", admin_api_key=ADMIN_KEY), "every route but the admin"))
    for case, warning in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="gateway.api.auth"):
            log_key_policy(case)
        assert warning in caplog.text
        assert USER_KEY not in caplog.text and ADMIN_KEY not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gateway.api.auth"):
        log_key_policy(config)                                        # loopback, no key: local development
        log_key_policy(dataclasses.replace(config, host="::1"))
        log_key_policy(dataclasses.replace(config, api_key=USER_KEY, admin_api_key=ADMIN_KEY, host="0.0.0.0"))
    assert caplog.text == ""


def test_config_keeps_the_keys_apart_and_out_of_its_repr(smollm2_path: Path, tmp_path_factory) -> None:
    config = _config(tmp_path_factory, smollm2_path, api_key=USER_KEY, admin_api_key=ADMIN_KEY)
    assert USER_KEY not in repr(config) and ADMIN_KEY not in repr(config)
    with pytest.raises(ValueError, match="must differ"):
        dataclasses.replace(config, admin_api_key=USER_KEY)
