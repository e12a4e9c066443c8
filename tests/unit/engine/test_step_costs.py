"""Tests for engine.step_costs: the prompt-token cap of steps that also decode and the drafts a step
verifies, both learned from step times (synthetic costs here), and the scheduler's use of them.
Plain Python."""

from __future__ import annotations

import pytest

from engine.config import ConfigError, EngineConfig
from engine.page_allocator import PageAllocator
from engine.page_pool import NoPrefixCache
from engine.prefix_cache import PrefixCache
from engine.request import Request, SamplingParams
from engine.scheduler import Scheduler
from engine.step_costs import DecodePacer, DecodeStepTimes, DraftBudget
from engine.step_records import ModelOutput, SampledToken


def _pacer(max_slowdown: float, **kwargs) -> DecodePacer:
    return DecodePacer(max_slowdown, DecodeStepTimes(), **kwargs)


def _observe(pacer: DecodePacer, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
    """What the engine does after a step (Engine._observe_step_time)."""
    if prompt_tokens == 0:
        pacer.times.observe(decode_rows, seconds)
    pacer.observe(decode_rows, prompt_tokens, seconds)


def _run(pacer: DecodePacer, decode_rows: int, decode_s: float, s_per_token: float, steps: int) -> list[int]:
    """Steps of `decode_rows` decode rows plus what the pacer allows of an endless prompt, costing
    `decode_s` + `s_per_token` per prompt token; each step's prompt tokens."""
    taken = []
    for _ in range(steps):
        num_prompt = pacer.prompt_budget(decode_rows)
        assert num_prompt is not None
        _observe(pacer, decode_rows, num_prompt, decode_s + s_per_token * num_prompt)
        taken.append(num_prompt)
    return taken


def test_first_step_decodes_alone_to_measure_the_reference() -> None:
    pacer = _pacer(1.5, initial_cap=16)
    assert pacer.prompt_budget(0) is None  # nothing decodes: no cap
    assert pacer.prompt_budget(4) == 0  # nothing measured at 4 rows yet
    _observe(pacer, 4, 0, 0.030)
    assert pacer.prompt_budget(4) == 16
    assert pacer.prompt_budget(5) == 16  # 4 rows stand for 5
    assert pacer.prompt_budget(8) == 0  # but not for 8


@pytest.mark.parametrize(
    ("s_per_token", "fitting"),
    [(0.004, 3), (0.00021, 71), (0.0000099, 1515)],  # compute-bound rows, cheap rows, nearly free rows
)
def test_cap_settles_where_mixed_steps_take_the_allowed_slowdown(s_per_token: float, fitting: int) -> None:
    decode_s = 0.030
    pacer = _pacer(1.5, initial_cap=16, refresh_steps=1000)
    taken = _run(pacer, 4, decode_s, s_per_token, 40)[20:]
    assert all(0 < n <= fitting for n in taken)
    assert min(taken) >= 0.9 * fitting  # not needlessly below it
    assert max(decode_s + s_per_token * n for n in taken) <= 1.5 * decode_s * 1.0001


def test_the_cap_moves_at_most_twofold_a_step() -> None:
    pacer = _pacer(1.5, initial_cap=64, refresh_steps=1000)
    _observe(pacer, 2, 0, 0.010)
    _observe(pacer, 2, 64, 10.0)  # one very slow step (another process took the core)
    assert pacer.prompt_budget(2) == 0  # its debt is one step's earnings at most: one decode-only step
    _observe(pacer, 2, 0, 0.010)
    assert pacer.prompt_budget(2) == 32
    _observe(pacer, 2, 32, 0.010)  # prompt rows free
    assert pacer.prompt_budget(2) == 64


def test_a_decode_only_step_every_refresh_steps_and_the_prompt_always_moves() -> None:
    pacer = _pacer(1.5, initial_cap=8, refresh_steps=5)
    taken = _run(pacer, 1, 0.020, 0.001, 24)
    assert taken[0] == 0
    zeros = [i for i, n in enumerate(taken) if n == 0]
    assert zeros == [0, 6, 12, 18]  # after 5 mixed steps, one to measure again
    assert all(n >= 1 for i, n in enumerate(taken) if i not in zeros)


def test_where_one_prompt_token_costs_more_than_allowed_the_prompt_gets_its_time_on_average() -> None:
    pacer = _pacer(1.5, initial_cap=4, refresh_steps=1000)
    decode_s, first_token_s = 0.020, 0.016  # a step's cost jumps at the first prompt row: 1.8x
    seconds = []
    for _ in range(200):
        num_prompt = pacer.prompt_budget(4)
        assert num_prompt is not None
        step_s = decode_s + (first_token_s + 0.001 * (num_prompt - 1) if num_prompt else 0.0)
        _observe(pacer, 4, num_prompt, step_s)
        seconds.append(step_s)
    assert sum(seconds[20:]) / len(seconds[20:]) <= 1.5 * decode_s * 1.02
    assert sum(s > decode_s for s in seconds[20:]) >= 0.4 * len(seconds[20:])  # the prompt still moves


def test_the_reference_follows_the_decode_steps_moving_average() -> None:
    pacer = _pacer(2.0, initial_cap=1, refresh_steps=1000)
    _observe(pacer, 1, 0, 0.010)
    _observe(pacer, 1, 0, 0.020)  # 0.010 + 0.3 * 0.010 = 0.013
    _observe(pacer, 1, 1, 0.013 + 0.0065)  # a token costs 0.0065 s: 0.013 / 0.0065 = 2 fit
    assert pacer.prompt_budget(1) == 2


@pytest.mark.parametrize("bad", [1.0, 0.5, -2.0])
def test_a_slowdown_of_one_or_less_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="above 1"):
        _pacer(bad)
    with pytest.raises(ConfigError, match="max_decode_slowdown"):
        EngineConfig(max_decode_slowdown=bad)
    assert EngineConfig(max_decode_slowdown=None).max_decode_slowdown is None


