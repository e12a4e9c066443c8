"""Sampled tokens -> `StepOutput`s: whether a token ends its request, and what each output carries.

Plain functions over one `Request`. They record a token in the request, never touch the queues or
the pages: the engine finishes the request (`Scheduler.finish`) when `append_token` says so.
No torch here.
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequestError
from engine.request import FinishReason, Request, StepOutput
from engine.step_records import SampledToken


def finish_reason(req: Request, token_id: int, eos_token_ids: frozenset[int], context_len: int) -> FinishReason | None:
    """STOP for a stop token id (or an eos id, unless `ignore_eos`); LENGTH once `req` has
    `max_new_tokens` outputs or fills the context; None while it goes on. `token_id` must be
    already appended to `req.output_ids`."""
    params = req.sampling
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
        return FinishReason.STOP
    if len(req.output_ids) >= params.max_new_tokens or req.seq_len >= context_len:
        return FinishReason.LENGTH
    return None


def accept_token(matcher: Any, token_id: int) -> None:
    """Advance an xgrammar matcher past a token; a token outside the grammar is an engine bug (the
    step's mask allowed only tokens that continue it)."""
    if not matcher.accept_token(token_id):
        raise InvalidRequestError(f"token {token_id} does not continue the requested grammar")


def accept_grammar_token(req: Request, token_id: int) -> None:
    """`accept_token` on `req`'s grammar matcher, if it has one."""
    if req.grammar_matcher is not None:
        accept_token(req.grammar_matcher, token_id)


def record_token(req: Request, token: SampledToken) -> None:
    """Append `token` and its logprob to `req`'s outputs."""
    req.output_ids.append(token.token_id)
    req.output_logprobs.append(token.logprob)


def append_token(
    req: Request, token: SampledToken, eos_token_ids: frozenset[int], context_len: int
) -> FinishReason | None:
    """Record `token` as `req`'s next output and return the reason it ends `req` (None: it goes on).
    When it ends `req`, sets `req.matched_token_id` (the token, for STOP; else None)."""
    record_token(req, token)
    reason = finish_reason(req, token.token_id, eos_token_ids, context_len)
    if reason is not None:
        req.matched_token_id = token.token_id if reason is FinishReason.STOP else None
    return reason


def token_output(req: Request, token: SampledToken, reason: FinishReason | None) -> StepOutput:
    """The output carrying `req`'s newest token (already recorded) and `reason` if it ended `req`.
    A request's first token also carries what its prefill learned: cached tokens, prompt
    logprobs, when the prefill began; its last, what speculation did for it."""
    is_first = len(req.output_ids) == 1
    is_last = reason is not None
    return StepOutput(
        req.request_id,
        token.token_id,
        token.logprob,
        reason,
        matched_token_id=req.matched_token_id,
        top_logprobs=token.top,
        token_ids_logprobs=token.requested,
        cached_tokens=req.num_cached_tokens if is_first else 0,
        prompt_logprobs=req.prompt_logprobs if is_first else None,
        prefill_started_at=req.prefill_started_at if is_first else None,
        spec_verify_ct=req.num_spec_steps if is_last else 0,
        spec_accepted_tokens=req.num_accepted_drafts if is_last else 0,
    )


def prefill_only_output(req: Request, token: SampledToken, weights_id: str) -> StepOutput:
    """The one output of a prefill-only request: its first token, no finish reason (decoding goes
    on elsewhere), and `weights_id`, naming the weights its KV was computed with."""
    return StepOutput(
        req.request_id,
        token.token_id,
        token.logprob,
        top_logprobs=token.top,
        token_ids_logprobs=token.requested,
        cached_tokens=req.num_cached_tokens,
        weights_id=weights_id,
        prompt_logprobs=req.prompt_logprobs,
        prefill_started_at=req.prefill_started_at,
    )


def finish_output(req: Request) -> StepOutput:
    """The token-less output of a finished `req`: its finish reason, matched token and abort message."""
    return StepOutput(
        req.request_id,
        None,
        None,
        req.finish_reason,
        matched_token_id=req.matched_token_id,
        abort_message=req.abort_message,
        spec_verify_ct=req.num_spec_steps,
        spec_accepted_tokens=req.num_accepted_drafts,
    )
