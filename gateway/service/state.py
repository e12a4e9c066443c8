"""What every operation needs: config, tokenizer, the worker pool, the metrics and the generation service
(one per app, held on `app.state.gateway`; the HTTP routes get it through `gateway.api.app_state`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.cluster.pool import WorkerPool
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.service.generation import GenerationService
from gateway.service.pooling import PoolingWorkers
from gateway.text.tokenizer import Tokenizer


@dataclass(slots=True)
class GatewayState:
    config: GatewayConfig
    tokenizer: Tokenizer | None  # None with --skip-tokenizer-init: token ids in, token ids out
    pool: WorkerPool
    metrics: GatewayMetrics
    generation: GenerationService
    started_at: int = field(default_factory=lambda: int(time.time()))  # Unix time (the models' `created`)

    def resolve_model(self, model: str, param: str = "model") -> str:
        """The LoRA adapter a request's `model` names: "" for the served model (its served name or its
        path), the name itself for an adapter loaded on the workers; else 404 `model_not_found`."""
        if model in (self.config.served_model_name, self.config.model_path):
            return ""
        if model and model in self.pool.lora_adapters():
            return model
        raise APIError(
            404,
            f"The model `{model}` does not exist. Served: `{self.config.served_model_name}`"
            + "".join(f", `{name}`" for name in self.pool.lora_adapters())
            + ".",
            "not_found_error",
            param=param,
            code="model_not_found",
        )

    def check_model(self, model: str) -> None:
        """For the routes that serve the base model only (embeddings, scoring): 404 unless `model`
        names the served model, 400 when it names a LoRA adapter."""
        if self.resolve_model(model):
            raise APIError(400, f"`{model}` is a LoRA adapter: this route serves the base model only", param="model")

    def require_generation(self) -> None:
        """400 on generation routes when the served model is an embedding model."""
        if self.config.is_embedding:
            raise APIError(
                400,
                f"`{self.config.served_model_name}` is an embedding model: use /v1/embeddings or /encode",
                param="model",
                code="model_not_generative",
            )

    def pooling_workers(self) -> PoolingWorkers:
        """The embedding workers, for the pooling operations (embeddings, score, rerank)."""
        return PoolingWorkers(self.pool, self.config.served_model_name, self.config.prefill_timeout_s)

    def require_tokenizer(self, param: str) -> Tokenizer:
        """The tokenizer, or a 400 naming `param` when the server runs without one."""
        if self.tokenizer is None:
            raise APIError(
                400,
                f"`{param}` needs text, but the server runs with --skip-tokenizer-init: "
                "send token ids (`input_ids` / a token-id prompt) instead",
                param=param,
            )
        return self.tokenizer
