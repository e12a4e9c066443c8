"""Paged attention backends, chosen by name at start-up.

KV layout, per layer: `kv_cache[page, 0 | 1, offset, kv_head, head_dim]` (0 = K, 1 = V); the pool
tensor in `engine.kv_pool` is page-major so one page of every layer is one contiguous region.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Layout of one forward pass. New tokens of all sequences are concatenated in order.

    `page_table[i, j]` is the j-th page of sequence i (rows padded with 0); `seq_lens[i]` counts
    the sequence's tokens including the new ones; new token t is written to page
    `write_pages[t]` at offset `write_offsets[t]`. For decode batches (every query_len is 1),
    `gather_pages`/`gather_offsets` [B, L] locate each sequence's keys (padded to the longest, L)
    and `key_mask` [B, 1, 1, L] marks the real ones.
    """

    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    page_table: torch.Tensor
    write_pages: torch.Tensor
    write_offsets: torch.Tensor
    is_decode: bool
    gather_pages: torch.Tensor | None = None
    gather_offsets: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None


class AttentionBackend(ABC):
    """Writes the new tokens' K/V into the paged cache, then attends over each sequence's KV."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: [P, 2, S, Hkv, D] (mutated). Returns [T, Hq, D]."""


_BACKENDS: dict[str, Callable[..., AttentionBackend]] = {}


def register_attention_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    def wrap(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        _BACKENDS[name] = cls
        return cls
    return wrap


def create_attention_backend(name: str, **kwargs: int) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}")
    return _BACKENDS[name](**kwargs)


@register_attention_backend("torch")
class TorchAttention(AttentionBackend):
    """Reference implementation on torch SDPA; the CPU path and the oracle for GPU backends."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        kv_cache[meta.write_pages, 0, meta.write_offsets] = k
        kv_cache[meta.write_pages, 1, meta.write_offsets] = v
        if meta.is_decode:
            return self._decode(q, kv_cache, meta)
        return self._prefill(q, k, v, kv_cache, meta)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        keys = kv_cache[meta.gather_pages, 0, meta.gather_offsets].transpose(1, 2)   # [B, Hkv, L, D]
        values = kv_cache[meta.gather_pages, 1, meta.gather_offsets].transpose(1, 2)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=meta.key_mask,
                                             enable_gqa=True)
        return out.squeeze(2)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        outputs = []
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens)):
            qi = q[start:start + query_len].transpose(0, 1)    # [Hq, n, D]
            if seq_len == query_len:
                ki = k[start:start + query_len].transpose(0, 1)
                vi = v[start:start + query_len].transpose(0, 1)
                mask, is_causal = None, True
            else:
                num_pages = -(-seq_len // self.page_size)
                pages = meta.page_table[i, :num_pages]
                ki = kv_cache[pages, 0].reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len].transpose(0, 1)
                vi = kv_cache[pages, 1].reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len].transpose(0, 1)
                positions = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)
                mask, is_causal = torch.arange(seq_len).unsqueeze(0) <= positions, False
            out = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=is_causal,
                                                 enable_gqa=True)
            outputs.append(out.transpose(0, 1))
            start += query_len
        return torch.cat(outputs, dim=0)
