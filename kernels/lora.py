"""Batched LoRA over segments of rows (multi-LoRA, issue 29): Punica's shrink / expand split.

A batch's rows are grouped into segments of consecutive rows that share one adapter slot
(`segments_from_slots`). `lora_shrink` takes each row into its adapter's low rank, t = x A^T;
`lora_expand` adds scaling * t B^T into columns of the base projection's output, in place. A merged
projection (q/k/v or gate/up, engine/models/layers.py's MergedLinear) takes one shrink over its
parts' A matrices stacked along the rank, then one expand per part at its rank and output offsets.

Adapters of different ranks share one stack: a slot's A [r, in] and B [out, r] are zero-padded to
the stack's rank (at most MAX_RANK per part). Padded rows of A give t columns of zeros, and padded
columns of B multiply them, so the padding adds nothing; `scaling` stays each adapter's alpha / r.

float32 contiguous CPU tensors go through the C++ kernels (`kernels/csrc/lora.cpp`) when they are
built; everything else (CUDA, bfloat16, no build) takes the torch code here, which is also the tests'
oracle. Both raise ValueError for operands that do not fit. The segment tables are read on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import NamedTuple

import torch

NO_ADAPTER = -1  # the slot of rows that take no adapter
MAX_RANK = 64  # the largest rank of one expand (kernels/csrc/kernels.h's kMaxLoraRank)


class LoraSegments(NamedTuple):
    """Rows starts[s]..starts[s + 1] take adapter slot slots[s] (NO_ADAPTER: none)."""

    starts: torch.Tensor  # int32 [S + 1], from 0 to the batch's rows, never decreasing
    slots: torch.Tensor  # int32 [S]


def segments_from_slots(row_slots: Sequence[int]) -> LoraSegments:
    """The segment table of a batch whose row i takes slot row_slots[i], equal neighbours merged."""
    starts: list[int] = []
    slots: list[int] = []
    for row, slot in enumerate(row_slots):
        if not slots or slot != slots[-1]:
            starts.append(row)
            slots.append(slot)
    starts.append(len(row_slots))
    return LoraSegments(torch.tensor(starts, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> torch.Tensor:
    """t [n, R] = x [n, in] times a[slot]^T for each segment's rows, a [slots, R, in] (R: the parts'
    ranks stacked); rows of NO_ADAPTER get zeros. A new tensor in x's dtype."""
    if (kernels := _native(x, a)) is not None:
        return kernels.lora_shrink(x, a, seg_starts, seg_slots)
    return reference_shrink(x, a, seg_starts, seg_slots)


def lora_expand(
    t: torch.Tensor,
    b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    scaling: torch.Tensor,
    y: torch.Tensor,
    r_offset: int = 0,
    out_offset: int = 0,
) -> None:
    """y[rows, out_offset:out_offset + out] += scaling[slot] * t[rows, r_offset:r_offset + r] times
    b[slot]^T for each segment's rows, b [slots, out, r <= MAX_RANK], scaling [slots]. Mutates y
    [n, OUT] in place; rows of NO_ADAPTER are left alone."""
    if (kernels := _native(t, b, scaling, y)) is not None:
        kernels.lora_expand(t, b, seg_starts, seg_slots, scaling, y, r_offset, out_offset)
    else:
        reference_expand(t, b, seg_starts, seg_slots, scaling, y, r_offset, out_offset)


def reference_shrink(
    x: torch.Tensor, a: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor
) -> torch.Tensor:
    """lora_shrink in torch: one matmul per segment."""
    if x.dim() != 2 or a.dim() != 3 or a.shape[2] != x.shape[1] or a.dtype != x.dtype:
        raise ValueError(f"x [n, in] and a [slots, R, in] of one dtype do not fit: {x.shape}, {a.shape}")
    t = x.new_zeros(x.shape[0], a.shape[1])
    for start, end, slot in _checked_segments(seg_starts, seg_slots, x.shape[0], a.shape[0]):
        if slot != NO_ADAPTER:
            t[start:end] = x[start:end] @ a[slot].T
    return t


def reference_expand(
    t: torch.Tensor,
    b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    scaling: torch.Tensor,
    y: torch.Tensor,
    r_offset: int = 0,
    out_offset: int = 0,
) -> None:
    """lora_expand in torch: one matmul per segment, added into y's columns in place."""
    if t.dim() != 2 or b.dim() != 3 or y.dim() != 2 or scaling.shape != (b.shape[0],) or t.shape[0] != y.shape[0]:
        raise ValueError(
            f"t [n, R], b [slots, out, r], scaling [slots] and y [n, OUT] do not fit: "
            f"{t.shape}, {b.shape}, {scaling.shape}, {y.shape}"
        )
    num_slots, out, r = b.shape
    if r > MAX_RANK:
        raise ValueError(f"b's rank {r} is above the largest, {MAX_RANK}")
    if not (0 <= r_offset and r_offset + r <= t.shape[1] and 0 <= out_offset and out_offset + out <= y.shape[1]):
        raise ValueError(f"t's columns {r_offset} + {r} or y's {out_offset} + {out} do not fit {t.shape}, {y.shape}")
    for start, end, slot in _checked_segments(seg_starts, seg_slots, y.shape[0], num_slots):
        if slot != NO_ADAPTER:
            delta = t[start:end, r_offset : r_offset + r] @ b[slot].T
            y[start:end, out_offset : out_offset + out] += scaling[slot] * delta


def _checked_segments(
    seg_starts: torch.Tensor, seg_slots: torch.Tensor, num_rows: int, num_slots: int
) -> list[tuple[int, int, int]]:
    """(start, end, slot) of each segment, checked as the C++ bindings check them."""
    if seg_starts.dtype != torch.int32 or seg_slots.dtype != torch.int32 or seg_starts.dim() != 1:
        raise ValueError("seg_starts and seg_slots must be 1-d int32 tensors")
    if seg_slots.shape != (seg_starts.shape[0] - 1,):
        raise ValueError("seg_starts must hold one more entry than seg_slots")
    starts, slots = seg_starts.tolist(), seg_slots.tolist()
    if starts[0] != 0 or starts[-1] != num_rows:
        raise ValueError(f"seg_starts must run from 0 to the {num_rows} rows")
    if any(end < start for start, end in zip(starts, starts[1:], strict=False)):
        raise ValueError("seg_starts must not decrease")
    if any(not NO_ADAPTER <= slot < num_slots for slot in slots):
        raise ValueError(f"a slot of {slots} is neither {NO_ADAPTER} nor one of the {num_slots} slots")
    return list(zip(starts, starts[1:], slots, strict=False))


def _native(*tensors: torch.Tensor) -> ModuleType | None:
    """The C++ kernels when every operand is a contiguous float32 CPU tensor and they are built."""
    if not all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return None
    from kernels import native

    return native.load() if native.is_available() else None
