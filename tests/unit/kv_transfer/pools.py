"""Torch tensors shaped like KV pools, for the transport tests (test_transport_contract.py and each
backend's own file)."""

from __future__ import annotations

import torch

NUM_PAGES = 64
PAGE_SHAPE = (2, 4, 16)  # (k/v, kv heads, head_dim) for one token-page slice


def make_pool(random: bool, num_pages: int = NUM_PAGES) -> torch.Tensor:
    """A page-major bfloat16 pool: random values, or zeros."""
    shape = (num_pages, *PAGE_SHAPE)
    return torch.randn(shape, dtype=torch.bfloat16) if random else torch.zeros(shape, dtype=torch.bfloat16)


def page_bytes(pool: torch.Tensor) -> int:
    return pool[0].numel() * pool.element_size()


def pool_bytes(pool: torch.Tensor) -> int:
    return pool.numel() * pool.element_size()
