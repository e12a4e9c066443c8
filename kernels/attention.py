"""Paged attention backends, chosen by name at start-up, over one CSR page table per step.

KV layout, per layer: `kv_cache[page, 0 | 1, offset, kv_head, head_dim]` (0 = K, 1 = V); the pool
tensor in `engine.kv_pool` is page-major so one page of every layer is one contiguous region, and
`pool[:, layer]` is the 5-D "NHD" cache FlashInfer reads.

The page table is FlashInfer's CSR form (all int32): sequence i's new tokens are rows
`qo_indptr[i]:qo_indptr[i+1]` of q; its pages are `kv_indices[kv_indptr[i]:kv_indptr[i+1]]`, the
last holding `kv_last_page_len[i]` tokens (1..page_size). Attention is causal: a sequence with
q_len new tokens and seq_len tokens in all has its new tokens at positions seq_len - q_len ... One
`AttentionMetadata` is built per step, on the host, and shared by every layer.

A backend is created once per engine for its model's shapes, dtype and device. Each eager step the
runner calls `plan` once with the host-side metadata (pinned when the device is CUDA), then
`attend` in every layer with the same metadata on the device. A CUDA-graph decode step plans with
`plan_cuda_graph` instead (engine/cuda_graph.py), and a fused CPU layer runs the C++ attention
kernel itself (kernels/fused_layer.py) without `attend`.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from kernels.layers import NATIVE_KV_CACHE_DTYPES
from kernels.registry import BackendRegistry, as_device, is_flashinfer_installed

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
    def build(
        cls,
        page_ids: Sequence[Sequence[int]],
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        page_size: int,
        pin: bool = False,
    ) -> AttentionMetadata:
        """From each sequence's pages (at least ceil(seq_len / page_size) of them, extra ones ignored),
        its number of new tokens and its total length; host tensors, in pinned memory when `pin`
        (so that `to` can copy them without blocking)."""
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
        int32, int64 = torch.int32, torch.int64
        return cls(
            qo_indptr=host_tensor(list(accumulate(query_lens, initial=0)), int32, pin),
            kv_indptr=host_tensor(list(accumulate(num_pages, initial=0)), int32, pin),
            kv_indices=host_tensor(indices, int32, pin),
            kv_last_page_len=host_tensor([n - (c - 1) * page_size for n, c in zip(seq_lens, num_pages)], int32, pin),
            write_pages=host_tensor(write_pages, int64, pin),
            write_offsets=host_tensor(write_offsets, int64, pin),
            query_lens=tuple(query_lens),
            seq_lens=tuple(seq_lens),
        )

    def to(self, device: torch.device | str, non_blocking: bool = True) -> AttentionMetadata:
        """The same metadata with its tensors on `device` (itself when they are there already);
        `query_lens` and `seq_lens` stay Python ints. Non-blocking copies are asynchronous only from
        pinned memory, which must then not be written until the copy is done."""
        device = as_device(device)
        if self.qo_indptr.device == device:
            return self

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        return AttentionMetadata(
            qo_indptr=move(self.qo_indptr),
            kv_indptr=move(self.kv_indptr),
            kv_indices=move(self.kv_indices),
            kv_last_page_len=move(self.kv_last_page_len),
            write_pages=move(self.write_pages),
            write_offsets=move(self.write_offsets),
            query_lens=self.query_lens,
            seq_lens=self.seq_lens,
        )

    @property
    def num_sequences(self) -> int:
        return len(self.query_lens)

    def pages_of(self, seq: int) -> torch.Tensor:
        """Sequence `seq`'s page ids in order (int64, for indexing)."""
        return self.kv_indices[self.kv_indptr[seq] : self.kv_indptr[seq + 1]].long()


