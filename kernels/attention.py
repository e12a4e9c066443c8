"""Paged attention backends, chosen by name at start-up, over one CSR page table per step.

KV layout, per layer: `kv_cache[page, 0 | 1, offset, kv_head, head_dim]` (0 = K, 1 = V); the pool
tensor in `engine.kv_pool` is page-major so one page of every layer is one contiguous region, and
`pool[:, layer]` is the 5-D "NHD" cache FlashInfer reads.

The page table is FlashInfer's CSR form (all int32): sequence i's new tokens are rows
`qo_indptr[i]:qo_indptr[i+1]` of q; its pages are `kv_indices[kv_indptr[i]:kv_indptr[i+1]]`, the
last holding `kv_last_page_len[i]` tokens (1..page_size). Attention is causal: a sequence with
q_len new tokens and seq_len tokens in all has its new tokens at positions seq_len - q_len ... One
`AttentionMetadata` is built per step and shared by every layer.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """One forward pass's page table (CSR, int32) and where each new token's K/V is written.

    New token t (rows of q in sequence order) goes to page `write_pages[t]` at `write_offsets[t]`
    (int64). `query_lens` and `seq_lens` are the same facts as Python ints, for host-side loops.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    write_pages: torch.Tensor
    write_offsets: torch.Tensor
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]

    @classmethod
    def build(cls, page_ids: Sequence[Sequence[int]], query_lens: Sequence[int], seq_lens: Sequence[int],
              page_size: int) -> "AttentionMetadata":
        """From each sequence's pages (at least ceil(seq_len / page_size) of them, extra ones ignored),
        its number of new tokens and its total length."""
        num_pages = [-(-n // page_size) for n in seq_lens]
        indices: list[int] = []
        write_pages: list[int] = []
        write_offsets: list[int] = []
        for pages, q_len, seq_len, count in zip(page_ids, query_lens, seq_lens, num_pages):
            if not 0 < q_len <= seq_len or len(pages) < count:
                raise ValueError(f"bad sequence layout: {q_len} new of {seq_len} tokens in {len(pages)} pages")
            indices.extend(pages[:count])
            for pos in range(seq_len - q_len, seq_len):
                write_pages.append(pages[pos // page_size])
                write_offsets.append(pos % page_size)
        int32 = torch.int32
        return cls(
            qo_indptr=torch.tensor([0, *query_lens], dtype=int32).cumsum(0, dtype=int32),
            kv_indptr=torch.tensor([0, *num_pages], dtype=int32).cumsum(0, dtype=int32),
            kv_indices=torch.tensor(indices, dtype=int32),
            kv_last_page_len=torch.tensor([n - (c - 1) * page_size for n, c in zip(seq_lens, num_pages)], dtype=int32),
            write_pages=torch.tensor(write_pages, dtype=torch.int64),
            write_offsets=torch.tensor(write_offsets, dtype=torch.int64),
            query_lens=tuple(query_lens), seq_lens=tuple(seq_lens))

    @property
    def num_sequences(self) -> int:
        return len(self.query_lens)

    def pages_of(self, seq: int) -> torch.Tensor:
        """Sequence `seq`'s page ids in order (int64, for indexing)."""
        return self.kv_indices[self.kv_indptr[seq]:self.kv_indptr[seq + 1]].long()


class AttentionBackend(ABC):
    """Attends over each sequence's KV in the paged cache. The new tokens' K/V are written there
    first, with rotary, by `kernels.layers.RotaryEmbedding.apply_and_store`."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.scale = 1.0 / math.sqrt(head_dim)

    @abstractmethod
    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Causal attention of q [T, Hq, D] over the KV already in kv_cache [P, 2, S, Hkv, D];
        [T, Hq, D] in q's dtype."""


_BACKENDS: dict[str, Callable[..., AttentionBackend]] = {}


def register_attention_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    def wrap(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        _BACKENDS[name] = cls
        return cls
    return wrap


def resolve_attention_backend(name: str) -> str:
    """`auto` is the C++ CPU kernel where it builds, else torch; other names pass through."""
    if name != "auto":
        return name
    from kernels import native
    return "cpu" if native.is_available() else "torch"


def create_attention_backend(name: str, **kwargs: int) -> AttentionBackend:
    name = resolve_attention_backend(name)
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(['auto', *_BACKENDS])}")
    return _BACKENDS[name](**kwargs)


@register_attention_backend("torch")
class TorchAttention(AttentionBackend):
    """Reference implementation on torch SDPA, one sequence at a time: the oracle for the others."""

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        outputs = []
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens)):
            pages = meta.pages_of(i)
            qi = q[start:start + query_len].transpose(0, 1)    # [Hq, n, D]
            ki = kv_cache[pages, 0].reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len].transpose(0, 1)
            vi = kv_cache[pages, 1].reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len].transpose(0, 1)
            if seq_len == query_len:
                mask, is_causal = None, query_len > 1
            else:
                positions = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)
                mask, is_causal = torch.arange(seq_len).unsqueeze(0) <= positions, False
            out = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
            outputs.append(out.transpose(0, 1))
            start += query_len
        return torch.cat(outputs, dim=0)


@register_attention_backend("cpu")
class CpuPagedAttention(TorchAttention):
    """The C++ kernel (`kernels/csrc`): reads K/V in place through the page table, no padding, no
    masks, no copies; each row's result is independent of the rest of the batch. fp32 math over a
    float32 or bfloat16 pool; a float16 pool takes the torch path."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, page_size)
        from kernels import native
        self._kernels = native.load()

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if kv_cache.dtype not in (torch.float32, torch.bfloat16):
            return super().attend(q, kv_cache, meta)
        out = self._kernels.paged_attention(q.float().contiguous(), kv_cache, meta.qo_indptr, meta.kv_indptr,
                                            meta.kv_indices, meta.kv_last_page_len, self.scale)
        return out.to(q.dtype)
