"""Speculative decoding with a draft model (engine/draft_model.py) through the engine, on tiny random
Llamas: greedy output identical with it on and off (another model drafting, alone and batched, under
preemption, at the context limit, with an abort); every draft accepted when the draft model is the
target itself (its KV kept right across steps); the draft pool's pages all back when requests end;
settings that cannot work refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from engine.config import ConfigError, EngineConfig
from engine.draft_model import DraftModelProposer, _common_prefix_len
from engine.engine import Engine
from engine.proposers import DraftAsk
from engine.request import FinishReason, Request, SamplingParams, StepOutput
from engine.weights import open_checkpoint
from tests.tiny_models import save_tiny_llama, save_tiny_qwen2

PAGE_SIZE = 4
GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = {"a": [3, 17, 42, 99, 5, 61, 7, 200, 31, 3, 17], "b": [11, 250, 9, 128, 77, 11], "c": [8] * 9}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("draft"), seed=1)


def _engine(target: Path, draft: Path | None, **overrides) -> Engine:
    config = dict(dtype="float32", page_size=PAGE_SIZE, max_total_tokens=256)
    if draft is not None:
        config.update(speculative_algorithm="draft", speculative_num_draft_tokens=3, speculative_draft_policy="always")
    config.update(overrides)
    checkpoint = open_checkpoint(str(draft)) if draft is not None else None
    return Engine(open_checkpoint(str(target)), EngineConfig(**config), progress=False, draft=checkpoint)


def _run(engine: Engine, requests: list[Request]) -> dict[str, list[int]]:
    for req in requests:
        engine.add_request(req)
    outputs: dict[str, list[StepOutput]] = {}
    for _ in range(1000):
        if not engine.has_work:
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert not engine.has_work
    assert engine.allocator.num_free == engine.allocator.num_pages
    _assert_draft_pool_empty(engine)
    return {rid: [o.token_id for o in outs if o.token_id is not None] for rid, outs in outputs.items()}


def _proposer(engine: Engine) -> DraftModelProposer:
    proposer = engine.scheduler.proposer
    assert isinstance(proposer, DraftModelProposer)
    return proposer


def _assert_draft_pool_empty(engine: Engine) -> None:
    proposer = engine.scheduler.proposer
    if isinstance(proposer, DraftModelProposer):
        assert proposer.num_sequences == 0
        assert proposer.allocator.num_free == proposer.allocator.num_pages


def _requests(max_new_tokens: int = 24, **sampling) -> list[Request]:
    settings = GREEDY | sampling
    return [Request(rid, list(p), SamplingParams(max_new_tokens=max_new_tokens, **settings)) for rid, p in PROMPTS.items()]


def test_another_models_drafts_leave_greedy_output_unchanged(target_dir: Path, other_dir: Path) -> None:
    plain = _run(_engine(target_dir, None), _requests())
    engine = _engine(target_dir, other_dir)
    assert _run(engine, _requests()) == plain
    assert all(len(tokens) == 24 for tokens in plain.values())
    scheduler = engine.scheduler
    assert scheduler.num_draft_tokens > 0 and scheduler.num_accepted_tokens <= scheduler.num_draft_tokens
    assert _proposer(engine).seconds_per_draft > 0


def test_the_target_drafting_for_itself_has_every_draft_accepted(target_dir: Path) -> None:
    """The draft model's KV after rejections and catch-ups is right: with the target's own weights,
    its greedy guesses are the target's tokens, so nearly all are accepted (a near tie between two
    logits may still flip one), and a step yields up to four tokens."""
    plain = _run(_engine(target_dir, None), _requests(max_new_tokens=40))
    engine = _engine(target_dir, target_dir)
    assert _run(engine, _requests(max_new_tokens=40)) == plain
    scheduler = engine.scheduler
    assert scheduler.num_draft_tokens >= 3 * 3 * 9  # each of the 3 requests: 3 drafts a step, 40 tokens in ~10
    assert scheduler.num_accepted_tokens >= 0.95 * scheduler.num_draft_tokens


def test_requests_join_and_leave_a_drafting_batch_unchanged(target_dir: Path, other_dir: Path) -> None:
    """Different lengths end at different steps, and a request added later starts its draft KV from
    its prompt while the others' go on."""
    plain = _run(_engine(target_dir, None), _requests())
    engine = _engine(target_dir, other_dir)
    requests = _requests()
    for i, req in enumerate(requests):
        req.sampling = SamplingParams(max_new_tokens=8 * (i + 1), **GREEDY)
    engine.add_request(requests[0])
    early = [out.token_id for _ in range(2) for out in engine.step()]
    got = _run(engine, requests[1:])
    got["a"] = early + got["a"]
    assert got == {rid: plain[rid][: 8 * (i + 1)] for i, rid in enumerate(PROMPTS)}


