"""Check a request's `SamplingSpec` as its HTTP route built it and fill in the server's defaults, naming the
offending param on error."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from gateway.cluster.pool import ModelLimits
from gateway.errors import APIError, bad_request, context_length_exceeded
from gateway.sampling_defaults import SamplingDefaults
from tandem.limits import (
    LOGIT_BIAS,
    MAX_NEW_TOKENS,
    MIN_NEW_TOKENS,
    MIN_P,
    PENALTY,
    REPETITION_PENALTY,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_LOGPROBS_NUM,
    TOP_P,
    Range,
)
from tandem.sampling import GrammarKind, GrammarSpec, SamplingSpec


def build_sampling(
    spec: SamplingSpec,
    prompt_len: int,
    limits: ModelLimits,
    defaults: SamplingDefaults,
    max_tokens_param: str = "max_tokens",
    prompt_param: str = "prompt",
) -> SamplingSpec:
    """`spec` once its values and the context budget are checked: unset max_new_tokens fills the rest
    of the context, unset temperature / top_p / top_k / min_p take the server's `defaults` (if any), and
    top_k <= 0 or top_logprobs_num 0 become unset."""
    _check_values(spec, limits, max_tokens_param)
    room = _room(prompt_len, spec.max_new_tokens, limits, max_tokens_param, prompt_param)
    top_k = _first_set(spec.top_k, defaults.top_k)
    return replace(
        spec,
        temperature=_first_set(spec.temperature, defaults.temperature),
        top_p=_first_set(spec.top_p, defaults.top_p),
        top_k=top_k if top_k is not None and top_k > 0 else None,
        min_p=_first_set(spec.min_p, defaults.min_p),
        max_new_tokens=spec.max_new_tokens or room,
        top_logprobs_num=spec.top_logprobs_num or None,
    )


def _check_values(spec: SamplingSpec, limits: ModelLimits, max_tokens_param: str) -> None:
    """400 naming the HTTP param of the first value outside its `tandem.limits` range or the vocabulary."""
    for param, value, allowed in (
        ("temperature", spec.temperature, TEMPERATURE),
        ("top_p", spec.top_p, TOP_P),
        ("top_k", spec.top_k, TOP_K),
        ("min_p", spec.min_p, MIN_P),
        (max_tokens_param, spec.max_new_tokens, MAX_NEW_TOKENS),
        ("seed", spec.seed, SEED),
        ("presence_penalty", spec.presence_penalty, PENALTY),
        ("frequency_penalty", spec.frequency_penalty, PENALTY),
        ("repetition_penalty", spec.repetition_penalty, REPETITION_PENALTY),
        ("min_tokens", spec.min_new_tokens, MIN_NEW_TOKENS),
    ):
        _check_range(param, value, allowed)
    if spec.min_new_tokens and spec.max_new_tokens is not None and spec.min_new_tokens > spec.max_new_tokens:
        raise bad_request(
            f"min_tokens ({spec.min_new_tokens}) must not exceed the maximum number of tokens ({spec.max_new_tokens})",
            "min_tokens",
        )
    for token_id, bias in spec.logit_bias:
        if not (0 <= token_id < limits.vocab_size):
            raise bad_request(f"logit_bias: token id {token_id} is outside the vocabulary", "logit_bias")
        if bias not in LOGIT_BIAS:
            raise bad_request(
                f"logit_bias: bias {bias} for token {token_id} is outside [{LOGIT_BIAS.low:g}, {LOGIT_BIAS.high:g}]",
                "logit_bias",
            )
    check_token_ids(list(spec.token_ids_logprob), limits, "token_ids_logprob")
    bad_id = next((t for t in spec.stop_token_ids if not (0 <= t < limits.vocab_size)), None)
    if bad_id is not None:
        raise bad_request(f"stop_token_ids: {bad_id} is outside the vocabulary", "stop_token_ids")


def _room(
    prompt_len: int, max_new_tokens: int | None, limits: ModelLimits, max_tokens_param: str, prompt_param: str
) -> int:
    """How many tokens the context leaves after the prompt: 400 when the prompt is empty or leaves none,
    or when `max_new_tokens` asks for more."""
    if prompt_len == 0:
        raise bad_request("the prompt is empty", "prompt")
    room = limits.context_len - prompt_len
    if room < 1:
        raise context_length_exceeded(limits.context_len, prompt_len, None, prompt_param)
    if max_new_tokens is not None and max_new_tokens > room:
        raise context_length_exceeded(limits.context_len, prompt_len, max_new_tokens, max_tokens_param)
    return room


def check_token_ids(token_ids: list[int], limits: ModelLimits, param: str) -> None:
    bad = next((t for t in token_ids if not (0 <= t < limits.vocab_size)), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})", param)


def check_top_logprobs(num_top: int, param: str) -> None:
    """400 naming `param` unless 0 <= num_top <= MAX_TOP_LOGPROBS (`tandem.limits`, the engine's limit too)."""
    _check_range(param, num_top, TOP_LOGPROBS_NUM)


def parse_logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI sends token ids as JSON object keys (strings)."""
    if not bias:
        return ()
    try:
        return tuple((int(token), float(value)) for token, value in bias.items())
    except (TypeError, ValueError):
        raise bad_request("logit_bias keys must be token ids and values numbers", "logit_bias") from None


def output_constraint(
    json_schema: Any = None,
    regex: str | None = None,
    ebnf: str | None = None,
    json_object: bool = False,
    schema_param: str = "json_schema",
) -> GrammarSpec | None:
    """At most one of the constraints; a JSON schema may come as a dict or as JSON text (`false`,
    `true` and schemas nested deeper than MAX_SCHEMA_DEPTH are refused)."""
    given = [
        name
        for name, value in (
            ("json_schema", json_schema is not None),
            ("regex", regex),
            ("ebnf", ebnf),
            ("json_object", json_object),
        )
        if value
    ]
    if len(given) > 1:
        raise bad_request(f"only one output constraint may be given, got {', '.join(given)}", given[1])
    if not given:
        return None
    if given[0] == "json_schema":
        if isinstance(json_schema, str):
            try:
                json_schema = json.loads(json_schema)
            except json.JSONDecodeError as exc:
                raise bad_request(f"the JSON schema is not valid JSON: {exc}", schema_param) from None
        if json_schema is False:
            raise bad_request("the JSON schema `false` matches nothing: no output could satisfy it", schema_param)
        if json_schema is True:
            raise bad_request(
                "the JSON schema `true` allows any JSON value: send a schema object, or ask for json_object",
                schema_param,
            )
        if not isinstance(json_schema, dict):
            raise bad_request("the JSON schema must be a JSON object", schema_param)
        if (depth := nesting_depth(json_schema)) > MAX_SCHEMA_DEPTH:
            raise bad_request(
                f"the JSON schema is nested {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are allowed",
                schema_param,
                "invalid_value",
            )
        return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(json_schema))
    if given[0] == "json_object":
        return GrammarSpec(GrammarKind.JSON_OBJECT)
    return GrammarSpec(GrammarKind(given[0]), (regex if given[0] == "regex" else ebnf) or "")


MAX_SCHEMA_DEPTH = 64  # objects and arrays inside each other; compile time grows steeply with depth


def nesting_depth(document: Any) -> int:
    """How many objects and arrays deep `document` (parsed JSON) goes; iterative, so any depth is safe."""
    deepest, pending = 0, [(document, 1)]
    while pending:
        value, depth = pending.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            pending += [(child, depth + 1) for child in children]
    return deepest


def stop_list(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not s for s in stops):
        raise bad_request("stop strings must be non-empty", "stop")
    if len(stops) > 16:
        raise bad_request("at most 16 stop strings are allowed", "stop")
    return stops


def _first_set(value, default):
    return value if value is not None else default


def _check_range(param: str, value: float | None, allowed: Range) -> None:
    if value is not None and value not in allowed:
        raise APIError(400, allowed.error(param, value), param=param)
