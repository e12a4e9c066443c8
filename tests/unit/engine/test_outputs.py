"""Tests for engine.outputs: when a token ends a request, and what its outputs carry."""

from __future__ import annotations

import pytest

from engine.outputs import append_token, finish_output, finish_reason, prefill_only_output, token_output
from engine.request import FinishReason, Request, SamplingParams
from engine.runner import SampledToken

EOS = frozenset({2})


def _req(**sampling: object) -> Request:
    return Request("r", [5, 6, 7], SamplingParams(**sampling), num_cached_tokens=2, prefill_started_at=1.5)


@pytest.mark.parametrize("sampling,token_id,context_len,reason", [
    ({}, 9, 100, None),
    ({}, 2, 100, FinishReason.STOP),                                  # eos
    ({"ignore_eos": True}, 2, 100, None),
    ({"ignore_eos": True, "stop_token_ids": (2,)}, 2, 100, FinishReason.STOP),
    ({"max_new_tokens": 1}, 9, 100, FinishReason.LENGTH),
    ({}, 9, 4, FinishReason.LENGTH),                                  # 3 prompt + 1 output fill the context
])
def test_finish_reason(sampling: dict, token_id: int, context_len: int, reason: FinishReason | None) -> None:
    req = _req(**sampling)
    req.output_ids.append(token_id)
    assert finish_reason(req, token_id, EOS, context_len) is reason


def test_append_token_records_and_sets_the_matched_token_only_for_stop() -> None:
    req = _req(max_new_tokens=2)
    assert append_token(req, SampledToken(9, -0.5), EOS, 100) is None
    assert req.output_ids == [9] and req.output_logprobs == [-0.5] and req.matched_token_id is None
    assert append_token(req, SampledToken(2, -0.1), EOS, 100) is FinishReason.STOP
    assert req.matched_token_id == 2
    length = _req(max_new_tokens=1)
    assert append_token(length, SampledToken(9, -0.5), EOS, 100) is FinishReason.LENGTH
    assert length.matched_token_id is None


def test_only_the_first_token_carries_the_prefill_extras() -> None:
    req = _req()
    token = SampledToken(9, -0.5, top=((9, -0.5),))
    append_token(req, token, EOS, 100)
    first = token_output(req, token, None)
    assert (first.token_id, first.cached_tokens, first.prefill_started_at) == (9, 2, 1.5)
    assert first.top_logprobs == ((9, -0.5),)
    append_token(req, SampledToken(8, -1.0), EOS, 100)
    second = token_output(req, SampledToken(8, -1.0), None)
    assert (second.cached_tokens, second.prefill_started_at) == (0, None)


def test_prefill_only_and_finish_outputs() -> None:
    req = _req()
    out = prefill_only_output(req, SampledToken(9, -0.5), "w1")
    assert (out.token_id, out.finish_reason, out.weights_id, out.cached_tokens) == (9, None, "w1", 2)
    req.finish_reason, req.abort_message = FinishReason.ABORT, "gone"
    done = finish_output(req)
    assert (done.token_id, done.finish_reason, done.abort_message) == (None, FinishReason.ABORT, "gone")
    assert done.matched_token_id is None
