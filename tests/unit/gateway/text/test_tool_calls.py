"""Tool planning, the forced-call schema, and parsing calls out of model text."""

from __future__ import annotations

import json

import pytest

from gateway.errors import APIError
from gateway.text.tool_calls import parse_tool_calls, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_choices_decide_what_is_shown_and_forced() -> None:
    assert plan_tools(None, None, None).tools == []
    assert plan_tools([WEATHER], "none", None).tools == []
    auto = plan_tools([WEATHER, TIME], None, None)
    assert auto.tools and auto.forced_schema is None and auto.parallel
    required = plan_tools([WEATHER, TIME], "required", None)
    assert required.forced_schema["type"] == "array" and len(required.forced_schema["items"]["anyOf"]) == 2
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None)
    assert named.forced_schema["properties"]["name"] == {"const": "get_time"} and not named.parallel


@pytest.mark.parametrize("tools, choice, param", [
    ([{"type": "function"}], None, "tools"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    (None, "required", "tool_choice")])
def test_invalid_tools_are_400s_naming_the_param(tools, choice, param) -> None:
    with pytest.raises(APIError) as info:
        plan_tools(tools, choice, None)
    assert info.value.status == 400 and info.value.param == param


def test_calls_are_parsed_from_blocks_bare_json_and_arrays() -> None:
    plan = plan_tools([WEATHER, TIME], "auto", True)
    content, calls = parse_tool_calls('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                                      '</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>', plan)
    assert content == "Sure." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"} and calls[0].id.startswith("call_")
    content, calls = parse_tool_calls('[{"name": "get_time", "arguments": {}}]', plan)
    assert content is None and [c.name for c in calls] == ["get_time"]
    content, calls = parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Rome"}}', plan)
    assert json.loads(calls[0].arguments) == {"city": "Rome"}


def test_text_without_a_known_call_stays_content_and_parallel_false_keeps_one() -> None:
    plan = plan_tools([WEATHER], "auto", False)
    assert parse_tool_calls("It is sunny.", plan) == ("It is sunny.", [])
    assert parse_tool_calls('{"name": "unknown", "arguments": {}}', plan)[1] == []
    _, calls = parse_tool_calls('<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>'
                                '<tool_call>{"name": "get_weather", "arguments": {"city": "B"}}</tool_call>', plan)
    assert len(calls) == 1
