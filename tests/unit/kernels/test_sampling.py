"""Tests for kernels.sampling: greedy, truncation (top-k, top-p, min-p), the sampled distribution,
raw-logit logprobs, seeded reproducibility, and the sampler registry."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels.sampling import (
    SamplingBatch,
    TorchSampler,
    create_sampler,
    draw_index,
    resolve_sampler,
    sample,
    truncated,
)


def _batch(num_rows: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
           is_greedy: bool = False, seeds: tuple[int | None, ...] | None = None,
           steps: tuple[int, ...] | None = None) -> SamplingBatch:
    return SamplingBatch(
        temperatures=torch.full((num_rows,), temperature),
        top_ps=torch.full((num_rows,), top_p),
        top_ks=torch.full((num_rows,), top_k, dtype=torch.int64),
        min_ps=torch.full((num_rows,), min_p),
        is_greedy=torch.full((num_rows,), is_greedy, dtype=torch.bool),
        seeds=seeds if seeds is not None else (None,) * num_rows,
        steps=steps if steps is not None else (0,) * num_rows,
    )


def _random_logits(num_rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return 3.0 * torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed))


def _counts(token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(token_ids, minlength=vocab).double()


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# Critical value of chi-square with 4 degrees of freedom at p = 1e-4 (draws below are seeded anyway).
CHI2_4DOF_P1E4 = 23.51


def test_greedy_picks_argmax_with_raw_logprobs() -> None:
    logits = _random_logits(6, 50)
    token_ids, logprobs = sample(logits, _batch(6, temperature=0.0, is_greedy=True))
    assert token_ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(token_ids, logits.argmax(dim=-1))
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).max(dim=-1).values)


def test_sampled_logprobs_are_log_softmax_of_raw_logits() -> None:
    """Not of the tempered or truncated distribution."""
    logits = _random_logits(64, 30, seed=1)
    batch = _batch(64, temperature=0.5, top_k=5, top_p=0.8, seeds=tuple(range(64)))
    token_ids, logprobs = sample(logits, batch)
    expected = torch.log_softmax(logits, dim=-1).gather(1, token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(logprobs, expected)
    assert len(set(token_ids.tolist())) > 1  # really sampled, not argmax everywhere


@pytest.mark.parametrize("truncation", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_extreme_truncation_leaves_only_the_top_token(truncation: dict) -> None:
    logits = _random_logits(200, 40, seed=2)
    batch = _batch(200, temperature=2.0, seeds=tuple(range(200)), **truncation)
    token_ids, _ = sample(logits, batch)
    assert torch.equal(token_ids, logits.argmax(dim=-1))


def test_greedy_rows_stay_greedy_in_a_mixed_batch() -> None:
    logits = _random_logits(1, 1000, seed=3).expand(40, -1) * 0.01  # nearly flat: sampling wanders
    is_greedy = torch.tensor([i % 2 == 0 for i in range(40)])
    batch = _batch(40, seeds=tuple(range(40)))
    batch = SamplingBatch(batch.temperatures, batch.top_ps, batch.top_ks, batch.min_ps, is_greedy,
                          batch.seeds, batch.steps)
    token_ids, _ = sample(logits.contiguous(), batch)
    top = int(logits[0].argmax())
    assert (token_ids[is_greedy] == top).all()
    assert (token_ids[~is_greedy] != top).any()


def _draws(logits_row: torch.Tensor, num_draws: int, **settings) -> torch.Tensor:
    logits = logits_row.unsqueeze(0).expand(num_draws, -1).contiguous()
    token_ids, _ = sample(logits, _batch(num_draws, seeds=tuple(range(num_draws)), **settings))
    return token_ids


NUM_DRAWS = 20000
LOGITS_5 = torch.tensor([1.5, 0.2, -0.3, 0.9, -1.2])


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_empirical_distribution_matches_softmax(temperature: float) -> None:
    counts = _counts(_draws(LOGITS_5, NUM_DRAWS, temperature=temperature), 5)
    probs = torch.softmax(LOGITS_5 / temperature, dim=-1)
    assert _chi_square(counts, probs) < CHI2_4DOF_P1E4


def test_top_k_renormalises_over_the_k_best() -> None:
    counts = _counts(_draws(LOGITS_5, NUM_DRAWS, top_k=2), 5)
    assert counts[[1, 2, 4]].sum() == 0
    probs = torch.softmax(LOGITS_5, -1) * torch.tensor([1.0, 0, 0, 1.0, 0])
    assert _chi_square(counts, probs / probs.sum()) < 10.83  # 1 dof, p = 1e-3


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    counts = _counts(_draws(logits, NUM_DRAWS, top_p=0.7), 4)  # 0.5 < 0.7 <= 0.8: keep 2 tokens
    assert counts[2:].sum() == 0
    assert abs(float(counts[0] / counts.sum()) - 0.625) < 0.02


def test_min_p_drops_tokens_below_a_fraction_of_the_top() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    counts = _counts(_draws(logits, NUM_DRAWS, min_p=0.4), 4)  # keep p >= 0.2
    assert counts[2:].sum() == 0 and counts[1] > 0
    assert abs(float(counts[0] / counts.sum()) - 0.625) < 0.02


def _sorted_reference(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V]: each row's distribution after temperature, top-k, top-p and min-p, computed the plain way
    (the whole vocabulary sorted), as the oracle of `truncated`, which sorts none of it."""
    scaled = logits / batch.temperatures.clamp(min=1e-5).unsqueeze(1)
    values, ids = scaled.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    top_ks = torch.where(batch.top_ks > 0, batch.top_ks, vocab).unsqueeze(1)
    probs = values.masked_fill(torch.arange(vocab).unsqueeze(0) >= top_ks, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before > batch.top_ps.unsqueeze(1)) | (probs < batch.min_ps.unsqueeze(1) * probs[:, :1])
    drop[:, 0] = False
    kept = probs.masked_fill(drop, 0.0)
    return torch.zeros_like(kept).scatter_(1, ids, kept / kept.sum(dim=-1, keepdim=True))