def test_preempted_and_aborted_requests_give_their_draft_pages_back(target_dir: Path, other_dir: Path) -> None:
    plain = _run(_engine(target_dir, None), _requests())
    engine = _engine(target_dir, other_dir, max_total_tokens=64)  # 16 pages: three requests need 27
    assert _run(engine, _requests()) == plain
    assert engine.scheduler.num_preemptions >= 1

    engine = _engine(target_dir, other_dir)
    engine.add_request(Request("a", list(PROMPTS["a"]), SamplingParams(max_new_tokens=100, **GREEDY)))
    while engine.scheduler.num_draft_tokens == 0:
        engine.step()
    assert _proposer(engine).num_sequences == 1
    final = engine.abort("a")
    assert final is not None and final.finish_reason is FinishReason.ABORT
    assert not engine.has_work
    _assert_draft_pool_empty(engine)


def test_drafting_stops_at_the_context_length_as_without(target_dir: Path, other_dir: Path) -> None:
    plain = _run(_engine(target_dir, None, context_len=30), _requests(max_new_tokens=200))
    assert _run(_engine(target_dir, other_dir, context_len=30), _requests(max_new_tokens=200)) == plain


def test_seeded_sampling_with_a_draft_model_is_reproducible(target_dir: Path, other_dir: Path) -> None:
    sampling = dict(temperature=0.8, seed=7)
    first = _run(_engine(target_dir, other_dir), _requests(**sampling))
    assert _run(_engine(target_dir, other_dir), _requests(**sampling)) == first


def test_a_short_draft_pool_evicts_idle_sequences_then_drafts_nothing(target_dir: Path) -> None:
    engine = _engine(target_dir, target_dir)
    proposer = _proposer(engine)
    proposer.allocator = type(proposer.allocator)(4)  # 16 tokens of draft KV
    assert proposer.propose([DraftAsk("x", [1, 2, 3, 4, 5], 3)]) != [[]]
    assert proposer.num_sequences == 1
    # a second request needs 3 pages: x asks nothing now, so its sequence goes
    assert len(proposer.propose([DraftAsk("y", list(range(1, 10)), 3)])[0]) == 3
    assert proposer.num_sequences == 1
    # one that could never fit gets no drafts, and the request asking beside it keeps its own
    drafts = proposer.propose([DraftAsk("y", list(range(1, 11)), 3), DraftAsk("z", list(range(1, 30)), 3)])
    assert len(drafts[0]) == 3 and drafts[1] == []


def test_draft_settings_that_cannot_work_are_refused(target_dir: Path, other_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs a draft model"):
        _engine(target_dir, None, speculative_algorithm="draft")
    with pytest.raises(ConfigError, match="only by speculative algorithm 'draft'"):
        Engine(
            open_checkpoint(str(target_dir)),
            EngineConfig(dtype="float32", page_size=PAGE_SIZE, max_total_tokens=256, speculative_algorithm="ngram"),
            progress=False,
            draft=open_checkpoint(str(other_dir)),
        )
    _engine(target_dir, save_tiny_qwen2(tmp_path / "qwen"))  # another family of the same vocabulary drafts
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=300, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "wider")
    with pytest.raises(ConfigError, match="vocabulary"):
        _engine(target_dir, tmp_path / "wider")


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [([], [1], 0), ([1, 2, 3], [1, 2, 3, 4], 3), ([1, 2, 9, 4], [1, 2, 3, 4], 2), ([5], [6], 0), ([1, 2], [1, 2], 2)],
)
def test_common_prefix_len(a: list[int], b: list[int], expected: int) -> None:
    assert _common_prefix_len(a, b) == expected == _common_prefix_len(b, a)


