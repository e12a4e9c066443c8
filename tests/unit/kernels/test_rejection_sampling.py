"""Tests for kernels.rejection_sampling: greedy verification equals step-by-step greedy decoding,
sampled verification keeps the target distribution (chi-square goodness of fit, with one-hot and
dense draft distributions, with and without temperature and top-k), seeded draws depend only on
(seed, position), and raw-logit logprobs."""

from __future__ import annotations

import random

import pytest
import torch

from engine.proposers import NgramProposer
from kernels.rejection_sampling import Verified, expand_to_rows, target_probs, verify
from kernels.sampling import SamplingBatch, sample

# Critical values of chi-square at p = 1e-3 by degrees of freedom (scipy.stats.chi2.isf(1e-3, dof)).
CHI2_P1E3 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def _batch(
    num: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    is_greedy: bool | list[bool] = False,
    seeds: tuple[int | None, ...] | None = None,
    steps: tuple[int, ...] | None = None,
) -> SamplingBatch:
    greedy = is_greedy if isinstance(is_greedy, list) else [is_greedy] * num
    return SamplingBatch(
        temperatures=torch.full((num,), temperature),
        top_ps=torch.full((num,), top_p),
        top_ks=torch.full((num,), top_k, dtype=torch.int64),
        min_ps=torch.full((num,), min_p),
        is_greedy=torch.tensor(greedy, dtype=torch.bool),
        seeds=seeds if seeds is not None else (None,) * num,
        steps=steps if steps is not None else (0,) * num,
    )


def _greedy_reference(logits: torch.Tensor, drafts: list[list[int]]) -> list[list[int]]:
    """What greedy decoding emits, request by request: the argmax of each row while it equals the
    draft fed after it, then the argmax where it first differs (or after the last draft)."""
    emitted, row = [], 0
    for request_drafts in drafts:
        tokens = []
        for j in range(len(request_drafts) + 1):
            best = int(logits[row + j].argmax())
            tokens.append(best)
            if j == len(request_drafts) or request_drafts[j] != best:
                break
        emitted.append(tokens)
        row += len(request_drafts) + 1
    return emitted


def _random_greedy_case(num_requests: int, vocab: int, seed: int) -> tuple[torch.Tensor, list[list[int]]]:
    """Random logits and drafts that follow the argmax chain for a random number of tokens, then
    (sometimes) go wrong: all-accepted, first-rejected and draft-free requests among them."""
    rng = random.Random(seed)
    num_drafts = [rng.randrange(5) for _ in range(num_requests)]
    logits = 3.0 * torch.randn(sum(num_drafts) + num_requests, vocab, generator=torch.Generator().manual_seed(seed))
    argmax = logits.argmax(dim=-1).tolist()
    drafts, row = [], 0
    for k in num_drafts:
        request_drafts = argmax[row : row + k]
        if k and rng.random() < 0.6:
            wrong_at = rng.randrange(k)
            request_drafts[wrong_at] = (request_drafts[wrong_at] + 1 + rng.randrange(vocab - 1)) % vocab
        drafts.append(request_drafts)
        row += k + 1
    return logits, drafts


@pytest.mark.parametrize("mode", ["greedy", "greedy with draft probs", "top_k=1 sampled"])
def test_greedy_verification_emits_what_greedy_decoding_would(mode: str) -> None:
    logits, drafts = _random_greedy_case(60, 50, seed=1)
    num_drafts = sum(len(d) for d in drafts)
    draft_probs = torch.softmax(torch.randn(num_drafts, 50), dim=-1) if mode != "greedy" else None
    batch = _batch(60, top_k=1, seeds=tuple(range(60))) if mode == "top_k=1 sampled" else _batch(60, is_greedy=True)
    result = verify(logits, drafts, draft_probs, batch)
    expected = _greedy_reference(logits, drafts)
    assert result.token_ids == expected
    accepted = result.num_accepted
    assert any(n == len(d) > 0 for n, d in zip(accepted, drafts)), "some request takes its bonus token"
    assert any(n == 0 < len(d) for n, d in zip(accepted, drafts)), "some request has its first draft rejected"
    assert any(len(d) == 0 for d in drafts)
    for first, tokens, logprobs in zip(first_rows(drafts), result.token_ids, result.logprobs):
        raw = torch.log_softmax(logits[first : first + len(tokens)], dim=-1)
        assert logprobs == pytest.approx([float(raw[j, t]) for j, t in enumerate(tokens)])


def first_rows(drafts: list[list[int]]) -> list[int]:
    firsts, at = [], 0
    for request_drafts in drafts:
        firsts.append(at)
        at += len(request_drafts) + 1
    return firsts


def _tiny_model(vocab: int = 12) -> torch.Tensor:
    """Next-token logits [V, V, V] of a random model that looks at the last two tokens."""
    return 4.0 * torch.randn(vocab, vocab, vocab, generator=torch.Generator().manual_seed(7))


