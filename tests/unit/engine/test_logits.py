"""The engine applies logit adjustments when choosing, and reports raw logprobs and top-k extras."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import logits as engine_logits
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.request import FinishReason, Request, SamplingParams
from engine.weights import open_checkpoint
from tests.hf_oracle import hf_last_logits, load_hf_dir
from tests.local_handoff import confirm, take_kv_in
from tests.tiny_models import save_tiny_llama

PROMPT = [5, 17, 42, 99, 3, 7]
EOS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"))


def _run(model_dir: Path, sampling: SamplingParams, prompt=PROMPT):
    engine = Engine(open_checkpoint(str(model_dir)), EngineConfig(dtype="float32", page_size=4, max_total_tokens=128),
                    progress=False)
    engine.add_request(Request("r", list(prompt), sampling))
    outputs = []
    while engine.has_work:
        outputs += engine.step()
    assert engine.allocator.num_free == engine.allocator.num_pages
    return outputs


def test_logit_bias_forces_a_token_and_logprobs_stay_raw(model_dir: Path) -> None:
    outputs = _run(model_dir, SamplingParams(temperature=0, max_new_tokens=3, logit_bias=((77, 100.0),)))
    assert [o.token_id for o in outputs] == [77, 77, 77]
    hf = load_hf_dir(model_dir)
    raw = torch.log_softmax(hf_last_logits(hf, PROMPT), -1)
    assert outputs[0].logprob == pytest.approx(float(raw[77]), abs=1e-4)


def test_eos_is_masked_until_min_new_tokens(model_dir: Path) -> None:
    eos_first = SamplingParams(temperature=0, max_new_tokens=10, logit_bias=((EOS, 50.0),))
    assert [o.finish_reason for o in _run(model_dir, eos_first)] == [FinishReason.STOP]
    held = _run(model_dir, SamplingParams(temperature=0, max_new_tokens=10, min_new_tokens=4,
                                          logit_bias=((EOS, 50.0),)))
    assert len(held) == 5 and held[-1].token_id == EOS and held[-1].finish_reason is FinishReason.STOP
    assert EOS not in [o.token_id for o in held[:4]]


def test_frequency_penalty_breaks_a_forced_repeat(model_dir: Path) -> None:
    # a +3 bias makes token 77 the greedy choice; a strong frequency penalty must move off it
    biased = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True, logit_bias=((77, 3.0),))
    assert [o.token_id for o in _run(model_dir, biased)].count(77) == 6
    penalized = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True, logit_bias=((77, 3.0),),
                               frequency_penalty=2.0, presence_penalty=2.0)
    assert [o.token_id for o in _run(model_dir, penalized)].count(77) < 6


def test_top_logprobs_and_requested_ids_match_the_raw_distribution(model_dir: Path) -> None:
    [first, *_] = _run(model_dir, SamplingParams(temperature=0, max_new_tokens=2, top_logprobs_num=5,
                                                  token_ids_logprob=(9, 11)))
    hf = load_hf_dir(model_dir)
    raw = torch.log_softmax(hf_last_logits(hf, PROMPT), -1)
    values, ids = raw.topk(5)
    assert [t for t, _ in first.top_logprobs] == ids.tolist()
    assert [lp for _, lp in first.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
    assert first.top_logprobs[0] == (first.token_id, pytest.approx(first.logprob))
    assert [t for t, _ in first.token_ids_logprobs] == [9, 11]
    assert [lp for _, lp in first.token_ids_logprobs] == pytest.approx([float(raw[9]), float(raw[11])], abs=1e-4)


def test_invalid_penalty_values_are_rejected() -> None:
    from engine.errors import InvalidRequestError
    for kwargs in ({"presence_penalty": 3}, {"repetition_penalty": 0}, {"top_logprobs_num": 21},
                   {"min_new_tokens": 5, "max_new_tokens": 4}, {"logit_bias": ((1, 101.0),)}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**kwargs)


def test_prefix_cache_hits_give_the_same_tokens_as_recomputing(model_dir: Path) -> None:
    checkpoint = open_checkpoint(str(model_dir))
    prompt = list(range(10, 40))     # 30 tokens: seven full pages of 4
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)

    def run(engine: Engine, rid: str, ids: list[int]):
        engine.add_request(Request(rid, ids, greedy))
        outputs = []
        while engine.has_work:
            outputs += engine.step()
        return outputs

    plain = Engine(checkpoint, EngineConfig(dtype="float32", page_size=4, max_total_tokens=128), progress=False)
    cached = Engine(checkpoint, EngineConfig(dtype="float32", page_size=4, max_total_tokens=128,
                                             enable_prefix_cache=True), progress=False)
    first = run(cached, "a", prompt)
    assert first[0].cached_tokens == 0
    longer = prompt + [77, 78, 79]
    hit = run(cached, "b", longer)
    assert hit[0].cached_tokens == 28                        # seven pages of the shared prefix
    assert [o.token_id for o in hit] == [o.token_id for o in run(plain, "b", longer)]
    assert [o.token_id for o in first] == [o.token_id for o in run(plain, "a", prompt)]
    engine = cached
    assert engine.allocator.num_free + engine.num_cached_pages == engine.allocator.num_pages
    assert engine.flush_prefix_cache() > 0 and engine.allocator.num_free == engine.allocator.num_pages


def test_update_weights_checks_shapes_first_and_renames_the_weights(model_dir: Path, tmp_path: Path) -> None:
    from engine.errors import InvalidRequestError, RequestAbortedError
    from tests.tiny_models import save_tiny_qwen2
    engine = Engine(open_checkpoint(str(model_dir)), EngineConfig(dtype="float32", page_size=4, max_total_tokens=128),
                    progress=False)
    engine.add_request(Request("inflight", list(PROMPT), SamplingParams(max_new_tokens=50, ignore_eos=True)))
    engine.step()
    before = engine.weights_id
    other = save_tiny_llama(tmp_path / "other", seed=5)
    [aborted] = engine.update_weights(open_checkpoint(str(other)))
    assert aborted.finish_reason is FinishReason.ABORT and engine.weights_id == open_checkpoint(str(other)).identity
    assert engine.weights_id != before
    assert engine.allocator.num_free == engine.allocator.num_pages
    with pytest.raises(InvalidRequestError, match="do not match"):
        engine.update_weights(open_checkpoint(str(save_tiny_qwen2(tmp_path / "qwen"))))
    assert engine.weights_id == open_checkpoint(str(other)).identity
    take_kv_in(engine)
    engine.reserve("late", len(PROMPT))
    with pytest.raises(RequestAbortedError, match="different model weights"):
        confirm(engine, "late", list(PROMPT), 5, -1.0, SamplingParams(), weights_id=before)


def _hf_all_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """HF's log_softmax at every position of `ids` [len, vocab]: row p predicts token p + 1."""
    hf = load_hf_dir(model_dir)
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


