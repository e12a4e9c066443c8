"""FlashInfer's attention and sampler on CUDA against their torch oracles: attention (prefill, decode,
cached prefixes, mixed lengths, page boundaries, GQA) in bf16 within tolerance; greedy sampling
exactly; sampled distributions by chi-square on a small vocabulary; seeded draws by (seed, step).

Needs CUDA and flashinfer (`.venv/bin/pip install -e '.[gpu]'`, and nvcc: FlashInfer compiles its
kernels on first use); skipped without CUDA. With the CPU checks of the same API:
`.venv/bin/python -m pytest tests/gpu tests/unit/kernels/test_flashinfer_api.py`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)   # before importing CUDA libraries at all
pytest.importorskip("flashinfer", reason="pip install -e '.[gpu]' installs FlashInfer")

from kernels.attention import AttentionMetadata, TorchAttention  # noqa: E402
from kernels.flashinfer_attention import FlashInferAttention  # noqa: E402
from kernels.flashinfer_sampling import FlashInferSampler  # noqa: E402
from kernels.sampling import SamplingBatch, TorchSampler  # noqa: E402

DEVICE = torch.device("cuda")
NUM_LAYERS = 3
UNUSED = 100.0   # K/V of pages and slots no sequence owns: reading them would show


# ---------------------------------------------------------------- attention


class _Pool:
    """A bf16 pool `[P, layers, 2, S, Hkv, D]` on the GPU, sequences on shuffled pages; unowned pages
    and slots past each sequence's end hold UNUSED."""

    def __init__(self, seq_lens: list[int], page_size: int, num_kv_heads: int, head_dim: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        counts = [-(-n // page_size) for n in seq_lens]
        num_pages = sum(counts) + 7
        order = torch.randperm(num_pages, generator=gen).tolist()
        self.pages = []
        for count in counts:
            self.pages.append(order[:count])
            order = order[count:]
        pool = torch.randn(num_pages, NUM_LAYERS, 2, page_size, num_kv_heads, head_dim, generator=gen)
        pool[order] = UNUSED
        for pages, n in zip(self.pages, seq_lens):
            pool[pages[-1], :, :, n - (len(pages) - 1) * page_size:] = UNUSED
        self.tensor = pool.to(DEVICE, torch.bfloat16)


def _backends(num_heads: int, num_kv_heads: int, head_dim: int,
              page_size: int) -> tuple[FlashInferAttention, TorchAttention]:
    shapes = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size)
    return (FlashInferAttention(**shapes, dtype=torch.bfloat16, device=DEVICE),
            TorchAttention(**shapes, dtype=torch.float32, device=DEVICE))


def _check_step(flash: FlashInferAttention, oracle: TorchAttention, pool: _Pool, query_lens: list[int],
                seq_lens: list[int], seed: int) -> None:
    """Plan once, attend in every layer; each layer against torch in fp32 over the same bf16 K/V."""
    meta_host = AttentionMetadata.build(pool.pages, query_lens, seq_lens, flash.page_size, pin=True)
    meta = meta_host.to(DEVICE)
    flash.plan(meta_host)
    gen = torch.Generator().manual_seed(seed)
    for layer in range(NUM_LAYERS):
        q = torch.randn(sum(query_lens), flash.num_heads, flash.head_dim, generator=gen).to(DEVICE, torch.bfloat16)
        kv_cache = pool.tensor[:, layer]
        out = flash.attend(q, kv_cache, meta)
        expected = oracle.attend(q.float(), kv_cache.float(), meta)
        assert out.shape == q.shape and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


STEPS = {
    "prefill": ([37], [37]),
    "prefill_mixed_lengths": ([1, 17, 64, 5], [1, 17, 64, 5]),
    "cached_prefixes": ([5, 16, 1, 40], [21, 48, 100, 40]),
    "decode": ([1] * 6, [1, 15, 16, 17, 200, 33]),
    "decode_page_boundaries": ([1] * 4, [16, 32, 48, 64]),
    "prefill_page_boundaries": ([16, 32, 15], [32, 64, 17]),
}
# (query heads, KV heads, head_dim): decode on CUDA cores below a GQA ratio of 4, on tensor cores from it
HEADS = {"mha": (8, 8, 128), "smollm2_gqa3": (9, 3, 64), "gqa4": (8, 2, 128), "gqa8": (32, 4, 128)}


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("step", STEPS.values(), ids=STEPS.keys())
@pytest.mark.parametrize("page_size", [16, 1])
def test_attention_matches_torch(step: tuple[list[int], list[int]], heads: tuple[int, int, int],
                                 page_size: int) -> None:
    query_lens, seq_lens = step
    num_heads, num_kv_heads, head_dim = heads
    flash, oracle = _backends(num_heads, num_kv_heads, head_dim, page_size)
    pool = _Pool(seq_lens, page_size, num_kv_heads, head_dim, seed=len(seq_lens))
    _check_step(flash, oracle, pool, query_lens, seq_lens, seed=0)


def test_one_backend_plans_step_after_step() -> None:
    """Prefill, then decode steps on the same backend (the plan switches wrappers and is redone)."""
    flash, oracle = _backends(32, 4, 128, 16)
    pool = _Pool([40, 18], 16, 4, 128, seed=3)
    _check_step(flash, oracle, pool, [30, 9], [30, 9], seed=1)
    for n in range(31, 41):
        _check_step(flash, oracle, pool, [1, 1], [n, 9], seed=n)
    _check_step(flash, oracle, pool, [1, 9], [40, 18], seed=2)


def test_attend_checks_the_plan() -> None:
    flash, _ = _backends(8, 2, 128, 16)
    pool = _Pool([5], 16, 2, 128, seed=4)
    meta_host = AttentionMetadata.build(pool.pages, [5], [5], 16, pin=True)
    q = torch.zeros(5, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="before plan"):
        flash.attend(q, pool.tensor[:, 0], meta_host.to(DEVICE))
    flash.plan(meta_host)
    with pytest.raises(ValueError, match="plan is for 5 tokens"):
        flash.attend(q[:4], pool.tensor[:, 0], meta_host.to(DEVICE))


# ---------------------------------------------------------------- sampling


def _batch(num_rows: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
           is_greedy: bool = False, seeds: tuple[int | None, ...] | None = None,
           steps: tuple[int, ...] | None = None) -> SamplingBatch:
    return SamplingBatch(
        temperatures=torch.full((num_rows,), temperature, device=DEVICE),
        top_ps=torch.full((num_rows,), top_p, device=DEVICE),
        top_ks=torch.full((num_rows,), top_k, dtype=torch.int64, device=DEVICE),
        min_ps=torch.full((num_rows,), min_p, device=DEVICE),
        is_greedy=torch.full((num_rows,), is_greedy, dtype=torch.bool, device=DEVICE),
        seeds=seeds if seeds is not None else (None,) * num_rows,
        steps=steps if steps is not None else (0,) * num_rows)


def _stack(rows: list[SamplingBatch]) -> SamplingBatch:
    return SamplingBatch(*(torch.cat([getattr(r, f) for r in rows]) for f in
                           ("temperatures", "top_ps", "top_ks", "min_ps", "is_greedy")),
                         seeds=sum((r.seeds for r in rows), ()), steps=sum((r.steps for r in rows), ()))


def test_greedy_matches_torch_exactly() -> None:
    logits = 4.0 * torch.randn(64, 32000, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    batch = _batch(64, temperature=0.0, is_greedy=True)
    ids, logprobs = FlashInferSampler(DEVICE).sample(logits, batch)
    expected_ids, expected_logprobs = TorchSampler(DEVICE).sample(logits, batch)
    assert ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(logprobs, expected_logprobs)


def test_per_row_settings_in_one_batch() -> None:
    """Rows whose settings leave only the top token, beside free rows and greedy rows."""
    logits = 2.0 * torch.randn(1, 500, generator=torch.Generator().manual_seed(1)).to(DEVICE).expand(6, -1)
    batch = _stack([_batch(1, temperature=2.0, top_k=1), _batch(1, temperature=2.0),
                    _batch(1, temperature=2.0, top_p=1e-6), _batch(1, temperature=0.0, is_greedy=True),
                    _batch(1, temperature=2.0, min_p=1.0, seeds=(5,)), _batch(1, temperature=2.0, seeds=(6,))])
    top = int(logits[0].argmax())
    for _ in range(20):
        ids, logprobs = FlashInferSampler(DEVICE).sample(logits.contiguous(), batch)
        assert [int(ids[i]) for i in (0, 2, 3, 4)] == [top] * 4
        torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, ids.unsqueeze(1)).squeeze(1))


def _truncated_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                     min_p: float) -> torch.Tensor:
    """The distribution the torch sampler draws one row from, written out plainly (float64, CPU)."""
    probs = torch.softmax(logits.double().cpu() / temperature, dim=-1)
    order = probs.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(float(probs[i]) for i in kept)
    before, survivors = 0.0, []
    for i in kept:
        p = float(probs[i]) / mass
        if before <= top_p and p >= min_p * float(probs[kept[0]]) / mass:
            survivors.append(i)
        before += p
    out = torch.zeros_like(probs)
    out[survivors] = probs[survivors]
    return out / out.sum()


