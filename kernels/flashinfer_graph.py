"""FlashInfer's batch decode in CUDA-graph mode: one wrapper per captured batch size, over page-table
buffers that never move. Imported only by the `flashinfer` attention backend.

A decode wrapper built with `use_cuda_graph=True` has a fixed batch size (the length of its
last-page-length buffer) and keeps the page table in the device buffers it was given: `plan`
(outside the graph) copies each step's table into them, and a graph captured over `run` reads them
from there. So each captured batch size needs a wrapper of its own. Like mini-sglang's, they share
one set of buffers, sized for the largest batch: only one graph replays at a time, and each plan
rewrites what its replay reads. Every wrapper also keeps FlashInfer's own 8 MB integer workspace
(and 8 MB of pinned host memory) for its plan; the float workspace is the backend's, shared.

The constructor's arguments are built by a plain function, so CPU tests bind them against the
installed API's signature (tests/unit/kernels/test_flashinfer_api.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flashinfer
import torch


def graph_decode_wrapper_kwargs(
    eager_kwargs: dict[str, Any],
    *,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    last_page_len: torch.Tensor,
) -> dict[str, Any]:
    """Keyword arguments of `BatchDecodeWithPagedKVCacheWrapper(...)` for one batch size in CUDA-graph
    mode: the eager wrapper's `eager_kwargs` (workspace, FA2, NHD, tensor cores by the GQA ratio) with
    the fixed buffers: `indptr` [B + 1], `indices` [max pages], `last_page_len` [B], int32 on the device."""
    return {
        **eager_kwargs,
        "use_cuda_graph": True,
        "paged_kv_indptr_buffer": indptr,
        "paged_kv_indices_buffer": indices,
        "paged_kv_last_page_len_buffer": last_page_len,
    }


class GraphDecodeWrappers:
    """A CUDA-graph decode wrapper for each of `batch_sizes`, built like the eager decode wrapper
    (`eager_kwargs`: the backend's, its float workspace shared), sharing page-table buffers for the
    largest of the sizes and up to `max_num_pages` page ids per step, on the workspace's device."""

    def __init__(self, eager_kwargs: dict[str, Any], batch_sizes: Sequence[int], max_num_pages: int) -> None:
        if not batch_sizes or min(batch_sizes) < 1 or max_num_pages < max(batch_sizes):
            raise ValueError(f"batch sizes {tuple(batch_sizes)} with room for {max_num_pages} pages")
        device, int32 = eager_kwargs["float_workspace_buffer"].device, torch.int32
        largest = max(batch_sizes)
        self._indptr = torch.zeros(largest + 1, dtype=int32, device=device)
        self._indices = torch.zeros(max_num_pages, dtype=int32, device=device)
        self._last_page_len = torch.ones(largest, dtype=int32, device=device)
        self.max_num_pages = max_num_pages
        self._wrappers = {
            size: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                **graph_decode_wrapper_kwargs(
                    eager_kwargs,
                    indptr=self._indptr[: size + 1],
                    indices=self._indices,
                    last_page_len=self._last_page_len[:size],
                )
            )
            for size in batch_sizes
        }

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._wrappers))

    def wrapper(self, batch_size: int) -> flashinfer.BatchDecodeWithPagedKVCacheWrapper:
        """The wrapper of `batch_size`; ValueError for a size that was not prepared."""
        try:
            return self._wrappers[batch_size]
        except KeyError:
            raise ValueError(
                f"no CUDA-graph decode plan for {batch_size} sequences; prepared: {self.batch_sizes}"
            ) from None