@pytest.mark.parametrize("start", [0, 1, 13, 29])
def test_prompt_logprobs_equal_hfs_and_the_cache_never_serves_the_scored_part(model_dir: Path, start: int) -> None:
    prompt = list(range(10, 40))     # 30 tokens, 7 full pages of 4
    engine = Engine(open_checkpoint(str(model_dir)), EngineConfig(dtype="float32", page_size=4, max_total_tokens=128,
                                                                  enable_prefix_cache=True), progress=False)
    sampling = SamplingParams(temperature=0, max_new_tokens=2, top_logprobs_num=3, token_ids_logprob=(5, 77))

    def run(rid: str, prompt_logprob_start: int | None):
        engine.add_request(Request(rid, list(prompt), sampling, prompt_logprob_start=prompt_logprob_start))
        outputs = []
        while engine.has_work:
            outputs += engine.step()
        return outputs

    assert run("warm", None)[0].prompt_logprobs is None        # caches all 7 pages
    outputs = run("scored", start)
    first = outputs[0]
    assert first.cached_tokens == max(start - 1, 0) // 4 * 4    # only pages wholly before position start - 1
    assert all(o.prompt_logprobs is None for o in outputs[1:])
    scored = first.prompt_logprobs
    begin = max(start, 1)
    assert list(scored.token_ids) == prompt[begin:]
    hf = _hf_all_logprobs(model_dir, prompt)
    expected = hf[torch.arange(begin - 1, len(prompt) - 1), torch.tensor(prompt[begin:])]
    assert torch.allclose(torch.tensor(scored.logprobs), expected, atol=1e-4)
    for offset, (top, requested) in enumerate(zip(scored.top, scored.requested)):
        row = hf[begin - 1 + offset]
        values, ids = row.topk(3)
        assert [t for t, _ in top] == ids.tolist()
        assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=1e-4)
        assert [t for t, _ in requested] == [5, 77]
        assert [lp for _, lp in requested] == pytest.approx([float(row[5]), float(row[77])], abs=1e-4)
    assert engine.allocator.num_free + engine.num_cached_pages == engine.allocator.num_pages


def test_prompt_logprobs_longer_than_one_chunk_and_bad_start_positions(model_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(engine_logits, "_PROMPT_ROWS_PER_CHUNK", 16)
    prompt = [(7 * i) % 251 + 3 for i in range(100)]   # 99 scored rows: seven chunks of logits
    engine = Engine(open_checkpoint(str(model_dir)), EngineConfig(dtype="float32", page_size=4, max_total_tokens=512),
                    progress=False)
    engine.add_request(Request("long", prompt, SamplingParams(temperature=0, max_new_tokens=1),
                               prompt_logprob_start=0))
    outputs = []
    while engine.has_work:
        outputs += engine.step()
    scored = outputs[0].prompt_logprobs
    hf = _hf_all_logprobs(model_dir, prompt)
    expected = hf[torch.arange(0, len(prompt) - 1), torch.tensor(prompt[1:])]
    assert len(scored.logprobs) == 99
    assert torch.allclose(torch.tensor(scored.logprobs), expected, atol=1e-4)
    for bad in (-1, len(PROMPT)):
        with pytest.raises(InvalidRequestError, match="logprob_start_len"):
            engine.add_request(Request(f"bad{bad}", list(PROMPT), SamplingParams(), prompt_logprob_start=bad))
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_every_adjustment_stays_on_the_logits_device() -> None:
    """Penalties, logit bias and the min-tokens eos mask build every tensor on the logits' device: on
    `meta`, a [B] or [B, V] tensor made on the CPU would fail the arithmetic (GPU logits need the same)."""
    requests = [
        Request("p", [5, 6, 5], SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
                output_ids=[6, 7]),
        Request("b", [1, 2], SamplingParams(logit_bias=((3, 5.0), (9, -100.0)))),
        Request("m", [1, 2], SamplingParams(min_new_tokens=2, stop_token_ids=(4,))),
    ]
    logits = torch.empty(3, 64, device="meta")
    adjusted = engine_logits.adjust_logits(logits, requests, eos_token_ids=(EOS,))
    assert adjusted.device.type == "meta" and adjusted.shape == (3, 64) and adjusted is not logits