def test_scheduler_holds_a_prompt_chunk_to_the_pacers_cap_only_while_requests_decode() -> None:
    pacer = _pacer(1.5, initial_cap=3, refresh_steps=1000)
    scheduler = Scheduler(NoPrefixCache(PageAllocator(64), 4), 8, 1000, chunked_prefill_size=64, pacer=pacer)
    scheduler.add_waiting(Request("stream", list(range(10, 18)), SamplingParams()))
    first = scheduler.schedule()
    assert first.num_new_tokens == (8,) and first.num_decode_tokens == 0  # no stream decodes: a whole chunk
    scheduler.update_from_output(first, ModelOutput(((SampledToken(5, -0.1),),), ()))
    scheduler.add_waiting(Request("long", list(range(10, 210)), SamplingParams()))
    measuring = scheduler.schedule()
    assert measuring.num_new_tokens == (1,) and measuring.num_decode_tokens == 1  # decode-only: the reference
    _observe(pacer, 1, 0, 0.010)
    scheduler.update_from_output(measuring, ModelOutput(((SampledToken(5, -0.1),),), ()))
    paced = scheduler.schedule()
    assert [r.request_id for r in paced.requests] == ["stream", "long"]
    assert paced.num_new_tokens == (1, 3) and paced.num_decode_tokens == 1


def test_a_short_prompt_runs_whole_outside_the_pace_and_a_long_one_stays_paced() -> None:
    """With `unpaced_tokens` 16: a prompt of 40 tokens whose first 32 are cached (8 left) runs whole in
    the step that measures the decode reference (the pace allows no prompt token there), while a
    200-token prompt waits for the pace and then gets its cap. With 0, the short prompt is paced too."""
    for unpaced, expected in ((16, [("stream", 1), ("chat", 8)]), (0, [("stream", 1)])):
        pacer = _pacer(1.5, initial_cap=3, refresh_steps=1000, unpaced_tokens=unpaced)
        cache = PrefixCache(PageAllocator(64), 4)
        history = list(range(100, 140))
        cache.insert(history[:32], cache.allocate(8), 0)   # an earlier turn's pages
        scheduler = Scheduler(cache, 8, 1000, chunked_prefill_size=64, pacer=pacer)
        scheduler.add_waiting(Request("stream", list(range(10, 18)), SamplingParams()))
        first = scheduler.schedule()
        scheduler.update_from_output(first, ModelOutput(((SampledToken(5, -0.1),),), ()))
        scheduler.add_waiting(Request("chat", history, SamplingParams()))
        measuring = scheduler.schedule()
        assert list(zip([r.request_id for r in measuring.requests], measuring.num_new_tokens)) == expected
    long_pacer = _pacer(1.5, initial_cap=3, refresh_steps=1000, unpaced_tokens=16)
    scheduler = Scheduler(NoPrefixCache(PageAllocator(64), 4), 8, 1000, chunked_prefill_size=64, pacer=long_pacer)
    scheduler.add_waiting(Request("stream", list(range(10, 18)), SamplingParams()))
    first = scheduler.schedule()
    scheduler.update_from_output(first, ModelOutput(((SampledToken(5, -0.1),),), ()))
    scheduler.add_waiting(Request("long", list(range(10, 210)), SamplingParams()))
    assert scheduler.schedule().num_new_tokens == (1,)   # measuring: the long prompt waits
    assert scheduler.waiting[0].num_computed == 0 and scheduler.waiting[0].page_ids == []


