"""FlashInfer paged attention (CUDA): batch decode and batch prefill over Tandem's KV pool in place.

Imported only when the `flashinfer` attention backend is asked for (`kernels.attention`'s registry).
`pool[:, layer]` (`[P, 2, S, Hkv, D]`, page-strided) is FlashInfer's 5-D "NHD" cache as it stands:
the FA2 kernels read the tensor's strides, so nothing is copied. Other FlashInfer backends (cuDNN,
trtllm-gen, cute-dsl) may copy or transpose it, and `backend="auto"` may pick them, so FA2 is pinned.

Each step: `plan(meta_host)` once, with the step's metadata on the host (pinned), then `attend` in
every layer reusing that plan. A step whose every sequence has one new token is planned on the
decode wrapper, any other on the prefill wrapper with a causal mask (new tokens sit at the end of
their sequence, so the mask is aligned to the bottom right, as `TorchAttention` computes it).

A model with sliding-window layers (Mistral, Gemma 3, Qwen3 and Phi-3 where configured) gets a second
pair of wrappers planned with FlashInfer's `window_left` = window - 1 (a key at most window - 1 positions
left of its query, plus the query's own: HF's `sliding_window`), and `attend(..., window=W)` runs it.

Every FlashInfer call's arguments are built by a plain function below (`*_wrapper_kwargs`,
`*_plan_kwargs`), so CPU tests bind them against the installed API's signatures.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, TypeAlias

import flashinfer
import torch

from kernels.attention import AttentionBackend, AttentionMetadata, register_attention_backend
from kernels.flashinfer_graph import GraphDecodeWrappers

logger = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace for split-KV partials
TENSOR_CORE_MIN_GQA_RATIO = 4  # decode on tensor cores from this many query heads per KV head
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)  # FlashInfer has no fp32 attention kernels

_Wrapper: TypeAlias = flashinfer.BatchDecodeWithPagedKVCacheWrapper | flashinfer.BatchPrefillWithPagedKVCacheWrapper


def check_page_table(meta: AttentionMetadata, page_size: int) -> None:
    """Raise ValueError unless `meta` is a well-formed CSR page table for FlashInfer: int32 host
    tensors; `qo_indptr` and `kv_indptr` start at 0 and step by each sequence's new tokens (>= 1) and
    pages (= ceil(seq_len / page_size)); `kv_indices` holds exactly `kv_indptr[-1]` page ids, none
    negative; `kv_last_page_len` is each sequence's tokens on its last page, in 1..page_size."""
    _check_host_int32(meta)
    num_seqs = meta.num_sequences
    if num_seqs == 0:
        raise ValueError("a step must hold at least one sequence")
    if (
        len(meta.seq_lens) != num_seqs
        or meta.qo_indptr.numel() != num_seqs + 1
        or meta.kv_indptr.numel() != num_seqs + 1
        or meta.kv_last_page_len.numel() != num_seqs
    ):
        raise ValueError(f"page table sizes disagree with {num_seqs} sequences")
    qo_indptr, kv_indptr = meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
    last_page_len = meta.kv_last_page_len.tolist()
    if qo_indptr[0] != 0 or kv_indptr[0] != 0:
        raise ValueError("qo_indptr and kv_indptr must start at 0")
    for i, (query_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens)):
        num_pages = -(-seq_len // page_size)
        if not 0 < query_len <= seq_len:
            raise ValueError(f"sequence {i}: {query_len} new tokens of {seq_len}")
        if qo_indptr[i + 1] - qo_indptr[i] != query_len:
            raise ValueError(
                f"sequence {i}: qo_indptr steps by {qo_indptr[i + 1] - qo_indptr[i]}, not its {query_len} new tokens"
            )
        if kv_indptr[i + 1] - kv_indptr[i] != num_pages:
            raise ValueError(
                f"sequence {i}: kv_indptr steps by {kv_indptr[i + 1] - kv_indptr[i]}, "
                f"not the {num_pages} pages of {seq_len} tokens"
            )
        if not 1 <= last_page_len[i] <= page_size or (num_pages - 1) * page_size + last_page_len[i] != seq_len:
            raise ValueError(
                f"sequence {i}: last page holds {last_page_len[i]} tokens; {seq_len} tokens "
                f"in pages of {page_size} leave {seq_len - (num_pages - 1) * page_size}"
            )
    if meta.kv_indices.numel() != kv_indptr[-1]:
        raise ValueError(f"kv_indices has {meta.kv_indices.numel()} page ids, kv_indptr ends at {kv_indptr[-1]}")
    if meta.kv_indices.numel() and int(meta.kv_indices.min()) < 0:
        raise ValueError("kv_indices holds a negative page id")


def _check_host_int32(meta: AttentionMetadata) -> None:
    """Raise ValueError unless each page table tensor of `meta` is int32 and on the host."""
    tensors = {
        "qo_indptr": meta.qo_indptr,
        "kv_indptr": meta.kv_indptr,
        "kv_indices": meta.kv_indices,
        "kv_last_page_len": meta.kv_last_page_len,
    }
    for name, tensor in tensors.items():
        if tensor.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 (FlashInfer misindexes other types), got {tensor.dtype}")
        if tensor.device.type != "cpu":
            raise ValueError(f"plan takes the step's metadata on the host, got {name} on {tensor.device}")


def is_decode_step(meta: AttentionMetadata) -> bool:
    """Whether every sequence has exactly one new token (the decode wrapper's case)."""
    return all(n == 1 for n in meta.query_lens)


def decode_wrapper_kwargs(workspace: torch.Tensor, num_heads: int, num_kv_heads: int) -> dict[str, Any]:
    """Keyword arguments of `BatchDecodeWithPagedKVCacheWrapper(...)`."""
    return {
        "float_workspace_buffer": workspace,
        "kv_layout": "NHD",
        "use_cuda_graph": False,
        "use_tensor_cores": num_heads // num_kv_heads >= TENSOR_CORE_MIN_GQA_RATIO,
        "backend": "fa2",
    }


def prefill_wrapper_kwargs(workspace: torch.Tensor) -> dict[str, Any]:
    """Keyword arguments of `BatchPrefillWithPagedKVCacheWrapper(...)`."""
    return {"float_workspace_buffer": workspace, "kv_layout": "NHD", "use_cuda_graph": False, "backend": "fa2"}


def decode_plan_kwargs(
    meta_host: AttentionMetadata,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    window: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of the decode wrapper's `plan` for a step of one new token per sequence
    (each query attending its last `window` positions only, with `window`).
    Every argument by keyword (FlashInfer deprecates positional ones after `page_size`), data types
    explicit (its default is float16). Raises ValueError on a malformed page table or a step with a
    sequence of more than one new token."""
    check_page_table(meta_host, page_size)
    if not is_decode_step(meta_host):
        raise ValueError("decode plans a step with exactly one new token per sequence")
    return {
        "indptr": meta_host.kv_indptr,
        "indices": meta_host.kv_indices,
        "last_page_len": meta_host.kv_last_page_len,
        "num_qo_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "page_size": page_size,
        "pos_encoding_mode": "NONE",
        "q_data_type": dtype,
        "kv_data_type": dtype,
        "o_data_type": dtype,
        "sm_scale": 1.0 / math.sqrt(head_dim),
        "window_left": window_left(window),
        "non_blocking": True,
    }


def window_left(window: int | None) -> int:
    """FlashInfer's `window_left` for HF's `sliding_window`: the keys left of the query it sees (-1: all)."""
    return -1 if window is None else window - 1


def prefill_plan_kwargs(
    meta_host: AttentionMetadata,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    window: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of the prefill wrapper's `plan`: causal (FlashInfer's default is not),
    data types explicit, over the last `window` positions only with `window`. Raises ValueError on a
    malformed page table."""
    check_page_table(meta_host, page_size)
    return {
        "qo_indptr": meta_host.qo_indptr,
        "paged_kv_indptr": meta_host.kv_indptr,
        "paged_kv_indices": meta_host.kv_indices,
        "paged_kv_last_page_len": meta_host.kv_last_page_len,
        "num_qo_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim_qk": head_dim,
        "page_size": page_size,
        "causal": True,
        "pos_encoding_mode": "NONE",
        "q_data_type": dtype,
        "kv_data_type": dtype,
        "o_data_type": dtype,
        "sm_scale": 1.0 / math.sqrt(head_dim),
        "window_left": window_left(window),
        "non_blocking": True,
    }


@register_attention_backend("flashinfer")
class FlashInferAttention(AttentionBackend):
    """FlashInfer's FA2 paged kernels on one CUDA device, bf16 or fp16.

    Holds one zeroed 128 MB float workspace shared by a decode and a prefill wrapper, and by the
    CUDA-graph decode wrappers of `prepare_cuda_graphs` (one of them runs per step; a captured
    graph's step is planned by `plan_cuda_graph`). `plan` must be called once per step before
    `attend`; it first waits for the previous plan's host-to-device copies, which FlashInfer stages
    through one pinned buffer that the next plan overwrites. The caller must likewise leave
    `meta_host`'s pinned tensors unwritten until the step's attention has run (plan copies them
    without blocking).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__(
            num_heads, num_kv_heads, head_dim, page_size, dtype=dtype, device=device, sliding_window=sliding_window
        )
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"FlashInfer attention computes in bfloat16 or float16, not {dtype}; "
                "use the torch attention backend for float32"
            )
        if self.device.type != "cuda":
            raise ValueError(f"FlashInfer attention needs a CUDA device, not {self.device}")
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            **decode_wrapper_kwargs(self._workspace, num_heads, num_kv_heads)
        )
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(**prefill_wrapper_kwargs(self._workspace))
        self._windowed: tuple[_Wrapper, _Wrapper] | None = None  # (decode, prefill) for the sliding-window layers
        if sliding_window is not None:
            self._windowed = (
                flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    **decode_wrapper_kwargs(self._workspace, num_heads, num_kv_heads)
                ),
                flashinfer.BatchPrefillWithPagedKVCacheWrapper(**prefill_wrapper_kwargs(self._workspace)),
            )
        self._graph_wrappers: GraphDecodeWrappers | None = None  # prepare_cuda_graphs
        self._planned: _Wrapper | None = None  # the wrapper planned for the current step
        self._planned_windowed: _Wrapper | None = None  # its sliding-window twin, for a model that has one
        self._planned_num_tokens = 0
        self._plan_done = torch.cuda.Event()

    supports_cuda_graphs = True

    def plan(self, meta_host: AttentionMetadata) -> None:
        """Plan the step described by `meta_host` (host tensors, pinned); raises ValueError when the
        page table is malformed. Cannot run inside CUDA-graph capture."""
        is_decode = is_decode_step(meta_host)
        plan_kwargs = decode_plan_kwargs if is_decode else prefill_plan_kwargs
        if self._windowed is not None:
            windowed = self._windowed[0 if is_decode else 1]
            self._plan(windowed, plan_kwargs(meta_host, **self._shapes(), window=self.sliding_window), meta_host)
            self._planned_windowed = windowed
        self._plan(self._decode if is_decode else self._prefill, plan_kwargs(meta_host, **self._shapes()), meta_host)

    def prepare_cuda_graphs(self, batch_sizes: Sequence[int], max_num_pages: int) -> None:
        """One CUDA-graph decode wrapper per batch size (kernels/flashinfer_graph.py)."""
        eager_kwargs = decode_wrapper_kwargs(self._workspace, self.num_heads, self.num_kv_heads)
        self._graph_wrappers = GraphDecodeWrappers(eager_kwargs, batch_sizes, max_num_pages)

    def plan_cuda_graph(self, meta_host: AttentionMetadata) -> None:
        """Plan a decode step of a prepared batch size on that size's CUDA-graph wrapper; the same
        keyword arguments as an eager decode plan. ValueError before `prepare_cuda_graphs`, for
        another batch size, too many pages, or a malformed page table."""
        if self._graph_wrappers is None:
            raise ValueError("plan_cuda_graph before prepare_cuda_graphs")
        kwargs = decode_plan_kwargs(meta_host, **self._shapes())
        if meta_host.kv_indices.numel() > self._graph_wrappers.max_num_pages:
            raise ValueError(
                f"a step of {meta_host.kv_indices.numel()} pages; the CUDA-graph buffers hold "
                f"{self._graph_wrappers.max_num_pages}"
            )
        self._plan(self._graph_wrappers.wrapper(meta_host.num_sequences), kwargs, meta_host)

    def _shapes(self) -> dict[str, Any]:
        return {
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "page_size": self.page_size,
            "dtype": self.dtype,
        }

    def _plan(self, wrapper: _Wrapper, kwargs: dict[str, Any], meta_host: AttentionMetadata) -> None:
        # FlashInfer stages a plan's host-to-device copy through a pinned buffer that its next plan
        # overwrites: wait for the previous plan's copy first.
        self._plan_done.synchronize()
        with torch.cuda.device(self.device):
            wrapper.plan(**kwargs)
            self._plan_done.record()
        self._planned = wrapper
        self._planned_num_tokens = sum(meta_host.query_lens)

    def attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, window: int | None = None
    ) -> torch.Tensor:
        """q [T, Hq, D] and kv_cache [P, 2, S, Hkv, D] (any page stride) in the planned dtype on the
        device; with `window` (the backend's `sliding_window`), over each query's last `window`
        positions. `meta` is not read: the plan holds the page table (q's token count is checked
        against it). Raises RuntimeError before any plan, ValueError on a mismatch with it."""
        if self._planned is None:
            raise RuntimeError("FlashInferAttention.attend before plan: call plan once per step first")
        if q.shape[0] != self._planned_num_tokens or q.dtype != self.dtype or kv_cache.dtype != self.dtype:
            raise ValueError(
                f"attend got q {tuple(q.shape)} {q.dtype} and a {kv_cache.dtype} cache; the plan is "
                f"for {self._planned_num_tokens} tokens in {self.dtype}"
            )
        if window is None:
            return self._planned.run(q, kv_cache)
        if window != self.sliding_window or self._planned_windowed is None:
            raise ValueError(f"a window of {window}; this backend was built for {self.sliding_window}")
        return self._planned_windowed.run(q, kv_cache)