def test_a_long_prompt_is_caught_up_in_chunks_with_no_drafts_until_it_is(target_dir: Path) -> None:
    plain = _run(_engine(target_dir, None), _requests(max_new_tokens=30))
    engine = _engine(target_dir, target_dir)
    _proposer(engine).catch_up_tokens = 4  # the 11-token prompt takes three steps, the 9-token ones more
    first_drafts = None
    for req in _requests(max_new_tokens=30):
        engine.add_request(req)
    outputs: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    steps = 0
    while engine.has_work:
        steps += 1
        for out in engine.step():
            outputs[out.request_id] += [out.token_id] if out.token_id is not None else []
        if first_drafts is None and engine.scheduler.num_draft_tokens:
            first_drafts = steps
    assert outputs == plain
    assert first_drafts is not None and first_drafts >= 4  # after the first step's prompts, three catching up
    assert engine.scheduler.num_accepted_tokens >= 0.9 * engine.scheduler.num_draft_tokens
    _assert_draft_pool_empty(engine)


def test_a_paced_catch_up_feeds_what_fits_in_its_time(target_dir: Path) -> None:
    proposer = _proposer(_engine(target_dir, target_dir))
    assert proposer.catch_up_budget(None) == proposer.catch_up_tokens   # no pace to keep
    assert proposer.catch_up_budget(0.050) == proposer.first_paced_tokens   # nothing measured yet
    proposer.seconds_per_catch_up_token = 0.001
    assert proposer.catch_up_budget(0.050) == 50
    assert proposer.catch_up_budget(0.0001) == proposer.min_paced_tokens   # it gains on the request's growth
    assert proposer.catch_up_budget(100.0) == proposer.catch_up_tokens


def test_a_prompt_caught_up_beside_decoding_requests_keeps_their_pace(target_dir: Path) -> None:
    """While two or more requests decode, the pacer gives the catch-up its allowance over a decode-only
    step (`DecodePacer.catch_up_seconds`), and the proposer feeds what fits at its measured cost per token; one
    request alone is caught up as fast as it goes. The output is the plain engine's."""
    long_prompt = [(7 * i + 3) % 250 for i in range(40)]
    requests = lambda: [  # noqa: E731
        Request("short", [3, 17, 42], SamplingParams(max_new_tokens=40, **GREEDY)),
        Request("long", list(long_prompt), SamplingParams(max_new_tokens=8, **GREEDY)),
    ]
    plain = _run(_engine(target_dir, None), requests())
    engine = _engine(target_dir, target_dir, max_decode_slowdown=1.01)   # a pace that binds: the least chunks
    proposer = _proposer(engine)
    seen: list[tuple[int, float | None, int, int]] = []   # (decoding requests, catch-up seconds, budget, fed)
    real_propose = proposer.propose

    def propose(asks, catch_up_s=None):
        held = proposer._sequences
        before = {a.request_id: len(held[a.request_id].token_ids) if a.request_id in held else 0 for a in asks}
        budget = proposer.catch_up_budget(catch_up_s)
        out = real_propose(asks, catch_up_s)
        fed = sum(len(proposer._sequences[r].token_ids) - n for r, n in before.items() if r in proposer._sequences)
        seen.append((len(asks), catch_up_s, budget, fed))
        return out

    proposer.propose = propose
    short, long = requests()
    engine.add_request(short)
    outputs: dict[str, list[int]] = {"short": [], "long": []}
    for _ in range(6):   # the short request decodes alone: decode-only steps are measured
        for out in engine.step():
            outputs[out.request_id] += [out.token_id] if out.token_id is not None else []
    engine.add_request(long)
    while engine.has_work:
        for out in engine.step():
            outputs[out.request_id] += [out.token_id] if out.token_id is not None else []
    assert outputs == plain
    alone = [s for n, s, _, _ in seen if n == 1]
    beside = [(s, budget, fed) for n, s, budget, fed in seen if n == 2]
    assert alone and all(s is None for s in alone)
    assert beside and all(s is not None and s > 0 for s, _, _ in beside)
    # the long prompt's 40 tokens went in over several steps, each within the budget its time allowed
    # (plus the short request's own few tokens)
    assert all(fed <= budget + proposer.num_draft_tokens + 1 for _, budget, fed in beside)
    assert len([fed for _, _, fed in beside if fed > proposer.num_draft_tokens + 1]) >= 3
    assert min(budget for _, budget, _ in beside) == proposer.min_paced_tokens
    _assert_draft_pool_empty(engine)
