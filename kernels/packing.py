"""Block-quantized weights repacked once at load into the layout the C++ matmul reads (panels).

The matmul (`kernels/csrc/qmatmul.cpp`) computes 16 output columns at a time with integer dot
products. For that it wants, for each panel of 16 columns and each 32-input block, the 16 columns'
codes interleaved so that one 32-byte load expands to the operand of one vector instruction:

- Q8_0: 16 chunks of 32 bytes; byte 2j+t of chunk i holds q[j][2i+t] (int8), for column j, t < 2;
- every other format: 8 chunks of 32 bytes; byte 2j+t of chunk i holds the low nibbles of
  q[j][4i+t] (bits 0-3) and q[j][4i+2+t] (bits 4-7); then, for codes of 4 + h bits (h = 1: Q5_x,
  h = 2: Q6_K), 2h rows of 32 bytes with the bits above the nibble: those of q[j][4i+2u+t] sit at
  bit position h * (2i + u) of the rows' byte 2j+t read as one 16h-bit number (row = position / 8).

After a block's codes come the 16 columns' scales, as the file stores them:
- Q8_0, Q5_0: 16 float16 d; Q4_0, Q4_1, Q5_1: 16 float16 d, then 16 float16 m (Q4_0 is packed
  as d * q + m with m = -8 d, the form the kernel computes);
- Q4_K, Q5_K: 16 uint8 sc, then 16 uint8 mn; Q6_K: 16 int8 sc of elements 0-15, then of 16-31.
A K-quant's 8 blocks of a super-block are followed by the 16 columns' float16 D (and -Dmin), so
its scales are the file's integers and the kernel's products D * sc are exact. Q5_0 and Q6_K codes
are offset in int16 (q - 16, q - 32) before the dot. Any float32 d or m that is not a float16 is
rounded here (GGUF's and `quantize`'s are).

A `PackedWeight` is one or more row segments, each in its own format (a fused q/k/v whose parts
differ), one after another in one uint8 tensor; a segment's last panel is padded with zero
columns. Bytes per weight equal the file's for Q8_0, Q4_1, Q5_0, Q5_1 and Q6_K; Q4_0 stores m
(5 bits for the file's 4.5), Q4_K and Q5_K one more byte per super-block and column (4.625 and
5.625 for 4.5 and 5.5). Decode at batch 1 reads every byte once per token, so bytes are time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels import native
from kernels.quant import BLOCK, QuantFormat, QuantizedWeight

PANEL = 16
_K_GROUP = 8  # blocks of a K-quant super-block, stored together with its D (and -Dmin)


def value_bytes(fmt: QuantFormat) -> int:
    """Bytes of one (panel, block)'s codes: 8-bit, or the nibbles and 0, 1 or 2 bit rows above them."""
    return 512 if fmt is QuantFormat.Q8_0 else 256 + 64 * (fmt.bits - 4)


def scale_bytes(fmt: QuantFormat) -> int:
    """Bytes of one (panel, block)'s scales (and offsets)."""
    return 64 if fmt in (QuantFormat.Q4_0, QuantFormat.Q4_1, QuantFormat.Q5_1) else 32


def group_blocks(fmt: QuantFormat) -> int:
    """Blocks stored as one group: a K-quant's super-block, else one."""
    return _K_GROUP if fmt.is_k_quant else 1


def group_bytes(fmt: QuantFormat) -> int:
    """Bytes of one (panel, group): its blocks, then (K-quants) 16 float16 D and (Q4_K, Q5_K) 16 -Dmin."""
    tail = (64 if fmt.has_mins else 32) if fmt.is_k_quant else 0
    return group_blocks(fmt) * (value_bytes(fmt) + scale_bytes(fmt)) + tail


def panel_bytes(fmt: QuantFormat, in_features: int) -> int:
    """Bytes of one panel of 16 columns over `in_features` inputs."""
    return in_features // (BLOCK * group_blocks(fmt)) * group_bytes(fmt)


