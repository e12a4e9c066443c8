"""vLLM's /tokenize and /detokenize, for every front."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import bad_request
from gateway.service.request_schemas import ChatMessage
from gateway.service.sampling import check_token_ids
from gateway.service.state import GatewayState
from gateway.text.text_input import encode_chat, encode_texts


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int] = Field(default_factory=list)


async def tokenize(state: GatewayState, body: TokenizeRequest) -> dict[str, Any]:
    """vLLM's /tokenize answer: a prompt's or a chat's token ids (and their strings when asked)."""
    if body.model is not None:
        state.resolve_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("exactly one of `prompt` and `messages` is required", "prompt")
    context_len = state.pool.limits().context_len
    if body.prompt is not None:
        [tokens] = await encode_texts(
            state.require_tokenizer("prompt"),
            [body.prompt],
            "prompt",
            context_len,
            add_special_tokens=body.add_special_tokens,
        )
    else:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages or []]
        tokens = await encode_chat(
            state.require_tokenizer("messages"),
            messages,
            "messages",
            context_len,
            add_generation_prompt=body.add_generation_prompt,
        )
    reply: dict[str, Any] = {"count": len(tokens), "max_model_len": context_len, "tokens": tokens}
    if body.return_token_strs:
        reply["token_strs"] = state.require_tokenizer("return_token_strs").convert_ids_to_tokens(tokens)
    return reply


async def detokenize(state: GatewayState, body: DetokenizeRequest) -> dict[str, str]:
    """vLLM's /detokenize answer: the text of token ids, special tokens kept."""
    if body.model is not None:
        state.resolve_model(body.model)
    check_token_ids(body.tokens, state.pool.limits(), "tokens")
    return {"prompt": state.require_tokenizer("tokens").decode(body.tokens, skip_special_tokens=False)}