def test_greedy_output_is_identical_with_speculation_on_and_off() -> None:
    table = _tiny_model()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    num_new = 60

    plain = list(prompt)
    while len(plain) < len(prompt) + num_new:
        plain.append(int(table[plain[-2], plain[-1]].argmax()))

    proposer = NgramProposer(num_draft_tokens=4, max_n=3)
    speculative, num_steps = list(prompt), 0
    while len(speculative) < len(prompt) + num_new:
        remaining = len(prompt) + num_new - len(speculative)
        drafts = proposer.guess(speculative, remaining - 1)
        fed = speculative + drafts
        rows = torch.stack([table[fed[i - 2], fed[i - 1]] for i in range(len(speculative), len(fed) + 1)])
        result = verify(rows, [drafts], None, _batch(1, is_greedy=True))
        speculative.extend(result.token_ids[0])
        num_steps += 1
    assert speculative == plain
    assert num_steps < num_new, "n-gram drafts were accepted on this repetitive output"


def test_a_request_without_drafts_draws_the_token_sample_draws() -> None:
    logits = 2.0 * torch.randn(16, 40, generator=torch.Generator().manual_seed(2))
    batch = _batch(16, temperature=0.8, top_p=0.9, seeds=tuple(range(16)), steps=tuple(range(3, 19)))
    result = verify(logits, [[]] * 16, None, batch)
    token_ids, logprobs = sample(logits, batch)
    assert result.num_accepted == [0] * 16
    assert [t[0] for t in result.token_ids] == token_ids.tolist()
    assert [lp[0] for lp in result.logprobs] == pytest.approx(logprobs.tolist())


def test_seeded_verification_depends_only_on_seed_and_position() -> None:
    # Nearly flat rows: drafts are accepted about half the time and every draw matters.
    mine = torch.randn(4, 200, generator=torch.Generator().manual_seed(3)) * 0.1
    my_drafts = [int(mine[j].argsort()[100]) for j in range(3)]
    alone = verify(mine, [my_drafts], None, _batch(1, seeds=(42,), steps=(9,)))
    others = torch.randn(2 + 1 + 3, 200, generator=torch.Generator().manual_seed(4))
    crowded_logits = torch.cat([others[:3], mine, others[3:]])
    crowded = verify(crowded_logits, [[5, 6], my_drafts, [7, 8]], None, _batch(3, seeds=(1, 42, None), steps=(0, 9, 0)))
    assert crowded.token_ids[1] == alone.token_ids[0]
    assert verify(mine, [my_drafts], None, _batch(1, seeds=(42,), steps=(9,))).token_ids == alone.token_ids

    outcomes = {
        tuple(verify(mine, [my_drafts], None, _batch(1, seeds=(42,), steps=(step,))).token_ids[0]) for step in range(20)
    }
    assert len(outcomes) > 5, "other positions draw other numbers"


def test_expand_to_rows_repeats_settings_and_counts_positions() -> None:
    batch = _batch(3, seeds=(1, None, 3), steps=(10, 20, 30))
    batch = SamplingBatch(
        torch.tensor([0.5, 1.0, 2.0]),
        batch.top_ps,
        batch.top_ks,
        batch.min_ps,
        batch.is_greedy,
        batch.seeds,
        batch.steps,
    )
    rows = expand_to_rows(batch, [2, 0, 1])
    assert rows.temperatures.tolist() == [0.5, 0.5, 0.5, 1.0, 2.0, 2.0]
    assert rows.seeds == (1, 1, 1, None, 3, 3)
    assert rows.steps == (10, 11, 12, 20, 30, 31)


def test_target_probs_is_the_truncated_tempered_softmax() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(4, -1).contiguous()
    batch = _batch(4, top_p=0.7)
    batch = SamplingBatch(
        batch.temperatures,
        torch.tensor([0.7, 1.0, 1.0, 1.0]),
        batch.top_ks,
        torch.tensor([0.0, 0.4, 0.0, 0.0]),
        torch.tensor([False, False, False, True]),
        batch.seeds,
        batch.steps,
    )
    probs = target_probs(logits, batch)
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))  # top-p keeps 2
    torch.testing.assert_close(probs[1], torch.tensor([0.625, 0.375, 0.0, 0.0]))  # min-p keeps p >= 0.2
    torch.testing.assert_close(probs[2], torch.tensor([0.5, 0.3, 0.15, 0.05]))
    torch.testing.assert_close(probs[3], torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_shapes_that_do_not_agree_are_refused() -> None:
    logits = torch.zeros(4, 10)
    with pytest.raises(ValueError, match="logits must be"):
        verify(logits, [[1, 2]], None, _batch(1))
    with pytest.raises(ValueError, match="requests"):
        verify(logits, [[1], [2]], None, _batch(1))
    with pytest.raises(ValueError, match="draft_probs must be"):
        verify(logits, [[1], [2]], torch.zeros(3, 10), _batch(2))


# The chi-square tests: every request shares three target rows (V = 8) and feeds two drafts.
VOCAB = 8
NUM_REQUESTS = 20000
TARGET_LOGITS = 1.5 * torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(11))
DRAFT_LOGITS = 1.5 * torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(12))


