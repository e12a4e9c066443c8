"""Request messages to the bodies the HTTP routes take: `to_values`, then the few places where the
proto spells an OpenAI or SGLang union its own way. The record then checks every value as it checks
an HTTP body, so a bad field is refused with the same message, naming the same field."""

from __future__ import annotations

from typing import Any, TypeVar

from google.protobuf.message import Message
from pydantic import BaseModel, ValidationError

from gateway.errors import bad_request, validation_error
from gateway.grpc_api.convert import to_values

Record = TypeVar("Record", bound=BaseModel)


def record(cls: type[Record], values: dict[str, Any]) -> Record:
    """`cls` from `values`; a refused value is the HTTP route's 400 (INVALID_ARGUMENT), naming the field."""
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        raise validation_error(exc) from None


def chat_values(message: Message) -> dict[str, Any]:
    """A ChatCompletionRequest as /v1/chat/completions' body (without `request_id`)."""
    values = _lora_as_model(to_values(message))
    values.pop("request_id", None)
    values["messages"] = [_message(m) for m in values.get("messages", [])]
    choice = values.get("tool_choice")
    if choice is not None:
        values["tool_choice"] = (
            choice["mode"] if "mode" in choice else {"type": "function", "function": choice.get("function", {})}
        )
    return values


def message_values(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_message(m) for m in messages]


def _message(values: dict[str, Any]) -> dict[str, Any]:
    if "content_parts" in values:
        if "content" in values:
            raise bad_request("a message has `content` or `content_parts`, not both", "messages.content_parts")
        values = {key: value for key, value in values.items() if key != "content_parts"} | {
            "content": values["content_parts"]
        }
    return values


def completion_values(message: Message) -> dict[str, Any]:
    """A CompletionRequest as /v1/completions' body (without `request_id`)."""
    values = _lora_as_model(to_values(message))
    values.pop("request_id", None)
    _one_of_inputs(values, "prompt", "prompt_token_ids", "prompt", single=False)
    return values


def generate_values(message: Message, rid: str) -> dict[str, Any]:
    """A GenerateRequest as /generate's body: one prompt as one value (one answer), several as a
    list; the outputs' ids from `rid`."""
    values = to_values(message)
    count = _one_of_inputs(values, "text", "input_ids", "input_ids", single=True)
    values["rid"] = rid if count == 1 else [f"{rid}-{i}" for i in range(count)]
    names = [name or None for name in values.pop("lora_name", [])]
    if names:
        values["lora_path"] = names[0] if len(names) == 1 else names
    return values


def _lora_as_model(values: dict[str, Any]) -> dict[str, Any]:
    """A chat or completion request's `lora_name`, when set, is the model it runs (`model` over HTTP)."""
    if "lora_name" in values:
        values["model"] = values.pop("lora_name")
    return values


def embed_values(message: Message) -> dict[str, Any]:
    """An EmbedRequest as /v1/embeddings' body."""
    values = to_values(message)
    _one_of_inputs(values, "input", "input_token_ids", "input", single=False)
    return values


def classify_values(message: Message, rid: str) -> dict[str, Any]:
    """A ClassifyRequest as /classify's body; each output's id `<rid>-<index>` (always a list)."""
    values = to_values(message)
    count = _one_of_inputs(values, "text", "input_ids", "input_ids", single=False)
    values["rid"] = [f"{rid}-{i}" for i in range(count)]
    return values


def tokenize_values(message: Message) -> dict[str, Any]:
    values = to_values(message)
    if "messages" in values:
        values["messages"] = message_values(values["messages"])
    return values


def _one_of_inputs(values: dict[str, Any], text_key: str, ids_key: str, body_ids_key: str, single: bool) -> int:
    """Texts under `text_key` or token-id lists under `ids_key` (TokenIds messages) -> the body's
    `text_key` (texts) or `body_ids_key` (id lists); with `single`, one input as one value.
    Returns the number of inputs (0 leaves both out, which the record refuses)."""
    texts, id_lists = values.pop(text_key, None), values.pop(ids_key, None)
    if texts and id_lists:
        raise bad_request(f"exactly one of `{text_key}` and `{ids_key}` is required", text_key)
    if texts:
        values[text_key] = texts[0] if single and len(texts) == 1 else texts
        return len(texts)
    if id_lists:
        ids = [entry.get("ids", []) for entry in id_lists]
        values[body_ids_key] = ids[0] if single and len(ids) == 1 else ids
        return len(ids)
    return 0
