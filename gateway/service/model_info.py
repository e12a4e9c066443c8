"""The served model, as every front describes it: SGLang's /get_model_info and OpenAI's model list."""

from __future__ import annotations

from gateway.service.response_schemas import ModelCard, ModelList
from gateway.service.state import GatewayState


def model_info(state: GatewayState) -> dict:
    """Exactly the keys SGLang answers with (its notebook asserts the key set)."""
    return {
        "model_path": state.config.model_path,
        "tokenizer_path": state.config.model_path,
        "is_generation": not state.config.is_embedding,
    }


def model_list(state: GatewayState) -> ModelList:
    """The served model (every front's model list)."""
    return ModelList(data=[model_card(state)])


def model_card(state: GatewayState) -> ModelCard:
    return ModelCard(
        id=state.config.served_model_name,
        created=state.started_at,
        root=state.config.model_path,
        max_model_len=state.pool.limits().context_len if state.pool.is_ready else None,
    )