def _rows(*settings: dict) -> SamplingBatch:
    """One row per dict of `_batch`'s settings."""
    rows = [_batch(1, **row) for row in settings]
    return SamplingBatch(*(torch.cat([getattr(r, f) for r in rows]) for f in ("temperatures", "top_ps", "top_ks",
                                                                               "min_ps", "is_greedy")),
                         seeds=tuple(r.seeds[0] for r in rows), steps=tuple(r.steps[0] for r in rows))


_SETTINGS = ({"top_p": 0.9}, {"top_p": 0.5}, {"top_k": 300}, {"top_k": 5, "top_p": 0.8},
             {"min_p": 0.05}, {"temperature": 0.7, "top_p": 0.95, "min_p": 0.01}, {})


def test_truncation_without_a_sort_equals_the_sorted_distribution() -> None:
    """A flat row needs thousands of candidates to reach its top-p (the first 64 do not settle it); a top-k
    above 64; min-p; a row with none of them (the whole vocabulary, in token order) in the same batch; a
    masked token (-inf)."""
    vocab = 20000
    logits = _random_logits(7, vocab, seed=3)
    logits[:, 7] = float("-inf")
    logits[1] *= 0.05  # nearly flat
    batch = _rows(*_SETTINGS)
    reference = _sorted_reference(logits, batch)
    candidates = truncated(logits, batch)
    assert torch.allclose(candidates.spread(candidates.normalised(), vocab), reference, atol=1e-6)
    for row in range(7):  # alone, where no row forces the whole vocabulary
        alone = truncated(logits[row:row + 1], _rows(_SETTINGS[row]))
        alone = alone.spread(alone.normalised(), vocab)
        assert torch.allclose(alone, reference[row:row + 1], atol=1e-6), row
    assert int((reference[1] > 0).sum()) > 1000  # the flat row did need more than the first candidates


def test_a_draw_never_lands_on_a_token_of_weight_zero() -> None:
    weights = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0, 0.0], [1e-30, 0.0, 0.0, 0.0, 0.0, 0.0]])
    for u in (0.0, 0.2, 0.25, 0.5, 1.0 - 2**-24, 1.0):
        picked = draw_index(weights, torch.full((2,), u)).flatten().tolist()
        assert weights[0, picked[0]] > 0 and picked[1] == 0, (u, picked)


