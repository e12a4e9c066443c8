"""Tests for engine.request: SamplingParams rejects bad values with InvalidRequestError."""

from __future__ import annotations

import dataclasses
import math

import pytest

from engine.errors import InvalidRequestError
from engine.request import Request, RequestStatus, SamplingParams
from tandem.limits import SAMPLING_RANGES
from tandem.sampling import GrammarKind, GrammarSpec, SamplingSpec


def test_defaults_are_valid_and_not_greedy() -> None:
    params = SamplingParams()
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, 0, 0.0)
    assert params.seed is None and params.stop_token_ids == () and not params.ignore_eos
    assert not params.is_greedy


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.1), dict(temperature=math.nan), dict(temperature=math.inf), dict(temperature=2.01),
    dict(top_p=0.0), dict(top_p=-0.5), dict(top_p=1.01),
    dict(top_k=-2),
    dict(min_p=-0.01), dict(min_p=1.5),
    dict(max_new_tokens=0), dict(max_new_tokens=-4),
    dict(seed=-1), dict(seed=2**63),
])
def test_invalid_values_raise_invalid_request(kwargs: dict) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.0), dict(temperature=2.0), dict(top_p=1.0), dict(top_p=1e-9),
    dict(top_k=1), dict(top_k=-1), dict(min_p=0.0), dict(min_p=1.0), dict(max_new_tokens=1),
    dict(seed=0), dict(seed=2**63 - 1),
])
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value


@pytest.mark.parametrize(("kwargs", "is_greedy"), [
    (dict(temperature=0.0), True), (dict(top_k=1), True), (dict(temperature=0.0, top_k=5), True),
    (dict(temperature=0.7), False), (dict(top_k=2), False), (dict(top_p=0.01), False),
])
def test_is_greedy(kwargs: dict, is_greedy: bool) -> None:
    assert SamplingParams(**kwargs).is_greedy is is_greedy


def test_sampling_params_are_frozen() -> None:
    params = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.0  # type: ignore[misc]


def test_a_spec_resolves_over_the_defaults() -> None:
    assert [f.name for f in dataclasses.fields(SamplingSpec)] == [f.name for f in dataclasses.fields(SamplingParams)]
    assert SamplingParams.from_spec(SamplingSpec()) == SamplingParams()
    grammar = GrammarSpec(GrammarKind.REGEX, "a+")
    spec = SamplingSpec(temperature=0.0, top_k=0, seed=0, max_new_tokens=5, ignore_eos=False, stop_token_ids=(3,),
                        logit_bias=((4, 1.0),), grammar=grammar)
    assert SamplingParams.from_spec(spec) == SamplingParams(temperature=0.0, seed=0, max_new_tokens=5,
                                                            stop_token_ids=(3,), logit_bias=((4, 1.0),),
                                                            grammar=grammar)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams.from_spec(SamplingSpec(top_p=0.0))


def test_request_lengths_and_status() -> None:
    req = Request("r", [5, 6, 7], SamplingParams())
    assert req.status is RequestStatus.WAITING and not req.is_finished
    assert (req.prompt_len, req.seq_len) == (3, 3)
    req.output_ids.extend([1, 2])
    assert (req.prompt_len, req.seq_len) == (3, 5)
    req.status = RequestStatus.FINISHED
    assert req.is_finished


def test_requests_do_not_share_mutable_defaults() -> None:
    a = Request("a", [1], SamplingParams())
    b = Request("b", [1], SamplingParams())
    a.page_ids.append(3)
    a.output_ids.append(4)
    a.output_logprobs.append(-0.5)
    assert b.page_ids == [] and b.output_ids == [] and b.output_logprobs == []


def test_every_range_of_tandem_limits_is_checked_by_sampling_params() -> None:
    """The engine checks the gateway's table: each range names a field, and each refuses a value."""
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(SAMPLING_RANGES) <= fields
    for name, allowed in SAMPLING_RANGES.items():
        outside = allowed.low - 1 if allowed.low is not None else allowed.high + 1
        with pytest.raises(InvalidRequestError, match=f"^{name} "):
            SamplingParams(**{name: outside})
