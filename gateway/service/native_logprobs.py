"""/generate's logprob options and fields, in SGLang's shapes.

`return_logprob`, `logprob_start_len`, `top_logprobs_num` and `token_ids_logprob` may each be one
value for every prompt or a list with one per prompt, as in SGLang's batch requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.errors import bad_request
from gateway.service.generation import GenerationRequest, GenerationResult
from gateway.service.request_schemas import GenerateRequest
from gateway.service.response_schemas import LogprobTriple, NativeLogprobs
from gateway.service.sampling import check_top_logprobs


@dataclass(frozen=True, slots=True)
class LogprobOptions:
    """What one prompt's answers report: nothing unless `is_on`; then output logprobs, the prompt's
    from `prompt_start` (None: none), the `top_num` most likely tokens and the `token_ids` asked for."""

    is_on: bool = False
    prompt_start: int | None = None
    top_num: int = 0
    token_ids: tuple[int, ...] = ()


def logprob_options(body: GenerateRequest, prompts: list[list[int]]) -> list[LogprobOptions]:
    """One LogprobOptions per prompt; a value that is wrong for its prompt is a 400 naming it."""
    count = len(prompts)
    is_on = _per_prompt(body.return_logprob, count, "return_logprob")
    starts = _per_prompt(body.logprob_start_len, count, "logprob_start_len")
    tops = _per_prompt(body.top_logprobs_num, count, "top_logprobs_num")
    ids = body.token_ids_logprob or []
    id_lists = ids if ids and isinstance(ids[0], list) else [ids] * count
    if len(id_lists) != count:
        raise bad_request(f"{len(id_lists)} token_ids_logprob lists for {count} prompts", "token_ids_logprob")
    options = []
    for prompt_ids, on, start, top, wanted in zip(prompts, is_on, starts, tops, id_lists):
        check_top_logprobs(top, "top_logprobs_num")
        if not on:
            options.append(LogprobOptions())
            continue
        if not (-1 <= start < len(prompt_ids)):
            raise bad_request(
                f"logprob_start_len ({start}) must be -1 (output logprobs only) or a position in "
                f"the prompt (0 to {len(prompt_ids) - 1})",
                "logprob_start_len",
            )
        options.append(LogprobOptions(True, start if start >= 0 else None, top, tuple(wanted)))
    return options


def _per_prompt(value: Any, count: int, param: str) -> list:
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise bad_request(f"{len(value)} values of {param} for {count} prompts", param)
    return value


def logprob_fields(
    options: LogprobOptions,
    request: GenerationRequest,
    result: GenerationResult,
    token_text: Callable[[int], str] | None,
) -> NativeLogprobs:
    """SGLang's shape: [logprob, token_id, text or None] triples per position (`token_text` gives the
    text when asked for). The input_* lists cover the prompt from logprob_start_len on (empty when
    it is -1); position 0 has no distribution, so its logprob is None and its top / requested
    entries are None."""

    def triple(token_id: int, logprob: float | None) -> LogprobTriple:
        return logprob, token_id, token_text(token_id) if token_text else None

    scored = result.prompt_logprobs
    unscored = [request.prompt_ids[0]] if options.prompt_start == 0 else []  # position 0
    lists = NativeLogprobs(
        input_token_logprobs=[triple(t, None) for t in unscored] + [triple(t.token_id, t.logprob) for t in scored],
        output_token_logprobs=[triple(t.token_id, t.logprob) for t in result.tokens],
    )
    if options.top_num:
        lists.input_top_logprobs = [None] * len(unscored) + [[triple(i, lp) for i, lp in t.top] for t in scored]
        lists.output_top_logprobs = [[triple(i, lp) for i, lp in t.top] for t in result.tokens]
    if options.token_ids:
        lists.input_token_ids_logprobs = [None] * len(unscored) + [
            [triple(i, lp) for i, lp in t.requested] for t in scored
        ]
        lists.output_token_ids_logprobs = [[triple(i, lp) for i, lp in t.requested] for t in result.tokens]
    return lists
