"""--api-key: every route but the health probes needs the bearer key (the real app, in-process)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.config import GatewayConfig


@pytest.fixture(scope="module")
def client(smollm2_path: Path, tmp_path_factory):
    config = GatewayConfig(grpc_port=0, model_path=str(smollm2_path), served_model_name="m", prefill_addrs=("127.0.0.1:1",),
                           decode_addrs=("127.0.0.1:1",), api_key="sekret",
                           data_dir=str(tmp_path_factory.mktemp("data")))
    with TestClient(create_app(config)) as client:
        yield client


def test_missing_or_wrong_key_is_401_with_an_openai_body(client: TestClient) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/version")):
            response = client.request(method, path, headers=headers, json={})
            assert response.status_code == 401, (headers, path)
            assert response.json()["error"]["code"] == "invalid_api_key"


def test_right_key_passes_and_health_probes_need_none(client: TestClient) -> None:
    assert client.get("/version", headers={"Authorization": "Bearer sekret"}).status_code == 200
    # no worker is reachable: the probes answer 503, not 401
    assert client.get("/health").status_code == 503
    assert client.get("/ping").status_code == 503
