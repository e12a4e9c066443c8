"""gateway/service/request_schemas.py: /generate's sampling_params are typed, and an error's location names the key."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.service.request_schemas import ChatMessage, ChatRole, GenerateRequest, NativeSamplingParams


def test_one_set_for_every_prompt_or_a_list_of_one_per_prompt() -> None:
    assert GenerateRequest(text="x").sampling_params == NativeSamplingParams()
    one = GenerateRequest.model_validate({"text": "x", "sampling_params": {"temperature": 0, "n": 2}})
    assert one.sampling_params == NativeSamplingParams(temperature=0.0, n=2)
    each = GenerateRequest.model_validate({"text": ["a", "b"], "sampling_params": [{"top_k": 5}, {}]})
    assert each.sampling_params == [NativeSamplingParams(top_k=5), NativeSamplingParams()]


@pytest.mark.parametrize("params, loc", [
    ({"temprature": 0}, ("sampling_params", "temprature")),          # unknown key
    ({"ignore_eos": 1}, ("sampling_params", "ignore_eos")),          # strict: 1 is no flag
    ([{}, {"top_p": "0.5"}], ("sampling_params", "top_p")),          # strict: text is no number
    ("nope", ("sampling_params",)),
])
def test_an_error_is_located_at_the_key_without_the_union_member(params, loc: tuple) -> None:
    with pytest.raises(ValidationError) as caught:
        GenerateRequest.model_validate({"text": "x", "sampling_params": params})
    assert caught.value.errors()[0]["loc"] == loc


def test_chat_roles_are_an_enum_of_openais_words() -> None:
    assert ChatMessage(role="tool", content="x").role is ChatRole.TOOL
    with pytest.raises(ValidationError):
        ChatMessage(role="robot", content="x")
