"""Tests for kernels.attention: the torch paged backend against dense causal attention computed
directly, on a cache whose page ids are shuffled."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.attention import AttentionMetadata, TorchAttention, create_attention_backend

PAGE_SIZE = 4
NUM_PAGES = 16
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int) -> torch.Tensor:
    """q: [n, Hq, D] at positions first_pos.., k/v: [L, Hkv, D] at 0..L-1 -> [n, Hq, D], in float64."""
    group = NUM_HEADS // NUM_KV_HEADS
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(NUM_HEADS):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        for i in range(q.shape[0]):
            visible = first_pos + i + 1
            scores = kh[:visible] @ q[i, h].double() / math.sqrt(HEAD_DIM)
            out[i, h] = torch.softmax(scores, dim=0) @ vh[:visible]
    return out


class _Setup:
    """A random paged cache and per-sequence page lists drawn from a shuffled page order."""

    def __init__(self, seed: int, capacities: list[int]) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.cache = torch.randn(NUM_PAGES, 2, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=self.gen)
        order = torch.randperm(NUM_PAGES, generator=self.gen).tolist()
        self.pages: list[list[int]] = []
        for capacity in capacities:
            count = -(-capacity // PAGE_SIZE)
            self.pages.append(order[:count])
            order = order[count:]

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen)

    def page_table(self) -> torch.Tensor:
        width = max(len(p) for p in self.pages)
        return torch.tensor([p + [0] * (width - len(p)) for p in self.pages], dtype=torch.int64)

    def write_slots(self, seq: int, positions: range) -> tuple[list[int], list[int]]:
        return ([self.pages[seq][p // PAGE_SIZE] for p in positions], [p % PAGE_SIZE for p in positions])

    def keys_of(self, seq: int, length: int, which: int) -> torch.Tensor:
        """[length, Hkv, D] read straight from the cache, token by token."""
        return torch.stack([self.cache[self.pages[seq][p // PAGE_SIZE], which, p % PAGE_SIZE]
                            for p in range(length)])


def _prefill_meta(setup: _Setup, prefix_lens: list[int], query_lens: list[int]) -> AttentionMetadata:
    write_pages, write_offsets = [], []
    for seq, (prefix, n) in enumerate(zip(prefix_lens, query_lens)):
        pages, offsets = setup.write_slots(seq, range(prefix, prefix + n))
        write_pages += pages
        write_offsets += offsets
    return AttentionMetadata(
        query_lens=tuple(query_lens), seq_lens=tuple(p + n for p, n in zip(prefix_lens, query_lens)),
        page_table=setup.page_table(), write_pages=torch.tensor(write_pages),
        write_offsets=torch.tensor(write_offsets), is_decode=False)


@pytest.mark.parametrize("prefix_lens", [[0, 0], [6, 0], [5, 3]], ids=["fresh", "one-prefix", "two-prefixes"])
def test_prefill_matches_dense_causal_attention(prefix_lens: list[int]) -> None:
    query_lens = [7, 10]
    setup = _Setup(seed=sum(prefix_lens), capacities=[p + n for p, n in zip(prefix_lens, query_lens)])
    num_tokens = sum(query_lens)
    q = setup.randn(num_tokens, NUM_HEADS, HEAD_DIM)
    k = setup.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    v = setup.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    meta = _prefill_meta(setup, prefix_lens, query_lens)
    untouched = setup.cache.clone()
    out = TorchAttention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE).forward(q, k, v, setup.cache, meta)
    assert out.shape == (num_tokens, NUM_HEADS, HEAD_DIM)

    start = 0
    for seq, (prefix, n) in enumerate(zip(prefix_lens, query_lens)):
        rows = slice(start, start + n)
        # The new tokens' K/V landed in the pages at their positions.
        torch.testing.assert_close(setup.keys_of(seq, prefix + n, 0)[prefix:], k[rows])
        torch.testing.assert_close(setup.keys_of(seq, prefix + n, 1)[prefix:], v[rows])
        full_k = setup.keys_of(seq, prefix + n, 0)
        full_v = setup.keys_of(seq, prefix + n, 1)
        expected = _dense_attention(q[rows], full_k, full_v, first_pos=prefix)
        torch.testing.assert_close(out[rows].double(), expected, atol=1e-5, rtol=1e-5)
        start += n
    # Nothing outside the written slots changed.
    written = torch.zeros(NUM_PAGES, PAGE_SIZE, dtype=torch.bool)
    written[meta.write_pages, meta.write_offsets] = True
    cache_by_slot = setup.cache.transpose(1, 2)  # [P, S, 2, Hkv, D]
    assert torch.equal(cache_by_slot[~written], untouched.transpose(1, 2)[~written])


def test_decode_batch_matches_dense_attention() -> None:
    seq_lens = [6, 13, 1]  # each including the token being decoded
    setup = _Setup(seed=7, capacities=seq_lens)
    batch = len(seq_lens)
    q = setup.randn(batch, NUM_HEADS, HEAD_DIM)
    k = setup.randn(batch, NUM_KV_HEADS, HEAD_DIM)
    v = setup.randn(batch, NUM_KV_HEADS, HEAD_DIM)
    page_table = setup.page_table()
    longest = max(seq_lens)
    slots = torch.arange(longest)
    slot_pages = (slots // PAGE_SIZE).clamp(max=page_table.shape[1] - 1)
    write = [setup.write_slots(i, range(n - 1, n)) for i, n in enumerate(seq_lens)]
    meta = AttentionMetadata(
        query_lens=(1,) * batch, seq_lens=tuple(seq_lens), page_table=page_table,
        write_pages=torch.tensor([w[0][0] for w in write]), write_offsets=torch.tensor([w[1][0] for w in write]),
        is_decode=True,
        gather_pages=page_table[:, slot_pages], gather_offsets=(slots % PAGE_SIZE).expand(batch, -1),
        key_mask=(slots.unsqueeze(0) < torch.tensor(seq_lens).unsqueeze(1))[:, None, None, :])
    out = TorchAttention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE).forward(q, k, v, setup.cache, meta)
    assert out.shape == (batch, NUM_HEADS, HEAD_DIM)
    for i, n in enumerate(seq_lens):
        full_k, full_v = setup.keys_of(i, n, 0), setup.keys_of(i, n, 1)
        torch.testing.assert_close(full_k[-1], k[i])
        torch.testing.assert_close(full_v[-1], v[i])
        expected = _dense_attention(q[i:i + 1], full_k, full_v, first_pos=n - 1)
        torch.testing.assert_close(out[i:i + 1].double(), expected, atol=1e-5, rtol=1e-5)


def test_backend_registry() -> None:
    backend = create_attention_backend("torch", num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                                       head_dim=HEAD_DIM, page_size=PAGE_SIZE)
    assert isinstance(backend, TorchAttention)
    assert (backend.num_heads, backend.num_kv_heads, backend.head_dim, backend.page_size) == (4, 2, 8, 4)
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_attention_backend("no-such-backend", num_heads=4, num_kv_heads=2, head_dim=8, page_size=4)
