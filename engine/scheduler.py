"""Chooses what runs each step and owns page bookkeeping for requests. No torch here.

Policy: new prompts are prefilled first (by priority, then first come first served, up to
`max_prefill_tokens` per step, and only while their pages fit); otherwise every running request
decodes together in one batch. A running request that needs a new page when none is free preempts
running requests, the lowest priority (highest `priority` value) and then the newest first: they
give their pages back and wait, ahead of new prompts of their priority, to be recomputed by a
prefill of everything they had (their output so far included) once pages are free again, then
decode on. A reservation that does not fit preempts running requests of a lower priority than its
own the same way. Only a request that could not fit even alone in the whole pool is aborted.

Chunked prefill (`chunked_prefill_size`): a prefill step computes at most that many prompt tokens
(and at most `max_prefill_tokens`) in all; the prompt that would cross the cap is split, and the
rest of it stays at the head of `waiting`, holding every page of its prompt (allocated with its
first chunk), to continue first in the next step. So one long prompt never holds a step for
long; but prefill still comes first, so running requests decode only once no prompt is waiting,
as without chunking.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.errors import CapacityError
from engine.page_allocator import pages_needed
from engine.page_pool import PagePool
from engine.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    requests: list[Request]
    is_decode: bool


class Scheduler:
    """Owns `waiting` and `running`; takes and returns every request page through `pages`, which
    may or may not cache prefixes (the scheduler never needs to know)."""

    def __init__(
        self,
        pages: PagePool,
        max_running_requests: int,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None = None,
    ) -> None:
        self.pages = pages
        self.page_size = pages.page_size
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size or None  # 0, like None, means no chunking
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add_waiting(self, req: Request) -> None:
        """Queue a prompt behind every waiting request of its priority or a better one."""
        self.waiting.insert(self._waiting_slot(req.priority, is_ahead_of_equals=False), req)

    def _waiting_slot(self, priority: int, is_ahead_of_equals: bool) -> int:
        """Where a request of `priority` joins `waiting`: before the first request of a worse priority
        (or, `is_ahead_of_equals`, of the same one too), never before a prompt part-way through its
        chunks, which holds its pages at the head."""
        start = 1 if self.waiting and self.waiting[0].page_ids else 0
        for i in range(start, len(self.waiting)):
            other = self.waiting[i].priority
            if other > priority or (is_ahead_of_equals and other == priority):
                return i
        return len(self.waiting)

    def add_running(self, req: Request) -> None:
        """Admit a request whose prompt KV is already in `req.page_ids` (decode after a handoff)."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def schedule(self) -> tuple[ScheduledBatch | None, list[Request]]:
        """Pick the next batch. Also returns requests aborted because they could never fit (already finished)."""
        prefill = self._schedule_prefill()
        if prefill:
            return ScheduledBatch(prefill, is_decode=False), []
        evicted = self._grow_decode_pages()
        if not self.running:
            return None, evicted
        return ScheduledBatch(list(self.running), is_decode=True), evicted

    def _schedule_prefill(self) -> list[Request]:
        """Admit waiting prompts FCFS; set each one's `num_new_tokens` for this step.

        A request already part-way through its prompt (a chunk ran, its pages are allocated) is
        always first in `waiting` and continues regardless of `max_running_requests`, which
        counted it when it was admitted.
        """
        batch: list[Request] = []
        num_tokens = 0
        budget = self._prefill_budget
        while self.waiting and num_tokens < budget:
            req = self.waiting[0]
            is_continuing = bool(req.page_ids)  # only an admitted waiting request holds pages
            if not is_continuing and len(self.running) + len(batch) >= self.max_running_requests:
                break
            if self.chunked_prefill_size is None and batch and num_tokens + req.prefill_len - req.num_computed > budget:
                break
            matched = self._match_prefix(req)
            needed = pages_needed(req.prefill_len, self.page_size) - len(req.page_ids)
            # a preempted request comes back only with a page of room for each running one, or the
            # next decode step would preempt again at once
            headroom = len(self.running) if req.is_resuming and not is_continuing else 0
            if not self.pages.can_allocate(needed + headroom):
                if matched:  # give the matched pages back; the request retries the match later
                    self.release_pages(req)
                    req.num_computed = req.num_cached_tokens = 0
                break
            req.page_ids.extend(self.pages.allocate(needed))
            num_left = req.prefill_len - req.num_computed
            is_split = self.chunked_prefill_size is not None and num_tokens + num_left > budget
            req.num_new_tokens = budget - num_tokens if is_split else num_left
            batch.append(req)
            num_tokens += req.num_new_tokens
            if is_split:
                break  # the rest of its prompt stays at the head of `waiting` for the next step
            self.waiting.popleft()
        return batch

    @property
    def _prefill_budget(self) -> int:
        """Prompt tokens one prefill step may compute (without chunking, a lone longer prompt may exceed it)."""
        if self.chunked_prefill_size is None:
            return self.max_prefill_tokens
        return min(self.chunked_prefill_size, self.max_prefill_tokens)

    def _grow_decode_pages(self) -> list[Request]:
        """Give each running request room for the token it is about to write. When the pool has no
        page left, the newest running requests are preempted (`preempt`) until one is free; a request
        that could not fit even alone in the whole pool is aborted instead. Returns the aborted."""
        aborted: list[Request] = []
        for req in list(self.running):
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

    def preempt(self, req: Request) -> None:
        """Pause a running request: free its pages and queue it to be recomputed (ahead of new
        prompts of its priority, behind a prompt part-way through its chunks), keeping what it generated."""
        self.running.remove(req)
        self.release_pages(req)
        req.num_computed = req.num_cached_tokens = 0
        req.is_resuming = True
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
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

    def after_prefill(self, req: Request) -> bool:
        """The step wrote `req.num_new_tokens` more prompt tokens. Returns whether the prompt is now
        complete: then the request decodes (or, prefill-only, awaits its finish) and its full
        prompt pages join the prefix cache. Otherwise it stays at the head of `waiting` for its
        next chunk, and the token sampled this step must be ignored."""
        req.num_computed += req.num_new_tokens
        req.num_new_tokens = 0
        if req.num_computed < req.prefill_len:
            return False
        req.is_resuming = False
        self.pages.insert(req.prompt_ids, req.page_ids, req.num_cached_tokens // self.page_size)
        if not req.is_prefill_only:
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        return True

    def finish(self, req: Request, reason: FinishReason | None, message: str = "", keep_pages: bool = False) -> None:
        """Mark finished and drop from the queues; frees pages unless `keep_pages`."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.abort_message = message
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if not keep_pages:
            self.release_pages(req)

    def release_pages(self, req: Request) -> None:
        """Give back every page `req` holds (cached ones lose its reference)."""
        if req.page_ids:
            self.pages.release(req.page_ids)
            req.page_ids = []

    def reserve(self, num_tokens: int, priority: int = 0) -> list[int]:
        """Pages for `num_tokens` tokens arriving from elsewhere, for a request of `priority`. When
        they are not free, running requests of a worse priority are preempted for them (lowest
        priority, then newest first), but only if their pages would be enough; else CapacityError."""
        needed = pages_needed(num_tokens, self.page_size)
        if not self.pages.can_allocate(needed):
            victims = [r for r in self._victims(self.running) if r.priority > priority]
            if self.pages.can_allocate(max(0, needed - sum(len(r.page_ids) for r in victims))):
                for victim in victims:
                    if self.pages.can_allocate(needed):
                        break
                    self.preempt(victim)
        return self.pages.allocate(needed)

    def _match_prefix(self, req: Request) -> list[int]:
        """On a request's first scheduling, take the cached pages of its longest cached prefix.
        A request scoring its prompt from `prompt_logprob_start` needs the hidden state of position
        start - 1, so only the tokens before that may come from the cache."""
        if req.page_ids or req.num_computed:
            return []
        start = req.prompt_logprob_start
        tokens = req.prompt_ids if start is None else req.prompt_ids[:start]
        matched = self.pages.match(tokens)
        req.page_ids = list(matched)
        req.num_computed = req.num_cached_tokens = len(matched) * self.page_size
        return matched

    def check_capacity(self, num_tokens: int) -> None:
        """Raise CapacityError when a prompt could never fit in the whole pool."""
        needed = pages_needed(num_tokens, self.page_size)
        if needed > self.pages.num_pages:
            raise CapacityError(f"prompt needs {needed} KV pages but the pool has {self.pages.num_pages}")
