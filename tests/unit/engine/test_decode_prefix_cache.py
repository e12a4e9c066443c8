"""The decode side's prefix cache on a tiny random Llama in fp32: a finished request leaves its whole
sequence cached, a handoff's reservation shares the cached prefix of its prompt and only the pages
after it are written from outside, and the tokens then decoded equal one engine's run of the prompt."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import InvalidRequestError, RequestAbortedError
from engine.page_allocator import pages_needed
from engine.request import Request, SamplingParams
from engine.weights import open_checkpoint
from tests.local_handoff import LocalHandoff, confirm, take_kv_in
from tests.tiny_models import save_tiny_llama

PAGE_SIZE = 4
PROMPT = [3, 17, 42, 99, 5, 61, 7, 200, 31, 8]   # 10 tokens: two full pages and a part
NUM_NEW = 7
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=NUM_NEW)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def _engine(model_dir: Path) -> Engine:
    config = EngineConfig(dtype="float32", page_size=PAGE_SIZE, max_total_tokens=128, enable_prefix_cache=True)
    engine = Engine(open_checkpoint(str(model_dir)), config, progress=False)
    take_kv_in(engine)
    return engine


def _run(engine: Engine, request_id: str) -> list[int]:
    tokens = []
    while engine.has_work:
        tokens += [o.token_id for o in engine.step() if o.request_id == request_id and o.token_id is not None]
    return tokens


def _whole(model_dir: Path, prompt: list[int]) -> list[int]:
    engine = _engine(model_dir)
    engine.add_request(Request("whole", list(prompt), GREEDY))
    return _run(engine, "whole")


def _hand_off(prefill: Engine, decode: Engine, rid: str, prompt: list[int], namespace: str | None = "") -> list[int]:
    """Reserve with the prompt's tokens, prefill it, let prefill's KV connector write only the pages after
    the cached prefix (in-process), admit and decode; every token, the first included."""
    reserved = decode.reserve(rid, len(prompt), prompt_ids=prompt, namespace=namespace)
    with LocalHandoff(prefill, decode) as handoff:
        send = handoff.target(reserved.page_ids, first_page=reserved.cached_tokens // PAGE_SIZE)
        prefill.add_request(Request(rid, list(prompt), GREEDY, is_prefill_only=True, kv_params=send))
        [first] = prefill.step()
        assert send.written.result(timeout=10).num_bytes == len(reserved.page_ids) * prefill.runner.layout.page_bytes
        assert prefill.poll_kv() == [rid]
    assert confirm(decode, rid, prompt, first.token_id, first.logprob, GREEDY) is None
    return [first.token_id] + _run(decode, rid)


def _assert_settled(engine: Engine) -> None:
    engine.pages.check_integrity()
    assert engine.is_idle and engine.allocator.num_free + engine.pages.num_evictable_pages == engine.allocator.num_pages


def test_a_chat_turn_reuses_the_last_turns_prompt_and_answer(model_dir: Path) -> None:
    prefill, decode = _engine(model_dir), _engine(model_dir)
    elsewhere = decode.allocator.allocate(5)   # so decode's page ids differ from prefill's
    first_turn = _hand_off(prefill, decode, "t1", PROMPT)
    assert first_turn == _whole(model_dir, PROMPT)
    # 10 + 7 - 1 tokens have KV on decode: four full pages stay cached after the finish
    assert decode.pages.num_evictable_pages == (len(PROMPT) + NUM_NEW - 1) // PAGE_SIZE

    second = PROMPT + first_turn + [77, 12, 250]   # the next turn repeats the last prompt and answer
    reserved = decode.reserve("probe", len(second), prompt_ids=second)
    assert reserved.cached_tokens == 16
    assert len(reserved.page_ids) == pages_needed(len(second), PAGE_SIZE) - 4
    decode.abort("probe", write_settled=True)

    assert _hand_off(prefill, decode, "t2", second) == _whole(model_dir, second)
    decode.allocator.free(elsewhere)
    _assert_settled(decode)


def test_a_dropped_reservation_gives_its_cached_pages_back_at_once_and_quarantines_the_rest(model_dir: Path) -> None:
    prefill, decode = _engine(model_dir), _engine(model_dir)
    _hand_off(prefill, decode, "t1", PROMPT)
    now = [0.0]
    receiver = take_kv_in(decode, grace_s=60.0, clock=lambda: now[0])
    cached_before = dict(decode.pages.cached_page_refs())
    second = PROMPT + [9] * 12
    reserved = decode.reserve("late", len(second), prompt_ids=second)
    assert reserved.cached_tokens == 8 and len(reserved.page_ids) == 4
    decode.abort("late")   # a write may still be in flight: the written pages sit out the grace
    assert decode.pages.cached_page_refs() == cached_before   # no reference left on the shared ones
    assert receiver.num_quarantined_pages == 4 and not decode.holds("late")
    now[0] = 61.0
    decode.poll_kv()
    assert receiver.num_quarantined_pages == 0
    _assert_settled(decode)


def test_cached_pages_match_only_under_their_own_adapter(model_dir: Path) -> None:
    prefill, decode = _engine(model_dir), _engine(model_dir)
    _hand_off(prefill, decode, "t1", PROMPT)
    second = PROMPT + [9] * 6
    for rid, namespace in (("other", "adapter#1"), ("unknown", None)):   # None: an adapter not loaded here
        reserved = decode.reserve(rid, len(second), prompt_ids=second, namespace=namespace)
        assert reserved.cached_tokens == 0 and len(reserved.page_ids) == pages_needed(len(second), PAGE_SIZE)
        decode.abort(rid, write_settled=True)
    reserved = decode.reserve("base", len(second), prompt_ids=second)
    assert reserved.cached_tokens == 8
    with pytest.raises(RequestAbortedError, match="loaded again"):   # admitted under another adapter id
        confirm(decode, "base", second, 5, -1.0, GREEDY, lora_id="adapter#2")
    decode.abort("base", write_settled=True)
    _assert_settled(decode)


def test_a_prompt_that_does_not_fit_its_length_is_refused_before_any_page_is_taken(model_dir: Path) -> None:
    decode = _engine(model_dir)
    with pytest.raises(InvalidRequestError, match="prompt_len"):
        decode.reserve("r", len(PROMPT) + 1, prompt_ids=PROMPT)
    with pytest.raises(InvalidRequestError):
        decode.reserve("r", len(PROMPT), prompt_ids=PROMPT[:-1] + [10**6])   # outside the vocabulary
    assert decode.allocator.num_free == decode.allocator.num_pages and not decode.holds("r")


def test_new_weights_drop_reservations_that_share_cached_pages(model_dir: Path) -> None:
    prefill, decode = _engine(model_dir), _engine(model_dir)
    _hand_off(prefill, decode, "t1", PROMPT)
    now = [0.0]
    take_kv_in(decode, grace_s=30.0, clock=lambda: now[0])
    decode.reserve("held", len(PROMPT) + 4, prompt_ids=PROMPT + [1, 2, 3, 4])
    decode.update_weights(open_checkpoint(str(model_dir)))
    assert not decode.holds("held")
    now[0] = 3600.0
    decode.poll_kv()
    assert decode.pages.num_cached_pages == 0   # nothing computed under the old weights stays cached
    _assert_settled(decode)