def _expected_probs(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The target distribution, computed here without the module's code."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_k:
        kept = torch.zeros_like(probs).scatter_(-1, probs.topk(top_k, dim=-1).indices, 1.0)
        probs = probs * kept / (probs * kept).sum(dim=-1, keepdim=True)
    return probs


def _assert_fits(tokens: list[int], probs: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token the target excludes was emitted"
    expected = probs[support] * counts.sum()
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    assert statistic < CHI2_P1E3[int(support.sum()) - 1], (counts.tolist(), expected.tolist())


def _draws_from(probs: torch.Tensor, num: int, seed: int) -> list[int]:
    return torch.multinomial(probs, num, replacement=True, generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("draft_kind", ["one-hot (n-gram)", "dense (draft model)"])
@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.7, 5)])
def test_emitted_tokens_follow_the_target_distribution(draft_kind: str, temperature: float, top_k: int) -> None:
    target = _expected_probs(TARGET_LOGITS, temperature, top_k)
    if draft_kind.startswith("one-hot"):
        # The second most likely token, then the third: both rejected and accepted often.
        drafts = [[int(target[0].argsort()[-2]), int(target[1].argsort()[-3])]] * NUM_REQUESTS
        draft_probs = None
    else:
        q = torch.softmax(DRAFT_LOGITS, dim=-1)
        drafts = [list(pair) for pair in zip(_draws_from(q[0], NUM_REQUESTS, 1), _draws_from(q[1], NUM_REQUESTS, 2))]
        draft_probs = q.repeat(NUM_REQUESTS, 1)
    logits = TARGET_LOGITS.repeat(NUM_REQUESTS, 1)
    seeds = tuple(i if i % 2 else None for i in range(NUM_REQUESTS))  # half seeded, half not
    batch = _batch(NUM_REQUESTS, temperature=temperature, top_k=top_k, seeds=seeds)

    result = verify(logits, drafts, draft_probs, batch)

    emitted = result.token_ids
    _assert_fits([tokens[0] for tokens in emitted], target[0])
    second = [tokens[1] for tokens in emitted if len(tokens) > 1]
    third = [tokens[2] for tokens in emitted if len(tokens) > 2]
    assert len(second) > 2000 and len(third) > 100, "enough accepted drafts to test the later rows"
    # Row 1's draws are independent of row 0's, so given an accepted first draft the second token
    # follows row 1's target; likewise the bonus token follows row 2's.
    _assert_fits(second, target[1])
    _assert_fits(third, target[2])


def test_a_draft_the_target_excludes_is_never_accepted() -> None:
    logits = TARGET_LOGITS[:2].repeat(500, 1)
    least_likely = int(TARGET_LOGITS[0].argmin())
    result = verify(logits, [[least_likely]] * 500, None, _batch(500, top_k=2, seeds=tuple(range(500))))
    assert result.num_accepted == [0] * 500
    assert least_likely not in {tokens[0] for tokens in result.token_ids}


def test_verified_counts_accepted_drafts() -> None:
    assert Verified([[1, 2, 3], [4]], [[0.0] * 3, [0.0]]).num_accepted == [2, 0]


@pytest.mark.gpu
def test_seeded_verification_gives_the_same_tokens_on_cuda_as_on_cpu() -> None:
    logits = 0.3 * torch.randn(3 + 1 + 4, 300, generator=torch.Generator().manual_seed(13))
    drafts = [[int(logits[j].argsort()[-2]) for j in range(2)], [], [int(logits[4 + j].argmax()) for j in range(3)]]
    batch = _batch(3, temperature=0.9, top_p=0.95, seeds=(1, 2, 3), steps=(0, 5, 7))
    draft_probs = torch.softmax(torch.randn(5, 300, generator=torch.Generator().manual_seed(14)), dim=-1)
    on_cuda = SamplingBatch(
        *(t.cuda() for t in (batch.temperatures, batch.top_ps, batch.top_ks, batch.min_ps, batch.is_greedy)),
        batch.seeds,
        batch.steps,
    )
    for probs in (None, draft_probs):
        expected = verify(logits, drafts, probs, batch)
        got = verify(logits.cuda(), drafts, None if probs is None else probs.cuda(), on_cuda)
        assert got.token_ids == expected.token_ids
        assert len(got.logprobs) == len(expected.logprobs)
        for got_row, expected_row in zip(got.logprobs, expected.logprobs):
            assert got_row == pytest.approx(expected_row, abs=1e-5)