def _times(costs: dict[int, float]) -> DecodeStepTimes:
    times = DecodeStepTimes()
    for rows, seconds in costs.items():
        times.observe(rows, seconds)
    return times


def test_the_fit_is_the_least_squares_line_and_never_slopes_down() -> None:
    assert _times({1: 0.010}).fit() is None
    a, b = _times({1: 0.011, 5: 0.015, 9: 0.019}).fit()
    assert a == pytest.approx(0.010) and b == pytest.approx(0.001)
    assert _times({1: 0.020, 5: 0.010}).fit() == (pytest.approx(0.015), 0.0)


def test_drafts_go_where_rows_are_cheap_and_not_where_they_are_dear() -> None:
    cheap = DraftBudget(4, _times({1: 0.0172, 5: 0.0180}))  # SmolLM2-like: a row costs 1% of a step
    assert cheap.num_drafts([0.53]) == [4]
    dear = DraftBudget(4, _times({1: 0.0905, 5: 0.410}))  # K-quant on AVX2: a row costs about a step
    assert dear.num_drafts([0.53]) == [0]
    assert dear.num_drafts([0.99]) == [4]  # unless nearly every draft is accepted


def test_a_draft_models_proposal_cost_counts_beside_the_row() -> None:
    """Rows nearly free, but each draft costs a draft-model pass: drafts go only where acceptance pays for it."""
    budget = DraftBudget(4, _times({1: 0.0172, 5: 0.0180}))
    assert budget.num_drafts([0.53], draft_cost_s=0.0) == [4]
    assert budget.num_drafts([0.53], draft_cost_s=0.010) == [0]  # 0.53 tokens for 10 ms against 58 tokens/s
    assert budget.num_drafts([0.95], draft_cost_s=0.004)[0] >= 2


def test_drafts_go_to_the_requests_likeliest_to_keep_them() -> None:
    budget = DraftBudget(4, _times({2: 0.020, 10: 0.036}))  # a = 16 ms, b = 2 ms a row
    counts = budget.num_drafts([0.9, 0.2])
    assert counts[0] > counts[1]
    assert budget.num_drafts([0.0, 0.0]) == [0, 0]


def test_every_draft_is_allowed_until_two_row_counts_are_measured_and_every_explore_steps() -> None:
    times = DecodeStepTimes()
    budget = DraftBudget(3, times, explore_steps=4)
    assert budget.num_drafts([0.5]) == [3]  # nothing measured: allow all, which measures
    times.observe(1, 0.090)
    times.observe(4, 0.330)
    assert [budget.num_drafts([0.5]) for _ in range(8)] == [[0], [0], [0], [3], [0], [0], [0], [3]]


def test_step_times_are_kept_apart_per_thread_count() -> None:
    times = DecodeStepTimes()
    times.observe(4, 0.036)
    times.threads = 2
    assert times.near(4) is None  # measured on one thread only: a decode-only step is asked for
    times.observe(4, 0.024)
    assert times.near(4) == 0.024
    times.threads = 1
    assert times.near(4) == 0.036


def test_a_step_time_is_estimated_near_on_the_line_or_from_the_fastest() -> None:
    times = DecodeStepTimes()
    assert times.estimate(4) is None
    times.observe(4, 0.040)
    assert times.estimate(4) == 0.040 and times.estimate(1) == 0.040   # only one row count: the fastest
    times.observe(16, 0.100)
    assert times.estimate(15) == 0.100   # within a quarter: measured
    assert abs(times.estimate(8) - 0.060) < 1e-9   # on the line through (4, 0.040) and (16, 0.100)


def test_a_catch_up_gets_the_pace_allowance_only_beside_other_decoding_requests() -> None:
    times = DecodeStepTimes()
    pacer = DecodePacer(1.5, times)
    assert pacer.catch_up_seconds(2) is None   # nothing measured
    times.observe(2, 0.040)
    assert pacer.catch_up_seconds(1) is None   # alone: nobody else waits
    assert abs(pacer.catch_up_seconds(2) - 0.020) < 1e-12