# Critical values of chi-square at p = 1e-4 by degrees of freedom (draws are seeded, so no flakes).
CHI2_P1E4 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}
LOGITS_8 = torch.tensor([2.0, 1.1, 0.7, 0.3, -0.2, -0.9, -1.5, -2.4])
NUM_DRAWS = 20000
SETTINGS = {
    "plain": {}, "cold": {"temperature": 0.5}, "hot": {"temperature": 1.7}, "top_k": {"top_k": 3},
    "top_p": {"top_p": 0.8}, "top_k_top_p": {"top_k": 4, "top_p": 0.85}, "min_p": {"min_p": 0.15},
    "everything": {"temperature": 1.3, "top_k": 5, "top_p": 0.9, "min_p": 0.1},
}


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
@pytest.mark.parametrize("sampler", [FlashInferSampler, TorchSampler], ids=["flashinfer", "torch"])
def test_sampled_distribution_matches(settings: dict, sampler: type) -> None:
    """FlashInfer and (as a check of the reference) torch, each against the truncated softmax."""
    full = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, **settings}
    torch.manual_seed(1234)
    logits = LOGITS_8.to(DEVICE).expand(NUM_DRAWS, -1).contiguous()
    ids, _ = sampler(DEVICE).sample(logits, _batch(NUM_DRAWS, **full))
    counts = torch.bincount(ids.cpu(), minlength=8).double()
    expected = _truncated_probs(LOGITS_8, **full)
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew outside the truncated support: {counts.tolist()}"
    expected_counts = expected[support] * NUM_DRAWS
    chi2 = float(((counts[support] - expected_counts) ** 2 / expected_counts).sum())
    dof = int(support.sum()) - 1
    if dof:
        assert chi2 < CHI2_P1E4[dof], f"chi2 {chi2:.1f} with {dof} dof; counts {counts.tolist()}"


