"""Proto messages to and from the plain values the API's pydantic records read and write.

`to_values` gives a request message as the dict its HTTP body would be (a field left unset is left
out, so the record's default applies, as for a key missing from the JSON); `fill` writes an answer's
JSON form (`model_dump`) into a response message. Where OpenAI's JSON has a union or a null the proto
cannot hold, the proto names it and these two map it, by rule:
- a key `k` with a string or an integer goes to the proto's `k_text` or `k_token_id` (matched_stop);
- a null in a list goes to an empty wrapper message (`NullableDouble`, `TopLogprobMap`, `LogprobEntries`);
- SGLang's [logprob, token id, text] triple is a `LogprobEntry`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

_STRUCT = "google.protobuf.Struct"


def to_values(message: Message) -> dict[str, Any]:
    """The fields set in `message`, as plain values (Structs as dicts, with integral numbers as ints)."""
    return {field.name: _field_values(field, value) for field, value in message.ListFields()}


def _field_values(field: FieldDescriptor, value: Any) -> Any:
    if _is_map(field):
        value_field = field.message_type.fields_by_name["value"]
        return {key: _one_value(value_field, item) for key, item in value.items()}
    if _is_repeated(field):
        return [_one_value(field, item) for item in value]
    return _one_value(field, value)


def _one_value(field: FieldDescriptor, value: Any) -> Any:
    if field.type != FieldDescriptor.TYPE_MESSAGE:
        return value
    if field.message_type.full_name == _STRUCT:
        return _integral_numbers(json_format.MessageToDict(value))
    return to_values(value)


def _integral_numbers(value: Any) -> Any:
    """JSON numbers in a Struct are all doubles; a schema's `"maxLength": 5` must stay an integer."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: _integral_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integral_numbers(item) for item in value]
    return value


def fill(message: Message, values: Mapping[str, Any]) -> Message:
    """`message` with `values` (a record's JSON form) written in; keys the proto lacks and nulls are
    left out. Returns `message`."""
    fields = message.DESCRIPTOR.fields_by_name
    for key, value in values.items():
        if value is None:
            continue
        field = fields.get(key) or _union_member(fields, key, value)
        if field is None:
            continue
        if _is_map(field):
            getattr(message, field.name).update(value)
        elif _is_repeated(field):
            _fill_repeated(getattr(message, field.name), field, value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            target = getattr(message, field.name)
            target.SetInParent()
            fill(target, _wrapped(field, value))
        else:
            setattr(message, field.name, value)
    return message


def _fill_repeated(target: Any, field: FieldDescriptor, items: list[Any]) -> None:
    if field.type != FieldDescriptor.TYPE_MESSAGE:
        target.extend(items)
        return
    for item in items:
        fill(target.add(), _wrapped(field, item))


def _union_member(fields: Mapping[str, FieldDescriptor], key: str, value: Any) -> FieldDescriptor | None:
    """The proto field that holds `key` when OpenAI's JSON lets it be a string or an integer."""
    if isinstance(value, str):
        return fields.get(f"{key}_text")
    if isinstance(value, int) and not isinstance(value, bool):
        return fields.get(f"{key}_token_id")
    return None


# The JSON value (a null included) -> the fields of the wrapper message the proto has in its place.
_WRAPPERS: dict[str, Callable[[Any], Mapping[str, Any]]] = {
    "tandem.api.v1.NullableDouble": lambda value: {"value": value},
    "tandem.api.v1.TopLogprobMap": lambda value: {"logprobs": value},
    "tandem.api.v1.LogprobEntries": lambda value: {"entries": value},
    "tandem.api.v1.LogprobEntry": lambda value: {"logprob": value[0], "token_id": value[1], "token_text": value[2]},
}


def _wrapped(field: FieldDescriptor, value: Any) -> Mapping[str, Any]:
    wrap = _WRAPPERS.get(field.message_type.full_name)
    if wrap is None:
        return value
    return wrap(value) if value is not None else {}


def _is_repeated(field: FieldDescriptor) -> bool:
    return field.is_repeated


def _is_map(field: FieldDescriptor) -> bool:
    return (
        _is_repeated(field) and field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry
    )
