"""Tests for engine.proposers: n-gram prompt lookup (longest match first, most recent occurrence,
caps, no match) and its config checks."""

from __future__ import annotations

import random

import pytest

from engine.proposers import NgramProposer, Proposer


def test_proposes_the_tokens_that_followed_the_suffix() -> None:
    proposer = NgramProposer(num_draft_tokens=3)
    assert isinstance(proposer, Proposer)
    assert proposer.guess([5, 6, 7, 8, 9, 1, 5, 6], max_tokens=10) == [7, 8, 9]


def test_longest_n_gram_wins_over_a_more_recent_shorter_one() -> None:
    # [2, 3] ends at index 2 (followed by 10, 11); 3 alone last occurred at index 5 (followed by 20).
    token_ids = [1, 2, 3, 10, 11, 3, 20, 2, 3]
    assert NgramProposer(num_draft_tokens=2).guess(token_ids, 5) == [10, 11]
    assert NgramProposer(num_draft_tokens=2, max_n=1).guess(token_ids, 5) == [20, 2]


def test_the_most_recent_occurrence_of_the_longest_match_wins() -> None:
    token_ids = [7, 8, 1, 7, 8, 2, 7, 8, 3, 7, 8]
    assert NgramProposer(num_draft_tokens=1).guess(token_ids, 5) == [3]


def test_n_is_capped_at_max_n() -> None:
    # The whole suffix [1, 2, 3, 4] also occurs at the start, but max_n = 2 looks at [3, 4] only,
    # whose most recent earlier occurrence is followed by 9.
    token_ids = [1, 2, 3, 4, 5, 3, 4, 9, 1, 2, 3, 4]
    assert NgramProposer(num_draft_tokens=1, max_n=2).guess(token_ids, 5) == [9]
    assert NgramProposer(num_draft_tokens=1, max_n=4).guess(token_ids, 5) == [5]


def test_min_n_refuses_shorter_matches() -> None:
    token_ids = [4, 5, 6, 9, 6]  # only the single token 6 recurs
    assert NgramProposer(num_draft_tokens=2, min_n=1).guess(token_ids, 5) == [9, 6]
    assert NgramProposer(num_draft_tokens=2, min_n=2).guess(token_ids, 5) == []


@pytest.mark.parametrize(
    ("num_draft_tokens", "max_tokens", "expected"),
    [
        (3, 10, [2, 3, 4]),
        (10, 2, [2, 3]),
        (10, 10, [2, 3, 4, 5, 1]),
        (3, 0, []),
        (3, -1, []),
    ],
)
def test_proposal_is_capped_by_both_limits_and_the_text(
    num_draft_tokens: int, max_tokens: int, expected: list[int]
) -> None:
    token_ids = [1, 2, 3, 4, 5, 1]  # the earlier 1 is followed by five tokens
    assert NgramProposer(num_draft_tokens).guess(token_ids, max_tokens) == expected


def test_a_run_of_one_token_matches_itself_overlapping() -> None:
    assert NgramProposer(num_draft_tokens=3).guess([8, 8, 8, 8, 8], 5) == [8]
    # The most recent earlier [8, 8, 8, 8] ends one token before the text does.
    assert NgramProposer(num_draft_tokens=3).guess([1, 8, 8, 8, 8, 8, 8, 8], 5) == [8]
    assert NgramProposer(num_draft_tokens=3).guess([8, 8, 1, 8, 8], 5) == [1, 8, 8]


@pytest.mark.parametrize("token_ids", [[], [3], [1, 2, 3, 4], [1, 2, 3, 1, 2, 4]])
def test_no_match_proposes_nothing(token_ids: list[int]) -> None:
    assert NgramProposer(num_draft_tokens=4).guess(token_ids, 4) == []


def test_reads_any_sequence_and_leaves_it_alone() -> None:
    token_ids = (5, 6, 7, 5)
    assert NgramProposer(num_draft_tokens=2).guess(token_ids, 2) == [6, 7]
    listed = [5, 6, 7, 5]
    NgramProposer(num_draft_tokens=2).guess(listed, 2)
    assert listed == [5, 6, 7, 5]


def test_agrees_with_a_brute_force_search() -> None:
    """Every prefix of a text with many repeats, against the definition written out plainly."""
    rng = random.Random(0)
    text = [rng.randrange(6) for _ in range(300)]
    proposer = NgramProposer(num_draft_tokens=3, min_n=2, max_n=4)
    for end in range(1, len(text) + 1):
        prefix = text[:end]
        assert proposer.guess(prefix, 3) == _brute_force(prefix, 3, 2, 4), end


def _brute_force(token_ids: list[int], num: int, min_n: int, max_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n >= len(token_ids):
            continue
        suffix = token_ids[-n:]
        for start in range(len(token_ids) - n - 1, -1, -1):
            if token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + num]
    return []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_draft_tokens=0), "num_draft_tokens must be positive"),
        (dict(num_draft_tokens=2, min_n=0), "min_n must be positive"),
        (dict(num_draft_tokens=2, min_n=3, max_n=2), "must be at least min_n"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NgramProposer(**kwargs)
