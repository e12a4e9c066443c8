"""Overlapped steps: the next decode step chosen, given its pages and queued for the compute thread
while the step before it computes, so forward passes run back to back and the host's work between
them (the step's update, its outputs' delivery, the next step's choice) runs meanwhile.

While step N computes, `plan_ahead` chooses step N+1 from what N is certain to leave: every request
N samples for decodes one more token, the one N samples. That token is not known yet, so step N+1 is
computed from shadows, copies of its requests taken now, advanced by N's token with a placeholder
for it; the compute thread writes N's sampled token into each shadow the moment N ends
(`execute_ahead`), then runs N+1 with the same `ModelRunner.execute` as any step. The live requests
stay the engine thread's: it records N's tokens in them (`Engine.update`) while N+1 computes, and
N+1's own tokens when N+1 ends (`settle_ahead`, then `Engine.update`). The forward pass, the
sampler and each request's sampling state (its seed's step, penalties over its outputs, the minimum
of new tokens) see exactly what a step scheduled after N would have shown them, so the tokens are
the same with and without overlap.

It plans ahead only when step N+1 is certain to be exactly that: nothing waits to be admitted or
loads, no request is part-way through its prompt, no proposer drafts (drafts depend on N's token),
no request follows a grammar (its matcher must take N's token before it masks N+1's logits), and
every request that N does not certainly finish (its token limit, the context) gets one page of room
without preempting anyone. Otherwise the next step is scheduled after N as usual. The engine loop
plans nothing ahead while the MoE expert distribution is recorded either (a thrown-away row would count).

A request that N finishes anyway (a stop token) is computed once more in N+1 and that row thrown
away; since N+1 writes its KV into the request's pages, `Scheduler.writing` keeps them from being
freed until N+1 is over.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.engine import Engine
from engine.page_allocator import pages_needed
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from engine.step_records import ModelOutput, SchedulerOutput

_PLACEHOLDER = 0  # the shadow's newest token until the step before it ends


@dataclass(frozen=True, slots=True)
class AheadStep:
    """A decode step planned while the step before it computes: `scheduled` over the live requests
    (for `Engine.update`), `computed` over their shadows (for the compute thread), and `rows`, each
    request's index in the step before, whose sampled token it feeds."""

    scheduled: SchedulerOutput
    computed: SchedulerOutput
    rows: tuple[int, ...]

    @property
    def request_ids(self) -> frozenset[str]:
        return frozenset(r.request_id for r in self.scheduled.requests)


def plan_ahead(scheduler: Scheduler, in_flight: SchedulerOutput) -> AheadStep | None:
    """The decode step that follows `in_flight` (whose update has not run), or None when it is not
    certain (see the module docstring). Grows the live requests' pages for it."""
    if scheduler.waiting or scheduler.loading or scheduler.proposer is not None or in_flight.is_empty:
        return None
    rows = {id(r): i for i, r in enumerate(in_flight.requests) if in_flight.is_sampling[i]}
    if any(id(r) not in rows or r.grammar_matcher is not None for r in scheduler.running):
        return None  # a running request that will not sample, or whose next mask needs its token first
    going_on = [r for r in scheduler.running if not _ends_after_next_token(r, scheduler.context_len)]
    if not going_on:
        return None
    extra = [pages_needed(r.seq_len + 1, scheduler.page_size) - len(r.page_ids) for r in going_on]
    if not scheduler.pages.can_allocate(sum(n for n in extra if n > 0)):
        return None  # never preempt for a step ahead: the usual schedule decides that
    for req, num in zip(going_on, extra):
        if num > 0:  # a new list: the compute thread may be reading the old one for the step in flight
            req.page_ids = [*req.page_ids, *scheduler.pages.allocate(num)]
    count = len(going_on)
    ones, trues = (1,) * count, (True,) * count
    return AheadStep(
        SchedulerOutput(tuple(going_on), ones, trues, num_decode_tokens=count),
        SchedulerOutput(tuple(_shadow(r) for r in going_on), ones, trues, num_decode_tokens=count),
        tuple(rows[id(r)] for r in going_on),
    )


def _ends_after_next_token(req: Request, context_len: int) -> bool:
    """Whether the token the step in flight samples for `req` certainly ends it: its last by the token
    limit or the context, or the only one of a prefill-only request."""
    return (
        req.is_prefill_only or len(req.output_ids) + 1 >= req.sampling.max_new_tokens or req.seq_len + 1 >= context_len
    )


def _shadow(req: Request) -> Request:
    """A copy of `req` as it will be once the step in flight has recorded its token (a placeholder
    until then): the compute thread reads it while the engine thread updates `req`."""
    return replace(
        req,
        output_ids=[*req.output_ids, _PLACEHOLDER],
        output_logprobs=[],
        page_ids=list(req.page_ids),
        num_computed=req.seq_len,
        draft_ids=[],
        is_resuming=False,
        prompt_logprobs=None,
    )


def execute_ahead(engine: Engine, ahead: AheadStep, previous: ModelOutput) -> ModelOutput:
    """On the compute thread, once the step before has computed `previous`: give each shadow the token
    that step sampled for its request, then compute the step. A row whose request failed there gets the
    placeholder; its result is thrown away (`settle_ahead`)."""
    for shadow, row in zip(ahead.computed.requests, ahead.rows):
        sampled = previous.sampled[row]
        shadow.output_ids[-1] = sampled[-1].token_id if sampled else _PLACEHOLDER
    return engine.execute(ahead.computed)


def settle_ahead(ahead: AheadStep, output: ModelOutput) -> tuple[SchedulerOutput, ModelOutput]:
    """`ahead`'s step and output without the requests the step before finished (their rows are thrown
    away), for `Engine.update`."""
    kept = [i for i, r in enumerate(ahead.scheduled.requests) if r.status is RequestStatus.RUNNING]
    if len(kept) == len(ahead.scheduled.requests):
        return ahead.scheduled, output
    count = len(kept)
    scheduled = SchedulerOutput(
        tuple(ahead.scheduled.requests[i] for i in kept), (1,) * count, (True,) * count, num_decode_tokens=count
    )
    new_index = {old: new for new, old in enumerate(kept)}
    return scheduled, ModelOutput(
        tuple(output.sampled[i] for i in kept),
        tuple(output.prompt[i] for i in kept) if output.prompt else (),
        frozenset(new_index[i] for i in output.non_finite if i in new_index),
    )
