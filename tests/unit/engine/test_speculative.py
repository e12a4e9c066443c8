"""Speculative decoding (n-gram prompt lookup) and mixed prefill/decode steps through the engine, on a
tiny random Llama: greedy output identical with speculation on and off (alone, batched, under
preemption, at the token and context limits), drafts accepted where the text repeats, seeded sampling
reproducible, and running requests decoding in every step of a chunked prompt with their tokens
unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import ConfigError, EngineConfig
from engine.engine import Engine
from engine.request import FinishReason, Request, SamplingParams, StepOutput
from engine.weights import open_checkpoint
from tests.tiny_models import save_tiny_llama

PAGE_SIZE = 4
GREEDY = dict(temperature=0.0, ignore_eos=True)
# a prompt that repeats itself, so prompt lookup has something to find
REPEATING = [3, 17, 42, 99, 5, 61, 7, 200, 31, 3, 17, 42, 99, 5, 61, 7]
OTHER = [11, 250, 9, 128, 77, 11, 250, 9]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def _engine(model_dir: Path, speculative: bool, **overrides) -> Engine:
    """Speculation verifies every draft it guesses (policy "always"), so the counts here do not
    depend on step times."""
    config = dict(dtype="float32", page_size=PAGE_SIZE, max_total_tokens=256)
    if speculative:
        config.update(speculative_algorithm="ngram", speculative_num_draft_tokens=4, speculative_draft_policy="always")
    config.update(overrides)
    return Engine(open_checkpoint(str(model_dir)), EngineConfig(**config), progress=False)


def _run(engine: Engine, requests: list[Request]) -> tuple[dict[str, list[StepOutput]], int]:
    """Add `requests`, step until idle; the outputs by request id and the number of steps."""
    for req in requests:
        engine.add_request(req)
    outputs: dict[str, list[StepOutput]] = {}
    steps = 0
    while engine.has_work:
        steps += 1
        assert steps < 1000, "engine still busy"
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert engine.allocator.num_free == engine.allocator.num_pages
    return outputs, steps


def _tokens(outputs: list[StepOutput]) -> list[int]:
    return [out.token_id for out in outputs if out.token_id is not None]


def _requests(**sampling) -> list[Request]:
    return [
        Request("a", list(REPEATING), SamplingParams(**sampling)),
        Request("b", list(OTHER), SamplingParams(**sampling)),
    ]


def test_greedy_output_is_identical_under_the_measured_draft_budget(model_dir: Path) -> None:
    """Policy "auto" verifies as many drafts as step times say pay, from none to all: the tokens
    are the same whatever it chose."""
    plain, _ = _run(_engine(model_dir, speculative=False), _requests(max_new_tokens=40, **GREEDY))
    engine = _engine(model_dir, speculative=True, speculative_draft_policy="auto")
    spec, _ = _run(engine, _requests(max_new_tokens=40, **GREEDY))
    assert engine.scheduler.draft_budget is not None
    assert {rid: _tokens(outputs) for rid, outputs in spec.items()} == {rid: _tokens(o) for rid, o in plain.items()}


def test_greedy_output_is_identical_with_speculation_and_drafts_are_accepted(model_dir: Path) -> None:
    plain, plain_steps = _run(_engine(model_dir, speculative=False), _requests(max_new_tokens=40, **GREEDY))
    engine = _engine(model_dir, speculative=True)
    spec, spec_steps = _run(engine, _requests(max_new_tokens=40, **GREEDY))
    for rid in ("a", "b"):
        assert _tokens(spec[rid]) == _tokens(plain[rid]), rid
        assert len(_tokens(spec[rid])) == 40 and spec[rid][-1].finish_reason is FinishReason.LENGTH
        assert [o.logprob for o in spec[rid]] == pytest.approx([o.logprob for o in plain[rid]], abs=1e-5)
    scheduler = engine.scheduler
    assert scheduler.num_draft_tokens > 0 and 0 < scheduler.num_accepted_tokens <= scheduler.num_draft_tokens
    # a step rejects at most one draft of a request (the rest after it are never tried)
    assert 0 < scheduler.num_rejecting_steps <= scheduler.num_draft_tokens - scheduler.num_accepted_tokens
    assert spec_steps < plain_steps  # accepted drafts are tokens without steps of their own
    # each request's last output says what speculation did for it
    lasts = [spec[rid][-1] for rid in ("a", "b")]
    assert sum(o.spec_accepted_tokens for o in lasts) == scheduler.num_accepted_tokens
    assert all(0 < o.spec_verify_ct < 40 for o in lasts) and plain["a"][-1].spec_verify_ct == 0


def test_speculation_stops_at_eos_and_the_context_length_as_without(model_dir: Path) -> None:
    for sampling, overrides in (
        (dict(max_new_tokens=60, temperature=0.0), {}),
        (dict(max_new_tokens=200, **GREEDY), dict(context_len=40)),
    ):
        plain, _ = _run(_engine(model_dir, speculative=False, **overrides), _requests(**sampling))
        spec, _ = _run(_engine(model_dir, speculative=True, **overrides), _requests(**sampling))
        for rid in ("a", "b"):
            assert _tokens(spec[rid]) == _tokens(plain[rid]), (rid, sampling)
            assert spec[rid][-1].finish_reason is plain[rid][-1].finish_reason


def test_preempted_speculating_requests_come_back_unchanged(model_dir: Path) -> None:
    prompt = REPEATING[:8]
    alone, _ = _run(
        _engine(model_dir, speculative=False), [Request("x", prompt, SamplingParams(max_new_tokens=20, **GREEDY))]
    )
    engine = _engine(model_dir, speculative=True, max_total_tokens=64)  # 16 pages: three requests need 21 in all
    requests = [Request(rid, list(prompt), SamplingParams(max_new_tokens=20, **GREEDY)) for rid in ("r0", "r1", "r2")]
    outputs, _ = _run(engine, requests)
    assert engine.scheduler.num_preemptions >= 1
    for rid in ("r0", "r1", "r2"):
        assert _tokens(outputs[rid]) == _tokens(alone["x"]), rid


def test_seeded_sampling_with_speculation_is_reproducible_in_any_batch(model_dir: Path) -> None:
    sampling = dict(max_new_tokens=30, temperature=0.8, seed=7, ignore_eos=True)
    alone, _ = _run(_engine(model_dir, speculative=True), [Request("a", list(REPEATING), SamplingParams(**sampling))])
    together, _ = _run(_engine(model_dir, speculative=True), _requests(**sampling))
    assert _tokens(together["a"]) == _tokens(alone["a"]) and len(_tokens(alone["a"])) == 30


def test_requests_with_penalties_or_a_minimum_get_no_drafts_and_keep_their_output(model_dir: Path) -> None:
    for sampling in (dict(frequency_penalty=0.5), dict(min_new_tokens=30), dict(logit_bias=((5, 3.0),))):
        settings = dict(max_new_tokens=30, **GREEDY) | sampling
        plain, _ = _run(_engine(model_dir, speculative=False), _requests(**settings))
        engine = _engine(model_dir, speculative=True)
        spec, _ = _run(engine, _requests(**settings))
        assert _tokens(spec["a"]) == _tokens(plain["a"]) and _tokens(spec["b"]) == _tokens(plain["b"])
        assert engine.scheduler.num_draft_tokens == 0, sampling


@pytest.mark.parametrize("max_decode_slowdown", [None, 1.5])
def test_running_requests_decode_in_every_step_of_a_chunked_prompt_with_unchanged_tokens(
    model_dir: Path, max_decode_slowdown: float | None
) -> None:
    """Without pacing the prompt takes a whole chunk a step; with it (engine/pacing.py), chunks as
    small as its measured cap, and one decode-only step first to measure: either way d decodes in
    every step, its tokens unchanged."""
    long_prompt = [(7 * i) % 250 + 3 for i in range(60)]
    alone, _ = _run(
        _engine(model_dir, speculative=False), [Request("d", list(OTHER), SamplingParams(max_new_tokens=30, **GREEDY))]
    )
    engine = _engine(model_dir, speculative=False, chunked_prefill_size=8, max_decode_slowdown=max_decode_slowdown)
    engine.add_request(Request("d", list(OTHER), SamplingParams(max_new_tokens=30, **GREEDY)))
    outputs = engine.step()  # d's prompt; it decodes from the next step on
    engine.add_request(Request("long", long_prompt, SamplingParams(max_new_tokens=2, **GREEDY)))
    steps_with_d = 0
    while engine.has_work:
        step = engine.step()
        outputs.extend(step)
        if not any(o.request_id == "long" and o.token_id is not None for o in outputs):  # still prefilling
            assert [o.request_id for o in step] == ["d"]  # d gets a token in every chunk's step
            steps_with_d += 1
    if max_decode_slowdown is None:
        assert steps_with_d == 60 // 8
    else:
        assert steps_with_d >= 60 // 8 + 1
    assert _tokens([o for o in outputs if o.request_id == "d"]) == _tokens(alone["d"])


def test_bad_speculative_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="speculative_algorithm"):
        EngineConfig(speculative_algorithm="eagle")
    with pytest.raises(ConfigError, match="speculative_num_draft_tokens"):
        EngineConfig(speculative_algorithm="ngram", speculative_num_draft_tokens=0)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        EngineConfig(max_running_requests=8, max_num_batched_tokens=16, speculative_algorithm="ngram")


def test_top_logprobs_are_the_same_with_speculation(model_dir: Path) -> None:
    sampling = dict(max_new_tokens=30, top_logprobs_num=3, token_ids_logprob=(5, 7), **GREEDY)
    plain, _ = _run(_engine(model_dir, speculative=False), _requests(**sampling))
    engine = _engine(model_dir, speculative=True)
    spec, _ = _run(engine, _requests(**sampling))
    assert engine.scheduler.num_accepted_tokens > 0
    for rid in ("a", "b"):
        for got, expected in zip(spec[rid], plain[rid], strict=True):
            assert [t for t, _ in got.top_logprobs] == [t for t, _ in expected.top_logprobs]
            assert [lp for _, lp in got.top_logprobs] == pytest.approx(
                [lp for _, lp in expected.top_logprobs], abs=1e-5
            )
            assert [lp for _, lp in got.token_ids_logprobs] == pytest.approx(
                [lp for _, lp in expected.token_ids_logprobs], abs=1e-5
            )


def test_aborting_a_speculating_request_frees_every_page(model_dir: Path) -> None:
    engine = _engine(model_dir, speculative=True)
    engine.add_request(Request("a", list(REPEATING), SamplingParams(max_new_tokens=100, **GREEDY)))
    while engine.scheduler.num_draft_tokens == 0:
        engine.step()
    final = engine.abort("a")
    assert final is not None and final.finish_reason is FinishReason.ABORT
    assert not engine.has_work and engine.allocator.num_free == engine.allocator.num_pages
