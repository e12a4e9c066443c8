"""tandem.limits: the ranges' ends, NaN, and the words of their errors."""

from __future__ import annotations

import math

import pytest

from tandem.limits import MAX_TOP_LOGPROBS, SAMPLING_RANGES, TEMPERATURE, TOP_K, TOP_P, Range


def test_closed_and_open_ends() -> None:
    assert 0 in TEMPERATURE and 2 in TEMPERATURE and 2.01 not in TEMPERATURE and -0.1 not in TEMPERATURE
    assert 0 not in TOP_P and 1e-9 in TOP_P and 1 in TOP_P
    assert -1 in TOP_K and 10**9 in TOP_K and -2 not in TOP_K   # no upper end
    assert 2**63 - 1 in SAMPLING_RANGES["seed"] and 2**63 not in SAMPLING_RANGES["seed"]
    assert MAX_TOP_LOGPROBS in SAMPLING_RANGES["top_logprobs_num"]


@pytest.mark.parametrize("allowed", list(SAMPLING_RANGES.values()))
def test_nan_is_in_no_range(allowed: Range) -> None:
    assert math.nan not in allowed


def test_the_error_names_the_field_and_the_rule() -> None:
    assert TEMPERATURE.error("temperature", 3.0) == "temperature must be between 0 and 2, got 3.0"


def test_the_table_is_read_only() -> None:
    with pytest.raises(TypeError):
        SAMPLING_RANGES["temperature"] = TOP_P   # type: ignore[index]
