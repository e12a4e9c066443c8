"""Chunked prefill through the engine on a tiny random fp32 Llama: a prompt computed in chunks of 16
or 7 tokens (page size 16, so chunks also end mid-page) gives the same logits, greedy and seeded
tokens, logprobs and prompt logprobs as computed whole; a chunked request holds its pages from the
first chunk and returns every one when aborted in the middle."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from engine.config import ConfigError, EngineConfig
from engine.engine import Engine
from engine.page_allocator import pages_needed
from engine.request import FinishReason, PromptLogprobs, Request, SamplingParams, StepOutput
from engine.step_records import ModelOutput, SampledToken
from engine.weights import open_checkpoint
from tests.local_handoff import LocalHandoff
from tests.tiny_models import save_tiny_llama

PAGE_SIZE = 16
CHUNK_SIZES = [16, 7]
GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = {"long": [(7 * i) % 251 + 3 for i in range(45)],
           "mid": [(11 * i + 5) % 253 + 2 for i in range(30)],
           "short": [9, 40, 200, 31, 77]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def _engine(model_dir: Path, chunked_prefill_size: int | None = None, **overrides) -> Engine:
    config = EngineConfig(dtype="float32", page_size=PAGE_SIZE, max_total_tokens=512,
                          chunked_prefill_size=chunked_prefill_size, **overrides)
    return Engine(open_checkpoint(str(model_dir)), config, progress=False)


def _run(engine: Engine, requests: list[Request]) -> dict[str, list[StepOutput]]:
    """Queue `requests` and step until idle; outputs grouped by request id."""
    for req in requests:
        engine.add_request(req)
    outputs: dict[str, list[StepOutput]] = {}
    for _ in range(200):
        if not engine.has_work:
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine still busy after 200 steps")


def _assert_idle(engine: Engine) -> None:
    assert not engine.has_work
    assert engine.allocator.num_free + engine.num_cached_pages == engine.allocator.num_pages


def _forward_logits(engine: Engine, prompt: list[int], num_decode: int) -> list[tuple[int, torch.Tensor]]:
    """Drive one greedy request through the engine's scheduler and `runner.forward_logits`: for each
    forward pass (every prefill chunk, then `num_decode` decode steps), the number of tokens whose
    KV it completes and the fp32 logits [V] of its last row."""
    req = Request("probe", list(prompt), SamplingParams(max_new_tokens=num_decode + 1, **GREEDY))
    engine.add_request(req)
    seen: list[tuple[int, torch.Tensor]] = []
    while len(req.output_ids) <= num_decode:
        scheduled = engine.scheduler.schedule()
        assert scheduled.requests == (req,) and scheduled.aborted == ()
        logits = engine.runner.forward_logits([req], list(scheduled.num_new_tokens))[0]
        seen.append((req.num_computed + scheduled.num_new_tokens[0], logits))
        sampled = (SampledToken(int(logits.argmax()), 0.0),) if scheduled.is_sampling[0] else ()
        engine.scheduler.update_from_output(scheduled, ModelOutput((sampled,), ()))
    engine.abort("probe")
    _assert_idle(engine)
    return seen


def _assert_same_prompt_logprobs(got: PromptLogprobs, expected: PromptLogprobs) -> None:
    assert got.token_ids == expected.token_ids
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(expected.logprobs), atol=1e-5, rtol=0)
    assert [[t for t, _ in row] for row in got.top] == [[t for t, _ in row] for row in expected.top]
    for got_row, expected_row in zip(got.top + got.requested, expected.top + expected.requested):
        assert [lp for _, lp in got_row] == pytest.approx([lp for _, lp in expected_row], abs=1e-5)


@pytest.mark.parametrize("size", [-1, -512])
def test_negative_chunk_size_is_a_config_error(size: int) -> None:
    with pytest.raises(ConfigError, match="chunked_prefill_size"):
        EngineConfig(chunked_prefill_size=size)
    assert EngineConfig(chunked_prefill_size=0).chunked_prefill_size == 0   # off, like None


@pytest.mark.parametrize("chunk", CHUNK_SIZES)
def test_every_chunks_logits_equal_the_unchunked_computation(model_dir: Path, chunk: int) -> None:
    """The last row of each chunk equals a whole-prompt forward of the same prefix, and the KV the
    chunks wrote gives the same decode logits."""
    whole_engine, chunked_engine = _engine(model_dir), _engine(model_dir, chunk)
    prompt = PROMPTS["long"]
    whole = _forward_logits(whole_engine, prompt, num_decode=4)
    chunked = _forward_logits(chunked_engine, prompt, num_decode=4)
    ends = [end for end, _ in chunked]
    expected_ends = [*range(chunk, len(prompt), chunk), len(prompt), *range(len(prompt) + 1, len(prompt) + 5)]
    assert ends == expected_ends
    assert [end for end, _ in whole] == [len(prompt), *range(len(prompt) + 1, len(prompt) + 5)]
    num_chunks = len(ends) - 4
    for end, logits in chunked[:num_chunks - 1]:
        [(_, prefix_logits)] = _forward_logits(whole_engine, prompt[:end], num_decode=0)
        torch.testing.assert_close(logits, prefix_logits, atol=1e-5, rtol=1e-5)
    for (_, got), (_, expected) in zip(chunked[num_chunks - 1:], whole, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", CHUNK_SIZES)
def test_chunked_batch_gives_the_same_tokens_and_logprobs(model_dir: Path, chunk: int) -> None:
    def requests() -> list[Request]:
        return [Request("long", PROMPTS["long"], SamplingParams(max_new_tokens=8, **GREEDY)),
                Request("mid", PROMPTS["mid"], SamplingParams(max_new_tokens=8, top_logprobs_num=3, **GREEDY)),
                Request("seeded", PROMPTS["mid"], SamplingParams(temperature=1.0, seed=7, max_new_tokens=8,
                                                                 ignore_eos=True)),
                Request("short", PROMPTS["short"], SamplingParams(max_new_tokens=8, **GREEDY))]

    whole_engine, chunked_engine = _engine(model_dir), _engine(model_dir, chunk)
    whole, chunked = _run(whole_engine, requests()), _run(chunked_engine, requests())
    for rid, outputs in whole.items():
        got = chunked[rid]
        assert [o.token_id for o in got] == [o.token_id for o in outputs], rid
        assert [o.logprob for o in got] == pytest.approx([o.logprob for o in outputs], abs=1e-5)
        assert [[t for t, _ in o.top_logprobs] for o in got] == [[t for t, _ in o.top_logprobs] for o in outputs]
        assert got[-1].finish_reason is FinishReason.LENGTH
    _assert_idle(whole_engine)
    _assert_idle(chunked_engine)


@pytest.mark.parametrize("chunk", CHUNK_SIZES)
@pytest.mark.parametrize("start", [0, 5, 20, 40])
def test_prompt_logprobs_gathered_over_chunks_equal_the_unchunked_ones(model_dir: Path, chunk: int,
                                                                       start: int) -> None:
    sampling = SamplingParams(max_new_tokens=2, top_logprobs_num=3, token_ids_logprob=(5, 77), **GREEDY)

    def requests() -> list[Request]:
        return [Request("scored", PROMPTS["long"], sampling, prompt_logprob_start=start),
                Request("plain", PROMPTS["mid"], sampling)]

    whole, chunked = _run(_engine(model_dir), requests()), _run(_engine(model_dir, chunk), requests())
    expected = whole["scored"][0].prompt_logprobs
    assert expected is not None and len(expected.token_ids) == len(PROMPTS["long"]) - max(start, 1)
    got = chunked["scored"][0].prompt_logprobs
    assert got is not None
    _assert_same_prompt_logprobs(got, expected)
    assert all(o.prompt_logprobs is None for o in chunked["scored"][1:] + chunked["plain"])


def test_prompt_logprobs_with_the_prefix_cache_and_chunks(model_dir: Path) -> None:
    """The cache serves the pages before position start - 1; the chunks compute the rest."""
    sampling = SamplingParams(max_new_tokens=1, top_logprobs_num=2, **GREEDY)
    whole = _run(_engine(model_dir), [Request("s", PROMPTS["long"], sampling, prompt_logprob_start=40)])
    engine = _engine(model_dir, 7, enable_prefix_cache=True)
    _run(engine, [Request("warm", PROMPTS["long"], sampling)])
    [first] = _run(engine, [Request("s", PROMPTS["long"], sampling, prompt_logprob_start=40)])["s"]
    assert first.cached_tokens == 32
    _assert_same_prompt_logprobs(first.prompt_logprobs, whole["s"][0].prompt_logprobs)
    _assert_idle(engine)


def test_prefill_only_request_finishes_after_its_last_chunk(model_dir: Path) -> None:
    [expected] = _run(_engine(model_dir), [Request("p", PROMPTS["long"], SamplingParams(**GREEDY),
                                                   is_prefill_only=True)])["p"]
    engine = _engine(model_dir, 16)
    num_pages = pages_needed(len(PROMPTS["long"]), PAGE_SIZE)
    with LocalHandoff(engine, _engine(model_dir)) as handoff:
        send = handoff.target(list(range(num_pages)))
        engine.add_request(Request("p", PROMPTS["long"], SamplingParams(**GREEDY), is_prefill_only=True,
                                   kv_params=send))
        before_first = time.perf_counter()
        assert engine.step() == []
        after_first = time.perf_counter()
        assert engine.step() == [] and not send.written.done()
        [out] = engine.step()                     # 16 + 16 + 13 tokens
        assert out.token_id == expected.token_id and out.logprob == pytest.approx(expected.logprob, abs=1e-5)
        assert before_first <= out.prefill_started_at <= after_first   # timed from the first chunk
        assert send.written.result(timeout=10).num_bytes > 0 and not engine.has_work
        assert engine.allocator.num_used == num_pages and engine.holds("p")
        assert engine.poll_kv() == ["p"]
    _assert_idle(engine)


@pytest.mark.parametrize("enable_prefix_cache", [False, True])
def test_abort_in_the_middle_of_chunking_returns_every_page(model_dir: Path, enable_prefix_cache: bool) -> None:
    engine = _engine(model_dir, 7, enable_prefix_cache=enable_prefix_cache)
    if enable_prefix_cache:   # so the aborted request also holds pages matched from the cache
        _run(engine, [Request("warm", PROMPTS["long"][:20], SamplingParams(max_new_tokens=1, **GREEDY))])
    engine.add_request(Request("r", PROMPTS["long"], SamplingParams(max_new_tokens=4, **GREEDY)))
    assert engine.step() == [] and engine.step() == []
    assert engine.allocator.num_used == pages_needed(len(PROMPTS["long"]), PAGE_SIZE)
    out = engine.abort("r", "client went away")
    assert out == StepOutput("r", None, None, FinishReason.ABORT, abort_message="client went away")
    _assert_idle(engine)
    assert not engine.holds("r") and engine.step() == []
    engine.pages.check_integrity()
    # The engine serves the next prompt as if nothing had happened.
    after = _run(engine, [Request("next", PROMPTS["long"], SamplingParams(max_new_tokens=4, **GREEDY))])
    fresh = _run(_engine(model_dir), [Request("next", PROMPTS["long"], SamplingParams(max_new_tokens=4, **GREEDY))])
    assert [o.token_id for o in after["next"]] == [o.token_id for o in fresh["next"]]
    _assert_idle(engine)
