"""The paged KV pool: one contiguous tensor, page-major, registered once with the KV transport."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one page: `page_bytes` bytes holding K and V of `page_size` tokens in every layer."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.page_bytes // self.page_size

    @classmethod
    def for_model(cls, config: ModelConfig, page_size: int, dtype: torch.dtype) -> KVLayout:
        return cls(config.num_layers, page_size, config.num_kv_heads, config.head_dim, dtype)


class KVPool:
    """`tensor[page, layer, 0 | 1, offset, kv_head, head_dim]` on `device`; page i spans bytes
    [base_addr + i * page_bytes, base_addr + (i + 1) * page_bytes) of that device's memory.

    Pages 0 .. num_pages - 1 hold requests' KV. `num_scratch_pages` more follow them, never handed
    out: the padded rows of a CUDA-graph decode step write their K/V there (`scratch_page_ids`).
    """

    # The tensor's axes, outermost first: KV moves between workers as bytes, so both must agree on it.
    AXES = ("page", "layer", "kv", "offset", "kv_head", "head_dim")

    def __init__(
        self, layout: KVLayout, num_pages: int, device: torch.device | str = "cpu", num_scratch_pages: int = 0
    ) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.scratch_page_ids = tuple(range(num_pages, num_pages + num_scratch_pages))
        shape = (
            num_pages + num_scratch_pages,
            layout.num_layers,
            2,
            layout.page_size,
            layout.num_kv_heads,
            layout.head_dim,
        )
        self.tensor = torch.zeros(shape, dtype=layout.dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def base_addr(self) -> int:
        """The pool's address in its device's memory (a CUDA pointer on a GPU)."""
        return self.tensor.data_ptr()

    @property
    def num_bytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def read_tokens(self, page_ids: list[int], num_tokens: int) -> torch.Tensor:
        """KV of the first `num_tokens` tokens held in `page_ids`: [L, 2, num_tokens, Hkv, D] (a copy, on
        the pool's device)."""
        pages = self.tensor[page_ids]  # [n, L, 2, S, H, D]
        kv = pages.permute(1, 2, 0, 3, 4, 5).reshape(
            self.layout.num_layers, 2, -1, self.layout.num_kv_heads, self.layout.head_dim
        )
        return kv[:, :, :num_tokens].clone()
