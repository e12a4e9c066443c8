"""engine/overlap.py on a tiny random Llama, driven as the engine loop drives it but on one thread: each
step ahead is planned before the step in flight computes (so that step reads live requests whose page
lists just grew), and the step in flight is updated while the step ahead is "computing" (its pages
must stay held). The outputs must equal a plain `Engine.step` run's, token for token and logprob for
logprob, for greedy, seeded, penalised and limited requests, and every page must come back."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.overlap import AheadStep, execute_ahead, plan_ahead, settle_ahead
from engine.request import FinishReason, Request, SamplingParams, StepOutput
from engine.step_records import ModelOutput
from engine.weights import open_checkpoint
from tests.tiny_models import save_tiny_llama

PAGE_SIZE = 4
PROMPTS = [[3, 17, 42, 99, 5, 61, 7, 200, 31], [11, 250, 9, 128, 77], [5, 6, 7], list(range(40, 75))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def _engine(model_dir: Path, **overrides) -> Engine:
    config = dict(dtype="float32", page_size=PAGE_SIZE, max_total_tokens=256, enable_prefix_cache=True)
    config.update(overrides)
    return Engine(open_checkpoint(str(model_dir)), EngineConfig(**config), progress=False)


Arrivals = dict[int, list[Request]]  # step number -> requests added before it


def _plain(engine: Engine, arrivals: Arrivals) -> list[StepOutput]:
    outputs: list[StepOutput] = []
    step = 0
    while engine.has_work or any(n >= step for n in arrivals):
        for req in arrivals.get(step, []):
            engine.add_request(req)
        outputs += engine.step()
        step += 1
    return outputs


def _overlapped(engine: Engine, arrivals: Arrivals) -> tuple[list[StepOutput], int]:
    """The engine loop's order: plan the step ahead, compute the step in flight, update it (the step
    ahead still computing), then the step ahead becomes the one in flight. Requests arrive only between
    steps with nothing ahead, as the loop's commands do. Returns the outputs and the steps run ahead."""
    outputs: list[StepOutput] = []
    step, num_ahead = 0, 0
    in_flight: AheadStep | None = None
    before: ModelOutput | None = None
    while True:
        if in_flight is None:
            for req in arrivals.pop(step, []):
                engine.add_request(req)
            if not engine.has_work and not arrivals:
                return outputs, num_ahead
            scheduled = engine.schedule()
        else:
            scheduled = in_flight.scheduled
        ahead = plan_ahead(engine.scheduler, scheduled)
        if in_flight is None:
            output = engine.execute(scheduled)
            to_update = scheduled, output
        else:
            assert before is not None
            output = execute_ahead(engine, in_flight, before)
            to_update = settle_ahead(in_flight, output)
            num_ahead += 1
        writing = ahead.request_ids if ahead is not None else frozenset()
        outputs += engine.update(*to_update, writing)
        if ahead is not None:  # the step ahead "computes" now: every page it writes into is still held
            for shadow in ahead.computed.requests:
                assert all(engine.allocator.is_allocated(p) for p in shadow.page_ids), shadow.request_id
        in_flight, before = ahead, output
        step += 1


def _requests(make: Callable[[int, list[int]], SamplingParams]) -> list[Request]:
    return [Request(f"r{i}", list(p), make(i, p)) for i, p in enumerate(PROMPTS)]


def _by_request(outputs: list[StepOutput]) -> dict[str, list[tuple]]:
    grouped: dict[str, list[tuple]] = {}
    for o in outputs:
        grouped.setdefault(o.request_id, []).append(
            (o.token_id, None if o.logprob is None else round(o.logprob, 4), o.finish_reason, o.top_logprobs and
             tuple((t, round(p, 4)) for t, p in o.top_logprobs))
        )
    return grouped


def _assert_all_pages_back(engine: Engine) -> None:
    engine.pages.check_integrity()
    assert all(refs == 0 for refs in engine.pages.cached_page_refs().values())
    assert engine.allocator.num_used == engine.pages.num_cached_pages


