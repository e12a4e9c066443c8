"""The generations of an OpenAI chat or text completion: one `GenerationRequest` per prompt and
choice, from the body's sampling fields, stop strings and output constraint."""

from __future__ import annotations

from dataclasses import replace

from gateway.caller import checked_priority
from gateway.errors import bad_request
from gateway.service.generation import GenerationRequest
from gateway.service.request_schemas import ChatCompletionRequest, CompletionRequest
from gateway.service.sampling import build_sampling, output_constraint, parse_logit_bias, stop_list
from gateway.service.state import GatewayState
from gateway.text.tool_calls import ToolPlan
from tandem.limits import MAX_N
from tandem.sampling import GrammarSpec, SamplingSpec


def choice_requests(
    state: GatewayState,
    body: ChatCompletionRequest | CompletionRequest,
    prompts: list[list[int]],
    n: int,
    max_tokens: int | None,
    max_tokens_param: str,
    num_top: int,
    plan: ToolPlan | None = None,
    prompt_logprob_start: int | None = None,
) -> list[GenerationRequest]:
    """Each prompt's `n` generations, prompt-major; a bad field is a 400 naming it."""
    if not (1 <= n <= MAX_N):
        raise bad_request(f"n must be between 1 and {MAX_N}, got {n}", "n")
    priority = checked_priority(body.priority)
    lora_name = state.resolve_model(body.model)
    requests = []
    for prompt_ids in prompts:
        spec = SamplingSpec(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            seed=body.seed,
            max_new_tokens=max_tokens,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            min_new_tokens=body.min_tokens,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=parse_logit_bias(body.logit_bias),
            top_logprobs_num=num_top,
            grammar=_constraint(body, plan),
        )
        sampling = build_sampling(
            spec,
            len(prompt_ids),
            state.pool.limits(),
            state.config.sampling_defaults,
            max_tokens_param,
            "messages" if isinstance(body, ChatCompletionRequest) else "prompt",
        )
        for i in range(n):
            choice_sampling = sampling
            if body.seed is not None and i:
                choice_sampling = replace(sampling, seed=(body.seed + i) % 2**63)  # distinct but reproducible choices
            requests.append(
                GenerationRequest(
                    prompt_ids,
                    choice_sampling,
                    _stops(state, body.stop),
                    body.skip_special_tokens,
                    spaces_between_special_tokens=body.spaces_between_special_tokens,
                    no_stop_trim=body.no_stop_trim,
                    prompt_logprob_start=prompt_logprob_start,
                    priority=priority,
                    lora_name=lora_name,
                )
            )
    return requests


def _stops(state: GatewayState, stop) -> tuple[str, ...]:
    stops = stop_list(stop)
    if stops:
        state.require_tokenizer("stop")
    return stops


def _constraint(body: ChatCompletionRequest | CompletionRequest, plan: ToolPlan | None = None) -> GrammarSpec | None:
    """response_format (chat), a forced tool call, or SGLang's regex / ebnf -> one output constraint."""
    schema, json_object = None, False
    response_format = getattr(body, "response_format", None)
    if response_format:
        kind = response_format.get("type", "text")
        if kind == "json_object":
            json_object = True
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise bad_request(
                    'response_format json_schema needs {"json_schema": {"name", "schema"}}', "response_format"
                )
            schema = spec["schema"]
        elif kind != "text":
            raise bad_request(
                f"response_format type must be text, json_object or json_schema, got {kind!r}", "response_format"
            )
    if plan is not None and plan.forced_schema is not None:
        if schema is not None or json_object:
            raise bad_request("tool_choice required or named cannot be combined with response_format", "tool_choice")
        schema = plan.forced_schema
    return output_constraint(schema, body.regex, body.ebnf, json_object, "response_format")
