"""Draft-token proposers for speculative decoding; no torch.

A proposer guesses the next few tokens of a request; the target model then checks every guess in
one forward pass (`kernels.rejection_sampling.verify`), so a good guess saves decode steps and a bad
one costs only the wasted rows. `NgramProposer` looks the guess up in the request's own text; the
draft-model proposer (`engine/draft_model.py`, torch) asks a smaller model of the same tokenizer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DraftAsk:
    """One decoding request's question to a proposer: the tokens that follow `token_ids` (its prompt
    then its output so far; only read), at most `max_tokens` of them."""

    request_id: str
    token_ids: list[int]
    max_tokens: int


class Proposer(ABC):
    """Guesses the tokens that follow requests' texts, a step's requests at once.

    A proposer that samples its drafts would have to give the verifier the probabilities it drew
    them from; these propose fixed guesses (a lookup, a draft model's argmax), which the verifier
    treats as drawn with probability one, so the output keeps the target distribution exactly."""

    @abstractmethod
    def propose(self, asks: Sequence[DraftAsk], catch_up_s: float | None = None) -> list[list[int]]:
        """The drafts for each ask, in order: at most its `max_tokens` (zero or less: none); [] where
        there is no guess. A proposer that builds state from the requests' prompts (a draft model's
        KV) spends at most about `catch_up_s` seconds on it this step (None: no pace to keep)."""

    def forget(self, request_id: str) -> None:
        """The request stopped decoding here (finished, aborted, preempted): a proposer that keeps
        state per request drops its."""
        return None

    @property
    def seconds_per_draft(self) -> float:
        """What proposing one draft token costs, measured (0: next to nothing, as a lookup)."""
        return 0.0

    @property
    def runs_model(self) -> bool:
        """Whether proposing runs a model (then the server schedules on the thread its steps compute on,
        with the threads they are tuned to)."""
        return False


@dataclass(frozen=True, slots=True)
class NgramProposer(Proposer):
    """Prompt lookup: the last n tokens are looked up earlier in the text, and the tokens that
    followed them there are the guess (vLLM's and SGLang's n-gram speculation).

    The longest n in [min_n, max_n] that matches wins; among the earlier occurrences of that
    n-gram, the most recent one (it may overlap the suffix itself, as in a run of one token). At
    most `num_draft_tokens` tokens are proposed, fewer when the text ends sooner after the match.
    """

    num_draft_tokens: int
    min_n: int = 1
    max_n: int = 4

    def __post_init__(self) -> None:
        if self.num_draft_tokens <= 0:
            raise ValueError(f"num_draft_tokens must be positive, got {self.num_draft_tokens}")
        if self.min_n <= 0:
            raise ValueError(f"min_n must be positive, got {self.min_n}")
        if self.max_n < self.min_n:
            raise ValueError(f"max_n ({self.max_n}) must be at least min_n ({self.min_n})")

    def propose(self, asks: Sequence[DraftAsk], catch_up_s: float | None = None) -> list[list[int]]:
        return [self.guess(ask.token_ids, ask.max_tokens) for ask in asks]

    def guess(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """The drafts to follow `token_ids`, at most `max_tokens` (and `num_draft_tokens`) of them."""
        num_wanted = min(self.num_draft_tokens, max_tokens)
        seq_len = len(token_ids)
        if num_wanted <= 0 or seq_len <= self.min_n:
            return []
        match_len, match_end = _longest_earlier_suffix(token_ids, min(self.max_n, seq_len - 1))
        if match_len < self.min_n:
            return []
        return list(token_ids[match_end + 1 : match_end + 1 + num_wanted])


def _longest_earlier_suffix(token_ids: Sequence[int], max_n: int) -> tuple[int, int]:
    """(n, end): the longest n <= max_n such that the last n tokens also end at index `end` <
    len - 1, with the largest such `end`; (0, -1) when the last token occurs nowhere earlier.

    Walks the earlier occurrences of the last token from the most recent back, found by
    `list.index` on the reversed text (C speed), and stops at the first one matching `max_n`.
    """
    backwards = list(reversed(token_ids))
    seq_len = len(backwards)
    best_len, best_at = 0, -1
    at = 0
    while best_len < max_n:
        try:
            at = backwards.index(backwards[0], at + 1)
        except ValueError:
            break
        length = 1
        while length < max_n and at + length < seq_len and backwards[at + length] == backwards[length]:
            length += 1
        if length > best_len:
            best_len, best_at = length, at
    return best_len, (seq_len - 1 - best_at if best_len else -1)
