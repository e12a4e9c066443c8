"""gateway/api/openai.py's /v1/models, on a bare app: the card's `created` is the gateway's start."""

from __future__ import annotations

import time
from types import SimpleNamespace

from fastapi import FastAPI
from fastapi.testclient import TestClient

from gateway.api import openai
from gateway.config import GatewayConfig
from gateway.service.state import GatewayState

CONFIG = GatewayConfig(grpc_port=0, model_path="/models/smol", served_model_name="smol", prefill_addrs=("p:1",),
                       decode_addrs=("d:1",), data_dir="/tmp/unused")


def _client(pool) -> tuple[TestClient, GatewayState]:
    app = FastAPI()
    app.include_router(openai.router)
    app.state.gateway = GatewayState(CONFIG, None, pool, metrics=None, generation=None)
    return TestClient(app), app.state.gateway


def test_models_carry_the_gateway_start_as_their_creation_time() -> None:
    before = int(time.time())
    client, state = _client(SimpleNamespace(is_ready=False, lora_adapters=dict))
    after = int(time.time())
    assert before <= state.started_at <= after
    listed = client.get("/v1/models").json()
    assert listed == {"object": "list", "data": [{"id": "smol", "object": "model", "created": state.started_at,
                                                  "owned_by": "tandem", "root": "/models/smol"}]}
    time.sleep(1.1)   # a later request answers the same time: the start, not the request's
    assert client.get("/v1/models/smol").json()["created"] == state.started_at


def test_a_ready_pool_adds_the_context_length() -> None:
    limits = SimpleNamespace(context_len=2048)
    client, _ = _client(SimpleNamespace(is_ready=True, limits=lambda: limits, lora_adapters=dict))
    assert client.get("/v1/models/smol").json()["max_model_len"] == 2048