@dataclass(frozen=True, slots=True)
class PackedSegment:
    """`rows` consecutive output rows in one format, whose panels start at byte `offset`."""

    format: QuantFormat
    rows: int
    offset: int


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A block-quantized weight [N, K] in panel layout (module docstring); what the matmul reads.
    `table` is the segments as the kernel takes them: int64 [S, 3] (format code, rows, offset)."""

    shape: tuple[int, int]
    data: torch.Tensor
    segments: tuple[PackedSegment, ...]
    table: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        rows = [(s.format.value, s.rows, s.offset) for s in self.segments]
        object.__setattr__(self, "table", torch.tensor(rows, dtype=torch.int64).reshape(-1, 3))

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def formats(self) -> tuple[QuantFormat, ...]:
        return tuple(s.format for s in self.segments)

    @property
    def format(self) -> QuantFormat:
        """The one format of a single-segment weight (ValueError for mixed ones: see `formats`)."""
        if len(self.segments) != 1:
            raise ValueError(f"a weight of segments {[f.name for f in self.formats]} has no single format")
        return self.segments[0].format

    @property
    def bits(self) -> int:
        return self.format.bits

    @property
    def num_bytes(self) -> int:
        return self.data.numel()

    @staticmethod
    def cat(parts: Sequence[PackedWeight]) -> PackedWeight:
        """The rows of `parts` stacked, their panels copied as they are: a segment continues the one
        before it when both are of one format and the earlier fills its last panel (its bytes are
        then those of packing the rows together), else it starts a new one."""
        k = parts[0].in_features
        if any(p.in_features != k for p in parts):
            raise ValueError(f"cannot stack weights of {sorted({p.in_features for p in parts})} input features")
        if len(parts) == 1:
            return parts[0]
        datas: list[torch.Tensor] = []
        segments: list[PackedSegment] = []
        offset = 0
        for part in parts:
            for segment in part.segments:
                size = -(-segment.rows // PANEL) * panel_bytes(segment.format, k)
                datas.append(part.data[segment.offset : segment.offset + size])
                last = segments[-1] if segments else None
                if last is not None and last.format is segment.format and last.rows % PANEL == 0:
                    segments[-1] = PackedSegment(last.format, last.rows + segment.rows, last.offset)
                else:
                    segments.append(PackedSegment(segment.format, segment.rows, offset))
                offset += size
        return PackedWeight((sum(s.rows for s in segments), k), torch.cat(datas), tuple(segments))

    def unpack(self) -> list[QuantizedWeight]:
        """Each segment as the `QuantizedWeight` it was packed from (scales as stored: float16 values)."""
        return [self._segment(s, torch.arange(s.rows)) for s in self.segments]

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [N, K], or only the output rows named by `rows` (int64; IndexError out of range)."""
        n, k = self.shape
        rows = torch.arange(n) if rows is None else rows.reshape(-1)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n):
            raise IndexError(f"rows out of range for a weight of {n} rows")
        out = torch.empty(len(rows), k)
        start = 0
        for segment in self.segments:
            inside = (rows >= start) & (rows < start + segment.rows)
            if bool(inside.any()):
                out[inside] = self._segment(segment, rows[inside] - start).dequantize()
            start += segment.rows
        return out

    def _segment(self, segment: PackedSegment, rows: torch.Tensor) -> QuantizedWeight:
        fmt, k = segment.format, self.in_features
        panels = -(-segment.rows // PANEL)
        data = self.data[segment.offset : segment.offset + panels * panel_bytes(fmt, k)]
        return _unpack(data.view(panels, -1, group_bytes(fmt)), fmt, k, rows)


def pack(weight: QuantizedWeight | PackedWeight | Sequence[QuantizedWeight | PackedWeight]) -> PackedWeight:
    """The panel layout of a weight, or of the rows of several stacked (one segment per run of one
    format; parts already packed keep their panels, `PackedWeight.cat`). Exact: no value changes but
    Q4_0's offset form and float16 rounding (docstring)."""
    parts = [weight] if isinstance(weight, (QuantizedWeight, PackedWeight)) else list(weight)
    k = parts[0].in_features
    if any(p.in_features != k for p in parts):
        raise ValueError(f"cannot stack weights of {sorted({p.in_features for p in parts})} input features")
    runs: list[PackedWeight | list[QuantizedWeight]] = []
    for part in parts:
        last = runs[-1] if runs else None
        if isinstance(part, QuantizedWeight) and isinstance(last, list) and last[0].format is part.format:
            last.append(part)
        else:
            runs.append([part] if isinstance(part, QuantizedWeight) else part)
    return PackedWeight.cat([run if isinstance(run, PackedWeight) else _pack_run(run) for run in runs])


def pack_gguf_blocks(
    raw: np.ndarray | torch.Tensor, fmt: QuantFormat, rows: int, cols: int, row_order: torch.Tensor | None = None
) -> PackedWeight:
    """The panels of a weight [rows, cols] straight from its GGUF blocks of `fmt` (`raw`: uint8,
    C-contiguous, the file's bytes, e.g. a view of its mapping), by the C++ repack: `pack` of the
    blocks read as a `QuantizedWeight` (engine.weights.gguf_blocks), byte for byte, without a byte per
    weight in between. With `row_order` (int64 [N]) output row i is the file's row row_order[i].
    Raises `native.KernelBuildError` when the kernels cannot be built (callers fall back to `pack`)."""
    buffer = raw.numpy() if isinstance(raw, torch.Tensor) else raw
    order = None if row_order is None else row_order.to(torch.int64).contiguous()
    data = native.load().repack_gguf(buffer, fmt.value, rows, cols, order)
    n = rows if order is None else len(order)
    return PackedWeight((n, cols), data, (PackedSegment(fmt, n, 0),))


def _pack_run(run: list[QuantizedWeight]) -> PackedWeight:
    merged = run[0] if len(run) == 1 else QuantizedWeight.cat(run)
    return PackedWeight(merged.shape, _pack_segment(merged), (PackedSegment(merged.format, merged.shape[0], 0),))


def _pack_segment(weight: QuantizedWeight) -> torch.Tensor:
    """uint8 [panels * panel_bytes]: one format's panels."""
    fmt, (n, k) = weight.format, weight.shape
    nb, panels = k // BLOCK, -(-n // PANEL)
    pad = panels * PANEL - n
    codes = _padded(weight.codes, pad).reshape(panels, PANEL, nb, BLOCK)
    blocks = torch.cat((_code_bytes(codes, fmt), _scale_bytes(weight, panels, pad)), dim=-1)
    if fmt.is_k_quant:
        supers = (weight.super_scales, weight.super_mins)
        tails = [_lanes(_padded(t, pad), panels, torch.float16) for t in supers if t is not None]
        blocks = torch.cat([blocks.reshape(panels, nb // _K_GROUP, -1), *tails], dim=-1)
    return blocks.reshape(-1)


def _code_bytes(codes: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """[panels, 16, nb, 32] codes -> [panels, nb, value_bytes] (module docstring)."""
    panels, _, nb, _ = codes.shape
    if fmt is QuantFormat.Q8_0:  # [panel, column j, block, chunk i, t] -> [panel, block, chunk i, column j, t]
        return codes.reshape(panels, PANEL, nb, 16, 2).permute(0, 2, 3, 1, 4).reshape(panels, nb, -1)
    low = (codes & 0x0F).reshape(panels, PANEL, nb, 8, 2, 2)  # element 4i + 2u + t: [..., i, u, t]
    rows = [low[..., 0, :] | (low[..., 1, :] << 4)]  # [panel, j, block, i, t]
    high_bits = fmt.bits - 4
    if high_bits:
        # position p = 2i + u = row * (8 / h) + s: bit h * s of the row's byte
        high = (codes >> 4).reshape(panels, PANEL, nb, 2 * high_bits, 8 // high_bits, 2)
        shifts = torch.arange(0, 8, high_bits, dtype=torch.uint8).view(-1, 1)
        rows.append((high << shifts).sum(dim=-2, dtype=torch.uint8))  # disjoint bits: the sum is their or
    return torch.cat(rows, dim=3).permute(0, 2, 3, 1, 4).reshape(panels, nb, -1)


def _scale_bytes(weight: QuantizedWeight, panels: int, pad: int) -> torch.Tensor:
    """[panels, nb, scale_bytes]: each block's 16 scales (and offsets) in the stored type."""
    fmt, nb = weight.format, weight.in_features // BLOCK
    if fmt.is_k_quant:
        dtype = torch.int8 if fmt is QuantFormat.Q6_K else torch.uint8
        fields = [weight.scales, weight.mins]
    else:
        dtype = torch.float16
        fields = [weight.scales, -8 * weight.scales if fmt is QuantFormat.Q4_0 else weight.mins]
    lanes = [_lanes(_padded(f, pad), panels, dtype).reshape(panels, nb, -1) for f in fields if f is not None]
    return torch.cat(lanes, dim=-1)


def _lanes(per_column: torch.Tensor, panels: int, dtype: torch.dtype) -> torch.Tensor:
    """[panels * 16, B] -> [panels, B, 16 * itemsize] uint8: each panel's 16 values per B, as `dtype`."""
    by_panel = per_column.to(dtype).reshape(panels, PANEL, -1).permute(0, 2, 1).contiguous()
    return by_panel.view(torch.uint8).reshape(panels, per_column.shape[1], -1)


def _padded(per_row: torch.Tensor, pad: int) -> torch.Tensor:
    return torch.cat((per_row, per_row.new_zeros(pad, *per_row.shape[1:]))) if pad else per_row


def _unpack(groups: torch.Tensor, fmt: QuantFormat, k: int, rows: torch.Tensor) -> QuantizedWeight:
    """The rows `rows` (int64, in the segment) of one format's panels [panels, groups, group_bytes]."""
    nb, lane, count = k // BLOCK, rows % PANEL, len(rows)
    picked = groups[rows // PANEL]  # [T, groups, group_bytes]
    block_bytes = value_bytes(fmt) + scale_bytes(fmt)
    blocks = picked[..., : group_blocks(fmt) * block_bytes].reshape(count, nb, block_bytes)
    codes = _codes(blocks[..., : value_bytes(fmt)], fmt, lane)
    stored = blocks[..., value_bytes(fmt) :]
    if not fmt.is_k_quant:
        scales = _pick(stored[..., :32], lane, torch.float16)
        mins = _pick(stored[..., 32:], lane, torch.float16) if fmt.has_mins else None
        return QuantizedWeight(fmt, codes, scales, mins)
    dtype = torch.int8 if fmt is QuantFormat.Q6_K else torch.uint8
    scales = _pick(stored[..., :16] if fmt.has_mins else stored, lane, dtype)
    mins = _pick(stored[..., 16:], lane, dtype) if fmt.has_mins else None
    tail = picked[..., group_blocks(fmt) * block_bytes :]
    super_mins = _pick(tail[..., 32:], lane, torch.float16) if fmt.has_mins else None
    return QuantizedWeight(fmt, codes, scales, mins, _pick(tail[..., :32], lane, torch.float16), super_mins)


def _pick(raw: torch.Tensor, lane: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, B, bytes] uint8 holding 16 lanes of `dtype` (or 32 for Q6_K's two scales per block) per B
    -> float32 [T, B'] of each row's own lane."""
    values = raw.contiguous().view(dtype).float().reshape(len(lane), -1, PANEL)
    return values[torch.arange(len(lane)), :, lane]


def _codes(values: torch.Tensor, fmt: QuantFormat, lane: torch.Tensor) -> torch.Tensor:
    """[T, nb, value_bytes] -> uint8 [T, K]: each row's codes in element order."""
    count, nb, _ = values.shape
    chunks = values.reshape(count, nb, -1, PANEL, 2)[torch.arange(count), :, :, lane]  # [T, nb, chunk, t]
    if fmt is QuantFormat.Q8_0:
        return chunks.reshape(count, -1)
    nibbles = chunks[:, :, :8]
    codes = torch.stack((nibbles & 0x0F, nibbles >> 4), dim=-2)  # [T, nb, i, u, t]
    high_bits = fmt.bits - 4
    if high_bits:
        shifts = torch.arange(0, 8, high_bits, dtype=torch.uint8).view(-1, 1)
        high = (chunks[:, :, 8:].unsqueeze(-2) >> shifts) & ((1 << high_bits) - 1)  # [T, nb, row, s, t]
        codes = codes | (high.reshape(count, nb, 8, 2, 2) << 4)
    return codes.reshape(count, -1)
