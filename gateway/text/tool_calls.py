"""Tool calling: tool definitions into the prompt, calls out of the model's text, forced calls.

Models whose chat template takes `tools` get them there; for others a system message describes the
tools and asks for the format most open models are trained on: `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`. `tool_choice` "required" or a named function is enforced with a JSON schema
(grammar-masked sampling), so a forced call always parses.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.errors import bad_request

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools mean for generation: the tools to show, the forced schema if any."""

    tools: list[dict]
    names: frozenset[str]
    forced_schema: dict | None
    parallel: bool

    @property
    def parses_calls(self) -> bool:
        return bool(self.tools)


def plan_tools(tools: list[dict] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan:
    """Validate `tools` / `tool_choice` (400 naming the param) and decide what to do."""
    tools = tools or []
    functions = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict) or not function.get("name"):
            raise bad_request('each tool must be {"type": "function", "function": {"name", ...}}', "tools")
        functions.append(function)
    names = frozenset(f["name"] for f in functions)
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if choice == "none" or not tools:
        if choice not in ("none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return ToolPlan([], frozenset(), None, False)
    parallel = True if parallel is None else parallel
    if choice == "auto":
        return ToolPlan(tools, names, None, parallel)
    if choice == "required":
        return ToolPlan(tools, names, _calls_schema(functions, parallel), parallel)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return ToolPlan(tools, names, _calls_schema(chosen, False), False)
    raise bad_request('tool_choice must be none, auto, required or {"type": "function", ...}', "tool_choice")


def tools_system_prompt(tools: list[dict]) -> str:
    """For chat templates without tool support: describe the tools and the call format."""
    described = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return (
        "You can call functions. Available functions, as JSON:\n" + described + "\n"
        'To call a function, answer with <tool_call>{"name": <function name>, "arguments": <JSON object>}'
        "</tool_call> (one block per call) and nothing else."
    )


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[ToolCall]]:
    """Tool calls in a finished output: `<tool_call>` blocks, or the whole text as JSON (a forced
    call, or a model that answers with a bare call). Returns (remaining content or None, calls)."""
    candidates: list[Any] = []
    blocks = _BLOCK.findall(text)
    if blocks:
        for block in blocks:
            candidates.append(_loads(block))
        content = _BLOCK.sub("", text).strip() or None
    else:
        whole = _loads(text.strip())
        candidates = whole if isinstance(whole, list) else [whole]
        content = text if whole is None else None
    calls = []
    for candidate in candidates:
        if isinstance(candidate, dict) and candidate.get("name") in plan.names:
            arguments = candidate.get("arguments", candidate.get("parameters", {}))
            calls.append(
                ToolCall(candidate["name"], json.dumps(arguments, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")
            )
    if not calls:
        return text, []
    return content, calls if plan.parallel else calls[:1]


def _calls_schema(functions: list[dict], parallel: bool) -> dict:
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    one: dict = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": one, "minItems": 1} if parallel else one


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
