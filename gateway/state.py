"""What every route needs: config, tokenizer and the worker pool (held on `app.state.gateway`)."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.tokenizer import Tokenizer
from gateway.workers import WorkerPool


@dataclass(slots=True)
class GatewayState:
    config: GatewayConfig
    tokenizer: Tokenizer
    pool: WorkerPool

    def check_model(self, model: str) -> None:
        """404 unless `model` names the served model (its served name or its path)."""
        if model not in (self.config.served_model_name, self.config.model_path):
            raise APIError(404, f"The model `{model}` does not exist. Served: `{self.config.served_model_name}`.",
                           "not_found_error", param="model", code="model_not_found")


def gateway_state(request: Request) -> GatewayState:
    return request.app.state.gateway
