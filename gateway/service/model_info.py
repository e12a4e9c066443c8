"""The served model, as every front describes it: SGLang's /get_model_info and OpenAI's model list."""

from __future__ import annotations

from gateway.service.lora_admin import adapter_cards
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
    """The served model, then each LoRA adapter the workers hold (every front's model list)."""
    return ModelList(data=[model_card(state), *adapter_cards(state)])


def model_card(state: GatewayState, model: str | None = None) -> ModelCard:
    """The card of `model` (the served model when None or its name; 404 for a name that is neither
    it nor a loaded adapter)."""
    if model is not None and state.resolve_model(model):
        return next(card for card in adapter_cards(state) if card.id == model)
    return ModelCard(
        id=state.config.served_model_name,
        created=state.started_at,
        root=state.config.model_path,
        max_model_len=state.pool.limits().context_len if state.pool.is_ready else None,
    )
