"""Engine: one model on one KV pool. `step()` is schedule -> run -> postprocess.

Single-threaded by contract: every method must be called from the same thread (the server
runtime's engine loop), with two exceptions: while `execute` computes a step on another thread, that
thread may call `reserve(..., may_preempt=False)` and `slow_tier_digests` (and, when the step computes
from shadow requests, `update` the step before it and `poll_kv`: engine/overlap.py); and
`read_slow_tiers` may run on any thread. Two ways in:
- `add_request`: a prompt to prefill (and decode, unless `is_prefill_only`), or the confirmation of a
  reservation;
- `reserve`: a request whose prompt KV another process writes into its pages (all but the prompt's
  prefix this worker already held in its prefix cache) waits as RECEIVING until `add_request` confirms
  it with its first token (`ReceivedKV`), then decodes;
and `abort` ends either.

KV moves through the KV connector (engine/kv_connector.py): a prefill-only request's KV leaves through
it, which keeps its pages while it sends them; it gives a receiving request its deadline and keeps the
pages of one dropped unconfirmed while a write may still land. A prompt whose cached pages sit in a slow
tier (disk, the cluster's store) waits as "loading" while `background` reads them, then queues and finds
them in the pool. `poll_kv` takes in what finished off the engine thread: it frees the pages of sends
that are over, drops expired reservations, takes back quarantined pages and queues the prompts whose
reads are done; `wake` (the worker's) is called from the thread that finished.

Pages come and go through one `PagePool`, with or without a prefix cache (engine/page_pool.py).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

import torch

from engine.config import ConfigError, EngineConfig
from engine.draft_model import proposer_for
from engine.errors import (
    CapacityError,
    InvalidRequestError,
    LoraLoadError,
    RequestAbortedError,
    RequestNotFoundError,
)
from engine.grammar import GrammarBackend
from engine.kv_connector import KVConnector, ReceivedKV, ReservedPages
from engine.kv_host_tier import TierReads, tier_chain
from engine.kv_store_tier import StoreAccess
from engine.lora import LoraAdapter
from engine.lora_slots import LoraSlots
from engine.outputs import accept_token, append_token, finish_output
from engine.page_allocator import PageAllocator, pages_needed
from engine.page_pool import NoPrefixCache, PagePool
from engine.prefix_cache import PrefixCache
from engine.request import FinishReason, PromptLimits, Request, RequestStatus, SamplingParams, StepOutput
from engine.runner import FaultHooks, ModelRunner
from engine.scheduler import Scheduler, cacheable_prompt
from engine.stats import EngineStats
from engine.step_costs import DecodePacer, DecodeStepTimes, DraftBudget
from engine.step_records import ModelOutput, SampledToken, SchedulerOutput
from engine.weights import Checkpoint
from engine.weights.names import shape_changes

logger = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        checkpoint: Checkpoint,
        config: EngineConfig,
        progress: bool = True,
        faults: FaultHooks = FaultHooks(),
        background: Callable[[Callable[[], None]], object] | None = None,
        kv_store: StoreAccess | None = None,
        kv_connector: KVConnector | None = None,
        draft: Checkpoint | None = None,
    ) -> None:
        """`draft`: the draft model of `speculative_algorithm` "draft". `background` runs the slow tiers'
        reads and the disk tier's writes off the engine thread (None: on
        it, and no prompt waits as loading); `kv_store`: the
        cluster's KV store, where the prefix cache keeps its pages too (engine/kv_store_tier.py);
        `kv_connector` moves KV in and out of the pool (None: none moves; prefill-only requests' pages are
        freed once computed)."""
        mc = checkpoint.config
        if mc.num_labels > 0:
            raise ConfigError(
                f"{mc.architecture} is a classification (reward) model, not a generation "
                "model: serve it with --is-embedding (/classify)"
            )
        self.model_config = mc
        self.config = config
        self.context_len = min(config.context_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.prompt_limits = PromptLimits(mc.vocab_size, self.context_len)
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        self.grammar = GrammarBackend(checkpoint.path, mc.vocab_size)
        self.runner = ModelRunner(checkpoint, config, self.context_len, progress=progress, faults=faults)
        self.allocator = PageAllocator(self.runner.kv_pool.num_pages)
        self.kv_tiers = tier_chain(config, self.runner.kv_pool, checkpoint.identity, background, kv_store)
        if config.enable_prefix_cache:
            self.pages: PagePool = PrefixCache(self.allocator, config.page_size, self.kv_tiers)
        else:
            self.pages = NoPrefixCache(self.allocator, config.page_size)
        self.step_times = DecodeStepTimes()
        is_budgeted = config.speculative_algorithm is not None and config.speculative_draft_policy == "auto"
        pace, unpaced = config.max_decode_slowdown, config.unpaced_prompt_tokens
        pacer = DecodePacer(pace, self.step_times, unpaced_tokens=unpaced) if pace else None
        self.scheduler = Scheduler(
            self.pages,
            config.max_running_requests,
            config.max_prefill_tokens,
            config.chunked_prefill_size,
            config.max_num_batched_tokens,
            self.eos_token_ids,
            self.context_len,
            proposer_for(config, draft, mc, self.context_len, self.runner.kv_pool.num_pages, progress),
            pacer,
            DraftBudget(config.speculative_num_draft_tokens, self.step_times) if is_budgeted else None,
        )
        self.kv_connector = kv_connector or KVConnector()
        self.wake: Callable[[], None] = lambda: None  # from another thread: something for `poll_kv` is ready
        self._background = background
        self._fetched: collections.deque[tuple[str, TierReads]] = collections.deque()  # (request id, its reads)
        self._requests: dict[str, Request] = {}
        self._sending: dict[str, Request] = {}  # prefill-only requests whose pages the connector holds
        self._receiving: dict[str, Request] = {}  # reserved requests whose KV is being written from outside
        self.weights_id = checkpoint.identity  # names the weights; prefill and decode must agree on it

    # ---- ways in -------------------------------------------------------------------------

    def add_request(self, req: Request) -> StepOutput | None:
        """Queue a prompt, or, for a request whose `kv_params` is `ReceivedKV`, start decoding the reserved
        request it confirms (`_admit`). Raises InvalidRequestError / ContextLengthExceededError /
        CapacityError. Returns a finish output if a confirmed request's first token already ends it."""
        if isinstance(req.kv_params, ReceivedKV):
            return self._admit(req, req.kv_params)
        if self.holds(req.request_id):
            raise InvalidRequestError(f"request id {req.request_id!r} is already in use")
        self.prompt_limits.check_prompt(req.prompt_ids, logprob_start=req.prompt_logprob_start)
        self.scheduler.check_capacity(req.prompt_len)
        self._check_lora_slot(req.lora_slot)
        if req.sampling.grammar is not None:
            req.grammar_matcher = self.grammar.new_matcher(req.sampling.grammar)
        self._requests[req.request_id] = req
        if self._start_fetch(req):
            self.scheduler.add_loading(req)
        else:
            self.scheduler.add_waiting(req)
        return None

    def _start_fetch(self, req: Request) -> bool:
        """Start reading the pages of `req`'s prompt that only the slow tiers hold, off the engine thread:
        True if `req` is to wait as loading for them. Without a `background`, they are read here and now."""
        digests = self.slow_tier_digests(cacheable_prompt(req), req.lora_id)
        if not digests:
            return False
        tiers, request_id = self.kv_tiers, req.request_id
        assert tiers is not None
        if self._background is None:
            self._take_fetched(tiers.fetch(digests), req)
            return False

        def fetch() -> None:
            try:
                reads = tiers.fetch(digests)
            except Exception:  # never leave the request loading: its tokens are computed instead
                logger.exception("reading cached KV pages from a slow tier failed")
                reads = []
            self._fetched.append((request_id, reads))
            self.wake()

        self._background(fetch)
        return True

    def slow_tier_digests(self, token_ids: list[int], namespace: str) -> list[bytes]:
        """The names of `token_ids`' pages that neither the pool nor the host tier holds, when a slow tier may
        hold them (empty: nothing to read)."""
        if self.kv_tiers is None or not self.kv_tiers.has_slow_tiers or not isinstance(self.pages, PrefixCache):
            return []
        digests = self.pages.missing_digests(token_ids, namespace)
        return digests if digests and self.kv_tiers.is_worth_fetching(digests[0]) else []

    def read_slow_tiers(self, digests: list[bytes]) -> TierReads:
        """Read `digests` from the disk tier and the store (`TierChain.fetch`); any thread may call it, and
        `reserve` takes the result in."""
        return self.kv_tiers.fetch(digests) if self.kv_tiers is not None and digests else []

    def _take_fetched(self, reads: TierReads, req: Request | None) -> None:
        """Put the pages a slow-tier read found for `req` into the pool as cached pages of its prompt, where
        its admission finds them (None: the request is gone; the reads are only accounted for)."""
        assert self.kv_tiers is not None
        self.kv_tiers.adopt(reads)
        if req is not None:
            self.pages.release(self.pages.match(cacheable_prompt(req), req.lora_id))
        self.kv_tiers.forget_fetched()

    def load_lora(self, slot_id: int, adapter: LoraAdapter) -> None:
        """Put `adapter` in LoRA slot `slot_id` for the requests that name it from now on. The caller
        (server_runtime/lora_registry.py) gives a slot only when no request still uses it."""
        self._check_lora_slot(slot_id)
        try:
            self._lora_slots.write(slot_id, adapter)
        except ValueError as exc:
            raise LoraLoadError(str(exc)) from None

    def unload_lora(self, slot_id: int) -> None:
        """Empty LoRA slot `slot_id`."""
        self._check_lora_slot(slot_id)
        self._lora_slots.clear(slot_id)

    @property
    def _lora_slots(self) -> LoraSlots:
        slots = self.runner.lora_slots
        if slots is None:
            raise InvalidRequestError("this worker serves no LoRA adapters (--max-loras 0)")
        return slots

    def _check_lora_slot(self, slot_id: int | None) -> None:
        if slot_id is not None and not 0 <= slot_id < self._lora_slots.num_slots:
            raise InvalidRequestError(f"LoRA slot {slot_id} is not one of this worker's {self._lora_slots.num_slots}")

    def reserve(
        self,
        request_id: str,
        prompt_len: int,
        priority: int = 0,
        may_preempt: bool = True,
        prompt_ids: list[int] | None = None,
        namespace: str | None = "",
        reads: TierReads | None = None,
    ) -> ReservedPages:
        """Make a RECEIVING request that holds pages for a prompt whose KV another process writes; the KV
        connector gives it its deadline (`KVConnector.on_reserved`). Running requests of a worse
        `priority` may be preempted for its pages (`Scheduler.reserve`); without `may_preempt` (a step is
        computing them), WouldPreemptError instead.

        Given the prompt's tokens (`prompt_ids`), its longest prefix cached in `namespace` (the LoRA
        adapter's cache id; "" the base model; None matches nothing) is shared into the reservation,
        and only the pages after it are to be written; the pages of it that only the slow tiers hold are
        those `reads` found (`read_slow_tiers`, run off the engine thread), or, without `reads`, read now.
        """
        if not self.kv_connector.takes_kv_in:
            raise InvalidRequestError("this worker takes no KV from another process")
        if self.holds(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.prompt_limits.check_prompt_len(prompt_len)
        if prompt_ids is not None:
            if len(prompt_ids) != prompt_len:
                raise InvalidRequestError(f"prompt has {len(prompt_ids)} tokens but prompt_len is {prompt_len}")
            self.prompt_limits.check_prompt(prompt_ids)
        needed = pages_needed(prompt_len, self.config.page_size)
        if needed > self.pages.num_pages:  # no wait would help: not a capacity error
            raise InvalidRequestError(
                f"prompt needs {needed} KV pages but the decode pool has {self.pages.num_pages} in all"
            )
        if self.scheduler.has_resuming_at(priority):
            raise CapacityError("requests paused for lack of KV pages are resumed before new ones are reserved")
        cached = self._share_cached_prefix(prompt_ids, namespace, reads) if prompt_ids and namespace is not None else []
        try:
            page_ids = cached + self.scheduler.reserve(prompt_len, priority, may_preempt, num_held_pages=len(cached))
        except BaseException:
            self.pages.release(cached)
            raise
        req = Request(
            request_id,
            [],  # its confirmation brings the prompt and the sampling
            SamplingParams(),
            page_ids=page_ids,
            num_computed=prompt_len,
            num_cached_tokens=len(cached) * self.config.page_size,
            status=RequestStatus.RECEIVING,
            priority=priority,
            lora_id=namespace or "",
        )
        self.kv_connector.on_reserved(req)
        self._receiving[request_id] = req
        return ReservedPages(page_ids[len(cached) :], req.num_cached_tokens)

    def _share_cached_prefix(self, prompt_ids: list[int], namespace: str, reads: TierReads | None) -> list[int]:
        """The pages of `prompt_ids`' longest prefix cached in `namespace`, a reference taken on each; the
        slow tiers' pages of it are those `reads` found, or, without `reads`, read now."""
        if reads is None:
            reads = self.read_slow_tiers(self.slow_tier_digests(prompt_ids, namespace))
        if reads and self.kv_tiers is not None:
            self.kv_tiers.adopt(reads)
        cached = self.pages.match(prompt_ids, namespace)
        if self.kv_tiers is not None:
            self.kv_tiers.forget_fetched()
        return cached

    def _admit(self, req: Request, received: ReceivedKV) -> StepOutput | None:
        """Start decoding the reserved request `req` confirms from its first token: the prompt's KV is in
        the reserved pages, computed with the weights `received.weights_id` names (None: not checked),
        under the LoRA adapter now in slot `req.lora_slot` (`req.lora_id` names it). Returns a finish
        output if the first token already ends it (its pages are then freed)."""
        request_id = req.request_id
        reserved = self._receiving.get(request_id)
        if reserved is None:
            raise RequestNotFoundError(f"no reservation for request {request_id!r} (expired or never made)")
        if reserved.num_cached_tokens and reserved.lora_id != req.lora_id:
            raise RequestAbortedError(
                "the LoRA adapter was loaded again between the reservation and Generate: "
                "the cached prefix was computed under the one before"
            )
        if received.weights_id is not None and received.weights_id != self.weights_id:
            raise RequestAbortedError(
                f"the prefill and decode workers hold different model weights "
                f"(prefill {received.weights_id or 'unnamed'}, decode {self.weights_id}); "
                "they were updated apart or started from different checkpoints"
            )
        if req.prompt_len != reserved.num_computed:
            raise InvalidRequestError(f"prompt has {req.prompt_len} tokens but {reserved.num_computed} were reserved")
        self.prompt_limits.check_prompt(req.prompt_ids + [received.first_token], allow_full_context=True)
        self._check_lora_slot(req.lora_slot)
        if req.sampling.grammar is not None:  # replay prefill's first token into our own matcher
            req.grammar_matcher = self.grammar.new_matcher(req.sampling.grammar)
            accept_token(req.grammar_matcher, received.first_token)
        del self._receiving[request_id]
        self.kv_connector.on_received(reserved)
        req.kv_params = None
        req.page_ids = reserved.page_ids
        req.num_computed = req.prompt_len
        req.num_cached_tokens = reserved.num_cached_tokens
        # the written pages now hold KV too: the prompt's full pages join the prefix cache
        num_cached_pages = reserved.num_cached_tokens // self.config.page_size
        self.pages.insert(req.prompt_ids, req.page_ids, num_cached_pages, req.lora_id)
        self._requests[request_id] = req
        self.scheduler.add_running(req)
        first = SampledToken(received.first_token, received.first_logprob)
        reason = append_token(req, first, self.eos_token_ids, self.context_len)
        if reason is None:
            return None
        self.scheduler.finish(req, reason)
        del self._requests[request_id]
        return finish_output(req)

    def _drop_reservation(self, request_id: str, write_settled: bool) -> bool:
        """End a RECEIVING request: the prefix-cache pages it shared go back at once, the pages written
        from outside once the connector says no write can land in them. False if there was none."""
        req = self._receiving.pop(request_id, None)
        if req is None:
            return False
        num_cached_pages = req.num_cached_tokens // self.config.page_size
        self.pages.release(req.page_ids[:num_cached_pages])  # no write aims at these
        written = req.page_ids[num_cached_pages:]
        if not self.kv_connector.on_dropped(req, written, write_settled):
            self.pages.release(written)
        req.status = RequestStatus.FINISHED
        return True

    def abort(self, request_id: str, message: str = "aborted", write_settled: bool = False) -> StepOutput | None:
        """End a request, freeing its pages. None if nothing was held, if it was still RECEIVING, or if
        its KV is being sent (its pages are freed once `poll_kv` sees the send over). A receiving request's
        written pages sit out the connector's write grace unless `write_settled` says no KV write into
        them can still be in flight."""
        if self._drop_reservation(request_id, write_settled):
            return None
        if request_id in self._sending:  # a send may be reading its pages: they go when it is over
            return None
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req, FinishReason.ABORT, message)
        return finish_output(req)

    def update_weights(self, checkpoint: Checkpoint) -> list[StepOutput]:
        """Load new weights in place: shapes must match exactly (checked before any byte is copied).
        Every waiting or running request is aborted and every reservation dropped first, so none mixes
        two sets of weights; the prefix cache is flushed and `weights_id` names the new weights.
        Returns the abort outputs."""
        changes = shape_changes(self.model_config, checkpoint.config)
        if changes:
            raise InvalidRequestError(f"the new weights do not match the served model's shapes ({', '.join(changes)})")
        outputs = [self.abort(rid, "aborted: the model weights are being updated") for rid in list(self._requests)]
        for rid in list(self._receiving):  # their cached prefixes hold the old weights' KV
            self._drop_reservation(rid, write_settled=False)
        self.runner.load_weights(checkpoint)
        self.flush_prefix_cache()
        self.weights_id = checkpoint.identity
        if self.kv_tiers is not None:  # pages computed with the old weights are never found again
            self.kv_tiers.set_identity(checkpoint.identity)
        return [o for o in outputs if o is not None]

    def poll_kv(self) -> list[str]:
        """Take in the KV moves that finished off the engine thread: queue the prompts whose slow-tier reads
        are over, with their pages in the pool, and what the KV connector's `poll` reports: free the pages
        of the sends that are over and of the quarantine's end, drop the reservations past their deadline.
        Returns the ids of those sends and reservations."""
        while self._fetched:
            request_id, reads = self._fetched.popleft()
            req = self.scheduler.loading.get(request_id)
            self._take_fetched(reads, req)
            self.scheduler.end_loading(request_id)
        polled = self.kv_connector.poll()
        for request_id in polled.sent:
            if (req := self._sending.pop(request_id, None)) is not None:
                self.scheduler.release_pages(req)
        for request_id in polled.expired:
            self._drop_reservation(request_id, write_settled=False)
        self.pages.release(polled.released)
        return polled.sent + polled.expired

    def holds(self, request_id: str) -> bool:
        """Whether a request (receiving, queued, running, or its KV being sent) exists under this id."""
        return request_id in self._requests or request_id in self._receiving or request_id in self._sending

    @property
    def is_idle(self) -> bool:
        """No request of any kind: nothing in flight would be lost by stopping now."""
        return not (self._requests or self._receiving or self._sending)

    @property
    def num_cached_pages(self) -> int:
        """Pages kept only by the prefix cache (reusable; evicted when the pool runs short)."""
        return self.pages.num_evictable_pages

    def flush_prefix_cache(self) -> int:
        """Drop every cached page no request is using; returns how many pages were freed."""
        return self.pages.flush()

    @property
    def num_receiving(self) -> int:
        """Reserved requests not confirmed yet (a prefill is on its way for each)."""
        return len(self._receiving)

    def stats(self) -> EngineStats:
        """The queues and the page pool now, as a value other threads may read."""
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.loading),
            num_free_pages=self.allocator.num_free,
            num_total_pages=self.allocator.num_pages,
            num_cached_pages=self.num_cached_pages,
            num_preemptions=self.scheduler.num_preemptions,
            num_draft_tokens=self.scheduler.num_draft_tokens,
            num_accepted_tokens=self.scheduler.num_accepted_tokens,
            tiers=() if self.kv_tiers is None else self.kv_tiers.stats(),
            num_loading=len(self.scheduler.loading),
            num_sending=len(self._sending),
        )

    # ---- the step ------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[StepOutput]:
        """Run one step: schedule -> execute -> update. A request whose step computed only a chunk of
        its prompt gives no output; its first token (with its prompt logprobs, gathered over the
        chunks) comes with the step that computes the prompt's last chunk."""
        scheduled = self.schedule()
        return self.update(scheduled, self.execute(scheduled))

    @property
    def schedule_computes(self) -> bool:
        """Whether `schedule` runs a model (a draft model proposing), so is best run where steps compute."""
        return self.scheduler.proposer is not None and self.scheduler.proposer.runs_model

    def schedule(self) -> SchedulerOutput:
        """The next step's batch (`Scheduler.schedule`), once `poll_kv` has taken in the finished reads and sends."""
        self.poll_kv()
        return self.scheduler.schedule()

    def execute(self, scheduled: SchedulerOutput) -> ModelOutput:
        """Compute `scheduled` (`ModelRunner.execute`). It reads the scheduled requests and writes
        only the KV pool, so it may run on another thread while this one answers reservations that
        preempt nobody (see the module docstring)."""
        if scheduled.is_empty:
            return ModelOutput((), ())
        started = time.perf_counter()
        output = self.runner.execute(scheduled, self.grammar)
        if scheduled.num_decode_tokens:
            self._observe_step_time(scheduled, time.perf_counter() - started)
        return output

    def _observe_step_time(self, scheduled: SchedulerOutput, seconds: float) -> None:
        """What the pacer and the draft budget learn from a step that decoded (engine/step_costs.py)."""
        num_prompt_tokens = scheduled.num_tokens - scheduled.num_decode_tokens
        self.step_times.threads = torch.get_num_threads()  # this thread computed the step
        if num_prompt_tokens == 0:
            self.step_times.observe(scheduled.num_decode_tokens, seconds)
        if self.scheduler.pacer is not None:
            self.scheduler.pacer.observe(scheduled.num_decode_tokens, num_prompt_tokens, seconds)

    def update(
        self, scheduled: SchedulerOutput, output: ModelOutput, writing: frozenset[str] = frozenset()
    ) -> list[StepOutput]:
        """Record what `execute` computed for `scheduled`; the step's `StepOutput`s. `writing`: the requests of
        a step computing after it (engine/overlap.py), whose pages stay held until its own update."""
        self.scheduler.release_parked(writing)
        outputs = self.scheduler.update_from_output(scheduled, output, self.weights_id)
        for req in scheduled.aborted + scheduled.requests:
            if req.is_finished and self._requests.pop(req.request_id, None) is not None:
                if req.is_prefill_only and req.finish_reason is None:  # its KV is computed: send it, or let it go
                    if self.kv_connector.on_finished(req):
                        self._sending[req.request_id] = req
                    else:
                        self.scheduler.release_pages(req)
        self.kv_connector.start_saves()
        return outputs