def host_tensor(values: Sequence[int] | Sequence[float], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A CPU tensor of `values`, in pinned (page-locked) memory when `pin`."""
    tensor = torch.tensor(values, dtype=dtype)
    return tensor.pin_memory() if pin else tensor


class AttentionBackend(ABC):
    """Attends over each sequence's KV in the paged cache. The new tokens' K/V are written there
    first, with rotary, by `kernels.layers.RotaryEmbedding.apply_and_store`.

    `dtype` and `device` are those of q and the KV pool (backends that allocate workspaces need them).
    `sliding_window`: the window of the model's sliding-window layers (None: it has none), for backends
    that plan a step per window (FlashInfer)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        sliding_window: int | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.sliding_window = sliding_window
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.scale = 1.0 / math.sqrt(head_dim)
        self.dtype = dtype
        self.device = as_device(device)

    def plan(self, meta_host: AttentionMetadata) -> None:  # noqa: B027 (an optional hook, empty by design)
        """Prepare for one step, once, before its forward pass: `meta_host` is the step's metadata
        on the host (pinned when the device is CUDA). The default does nothing."""

    @abstractmethod
    def attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, window: int | None = None
    ) -> torch.Tensor:
        """Causal attention of q [T, Hq, D] over the KV already in kv_cache [P, 2, S, Hkv, D];
        [T, Hq, D] in q's dtype. `meta` is the planned step's metadata, on q's device. With `window`
        (a sliding-window layer's, the backend's `sliding_window`), a row at position p attends keys
        p - window + 1 .. p only."""

    # CUDA-graph decode (engine/cuda_graph.py). A backend that can be captured reads nothing per step
    # from the host inside `attend`: its page table lives in fixed device buffers that a plan fills.
    supports_cuda_graphs = False

    def prepare_cuda_graphs(self, batch_sizes: Sequence[int], max_num_pages: int) -> None:
        """Set up, once, a decode plan per batch size in `batch_sizes` whose buffers stay put, so that a
        CUDA graph captured over `attend` replays any later plan of that size; at most `max_num_pages`
        page ids per step. Only where `supports_cuda_graphs`."""
        raise NotImplementedError(f"{type(self).__name__} cannot run under CUDA graphs")

    def plan_cuda_graph(self, meta_host: AttentionMetadata) -> None:
        """Like `plan`, for a decode step (one new token per sequence) of exactly one of the prepared
        batch sizes, into that size's fixed buffers; outside any capture, before the graph is
        captured or replayed. Raises ValueError for another batch size or a malformed page table."""
        raise NotImplementedError(f"{type(self).__name__} cannot run under CUDA graphs")


_BACKENDS: BackendRegistry[AttentionBackend] = BackendRegistry(
    "attention", {"flashinfer": "kernels.flashinfer_attention"}
)


def register_attention_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    """Class decorator: make the backend creatable as `name`."""
    return _BACKENDS.register(name)


