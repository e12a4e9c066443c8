"""Chooses the tokens each step computes and owns page bookkeeping for requests. No torch here.

A request has `num_computed` tokens with KV and `seq_len` tokens it knows (prompt, then output); a
step computes some of the rest. It samples its next token when the step reaches its last known
token. A step is filled in this order, prefill and decode in one batch:

1. running requests that lack only their newest token (decoding): one token each, always, plus the
   draft tokens a `proposer` guesses for them (speculative decoding: verified in the same step);
2. running requests part-way through their prompt (chunked prefill): their next chunk;
3. waiting prompts, by priority then first come first served, while their pages fit and fewer than
   `max_running_requests` run; an admitted prompt holds the pages of its whole prompt from its first
   chunk and runs from then on.

Prompt tokens per step are capped by `max_prefill_tokens`, by `chunked_prefill_size` when chunking
(the prompt crossing the cap is split), by what `max_num_batched_tokens` leaves after the decode
tokens and, while requests decode, by a `pacer` (engine/step_costs.py) that keeps the step close to
a decode-only step's time. Without chunking a prompt is never split: one longer than the cap runs
whole, alone. A `draft_budget` (same module) chooses how many drafts each decoding request may
verify, from measured step times and its acceptance so far (None: as many as the proposer guesses).

A decoding request that needs a new page when none is free preempts running requests, the lowest
priority (highest `priority` value) and then the newest first: they give their pages back and wait,
ahead of new prompts of their priority, to be recomputed over everything they had (their output
so far included), then decode on. A reservation that does not fit preempts running requests of a
lower priority than its own the same way. Only a request that could not fit even alone in the whole
pool is aborted.

`update_from_output` takes the step's `ModelOutput` and turns it into the requests' progress and
their `StepOutput`s.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from engine.errors import CapacityError, WouldPreemptError
from engine.outputs import accept_grammar_token, append_token, finish_output, prefill_only_output, token_output
from engine.page_allocator import pages_needed
from engine.page_pool import PagePool
from engine.proposers import DraftAsk, Proposer
from engine.request import FinishReason, Request, RequestStatus, StepOutput, join_prompt_logprobs
from engine.step_costs import DecodePacer, DraftBudget
from engine.step_records import ModelOutput, SchedulerOutput

logger = logging.getLogger(__name__)

NON_FINITE_LOGITS_MESSAGE = "the model produced non-finite logits (NaN or inf) for this request"


class Scheduler:
    """Owns `waiting` and `running`; takes and returns every request page through `pages`, which
    may or may not cache prefixes (the scheduler never needs to know). `eos_token_ids` and
    `context_len` decide when a sampled token ends its request."""

    def __init__(
        self,
        pages: PagePool,
        max_running_requests: int,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None = None,
        max_num_batched_tokens: int | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        context_len: int = 2**31,
        proposer: Proposer | None = None,
        pacer: DecodePacer | None = None,
        draft_budget: DraftBudget | None = None,
    ) -> None:
        self.pages = pages
        self.page_size = pages.page_size
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size or None  # 0, like None, means no chunking
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = eos_token_ids
        self.context_len = context_len
        self.waiting: deque[Request] = deque()
        self.loading: dict[str, Request] = {}  # queued once their slow-tier pages are read (Engine.add_request)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.proposer = proposer
        self.pacer = pacer
        self.draft_budget = draft_budget
        self.num_draft_tokens = 0  # proposed and verified, since start
        self.num_accepted_tokens = 0  # of those, accepted
        self.num_rejecting_steps = 0  # request-steps that rejected a draft
        self._preempted: list[Request] = []  # this step's, for its SchedulerOutput
        self.writing: frozenset[str] = frozenset()  # requests whose pages a step still computing writes into
        self._parked: list[int] = []  # pages of requests in `writing` that finished: freed once it is over

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add_waiting(self, req: Request) -> None:
        """Queue a prompt behind every waiting request of its priority or a better one."""
        self.waiting.insert(self._waiting_slot(req.priority, is_ahead_of_equals=False), req)

    def _waiting_slot(self, priority: int, is_ahead_of_equals: bool) -> int:
        """Where a request of `priority` joins `waiting`: before the first request of a worse priority
        (or, `is_ahead_of_equals`, of the same one too)."""
        for i, other in enumerate(self.waiting):
            if other.priority > priority or (is_ahead_of_equals and other.priority == priority):
                return i
        return len(self.waiting)

    def add_loading(self, req: Request) -> None:
        """Hold a prompt out of the queue while its cached pages are read from a slow tier."""
        req.status = RequestStatus.LOADING
        self.loading[req.request_id] = req

    def end_loading(self, request_id: str) -> None:
        """Queue a prompt whose slow-tier read is over (behind the prompts of its priority queued meanwhile)."""
        req = self.loading.pop(request_id, None)
        if req is not None:
            req.status = RequestStatus.WAITING
            self.add_waiting(req)

    def add_running(self, req: Request) -> None:
        """Admit a request whose prompt KV is already in `req.page_ids` (decode after a handoff)."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    # ---- the step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's tokens (see the module docstring). Requests that could never fit are
        finished here and listed in `aborted`."""
        self._preempted = []
        decoding = [r for r in self.running if r.seq_len - r.num_computed == 1]
        aborted = self._grow_decode_pages(decoding)
        decoding = [r for r in decoding if r in self.running]
        if self.proposer is not None:
            self._propose(decoding, self.proposer)
        requests: list[Request] = list(decoding)
        counts = [1 + len(r.draft_ids) for r in decoding]
        num_decode_tokens = sum(counts)
        unpaced_budget = self._prompt_budget(num_decode_tokens)
        cap = self.pacer.prompt_budget(num_decode_tokens) if self.pacer is not None else None
        budget = unpaced_budget if cap is None else min(unpaced_budget, cap)
        num_prompt_tokens = 0
        for req in [r for r in self.running if r.seq_len - r.num_computed > 1]:  # chunks to continue
            if num_prompt_tokens >= budget:
                break
            num_new = min(req.seq_len - req.num_computed, budget - num_prompt_tokens)
            requests.append(req)
            counts.append(num_new)
            num_prompt_tokens += num_new
        admitted = self._admit_waiting(
            budget - num_prompt_tokens,
            is_first=num_prompt_tokens == 0,
            unpaced_budget=unpaced_budget - num_prompt_tokens,
        )
        for req, num_new in admitted:
            requests.append(req)
            counts.append(num_new)
        is_sampling = tuple(r.num_computed + n == r.seq_len + len(r.draft_ids) for r, n in zip(requests, counts))
        return SchedulerOutput(
            tuple(requests), tuple(counts), is_sampling, tuple(aborted), tuple(self._preempted), num_decode_tokens
        )

    def _draft_limits(self, decoding: list[Request]) -> list[int]:
        """The most drafts each of `decoding` may get this step: the draft budget's choice, from each
        request's acceptance so far (drawn toward the worker's, two drafts' worth, while it has few)."""
        if self.draft_budget is None:
            return [2**31] * len(decoding)
        overall = (self.num_accepted_tokens + 1) / (self.num_accepted_tokens + self.num_rejecting_steps + 2)
        acceptance = [
            (r.num_accepted_drafts + 2 * overall) / (r.num_accepted_drafts + r.num_rejecting_steps + 2)
            for r in decoding
        ]
        cost = self.proposer.seconds_per_draft if self.proposer is not None else 0.0
        return self.draft_budget.num_drafts(acceptance, cost)

    def _propose(self, decoding: list[Request], proposer: Proposer) -> None:
        """Give the decoding requests the drafts `proposer` guesses, asked once for all of them: each at
        most what the draft budget allows it and its limits (max tokens, context) leave room for, cut
        at the first draft its grammar refuses and to the pages it holds or can take without
        preempting. A request whose next token's logits depend on its earlier tokens (penalties, logit
        bias, a minimum of new tokens still to reach) or that will not decode here gets none."""
        asks: list[tuple[Request, DraftAsk]] = []
        for req, limit in zip(decoding, self._draft_limits(decoding)):
            params = req.sampling
            if (
                limit <= 0
                or req.is_prefill_only
                or params.has_penalties
                or params.logit_bias
                or len(req.output_ids) < params.min_new_tokens
            ):
                continue
            room = min(params.max_new_tokens - len(req.output_ids) - 1, self.context_len - req.seq_len - 1, limit)
            if room > 0:
                asks.append((req, DraftAsk(req.request_id, req.token_ids(0, req.seq_len), room)))
        if not asks:
            return
        catch_up_s = self.pacer.catch_up_seconds(len(decoding)) if self.pacer is not None else None
        for (req, _), drafts in zip(asks, proposer.propose([ask for _, ask in asks], catch_up_s)):
            if drafts and req.grammar_matcher is not None:
                drafts = _grammar_prefix(req.grammar_matcher, drafts)
            extra_pages = pages_needed(req.seq_len + len(drafts), self.page_size) - len(req.page_ids)
            if extra_pages > 0:
                if self.pages.can_allocate(extra_pages):
                    req.page_ids.extend(self.pages.allocate(extra_pages))
                else:
                    drafts = drafts[: len(req.page_ids) * self.page_size - req.seq_len]
            req.draft_ids = drafts

    def _prompt_budget(self, num_decode_tokens: int) -> int:
        """Prompt tokens this step may compute, after `num_decode_tokens` decode tokens, before the decode
        pace caps them."""
        budget = self.max_prefill_tokens
        if self.chunked_prefill_size is not None:
            budget = min(budget, self.chunked_prefill_size)
        if self.max_num_batched_tokens is not None:
            budget = min(budget, self.max_num_batched_tokens - num_decode_tokens)
        return budget

    def _admit_waiting(
        self, budget: int, is_first: bool, unpaced_budget: int | None = None
    ) -> list[tuple[Request, int]]:
        """Admit waiting prompts in order within `budget` prompt tokens (`is_first`: no prompt token is
        in the step yet, so an unchunked prompt over the budget may run alone): their pages are
        allocated, they run, and each gets its number of new tokens for this step. A short prompt (at
        most the pacer's `unpaced_tokens` left to compute after its cached prefix) runs whole within
        `unpaced_budget`, the step's budget without the decode pace."""
        admitted: list[tuple[Request, int]] = []
        num_tokens = 0
        is_chunking = self.chunked_prefill_size is not None
        max_unpaced = self.pacer.unpaced_tokens if self.pacer is not None and unpaced_budget is not None else 0
        while self.waiting and len(self.running) < self.max_running_requests:
            req = self.waiting[0]
            room = budget - num_tokens
            unpaced_room = min(unpaced_budget - num_tokens, max_unpaced) if unpaced_budget is not None else 0
            if is_chunking and room <= 0 and unpaced_room <= 0:
                break
            if not is_chunking and req.seq_len > room and (admitted or not is_first):
                break
            matched = self._match_prefix(req)
            if 0 < req.seq_len - req.num_computed <= unpaced_room:  # short: whole, outside the decode pace
                room = max(room, req.seq_len - req.num_computed)
            elif is_chunking and room <= 0:
                self._give_back_match(req, matched)
                break
            needed = pages_needed(req.seq_len, self.page_size) - len(req.page_ids)
            # a preempted request comes back only with a page of room for each running one, or the
            # next decode step would preempt again at once
            headroom = len(self.running) if req.is_resuming else 0
            if not self.pages.can_allocate(needed + headroom):
                self._give_back_match(req, matched)
                break
            req.page_ids.extend(self.pages.allocate(needed))
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.prefill_started_at is None:  # a recompute keeps its first prefill's start
                req.prefill_started_at = time.perf_counter()
            num_left = req.seq_len - req.num_computed
            num_new = min(num_left, room) if is_chunking else num_left
            admitted.append((req, num_new))
            num_tokens += num_new
        return admitted

    def _grow_decode_pages(self, decoding: list[Request]) -> list[Request]:
        """Give each decoding request room for the token it is about to write. When the pool has no
        page left, running requests are preempted (`preempt`, the lowest priority and newest first)
        until one is free; a request that could not fit even alone in the whole pool is aborted
        instead. Returns the aborted."""
        aborted: list[Request] = []
        for req in decoding:
            needed = pages_needed(req.seq_len, self.page_size)
            if req not in self.running or needed <= len(req.page_ids):
                continue
            if needed > self.pages.num_pages:
                message = (
                    f"KV cache exhausted: the request needs {needed} KV pages for {req.seq_len} tokens, "
                    f"more than the pool's {self.pages.num_pages}"
                )
                self.finish(req, FinishReason.ABORT, message=message)
                aborted.append(req)
                continue
            while not self.pages.can_allocate(1) and req in self.running:
                self.preempt(self._victims(self.running)[0])
            if req in self.running:
                req.page_ids.extend(self.pages.allocate(1))
        return aborted

    def update_from_output(
        self, scheduled: SchedulerOutput, output: ModelOutput, weights_id: str = ""
    ) -> list[StepOutput]:
        """Record what the step computed and sampled: each request's `num_computed` advances, a
        completed prompt joins the prefix cache and decodes on, a sampled token is recorded (and may
        finish its request: `finish`), a prefill-only request finishes keeping its pages, a request
        with non-finite logits fails. Returns the step's outputs (those of `scheduled.aborted` first);
        a request whose chunk was not its prompt's last gives none. `weights_id` names the weights
        (for prefill-only outputs)."""
        outputs = [finish_output(r) for r in scheduled.aborted]
        for i, (req, num_new) in enumerate(zip(scheduled.requests, scheduled.num_new_tokens)):
            if i in output.non_finite:  # this request alone fails; the rest of the batch goes on
                logger.error("request %s failed: %s", req.request_id, NON_FINITE_LOGITS_MESSAGE)
                self.finish(req, FinishReason.ERROR, NON_FINITE_LOGITS_MESSAGE)
                outputs.append(finish_output(req))
                continue
            if output.prompt and output.prompt[i] is not None:  # the piece this chunk scored
                req.prompt_logprobs = join_prompt_logprobs(req.prompt_logprobs, output.prompt[i])
            was_prefilling = req.is_resuming or req.num_computed < req.prompt_len
            req.num_computed += num_new
            num_drafts, req.draft_ids = len(req.draft_ids), []
            if not scheduled.is_sampling[i]:
                continue
            if was_prefilling:
                self._complete_prefill(req)
            if num_drafts:  # the rejected drafts' KV is void: it is overwritten as the sequence grows
                num_accepted = len(output.sampled[i]) - 1
                self.num_draft_tokens += num_drafts
                self.num_accepted_tokens += num_accepted
                req.num_spec_steps += 1
                req.num_accepted_drafts += num_accepted
                if num_accepted < num_drafts:
                    req.num_rejecting_steps += 1
                    self.num_rejecting_steps += 1
                req.num_computed -= num_drafts - num_accepted
            for token in output.sampled[i]:
                if req.is_prefill_only:
                    req.output_ids.append(token.token_id)
                    req.output_logprobs.append(token.logprob)
                    self.finish(req, None, keep_pages=True)
                    outputs.append(prefill_only_output(req, token, weights_id))
                    break
                accept_grammar_token(req, token.token_id)
                reason = append_token(req, token, self.eos_token_ids, self.context_len)
                if reason is not None:
                    self.finish(req, reason)
                outputs.append(token_output(req, token, reason))
                if reason is not None:
                    break
        return outputs

    def _complete_prefill(self, req: Request) -> None:
        """`req`'s prompt (or, resuming, its whole sequence) now has KV: its full prompt pages join the
        prefix cache and it is no longer resuming."""
        req.is_resuming = False
        self.pages.insert(req.prompt_ids, req.page_ids, req.num_cached_tokens // self.page_size, req.lora_id)

    # ---- pages, preemption, finishing ----------------------------------------------------

    def preempt(self, req: Request) -> None:
        """Pause a running request: free its pages and queue it to be recomputed (ahead of new
        prompts of its priority), keeping what it generated."""
        self.running.remove(req)
        self.release_pages(req)
        if self.proposer is not None:
            self.proposer.forget(req.request_id)
        req.num_computed = req.num_cached_tokens = 0
        req.draft_ids = []
        req.is_resuming = True
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self._preempted.append(req)
        self.waiting.insert(self._waiting_slot(req.priority, is_ahead_of_equals=True), req)

    @staticmethod
    def _victims(running: list[Request]) -> list[Request]:
        """`running` in the order to preempt them: the lowest priority (highest value) first, then the newest."""
        newest_first = list(reversed(running))
        return sorted(newest_first, key=lambda r: -r.priority)  # stable: the newest first among equals

    @property
    def has_resuming(self) -> bool:
        """Preempted requests wait to come back."""
        return any(r.is_resuming for r in self.waiting)

    def has_resuming_at(self, priority: int) -> bool:
        """A preempted request of `priority` or a better one waits to come back: a new reservation of
        `priority` must not take its pages first."""
        return any(r.is_resuming and r.priority <= priority for r in self.waiting)

    def finish(self, req: Request, reason: FinishReason | None, message: str = "", keep_pages: bool = False) -> None:
        """Mark finished and drop from the queues; frees pages unless `keep_pages`. The full pages
        of every token with KV (prompt and output) join the prefix cache first, unless the request
        failed (its KV may hold non-finite values)."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.abort_message = message
        if req in self.running:
            self.running.remove(req)
            if self.proposer is not None:
                self.proposer.forget(req.request_id)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.loading.pop(req.request_id, None)
        if keep_pages:
            return
        if reason is not FinishReason.ERROR and not req.is_resuming and req.num_computed >= self.page_size:
            self.pages.insert(req.token_ids(0, req.num_computed), req.page_ids, 0, req.lora_id)
        self.release_pages(req)

    def release_pages(self, req: Request) -> None:
        """Give back every page `req` holds (cached ones lose its reference); a request in `writing`
        gives them back at `release_parked`, since a step still computing writes into them
        (engine/overlap.py)."""
        if req.page_ids:
            if req.request_id in self.writing:
                self._parked.extend(req.page_ids)
            else:
                self.pages.release(req.page_ids)
            req.page_ids = []

    def release_parked(self, writing: frozenset[str] = frozenset()) -> None:
        """The step that wrote into the parked pages is over: give them back. `writing`: the requests
        of the step computing from now on."""
        if self._parked:
            self.pages.release(self._parked)
            self._parked = []
        self.writing = writing

    def reserve(
        self, num_tokens: int, priority: int = 0, may_preempt: bool = True, num_held_pages: int = 0
    ) -> list[int]:
        """Pages for `num_tokens` tokens arriving from elsewhere, for a request of `priority`, beyond the
        `num_held_pages` it already holds (its cached prefix). When they are not free, running requests
        of a worse priority are preempted for them (lowest priority, then newest first), but only if
        their pages would be enough; else CapacityError. Without `may_preempt`, WouldPreemptError where
        it would preempt (and CapacityError as before)."""
        needed = pages_needed(num_tokens, self.page_size) - num_held_pages
        if not self.pages.can_allocate(needed):
            victims = [r for r in self._victims(self.running) if r.priority > priority]
            if self.pages.can_allocate(max(0, needed - sum(len(r.page_ids) for r in victims))):
                if not may_preempt:
                    raise WouldPreemptError("the reservation needs running requests' pages")
                for victim in victims:
                    if self.pages.can_allocate(needed):
                        break
                    self.preempt(victim)
        return self.pages.allocate(needed)

    def _give_back_match(self, req: Request, matched: list[int]) -> None:
        """Undo `_match_prefix` for a request that stays waiting: it matches again when admitted."""
        if matched:
            self.release_pages(req)
            req.num_computed = req.num_cached_tokens = 0

    def _match_prefix(self, req: Request) -> list[int]:
        """On a request's admission, take the cached pages of its longest cached prefix (of its
        `cacheable_prompt`)."""
        if req.page_ids or req.num_computed:
            return []
        matched = self.pages.match(cacheable_prompt(req), req.lora_id)
        req.page_ids = list(matched)
        req.num_computed = req.num_cached_tokens = len(matched) * self.page_size
        return matched

    def check_capacity(self, num_tokens: int) -> None:
        """Raise CapacityError when a prompt could never fit in the whole pool."""
        needed = pages_needed(num_tokens, self.page_size)
        if needed > self.pages.num_pages:
            raise CapacityError(f"prompt needs {needed} KV pages but the pool has {self.pages.num_pages}")


def cacheable_prompt(req: Request) -> list[int]:
    """The prompt tokens whose KV the prefix cache may serve: a request scoring its prompt from
    `prompt_logprob_start` needs the hidden state of position start - 1, so only the tokens before it."""
    start = req.prompt_logprob_start
    return req.prompt_ids if start is None else req.prompt_ids[:start]


def _grammar_prefix(matcher: Any, drafts: list[int]) -> list[int]:
    """The longest prefix of `drafts` the grammar `matcher` accepts from its state now, short of a token
    that would end it (no row may follow a stop token); the matcher is left in that state (xgrammar's
    `rollback`)."""
    num_valid = 0
    for token_id in drafts:
        if matcher.is_terminated() or not matcher.accept_token(token_id):
            break
        if matcher.is_terminated():
            matcher.rollback(1)
            break
        num_valid += 1
    if num_valid:
        matcher.rollback(num_valid)
    return drafts[:num_valid]
