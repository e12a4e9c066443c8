"""Tests for engine.scheduler's priorities: the waiting queue in priority order (lower first, then
first come first served), the preemption victim (the lowest priority, then the newest), and a
reservation that preempts running requests of a worse priority only. Plain Python."""

from __future__ import annotations

import pytest

from engine.errors import CapacityError
from engine.page_allocator import PageAllocator
from engine.page_pool import NoPrefixCache
from engine.request import Request, RequestStatus, SamplingParams
from engine.scheduler import Scheduler
from engine.step_records import ModelOutput, SampledToken

PAGE_SIZE = 4


def _scheduler(num_pages: int = 16, max_running_requests: int = 8,
               chunked_prefill_size: int | None = None) -> Scheduler:
    return Scheduler(NoPrefixCache(PageAllocator(num_pages), PAGE_SIZE), max_running_requests, 1000,
                     chunked_prefill_size)


def _request(request_id: str, prompt_len: int, priority: int = 0) -> Request:
    return Request(request_id, list(range(prompt_len)), SamplingParams(), priority=priority)


def _run(scheduler: Scheduler, *reqs: Request) -> None:
    """Prefill `reqs` in one step (in this order, after the decode rows of those running) and give every
    request of the step a token: all running."""
    for req in reqs:
        scheduler.add_waiting(req)
    scheduled = scheduler.schedule()
    assert list(scheduled.requests[-len(reqs):]) == list(reqs) and all(scheduled.is_sampling)
    scheduler.update_from_output(scheduled, ModelOutput(tuple((SampledToken(0, 0.0),) for _ in scheduled.requests), ()))


def test_waiting_prompts_are_served_by_priority_then_arrival() -> None:
    scheduler = _scheduler(max_running_requests=2)
    a, b, c, d = _request("a", 4), _request("b", 4, priority=5), _request("c", 4, priority=-1), _request("d", 4)
    for req in (a, b, c, d):
        scheduler.add_waiting(req)
    assert list(scheduler.waiting) == [c, a, d, b]
    assert list(scheduler.schedule().requests) == [c, a]   # two may run


def test_a_better_prompt_never_jumps_a_prompt_part_way_through_its_chunks() -> None:
    scheduler = _scheduler(chunked_prefill_size=8)
    long = _request("long", 12, priority=3)
    scheduler.add_waiting(long)
    scheduled = scheduler.schedule()
    assert scheduled.requests == (long,) and scheduled.is_sampling == (False,)
    scheduler.update_from_output(scheduled, ModelOutput(((),), ()))
    urgent = _request("urgent", 4, priority=-5)
    scheduler.add_waiting(urgent)
    scheduled = scheduler.schedule()   # the running prompt holds its pages; its chunk goes first
    assert scheduled.requests == (long, urgent) and scheduled.num_new_tokens == (4, 4)


def test_the_lowest_priority_running_request_is_preempted_before_a_newer_better_one() -> None:
    scheduler = _scheduler(num_pages=7)
    low, high, newest = _request("low", 8, priority=1), _request("high", 8), _request("newest", 4)
    _run(scheduler, low)
    _run(scheduler, high, newest)               # 3 + 2 + 1 pages; high and newest now need one more
    scheduler.pages.allocator.allocate(1)       # the last page is someone else's
    scheduled = scheduler.schedule()
    assert scheduled.aborted == () and low.is_resuming and low.status is RequestStatus.WAITING
    assert scheduled.requests == (high, newest) and len(high.page_ids) == 3


def test_among_equals_the_newest_is_preempted() -> None:
    scheduler = _scheduler(num_pages=5)
    old, new = _request("old", 8, priority=2), _request("new", 8, priority=2)
    _run(scheduler, old, new)
    scheduler.pages.allocator.allocate(1)
    scheduler.schedule()
    assert new.is_resuming and not old.is_resuming and scheduler.running == [old]


def test_a_preempted_request_waits_ahead_of_its_priority_and_behind_better_ones() -> None:
    scheduler = _scheduler(num_pages=4)
    victim = _request("victim", 8, priority=1)
    _run(scheduler, victim)
    better, same = _request("better", 4), _request("same", 4, priority=1)
    scheduler.add_waiting(better)
    scheduler.add_waiting(same)
    scheduler.preempt(victim)
    assert list(scheduler.waiting) == [better, victim, same]
    assert scheduler.has_resuming_at(1) and scheduler.has_resuming_at(2) and not scheduler.has_resuming_at(0)


def test_a_reservation_preempts_worse_running_requests_the_lowest_and_newest_first() -> None:
    scheduler = _scheduler(num_pages=6)
    mid, low_old, low_new = _request("mid", 8, priority=1), _request("low_old", 4, priority=2), _request(
        "low_new", 4, priority=2)
    _run(scheduler, mid, low_old, low_new)      # 2 + 1 + 1 pages; 2 free
    with pytest.raises(CapacityError):
        scheduler.reserve(12, priority=2)       # 3 pages: nobody worse than 2 runs
    assert scheduler.num_preemptions == 0
    page_ids = scheduler.reserve(12, priority=0)   # 3 pages: one low one is enough
    assert len(page_ids) == 3 and low_new.is_resuming and scheduler.running == [mid, low_old]
    assert scheduler.num_preemptions == 1


def test_a_reservation_that_preempting_could_not_fit_preempts_nobody() -> None:
    scheduler = _scheduler(num_pages=4)
    high, low = _request("high", 8), _request("low", 4, priority=3)
    _run(scheduler, high, low)                  # 2 + 1 pages; 1 free
    with pytest.raises(CapacityError):
        scheduler.reserve(12, priority=1)       # 3 pages: free 1 + low's 1 is not enough
    assert scheduler.num_preemptions == 0 and scheduler.running == [high, low]