def resolve_attention_backend(name: str, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> str:
    """The backend `name` means on `device` for a model in `dtype` (None: any). `auto`: on CUDA,
    FlashInfer when installed and the dtype is one it computes in (bf16, fp16), else torch; on CPU
    the C++ kernel where it builds, else torch; torch on any other device (`meta` in tests).
    Raises ValueError for an unknown name or one that cannot run on `device`."""
    device = as_device(device)
    if name == "auto":
        if device.type == "cuda":
            fits = dtype in (None, torch.bfloat16, torch.float16)
            return "flashinfer" if fits and is_flashinfer_installed() else "torch"
        if device.type != "cpu":
            return "torch"
        from kernels import native

        return "cpu" if native.is_available() else "torch"
    _BACKENDS.check_known(name)
    if name == "cpu" and device.type != "cpu":
        raise ValueError(
            f"the cpu attention backend (the C++ kernel) runs on CPU only, not on {device}; use torch or flashinfer"
        )
    if name == "flashinfer" and device.type != "cuda":
        raise ValueError(f"the flashinfer attention backend needs a CUDA device, not {device}")
    return name


def create_attention_backend(
    name: str,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    sliding_window: int | None = None,
) -> AttentionBackend:
    """The backend `name` (resolved for `device` as `resolve_attention_backend` says) for these shapes
    (and the model's `sliding_window`, where it has sliding-window layers). Raises ValueError for an
    unknown name, one that cannot run on `device`, or one not installed."""
    cls = _BACKENDS.get(resolve_attention_backend(name, device, dtype))
    return cls(
        num_heads,
        num_kv_heads,
        head_dim,
        page_size,
        dtype=dtype,
        device=as_device(device),
        sliding_window=sliding_window,
    )


def torch_paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    page_size: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over kv_cache [P, 2, S, Hkv, D] on torch SDPA, one sequence at
    a time: the reference every backend is tested against. With `window`, a token at position p sees
    the keys at positions p - window + 1 .. p only (HF's sliding window)."""
    num_kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
    outputs = []
    start = first_page = 0
    for query_len, seq_len in zip(meta.query_lens, meta.seq_lens):
        # page slices from the host-side lengths: no device-to-host read per sequence and layer
        num_pages = -(-seq_len // page_size)
        pages = meta.kv_indices[first_page : first_page + num_pages].long()
        first_page += num_pages
        qi = q[start : start + query_len].transpose(0, 1)  # [Hq, n, D]
        # a pool in another dtype than q's (a float32 model over a bfloat16 pool) computes in q's
        ki = kv_cache[pages, 0].reshape(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1).to(q.dtype)
        vi = kv_cache[pages, 1].reshape(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1).to(q.dtype)
        if seq_len == query_len and (window is None or seq_len <= window):
            mask, is_causal = None, query_len > 1
        else:
            positions = torch.arange(seq_len - query_len, seq_len, device=q.device).unsqueeze(1)
            keys = torch.arange(seq_len, device=q.device).unsqueeze(0)
            mask, is_causal = keys <= positions, False
            if window is not None:
                mask &= keys > positions - window
        out = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
        outputs.append(out.transpose(0, 1))
        start += query_len
    return torch.cat(outputs, dim=0)


@register_attention_backend("torch")
class TorchAttention(AttentionBackend):
    """Reference implementation on torch SDPA, one sequence at a time: the oracle for the others."""

    def attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, window: int | None = None
    ) -> torch.Tensor:
        return torch_paged_attention(q, kv_cache, meta, self.page_size, self.scale, window)


@register_attention_backend("cpu")
class CpuPagedAttention(TorchAttention):
    """The C++ kernel (`kernels/csrc`): reads K/V in place through the page table, no padding, no
    masks, no copies; each row's result is independent of the rest of the batch. fp32 math over a
    float32 or bfloat16 pool; a float16 pool takes the torch path. `attend` also takes a layer's own
    softmax scale and sliding window (the kernel skips the pages before a row's window)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        sliding_window: int | None = None,
    ) -> None:
        super().__init__(
            num_heads, num_kv_heads, head_dim, page_size, dtype=dtype, device=device, sliding_window=sliding_window
        )
        from kernels import native

        self._kernels = native.load()

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """`AttentionBackend.attend`, with scores (q * `scale`) . k (None: 1 / sqrt(head_dim)) and, with
        `window`, a row at position p attending keys p - window + 1 .. p only (`torch_paged_attention`'s)."""
        scale = self.scale if scale is None else scale
        if kv_cache.dtype not in NATIVE_KV_CACHE_DTYPES:
            return torch_paged_attention(q, kv_cache, meta, self.page_size, scale, window)
        rows = q.float()
        if rows.stride(2) != 1 or rows.stride(1) != rows.shape[2]:  # rows may be strided (a view of q/k/v), heads not
            rows = rows.contiguous()
        out = self._kernels.paged_attention(
            rows,
            kv_cache,
            meta.qo_indptr,
            meta.kv_indptr,
            meta.kv_indices,
            meta.kv_last_page_len,
            scale,
            window or 0,
        )
        return out.to(q.dtype)