def test_seeded_draws_depend_only_on_seed_and_step() -> None:
    flat = torch.zeros(4, 5000, device=DEVICE)   # uniform: independent draws almost surely differ
    sampler = FlashInferSampler(DEVICE)
    a, _ = sampler.sample(flat[:1].contiguous(), _batch(1, seeds=(42,), steps=(3,)))
    b, _ = sampler.sample(flat, _batch(4, seeds=(7, 8, 42, None), steps=(0, 0, 3, 0)))
    assert int(a[0]) == int(b[2])
    by_step, _ = sampler.sample(torch.zeros(8, 5000, device=DEVICE), _batch(8, seeds=(42,) * 8, steps=tuple(range(8))))
    again, _ = sampler.sample(torch.zeros(8, 5000, device=DEVICE), _batch(8, seeds=(42,) * 8, steps=tuple(range(8))))
    assert torch.equal(by_step, again) and len(set(by_step.tolist())) >= 7


def test_unseeded_draws_vary() -> None:
    ids, _ = FlashInferSampler(DEVICE).sample(torch.zeros(16, 5000, device=DEVICE), _batch(16))
    assert len(set(ids.tolist())) > 1


# ---------------------------------------------------------------- verification of drafts


def _assert_follows(counts: torch.Tensor, expected: torch.Tensor) -> None:
    """Chi-square of `counts` (per token) against the distribution `expected`, at p = 1e-4."""
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew outside the support: {counts.tolist()}"
    expected_counts = expected[support] * counts.sum()
    chi2 = float(((counts[support] - expected_counts) ** 2 / expected_counts).sum())
    dof = int(support.sum()) - 1
    if dof:
        assert chi2 < CHI2_P1E4[dof], f"chi2 {chi2:.1f} with {dof} dof; counts {counts.tolist()}"


@pytest.mark.parametrize("settings", [SETTINGS["plain"], SETTINGS["everything"]], ids=["plain", "everything"])
def test_chain_verification_keeps_the_target_distribution(settings: dict) -> None:
    """`FlashInferSampler.verify` (FlashInfer's chain speculative sampling) on NUM_DRAWS requests with the
    same three target rows and the same two n-gram drafts: the first token emitted follows p_0 whether
    the draft was accepted or not, the first draft is accepted with probability p_0(d_0), and the token
    after an accepted draft follows p_1."""
    full = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, **settings}
    torch.manual_seed(4321)
    rows = torch.stack([LOGITS_8, LOGITS_8.flip(0), LOGITS_8.roll(3)])
    p = [_truncated_probs(row, **full) for row in rows]
    drafts = [int(p[0].argsort()[-2]), int(p[1].argmax())]   # d_0 the second likeliest: accepted at times
    logits = rows.to(DEVICE).repeat(NUM_DRAWS, 1)
    got = FlashInferSampler(DEVICE).verify(logits, [drafts] * NUM_DRAWS, None, _batch(NUM_DRAWS, **full))
    assert all(1 <= len(tokens) <= 3 for tokens in got.token_ids)
    _assert_follows(torch.bincount(torch.tensor([t[0] for t in got.token_ids]), minlength=8).double(), p[0])
    accepted = [tokens for tokens in got.token_ids if len(tokens) >= 2]
    rate, expected_rate = len(accepted) / NUM_DRAWS, float(p[0][drafts[0]])
    assert abs(rate - expected_rate) < 5 * (expected_rate * (1 - expected_rate) / NUM_DRAWS) ** 0.5
    _assert_follows(torch.bincount(torch.tensor([t[1] for t in accepted]), minlength=8).double(), p[1])
    logprobs = torch.log_softmax(rows, dim=-1)
    assert got.logprobs[0] == pytest.approx([float(logprobs[j, t]) for j, t in enumerate(got.token_ids[0])], abs=1e-5)
