"""Tests for kernels.attention: the CSR page table, and both backends (torch SDPA, the C++ kernel)
against dense causal attention computed directly, on a cache whose page ids are shuffled; the C++
kernel's sliding window against the torch oracle's; the backend registry per device, and the
metadata's move to a device."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from kernels.attention import (
    AttentionMetadata,
    CpuPagedAttention,
    TorchAttention,
    create_attention_backend,
    resolve_attention_backend,
    torch_paged_attention,
)

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

    def keys_of(self, seq: int, length: int, which: int) -> torch.Tensor:
        """[length, Hkv, D] read straight from the cache, token by token."""
        return torch.stack([self.cache[self.pages[seq][p // PAGE_SIZE], which, p % PAGE_SIZE]
                            for p in range(length)])


BACKENDS = ["torch", "cpu"]


def _backend(name: str):
    return create_attention_backend(name, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                                    page_size=PAGE_SIZE)


def _write_and_attend(backend_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
    """What a layer does: the new K/V into their slots (as the rotary's store does), then attention."""
    cache[meta.write_pages, 0, meta.write_offsets] = k
    cache[meta.write_pages, 1, meta.write_offsets] = v
    return _backend(backend_name).attend(q, cache, meta)


def _meta(setup: _Setup, prefix_lens: list[int], query_lens: list[int]) -> AttentionMetadata:
    return AttentionMetadata.build(setup.pages, query_lens, [p + n for p, n in zip(prefix_lens, query_lens)],
                                   PAGE_SIZE)


def test_csr_metadata_encodes_the_page_tables() -> None:
    pages = [[7, 3, 9], [4], [11, 2, 5, 8]]
    seq_lens, query_lens = [9, 4, 16], [9, 1, 3]
    meta = AttentionMetadata.build(pages, query_lens, seq_lens, PAGE_SIZE)
    assert all(t.dtype == torch.int32 for t in (meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                                                meta.kv_last_page_len))
    assert meta.qo_indptr.tolist() == [0, 9, 10, 13]
    assert meta.kv_indptr.tolist() == [0, 3, 4, 8]
    assert meta.kv_indices.tolist() == [7, 3, 9, 4, 11, 2, 5, 8]
    assert meta.kv_last_page_len.tolist() == [1, 4, 4]     # 9 = 4 + 4 + 1; 16 = 4 * 4
    for seq in range(3):   # decoding the CSR form gives back each sequence's pages and length
        n = int(meta.kv_indptr[seq + 1] - meta.kv_indptr[seq])
        assert meta.pages_of(seq).tolist() == pages[seq][:n]
        assert (n - 1) * PAGE_SIZE + int(meta.kv_last_page_len[seq]) == seq_lens[seq]
    # each new token is written at its position: the last query_len positions of its sequence
    slots = list(zip(meta.write_pages.tolist(), meta.write_offsets.tolist()))
    expected = [(pages[s][p // PAGE_SIZE], p % PAGE_SIZE) for s in range(3)
                for p in range(seq_lens[s] - query_lens[s], seq_lens[s])]
    assert slots == expected
    with pytest.raises(ValueError, match="bad sequence layout"):
        AttentionMetadata.build([[1]], [1], [5], PAGE_SIZE)   # 5 tokens do not fit one 4-token page


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("prefix_lens", [[0, 0], [6, 0], [5, 3], [4, 8]],
                         ids=["fresh", "one-prefix", "two-prefixes", "page-aligned-prefixes"])
def test_prefill_matches_dense_causal_attention(backend_name: str, prefix_lens: list[int]) -> None:
    query_lens = [7, 10]
    setup = _Setup(seed=sum(prefix_lens), capacities=[p + n for p, n in zip(prefix_lens, query_lens)])
    num_tokens = sum(query_lens)
    q = setup.randn(num_tokens, NUM_HEADS, HEAD_DIM)
    k = setup.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    v = setup.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    meta = _meta(setup, prefix_lens, query_lens)
    untouched = setup.cache.clone()
    out = _write_and_attend(backend_name, q, k, v, setup.cache, meta)
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


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_decode_batch_of_mixed_lengths_matches_dense_attention(backend_name: str) -> None:
    seq_lens = [6, 13, 1, 8]  # each including the token being decoded; 8 fills its last page exactly
    setup = _Setup(seed=7, capacities=seq_lens)
    batch = len(seq_lens)
    q = setup.randn(batch, NUM_HEADS, HEAD_DIM)
    k = setup.randn(batch, NUM_KV_HEADS, HEAD_DIM)
    v = setup.randn(batch, NUM_KV_HEADS, HEAD_DIM)
    meta = _meta(setup, [n - 1 for n in seq_lens], [1] * batch)
    out = _write_and_attend(backend_name, q, k, v, setup.cache, meta)
    assert out.shape == (batch, NUM_HEADS, HEAD_DIM)
    for i, n in enumerate(seq_lens):
        full_k, full_v = setup.keys_of(i, n, 0), setup.keys_of(i, n, 1)
        torch.testing.assert_close(full_k[-1], k[i])
        torch.testing.assert_close(full_v[-1], v[i])
        expected = _dense_attention(q[i:i + 1], full_k, full_v, first_pos=n - 1)
        torch.testing.assert_close(out[i:i + 1].double(), expected, atol=1e-5, rtol=1e-5)


def test_cpu_kernel_rows_do_not_depend_on_the_rest_of_the_batch() -> None:
    """Bitwise: a sequence attended alone gives exactly what it gives inside a mixed batch, and a
    prompt computed in one pass gives what it gives in two chunks (the second over the cached first)."""
    prefix_lens, query_lens = [0, 5, 12, 3], [9, 1, 1, 6]
    setup = _Setup(seed=3, capacities=[p + n for p, n in zip(prefix_lens, query_lens)])
    q = setup.randn(sum(query_lens), NUM_HEADS, HEAD_DIM)
    backend = _backend("cpu")
    together = backend.attend(q, setup.cache, _meta(setup, prefix_lens, query_lens))
    start = 0
    for seq, (prefix, n) in enumerate(zip(prefix_lens, query_lens)):
        alone = AttentionMetadata.build([setup.pages[seq]], [n], [prefix + n], PAGE_SIZE)
        assert torch.equal(backend.attend(q[start:start + n], setup.cache, alone), together[start:start + n])
        start += n
    first, second = (AttentionMetadata.build([setup.pages[0]], [n], [end], PAGE_SIZE) for n, end in ((5, 5), (4, 9)))
    chunked = torch.cat([backend.attend(q[:5], setup.cache, first), backend.attend(q[5:9], setup.cache, second)])
    assert torch.equal(chunked, together[:9])


def test_cpu_kernel_reads_a_bfloat16_pool_within_bf16_rounding() -> None:
    setup = _Setup(seed=11, capacities=[14, 5])
    cache = setup.cache.to(torch.bfloat16)
    q = setup.randn(2, NUM_HEADS, HEAD_DIM)
    meta = _meta(setup, [13, 4], [1, 1])
    reference = _backend("torch").attend(q, cache.float(), meta)
    torch.testing.assert_close(_backend("cpu").attend(q, cache, meta), reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_vectorized_path_matches_the_torch_oracle(dtype: torch.dtype) -> None:
    """SmolLM2's geometry (9 query heads on 3 KV heads of 64): the kernel's register-blocked path, on a
    strided layer view of a page-major pool, mixing fresh prompts, cached prefixes and decodes."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, size = 9, 3, 64, 16
    pool = torch.randn(40, 4, 2, size, kv_heads, dim, generator=gen).to(dtype)
    layer = pool[:, 2]
    order = torch.randperm(40, generator=gen).tolist()
    seq_lens, query_lens = [37, 16, 1, 300 // 16 + 40, 17], [37, 5, 1, 1, 17]
    pages = []
    for n in seq_lens:
        count = -(-n // size)
        pages.append(order[:count])
        order = order[count:]
    meta = AttentionMetadata.build(pages, query_lens, seq_lens, size)
    q = torch.randn(sum(query_lens), heads, dim, generator=gen).to(dtype)
    make = lambda name: create_attention_backend(name, num_heads=heads, num_kv_heads=kv_heads,   # noqa: E731
                                                 head_dim=dim, page_size=size)
    expected = make("torch").attend(q.float(), layer.float(), meta)
    torch.testing.assert_close(make("cpu").attend(q.float(), layer, meta), expected, atol=2e-5, rtol=1e-4)


def test_cpu_kernel_returns_q_dtype_and_reads_strided_rows() -> None:
    """A bfloat16 model's q comes back bfloat16; q rows that are views of a fused q/k/v projection
    (strided rows, contiguous heads) are read in place and give what a contiguous copy gives."""
    setup = _Setup(seed=13, capacities=[6, 9])
    meta = _meta(setup, [5, 8], [1, 1])
    qkv = setup.randn(2, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM)
    q = qkv[:, : NUM_HEADS * HEAD_DIM].view(2, NUM_HEADS, HEAD_DIM)
    backend = _backend("cpu")
    assert torch.equal(backend.attend(q, setup.cache, meta), backend.attend(q.contiguous(), setup.cache, meta))
    out = backend.attend(q.bfloat16(), setup.cache.bfloat16(), meta)
    assert out.dtype == torch.bfloat16


def test_cpu_backend_serves_a_float16_pool_through_the_torch_path() -> None:
    setup = _Setup(seed=12, capacities=[9, 3])
    cache = setup.cache.half()
    q = setup.randn(2, NUM_HEADS, HEAD_DIM).half()
    meta = _meta(setup, [8, 2], [1, 1])
    torch.testing.assert_close(_backend("cpu").attend(q, cache, meta), _backend("torch").attend(q, cache, meta))


def test_backend_registry() -> None:
    backend = create_attention_backend("torch", num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                                       head_dim=HEAD_DIM, page_size=PAGE_SIZE)
    assert isinstance(backend, TorchAttention)
    assert (backend.num_heads, backend.num_kv_heads, backend.head_dim, backend.page_size) == (4, 2, 8, 4)
    assert isinstance(_backend("auto"), CpuPagedAttention)   # the kernels build on every CI machine
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_attention_backend("no-such-backend", num_heads=4, num_kv_heads=2, head_dim=8, page_size=4)


@pytest.mark.parametrize(("device", "dtype", "installed", "expected"), [
    ("cuda", torch.bfloat16, True, "flashinfer"),
    ("cuda:1", torch.float16, True, "flashinfer"),
    ("cuda", None, True, "flashinfer"),
    ("cuda", torch.float32, True, "torch"),       # FlashInfer has no fp32 attention
    ("cuda", torch.bfloat16, False, "torch"),
    ("cpu", torch.bfloat16, True, "cpu"),         # the C++ kernel builds on every CI machine
    ("meta", torch.float32, True, "torch"),
])
def test_auto_resolves_per_device(device: str, dtype: torch.dtype | None, installed: bool, expected: str,
                                  flashinfer_installed: Callable[[bool], None]) -> None:
    flashinfer_installed(installed)
    assert resolve_attention_backend("auto", device, dtype) == expected
    assert resolve_attention_backend("auto", torch.device(device), dtype) == expected


def test_explicit_names_pass_through_where_they_can_run() -> None:
    assert resolve_attention_backend("torch", "cuda") == "torch"
    assert resolve_attention_backend("cpu", "cpu") == "cpu"
    assert resolve_attention_backend("flashinfer", "cuda:0") == "flashinfer"


@pytest.mark.parametrize(("name", "device", "message"), [
    ("cpu", "cuda", "runs on CPU only"),
    ("cpu", "meta", "runs on CPU only"),
    ("flashinfer", "cpu", "needs a CUDA device"),
    ("no-such-backend", "cuda", "unknown attention backend"),
])
def test_names_that_cannot_run_on_the_device_are_refused(name: str, device: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_attention_backend(name, device)
    with pytest.raises(ValueError, match=message):
        create_attention_backend(name, num_heads=4, num_kv_heads=2, head_dim=8, page_size=4, device=device)


def test_the_backend_gets_the_models_dtype_and_device_and_plans_nothing_by_default() -> None:
    backend = create_attention_backend("torch", num_heads=4, num_kv_heads=2, head_dim=8, page_size=4,
                                       dtype=torch.bfloat16, device="meta")
    assert backend.dtype == torch.bfloat16 and backend.device == torch.device("meta")
    setup = _Setup(seed=13, capacities=[5])
    assert backend.plan(_meta(setup, [0], [5])) is None


def test_metadata_moves_to_a_device_with_its_lengths_as_ints() -> None:
    setup = _Setup(seed=14, capacities=[11, 6])
    meta = _meta(setup, [9, 3], [2, 3])
    assert meta.to("cpu") is meta
    moved = meta.to(torch.device("meta"))
    tensors = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "write_pages", "write_offsets")
    for name in tensors:
        assert getattr(moved, name).device.type == "meta"
        assert getattr(moved, name).dtype == getattr(meta, name).dtype
        assert getattr(moved, name).shape == getattr(meta, name).shape
    assert moved.query_lens == (2, 3) and moved.seq_lens == (11, 6)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "size"), [
    (4, 4, 16, 4),      # no GQA, the narrowest vector head, pages shorter than a key tile
    (8, 2, 128, 32),    # GQA 4, two 64-float output chunks, pages longer than a tile
    (16, 2, 32, 16),    # GQA 8: two groups of four query heads per value load
    (5, 1, 256, 8),     # GQA 5 (4 + 1), the widest vector head
], ids=["mha-d16-p4", "gqa4-d128-p32", "gqa8-d32-p16", "gqa5-d256-p8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_vector_path_across_geometries(heads: int, kv_heads: int, dim: int, size: int,
                                                  dtype: torch.dtype) -> None:
    """Every shape the vector path splits differently, against the torch oracle; and bitwise, each
    sequence alone gives what it gives in the batch (items then cover one kv head, not all)."""
    gen = torch.Generator().manual_seed(heads * dim + size)
    pool = torch.randn(64, 2, size, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(64, generator=gen).tolist()
    seq_lens, query_lens = [size * 3, 1, 2 * size + 5, 33, 70], [size * 3, 1, 1, 9, 1]
    pages = []
    for n in seq_lens:
        count = -(-n // size)
        pages.append(order[:count])
        order = order[count:]
    q = torch.randn(sum(query_lens), heads, dim, generator=gen)
    make = lambda name: create_attention_backend(name, num_heads=heads, num_kv_heads=kv_heads,   # noqa: E731
                                                 head_dim=dim, page_size=size)
    cpu = make("cpu")
    meta = AttentionMetadata.build(pages, query_lens, seq_lens, size)
    together = cpu.attend(q, pool, meta)
    torch.testing.assert_close(together, make("torch").attend(q, pool.float(), meta), atol=2e-5, rtol=1e-4)
    start = 0
    for seq, (n, length) in enumerate(zip(query_lens, seq_lens)):
        alone = AttentionMetadata.build([pages[seq]], [n], [length], size)
        assert torch.equal(cpu.attend(q[start:start + n], pool, alone), together[start:start + n])
        start += n


def test_cpu_kernel_bits_do_not_depend_on_the_number_of_threads() -> None:
    """Threads split (sequence, rows, kv heads) work items: 1, 2 and 3 threads give the same bits."""
    gen = torch.Generator().manual_seed(8)
    pool = torch.randn(40, 2, 16, 3, 64, generator=gen).to(torch.bfloat16)
    pages = [list(range(0, 10)), list(range(10, 14)), list(range(14, 40))]
    meta = AttentionMetadata.build(pages, [20, 1, 1], [150, 60, 400], 16)
    q = torch.randn(22, 9, 64, generator=gen)
    backend = create_attention_backend("cpu", num_heads=9, num_kv_heads=3, head_dim=64, page_size=16)
    threads = torch.get_num_threads()
    try:
        outputs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outputs.append(backend.attend(q, pool, meta))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outputs[0]) for out in outputs[1:])


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "size"), [
    (4, 2, 8, 4),       # the scalar path (head_dim below a vector), GQA 2
    (8, 2, 32, 16),     # GQA 4 on the vector path, pages longer than a key tile
    (9, 3, 64, 4),      # GQA 3, pages shorter than a tile: a window starts mid-page and mid-tile
], ids=["scalar-d8-p4", "gqa4-d32-p16", "gqa3-d64-p4"])
@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_sliding_window_matches_the_torch_oracle(heads: int, kv_heads: int, dim: int, size: int,
                                                            window: int, dtype: torch.dtype) -> None:
    """A sliding window of several widths against `torch_paged_attention`'s, over sequences shorter and
    longer than it: fresh prompts, a chunked prefill's second chunk over its cached first, decodes;
    and bitwise, each sequence alone gives what it gives in the batch."""
    gen = torch.Generator().manual_seed(heads * dim + size + window)
    pool = torch.randn(80, 2, size, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(80, generator=gen).tolist()
    seq_lens, query_lens = [30, 3, 50, 41, 12, 7], [30, 3, 1, 9, 1, 2]
    pages = []
    for n in seq_lens:
        count = -(-n // size)
        pages.append(order[:count])
        order = order[count:]
    q = torch.randn(sum(query_lens), heads, dim, generator=gen)
    meta = AttentionMetadata.build(pages, query_lens, seq_lens, size)
    cpu = create_attention_backend("cpu", num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, page_size=size)
    together = cpu.attend(q, pool, meta, window=window)
    expected = torch_paged_attention(q, pool, meta, size, cpu.scale, window)
    torch.testing.assert_close(together, expected, atol=2e-5, rtol=1e-4)
    start = 0
    for seq, (n, length) in enumerate(zip(query_lens, seq_lens)):
        alone = AttentionMetadata.build([pages[seq]], [n], [length], size)
        assert torch.equal(cpu.attend(q[start:start + n], pool, alone, window=window), together[start:start + n])
        start += n


def test_cpu_kernel_window_reads_no_page_before_it() -> None:
    """Pages wholly before every row's window are never read: NaN there changes nothing; a window that
    covers every key gives the bits of no window; and a scale passed in is the scale used."""
    gen = torch.Generator().manual_seed(21)
    pool = torch.randn(12, 2, 4, 2, 16, generator=gen)
    pages = [[7, 2, 9, 0, 5, 11]]  # 23 tokens
    meta = AttentionMetadata.build(pages, [2], [23], 4)
    q = torch.randn(2, 4, 16, generator=gen)
    cpu = create_attention_backend("cpu", num_heads=4, num_kv_heads=2, head_dim=16, page_size=4)
    clean = cpu.attend(q, pool, meta, window=6)  # rows at 21, 22 see 16..21 and 17..22: pages 4 and 5
    poisoned = pool.clone()
    poisoned[[7, 2, 9, 0]] = float("nan")
    assert torch.equal(cpu.attend(q, poisoned, meta, window=6), clean)
    assert torch.equal(cpu.attend(q, pool, meta, window=23), cpu.attend(q, pool, meta))
    torch.testing.assert_close(cpu.attend(q, pool, meta, window=6, scale=0.3),
                               torch_paged_attention(q, pool, meta, 4, 0.3, 6), atol=2e-5, rtol=1e-4)


def test_cpu_backend_windows_a_float16_pool_through_the_torch_path() -> None:
    setup = _Setup(seed=14, capacities=[13, 3])
    cache, q = setup.cache.half(), setup.randn(2, NUM_HEADS, HEAD_DIM).half()
    meta = _meta(setup, [12, 2], [1, 1])
    expected = torch_paged_attention(q, cache, meta, PAGE_SIZE, 0.5, 5)
    torch.testing.assert_close(_backend("cpu").attend(q, cache, meta, window=5, scale=0.5), expected)
