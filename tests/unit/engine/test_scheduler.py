"""Tests for engine.scheduler, driven with synthetic model outputs and no model: decode rows first
and prompts after them in one step, FCFS admission within token and page budgets, chunked prefill,
page growth, preemption of the newest request when the pool runs dry (and its return by recompute),
abort only of what could never fit, page release, and what `update_from_output` makes of a step's
sampled tokens. Plain Python."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import CapacityError
from engine.page_allocator import PageAllocator
from engine.page_pool import NoPrefixCache
from engine.prefix_cache import PrefixCache
from engine.request import FinishReason, Request, RequestStatus, SamplingParams
from engine.scheduler import Scheduler
from engine.step_records import ModelOutput, SampledToken, SchedulerOutput

PAGE_SIZE = 4
EOS = 2
REPO_ROOT = Path(__file__).resolve().parents[3]


def _scheduler(
    num_pages: int = 16,
    max_running_requests: int = 8,
    max_prefill_tokens: int = 1000,
    chunked_prefill_size: int | None = None,
    prefix_cache: bool = False,
    max_num_batched_tokens: int | None = None,
    context_len: int = 2**31,
) -> Scheduler:
    pages = (PrefixCache if prefix_cache else NoPrefixCache)(PageAllocator(num_pages), PAGE_SIZE)
    return Scheduler(
        pages,
        max_running_requests,
        max_prefill_tokens,
        chunked_prefill_size,
        max_num_batched_tokens,
        frozenset({EOS}),
        context_len,
    )


def _request(request_id: str, prompt_len: int, is_prefill_only: bool = False, **sampling) -> Request:
    return Request(
        request_id, list(range(10, 10 + prompt_len)), SamplingParams(**sampling), is_prefill_only=is_prefill_only
    )


def _sampled(scheduled: SchedulerOutput, token_id: int = 0) -> ModelOutput:
    """A model output giving `token_id` to every request that samples this step."""
    return ModelOutput(tuple((SampledToken(token_id, -0.5),) if s else () for s in scheduled.is_sampling), ())


def _step(scheduler: Scheduler, token_id: int = 0) -> SchedulerOutput:
    """Schedule one step and complete it, every sampling request sampling `token_id`."""
    scheduled = scheduler.schedule()
    scheduler.update_from_output(scheduled, _sampled(scheduled, token_id))
    return scheduled


def _rows(scheduled: SchedulerOutput) -> list[tuple[str, int, bool]]:
    """(request id, tokens computed, samples) per request of a step, in batch order."""
    return [
        (r.request_id, n, s) for r, n, s in zip(scheduled.requests, scheduled.num_new_tokens, scheduled.is_sampling)
    ]


def _chunks(scheduler: Scheduler) -> list[tuple[str, int, bool]]:
    """Run one step; its rows."""
    return _rows(_step(scheduler))


def _prefill(scheduler: Scheduler, *reqs: Request) -> None:
    """Queue `reqs`, prefill them in one step (nothing else running) and give each a first token."""
    for req in reqs:
        scheduler.add_waiting(req)
    scheduled = _step(scheduler)
    assert list(scheduled.requests) == list(reqs) and all(scheduled.is_sampling) and scheduled.aborted == ()


def _owned_pages(*reqs: Request) -> list[int]:
    return [page_id for req in reqs for page_id in req.page_ids]


def test_scheduler_modules_do_not_import_torch() -> None:
    code = (
        "import sys, engine.page_allocator, engine.page_pool, engine.prefix_cache, engine.request, "
        "engine.kv_connector, engine.scheduler, engine.step_records, engine.outputs; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_empty_scheduler_has_no_batch() -> None:
    scheduler = _scheduler()
    assert not scheduler.has_work
    scheduled = scheduler.schedule()
    assert scheduled.is_empty and scheduled.aborted == () and scheduled.num_tokens == 0


def test_prefill_is_fcfs_within_token_budget() -> None:
    scheduler = _scheduler(max_prefill_tokens=10)
    r0, r1, r2 = _request("r0", 6), _request("r1", 6), _request("r2", 3)
    for req in (r0, r1, r2):
        scheduler.add_waiting(req)
    # r1 would exceed the budget; r2 would fit but must not jump the queue.
    assert _chunks(scheduler) == [("r0", 6, True)]
    assert list(scheduler.waiting) == [r1, r2]
    assert _chunks(scheduler) == [("r0", 1, True), ("r1", 6, True), ("r2", 3, True)]
    assert not scheduler.waiting and scheduler.running == [r0, r1, r2]


def test_prompt_longer_than_budget_is_scheduled_alone() -> None:
    scheduler = _scheduler(max_prefill_tokens=4)
    big, small = _request("big", 9), _request("small", 1)
    scheduler.add_waiting(big)
    scheduler.add_waiting(small)
    assert _rows(scheduler.schedule()) == [("big", 9, True)]


def test_prefill_allocates_prompt_pages_and_stops_when_they_do_not_fit() -> None:
    scheduler = _scheduler(num_pages=3)
    r0, r1 = _request("r0", 8), _request("r1", 5)
    scheduler.add_waiting(r0)
    scheduler.add_waiting(r1)
    assert _rows(scheduler.schedule()) == [("r0", 8, True)]
    assert len(r0.page_ids) == 2 and scheduler.pages.allocator.num_free == 1
    assert list(scheduler.waiting) == [r1] and r1.page_ids == []  # needs 2 pages, 1 free


def test_prefill_respects_max_running_requests() -> None:
    scheduler = _scheduler(max_running_requests=2)
    r0 = _request("r0", 3)
    _prefill(scheduler, r0)
    waiting = [_request(f"w{i}", 3) for i in range(3)]
    for req in waiting:
        scheduler.add_waiting(req)
    assert _rows(scheduler.schedule()) == [("r0", 1, True), ("w0", 3, True)]


def test_decode_and_prefill_share_a_step_decode_rows_first() -> None:
    scheduler = _scheduler()
    r0 = _request("r0", 3)
    _prefill(scheduler, r0)
    r1 = _request("r1", 2)
    scheduler.add_waiting(r1)
    scheduled = _step(scheduler)
    assert _rows(scheduled) == [("r0", 1, True), ("r1", 2, True)] and scheduled.num_tokens == 3
    assert not scheduled.is_decode_only and r0.output_ids == [0, 0] and r1.output_ids == [0]
    scheduled = scheduler.schedule()
    assert _rows(scheduled) == [("r0", 1, True), ("r1", 1, True)] and scheduled.is_decode_only


def test_decode_grows_pages_only_at_page_boundaries() -> None:
    scheduler = _scheduler()
    req = _request("r", 4)  # one full page
    _prefill(scheduler, req)  # seq_len 5: the first output token needs a second page
    assert req.status is RequestStatus.RUNNING and len(req.page_ids) == 1 and req.num_computed == 4
    assert _chunks(scheduler) == [("r", 1, True)]
    assert len(req.page_ids) == 2
    for _ in range(3):  # seq_len 7..9: 8 tokens fit two pages, the 9th needs a third
        _step(scheduler)
        assert len(req.page_ids) == 2
    _step(scheduler)
    assert len(req.page_ids) == 3 and req.num_computed == 9 and req.seq_len == 10
    assert len(set(req.page_ids)) == 3 and scheduler.pages.allocator.num_used == 3


def test_newest_request_is_preempted_when_pages_run_out_and_comes_back_by_recompute() -> None:
    scheduler = _scheduler(num_pages=5)
    r0, r1 = _request("r0", 8), _request("r1", 8)
    _prefill(scheduler, r0, r1)  # 4 pages used; both now need a third page
    scheduler.pages.allocator.allocate(1)  # someone else holds the last page
    scheduled = _step(scheduler, token_id=7)
    assert scheduled.aborted == () and scheduled.preempted == (r1,)
    assert not r1.is_finished and r1.is_resuming and r1.output_ids == [0]
    assert r1.status is RequestStatus.WAITING and r1.page_ids == [] and r1.num_computed == 0
    assert list(scheduler.waiting) == [r1] and scheduler.has_resuming and scheduler.num_preemptions == 1
    assert _rows(scheduled) == [("r0", 1, True)]
    assert len(r0.page_ids) == 3 and scheduler.running == [r0]

    scheduler.finish(r0, FinishReason.LENGTH)  # its 3 pages come back: r1 fits with room to decode
    scheduled = scheduler.schedule()
    assert scheduled.aborted == () and _rows(scheduled) == [("r1", 9, True)] and len(r1.page_ids) == 3
    assert scheduled.requests[0].token_ids(0, 9) == list(range(10, 18)) + [0]  # its prompt, then its output
    scheduler.update_from_output(scheduled, _sampled(scheduled, token_id=5))
    assert r1.output_ids == [0, 5] and not r1.is_resuming and scheduler.running == [r1]
    assert not scheduler.has_resuming


def test_a_preempted_request_waits_for_headroom_before_it_comes_back() -> None:
    scheduler = _scheduler(num_pages=6)
    r0, r1 = _request("r0", 8), _request("r1", 8)
    _prefill(scheduler, r0, r1)  # 4 used, 2 free
    held = scheduler.pages.allocator.allocate(2)
    _step(scheduler)  # r1 preempted so that r0 grows
    scheduler.pages.allocator.free(held[:1])  # 2 free again: r1 needs 3 pages, plus one of room for r0
    assert _chunks(scheduler) == [("r0", 1, True)] and r1.is_resuming
    scheduler.pages.allocator.free(held[1:])  # 3 free: still one short of r1's 3 pages and r0's room
    while len(r0.page_ids) < 4:  # r0 fills its third page and takes a fourth
        assert _chunks(scheduler) == [("r0", 1, True)] and r1.is_resuming
    assert scheduler.pages.allocator.num_free == 2


def test_a_request_that_could_never_fit_is_aborted_saying_why() -> None:
    scheduler = _scheduler(num_pages=2)
    req = _request("r", 8)
    _prefill(scheduler, req)  # seq_len 9 needs 3 pages of a 2-page pool
    scheduled = scheduler.schedule()
    assert scheduled.is_empty and scheduled.aborted == (req,)
    assert req.finish_reason is FinishReason.ABORT and "more than the pool's 2" in req.abort_message
    assert scheduler.pages.allocator.num_free == 2 and not scheduler.has_work
    outputs = scheduler.update_from_output(scheduled, ModelOutput((), ()))
    assert [(o.request_id, o.token_id, o.finish_reason) for o in outputs] == [("r", None, FinishReason.ABORT)]


def test_last_free_page_goes_to_the_oldest_request() -> None:
    scheduler = _scheduler(num_pages=5)
    r0, r1 = _request("r0", 8), _request("r1", 8)
    _prefill(scheduler, r0, r1)  # 4 used, 1 free; both at seq_len 9 need a third page
    scheduled = scheduler.schedule()
    assert scheduled.aborted == () and r1.is_resuming and _rows(scheduled) == [("r0", 1, True)]
    assert scheduler.pages.allocator.num_used == 3


def test_prefill_only_request_finishes_keeping_its_pages() -> None:
    scheduler = _scheduler()
    req = _request("p", 5, is_prefill_only=True)
    scheduler.add_waiting(req)
    scheduled = scheduler.schedule()
    assert _rows(scheduled) == [("p", 5, True)]
    outputs = scheduler.update_from_output(scheduled, _sampled(scheduled, token_id=9), weights_id="w1")
    assert [(o.token_id, o.finish_reason, o.weights_id) for o in outputs] == [(9, None, "w1")]
    assert req.num_computed == 5 and req.is_finished and req.finish_reason is None
    assert scheduler.running == [] and not scheduler.has_work
    assert len(req.page_ids) == 2 and scheduler.pages.allocator.num_used == 2


def test_a_sampled_token_finishes_its_request_on_eos_stop_ids_or_length() -> None:
    scheduler = _scheduler(num_pages=32, context_len=12)
    eos, stop, length, context = (
        _request("eos", 3),
        _request("stop", 3, stop_token_ids=(7,)),
        _request("length", 3, max_new_tokens=2),
        _request("context", 10),
    )
    _prefill(scheduler, eos, stop, length, context)  # every first token is 0
    scheduled = scheduler.schedule()
    tokens = {"eos": EOS, "stop": 7, "length": 4, "context": 5}
    output = ModelOutput(tuple((SampledToken(tokens[r.request_id], -1.0),) for r in scheduled.requests), ())
    outputs = {o.request_id: o for o in scheduler.update_from_output(scheduled, output)}
    assert {rid: o.finish_reason for rid, o in outputs.items()} == {
        "eos": FinishReason.STOP,
        "stop": FinishReason.STOP,
        "length": FinishReason.LENGTH,
        "context": FinishReason.LENGTH,
    }
    assert outputs["stop"].matched_token_id == 7 and outputs["eos"].matched_token_id == EOS
    assert outputs["length"].token_id == 4 and outputs["length"].logprob == -1.0
    assert not scheduler.has_work and scheduler.pages.allocator.num_used == 0


def test_a_request_with_non_finite_logits_fails_alone() -> None:
    scheduler = _scheduler()
    good, bad = _request("good", 3), _request("bad", 3)
    _prefill(scheduler, good, bad)
    scheduled = scheduler.schedule()
    output = ModelOutput(((SampledToken(4, 0.0),), (SampledToken(4, 0.0),)), (), non_finite=frozenset({1}))
    outputs = scheduler.update_from_output(scheduled, output)
    assert [(o.request_id, o.token_id, o.finish_reason) for o in outputs] == [
        ("good", 4, None),
        ("bad", None, FinishReason.ERROR),
    ]
    assert "non-finite" in bad.abort_message and bad.page_ids == [] and scheduler.running == [good]


def test_finish_releases_pages_unless_kept() -> None:
    scheduler = _scheduler(num_pages=8)
    r0, r1 = _request("r0", 8), _request("r1", 8)
    _prefill(scheduler, r0, r1)
    scheduler.finish(r0, FinishReason.STOP)
    assert r0.is_finished and r0.finish_reason is FinishReason.STOP
    assert r0.page_ids == [] and scheduler.pages.allocator.num_used == 2
    kept = list(r1.page_ids)
    scheduler.finish(r1, None, keep_pages=True)
    assert r1.is_finished and r1.page_ids == kept and scheduler.pages.allocator.num_used == 2
    assert scheduler.running == []
    scheduler.release_pages(r1)
    assert r1.page_ids == [] and scheduler.pages.allocator.num_free == 8
    scheduler.release_pages(r1)  # nothing left: a no-op, not a double free
    assert scheduler.pages.allocator.num_free == 8


def test_finish_removes_a_waiting_request() -> None:
    scheduler = _scheduler()
    req = _request("w", 3)
    scheduler.add_waiting(req)
    scheduler.finish(req, FinishReason.ABORT, message="client went away")
    assert not scheduler.waiting and not scheduler.has_work
    assert req.abort_message == "client went away"


def test_add_running_decodes_on_reserved_pages() -> None:
    scheduler = _scheduler(num_pages=4)
    req = _request("d", 6)
    req.page_ids = scheduler.reserve(6)
    assert len(req.page_ids) == 2
    req.num_computed = 6
    req.output_ids.append(0)
    scheduler.add_running(req)
    assert req.status is RequestStatus.RUNNING
    assert _rows(scheduler.schedule()) == [("d", 1, True)]
    assert len(req.page_ids) == 2  # seq_len 7 fits two pages


def test_reserve_takes_pages_or_raises_taking_none() -> None:
    scheduler = _scheduler(num_pages=4)
    assert len(scheduler.reserve(5)) == 2
    with pytest.raises(CapacityError):
        scheduler.reserve(9)  # needs 3, 2 free
    assert scheduler.pages.allocator.num_free == 2


def test_check_capacity_against_whole_pool() -> None:
    scheduler = _scheduler(num_pages=4)
    scheduler.pages.allocator.allocate(4)
    scheduler.check_capacity(16)  # would fit an empty pool: accepted even though none are free
    with pytest.raises(CapacityError):
        scheduler.check_capacity(17)


# ---- chunked prefill -------------------------------------------------------------------------


def test_long_prompt_is_prefilled_in_chunks_holding_all_its_pages_from_the_first() -> None:
    scheduler = _scheduler(chunked_prefill_size=5)
    req = _request("long", 13)
    scheduler.add_waiting(req)
    assert _chunks(scheduler) == [("long", 5, False)]
    assert len(req.page_ids) == 4 and scheduler.pages.allocator.num_used == 4  # the whole prompt's pages
    assert req.num_computed == 5 and req.status is RequestStatus.RUNNING and req.output_ids == []
    assert scheduler.running == [req] and not scheduler.waiting and scheduler.has_work
    assert _chunks(scheduler) == [("long", 5, False)]
    assert req.num_computed == 10 and scheduler.pages.allocator.num_used == 4
    assert _chunks(scheduler) == [("long", 3, True)]
    assert req.num_computed == 13 and req.output_ids == [0]
    assert _chunks(scheduler) == [("long", 1, True)]


def test_chunk_budget_is_shared_by_the_prompts_and_splits_the_last_one() -> None:
    scheduler = _scheduler(chunked_prefill_size=8)
    r0, r1, r2, r3 = _request("r0", 3), _request("r1", 7), _request("r2", 2), _request("r3", 4)
    for req in (r0, r1, r2, r3):
        scheduler.add_waiting(req)
    assert _chunks(scheduler) == [("r0", 3, True), ("r1", 5, False)]
    assert list(scheduler.waiting) == [r2, r3]
    # r0 decodes; r1 continues first among prompts; r2 fits whole and r3 gets what is left of the budget.
    assert _chunks(scheduler) == [("r0", 1, True), ("r1", 2, True), ("r2", 2, True), ("r3", 4, True)]
    assert scheduler.running == [r0, r1, r2, r3] and not scheduler.waiting


def test_a_prompt_is_split_to_fill_the_budget_even_by_one_token() -> None:
    scheduler = _scheduler(chunked_prefill_size=8)
    r0, r1 = _request("r0", 7), _request("r1", 6)
    scheduler.add_waiting(r0)
    scheduler.add_waiting(r1)
    assert _chunks(scheduler) == [("r0", 7, True), ("r1", 1, False)]
    assert _chunks(scheduler) == [("r0", 1, True), ("r1", 5, True)]


def test_max_prefill_tokens_caps_a_chunk_too() -> None:
    scheduler = _scheduler(max_prefill_tokens=6, chunked_prefill_size=100)
    scheduler.add_waiting(_request("r", 10))
    assert _chunks(scheduler) == [("r", 6, False)]
    assert _chunks(scheduler) == [("r", 4, True)]


@pytest.mark.parametrize("chunked_prefill_size", [None, 0])
def test_without_chunking_a_step_computes_whole_prompts(chunked_prefill_size: int | None) -> None:
    scheduler = _scheduler(max_prefill_tokens=4, chunked_prefill_size=chunked_prefill_size)
    big, small = _request("big", 9), _request("small", 1)
    scheduler.add_waiting(big)
    scheduler.add_waiting(small)
    assert _chunks(scheduler) == [("big", 9, True)]
    assert _chunks(scheduler) == [("big", 1, True), ("small", 1, True)]


def test_a_partly_prefilled_prompt_continues_when_running_is_full() -> None:
    """It was counted against `max_running_requests` when admitted; a request that joined running
    since (a decode hand-off) must not strand it holding its pages."""
    scheduler = _scheduler(max_running_requests=1, chunked_prefill_size=4)
    req, waiting = _request("r", 10), _request("w", 2)
    scheduler.add_waiting(req)
    scheduler.add_waiting(waiting)
    assert _chunks(scheduler) == [("r", 4, False)]
    handed_off = _request("d", 3)
    handed_off.page_ids, handed_off.num_computed = scheduler.reserve(3), 3
    handed_off.output_ids.append(0)
    scheduler.add_running(handed_off)
    assert _chunks(scheduler) == [("d", 1, True), ("r", 4, False)]
    assert _chunks(scheduler) == [("d", 1, True), ("r", 2, True)]
    assert _chunks(scheduler) == [("r", 1, True), ("d", 1, True)]  # "w" waits for a free running slot
    assert list(scheduler.waiting) == [waiting]


def test_running_requests_decode_in_every_step_of_a_chunked_prompt() -> None:
    scheduler = _scheduler(chunked_prefill_size=4)
    r0 = _request("r0", 3)
    _prefill(scheduler, r0)
    r1 = _request("r1", 10)
    scheduler.add_waiting(r1)
    assert [_chunks(scheduler) for _ in range(3)] == [
        [("r0", 1, True), ("r1", 4, False)],
        [("r0", 1, True), ("r1", 4, False)],
        [("r0", 1, True), ("r1", 2, True)],
    ]
    assert r0.output_ids == [0] * 4 and r1.output_ids == [0]
    assert _rows(scheduler.schedule()) == [("r0", 1, True), ("r1", 1, True)]


def test_max_num_batched_tokens_leaves_prompts_what_decode_does_not_use() -> None:
    scheduler = _scheduler(chunked_prefill_size=8, max_num_batched_tokens=8)
    running = [_request(f"d{i}", 2) for i in range(3)]
    _prefill(scheduler, *running)
    scheduler.add_waiting(_request("p", 9))
    assert _chunks(scheduler) == [("d0", 1, True), ("d1", 1, True), ("d2", 1, True), ("p", 5, False)]
    assert _chunks(scheduler) == [("d0", 1, True), ("d1", 1, True), ("d2", 1, True), ("p", 4, True)]


def test_abort_in_the_middle_of_chunking_frees_every_page() -> None:
    scheduler = _scheduler(chunked_prefill_size=4)
    req = _request("r", 14)
    scheduler.add_waiting(req)
    _chunks(scheduler)
    assert scheduler.pages.allocator.num_used == 4
    scheduler.finish(req, FinishReason.ABORT, message="client went away")
    assert req.is_finished and req.page_ids == []
    assert scheduler.pages.allocator.num_free == 16 and not scheduler.waiting and not scheduler.has_work
    assert scheduler.schedule().is_empty


def test_chunked_prompt_matches_the_prefix_cache_once_and_caches_its_pages_when_done() -> None:
    scheduler = _scheduler(num_pages=8, chunked_prefill_size=3, prefix_cache=True)
    first = _request("first", 10)
    scheduler.add_waiting(first)
    while not first.output_ids:
        _chunks(scheduler)
    assert first.num_cached_tokens == 0
    assert scheduler.pages.num_cached_pages == 2  # its full pages, once the prompt is done
    scheduler.finish(first, FinishReason.STOP)

    second = _request("second", 11)  # the same first 10 tokens
    scheduler.add_waiting(second)
    assert _chunks(scheduler) == [("second", 3, True)]  # 8 tokens from the cache, 3 computed
    assert second.num_cached_tokens == 8
    scheduler.finish(second, FinishReason.STOP)
    third = _request("third", 13)
    scheduler.add_waiting(third)
    assert _chunks(scheduler) == [("third", 3, False)]  # 8 cached; 5 left to compute
    assert third.num_cached_tokens == 8 and third.num_computed == 11
    assert _chunks(scheduler) == [("third", 2, True)]
    assert third.num_cached_tokens == 8  # no second match on later chunks
    scheduler.pages.check_integrity()


def test_abort_mid_chunk_returns_the_cache_its_matched_pages() -> None:
    scheduler = _scheduler(num_pages=8, chunked_prefill_size=4, prefix_cache=True)
    warm = _request("warm", 9)
    scheduler.add_waiting(warm)
    while not warm.output_ids:
        _chunks(scheduler)
    scheduler.finish(warm, FinishReason.STOP)  # its 2 full pages stay cached
    req = _request("r", 20)
    scheduler.add_waiting(req)
    assert _chunks(scheduler) == [("r", 4, False)]
    assert req.num_cached_tokens == 8 and len(req.page_ids) == 5
    scheduler.finish(req, FinishReason.ABORT)
    scheduler.pages.check_integrity()
    assert scheduler.pages.num_evictable_pages == 3  # the 2 matched, and the full page its chunk computed
    assert scheduler.pages.allocator.num_free + scheduler.pages.num_evictable_pages == 8