SAMPLINGS: dict[str, Callable[[int, list[int]], SamplingParams]] = {
    "greedy, limits 1 to 24": lambda i, p: SamplingParams(temperature=0, ignore_eos=True,
                                                         max_new_tokens=[1, 2, 24, 9][i]),
    "seeded, penalised, top logprobs": lambda i, p: SamplingParams(
        temperature=0.9, top_p=0.95, seed=100 + i, max_new_tokens=20, ignore_eos=True,
        frequency_penalty=0.5 * (i % 2), repetition_penalty=1.3 if i == 2 else 1.0, top_logprobs_num=2),
}


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_overlapped_steps_give_the_plain_steps_outputs(model_dir: Path, name: str) -> None:
    torch.manual_seed(0)
    plain = _plain(_engine(model_dir), {0: _requests(SAMPLINGS[name])})
    engine = _engine(model_dir)
    overlapped, num_ahead = _overlapped(engine, {0: _requests(SAMPLINGS[name])})
    assert _by_request(overlapped) == _by_request(plain)
    assert num_ahead >= 15   # most decode steps went ahead
    _assert_all_pages_back(engine)


def test_a_stop_token_mid_stream_frees_the_pages_only_after_the_step_ahead(model_dir: Path) -> None:
    """Requests that a stop token ends while their next step is already queued: that step computes
    them once more (into their pages, which must not be freed meanwhile) and the row is dropped. A
    late arrival breaks the overlap (it waits to be admitted) and decoding goes ahead again after."""
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=30)
    free_run = _by_request(_plain(_engine(model_dir), {0: _requests(lambda i, p: greedy)}))
    stops = {f"r{i}": free_run[f"r{i}"][3 + 2 * i][0] for i in range(len(PROMPTS))}  # each one's 4th, 6th, ... token

    def requests() -> Arrivals:
        reqs = [Request(f"r{i}", list(p), SamplingParams(temperature=0, max_new_tokens=30,
                                                         stop_token_ids=(stops[f"r{i}"],)))
                for i, p in enumerate(PROMPTS)]
        late = Request("late", [9, 8, 7, 6, 5], SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))
        return {0: reqs, 5: [late]}

    plain = _plain(_engine(model_dir), requests())
    engine = _engine(model_dir)
    overlapped, num_ahead = _overlapped(engine, requests())
    assert _by_request(overlapped) == _by_request(plain)
    assert [o.finish_reason for o in overlapped if o.request_id == "r0"][-1] is FinishReason.STOP
    assert num_ahead >= 5
    _assert_all_pages_back(engine)


def test_a_step_ahead_takes_pages_only_when_they_are_free(model_dir: Path) -> None:
    """With no free page for the step ahead, nothing is planned (a step ahead never preempts)."""
    engine = _engine(model_dir, max_total_tokens=4 * PAGE_SIZE, enable_prefix_cache=False)
    engine.add_request(Request("a", [1, 2, 3, 4, 5, 6, 7], SamplingParams(temperature=0, ignore_eos=True,
                                                                            max_new_tokens=40)))
    scheduled = engine.schedule()                      # the 7-token prompt: 2 pages
    engine.update(scheduled, engine.execute(scheduled))
    hog = engine.allocator.allocate(engine.allocator.num_free)
    scheduled = engine.schedule()                      # decodes position 7, in page 2
    assert plan_ahead(engine.scheduler, scheduled) is None   # position 8 needs a third page
    assert len(engine.scheduler.running[0].page_ids) == 2
    engine.allocator.free(hog[:1])
    ahead = plan_ahead(engine.scheduler, scheduled)
    assert ahead is not None and len(engine.scheduler.running[0].page_ids) == 3
    assert ahead.computed.requests[0].page_ids == engine.scheduler.running[0].page_ids
    assert ahead.computed.requests[0] is not engine.scheduler.running[0]


def test_no_step_ahead_while_a_prompt_waits_or_a_grammar_decodes(model_dir: Path) -> None:
    engine = _engine(model_dir, max_running_requests=1)
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=9)
    engine.add_request(Request("a", [1, 2, 3], greedy))
    engine.add_request(Request("b", [4, 5, 6], greedy))   # waits: one request runs at a time
    scheduled = engine.schedule()
    engine.update(scheduled, engine.execute(scheduled))
    scheduled = engine.schedule()
    assert scheduled.is_decode_only and plan_ahead(engine.scheduler, scheduled) is None
    engine.abort("b")
    assert plan_ahead(engine.scheduler, scheduled) is not None
    engine.scheduler.running[0].grammar_matcher = object()   # its mask needs the token in flight first
    assert plan_ahead(engine.scheduler, scheduled) is None