def test_a_seeded_row_draws_the_same_token_whatever_the_rest_of_its_batch() -> None:
    """Its candidates are listed in an order that depends on the row alone: alone, its top-p row lists
    its best tokens; beside a row that keeps the whole vocabulary, the same tokens padded with zeros."""
    logits = _random_logits(2, 3000, seed=5) * 0.3
    for step in range(20):
        alone, _ = sample(logits[:1], _batch(1, top_p=0.9, seeds=(11,), steps=(step,)))
        mixed, _ = sample(logits, _rows({"top_p": 0.9, "seeds": (11,), "steps": (step,)}, {"seeds": (12,)}))
        assert int(alone[0]) == int(mixed[0]), step


def test_same_seed_and_step_give_the_same_draw() -> None:
    flat = torch.zeros(1, 5000)  # uniform: any two independent draws almost surely differ
    a, _ = sample(flat, _batch(1, seeds=(42,), steps=(3,)))
    # The same (seed, step) in another position of another batch.
    b, _ = sample(flat.expand(4, -1).contiguous(), _batch(4, seeds=(7, 8, 42, None), steps=(0, 0, 3, 0)))
    assert int(a[0]) == int(b[2])


def test_step_and_seed_select_different_streams() -> None:
    flat = torch.zeros(8, 5000)
    by_step, _ = sample(flat, _batch(8, seeds=(42,) * 8, steps=tuple(range(8))))
    by_seed, _ = sample(flat, _batch(8, seeds=tuple(range(8)), steps=(0,) * 8))
    assert len(set(by_step.tolist())) >= 7
    assert len(set(by_seed.tolist())) >= 7
    again, _ = sample(flat, _batch(8, seeds=(42,) * 8, steps=tuple(range(8))))
    assert torch.equal(by_step, again)


def test_unseeded_rows_vary() -> None:
    flat = torch.zeros(16, 5000)
    token_ids, _ = sample(flat, _batch(16))
    assert len(set(token_ids.tolist())) > 1


@pytest.mark.parametrize(("device", "installed", "expected"), [
    ("cuda", True, "flashinfer"), ("cuda:2", True, "flashinfer"), ("cuda", False, "torch"),
    ("cpu", True, "torch"), ("meta", True, "torch"),
])
def test_auto_sampler_per_device(device: str, installed: bool, expected: str,
                                 flashinfer_installed: Callable[[bool], None]) -> None:
    flashinfer_installed(installed)
    assert resolve_sampler("auto", device) == expected


@pytest.mark.parametrize(("name", "device", "message"), [
    ("flashinfer", "cpu", "needs a CUDA device"),
    ("no-such-sampler", "cpu", "unknown sampling backend"),
    ("no-such-sampler", "cuda", "unknown sampling backend"),
])
def test_samplers_that_cannot_run_are_refused(name: str, device: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_sampler(name, device)
    with pytest.raises(ValueError, match=message):
        create_sampler(name, device)


def test_the_torch_sampler_is_sample_on_its_device() -> None:
    sampler = create_sampler("auto", "cpu")
    assert isinstance(sampler, TorchSampler) and sampler.device == torch.device("cpu")
    assert resolve_sampler("torch", "cuda") == "torch"
    logits = _random_logits(8, 40, seed=9)
    batch = _batch(8, temperature=0.7, top_k=10, seeds=tuple(range(8)))
    token_ids, logprobs = sampler.sample(logits, batch)
    expected_ids, expected_logprobs = sample(logits, batch)
    assert torch.equal(token_ids, expected_ids) and torch.equal(logprobs, expected_logprobs)


@pytest.mark.gpu
def test_seeded_torch_sampling_draws_the_same_tokens_on_cuda_as_on_cpu() -> None:
    logits = _random_logits(16, 300, seed=10)
    batch = _batch(16, temperature=0.9, top_p=0.95, seeds=tuple(range(16)), steps=tuple(range(16)))
    on_cuda = SamplingBatch(*(t.cuda() for t in (batch.temperatures, batch.top_ps, batch.top_ks, batch.min_ps,
                                                 batch.is_greedy)), batch.seeds, batch.steps)
    token_ids, logprobs = create_sampler("torch", "cuda").sample(logits.cuda(), on_cuda)
    expected_ids, expected_logprobs = sample(logits, batch)
    assert token_ids.device.type == "cuda"
    assert torch.equal(token_ids.cpu(), expected_ids)
    torch.testing.assert_close(logprobs.cpu(), expected_logprobs)
