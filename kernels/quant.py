"""Block-quantized weights (GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) and their oracle.

A weight [N, K] holds one integer code q per element and, per output row, a scale (and for some
formats an offset) per sub-block of consecutive input elements:
- Q8_0: w = d * q, q int8, blocks of 32;
- Q4_0: w = d * (q - 8), q 4-bit; Q5_0: w = d * (q - 16), q 5-bit; blocks of 32;
- Q4_1, Q5_1: w = d * q + m, q 4 / 5-bit, blocks of 32;
- Q4_K, Q5_K: super-blocks of 256 = 8 blocks of 32 with 6-bit integers sc and mn per block and
  float16 D and Dmin per super-block: w = (D * sc) * q + (-Dmin) * mn, q 4 / 5-bit;
- Q6_K: w = (D * sc) * (q - 32), q 6-bit, sc int8 per 16 elements, D float16 per super-block.
d, m, D and Dmin are float16 values (as GGUF stores them and `quantize` rounds them) held in float32;
every product above is exact in float32, so `dequantize` gives the bits of gguf-py's dequantizer.

This is the form checkpoints are read, quantized, fused and checked in; `kernels.packing` repacks
it for the matmul (`kernels.quant_linear`). `reference_matmul` is the torch oracle: the
dequantized weight in float32.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

BLOCK = 32
SUPER_BLOCK = 256  # elements sharing a K-quant's D and Dmin


class QuantFormat(enum.Enum):
    Q8_0 = 0  # values are the kernel's format codes (kernels/csrc/kernels.h)
    Q4_0 = 1
    Q4_1 = 2
    Q5_0 = 3
    Q5_1 = 4
    Q4_K = 5
    Q5_K = 6
    Q6_K = 7

    @property
    def bits(self) -> int:
        """Bits of one code."""
        return int(self.name[1])  # Q<bits>_<kind>

    @property
    def offset(self) -> int:
        """What is subtracted from a code before scaling it."""
        return {QuantFormat.Q4_0: 8, QuantFormat.Q5_0: 16, QuantFormat.Q6_K: 32}.get(self, 0)

    @property
    def has_mins(self) -> bool:
        return self in (QuantFormat.Q4_1, QuantFormat.Q5_1, QuantFormat.Q4_K, QuantFormat.Q5_K)

    @property
    def is_k_quant(self) -> bool:
        """Whether scales (and mins) are integers times a float per super-block of 256."""
        return self.name.endswith("_K")

    @property
    def sub_block(self) -> int:
        """Elements per scale."""
        return 16 if self is QuantFormat.Q6_K else BLOCK

    @property
    def row_multiple(self) -> int:
        """What K must be a multiple of."""
        return SUPER_BLOCK if self.is_k_quant else BLOCK


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """`codes` uint8 [N, K], one per element (Q8_0: int8 bytes); `scales` float32 [N, K / sub_block]
    and, where the format has them, `mins` (same shape); K-quants: `scales` / `mins` are the integer
    sc / mn, `super_scales` float32 [N, K / 256] the D and `super_mins` the negated -Dmin."""

    format: QuantFormat
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None
    super_scales: torch.Tensor | None = None
    super_mins: torch.Tensor | None = None

    def __post_init__(self) -> None:
        fmt, (n, k) = self.format, self.codes.shape
        name = fmt.name
        if self.codes.dtype != torch.uint8 or k % fmt.row_multiple:
            raise ValueError(f"{name}: codes must be uint8 [N, K], K a multiple of {fmt.row_multiple}")
        if self.scales.shape != (n, k // fmt.sub_block):
            raise ValueError(f"{name}: scales {tuple(self.scales.shape)} do not fit codes {(n, k)}")
        if (self.mins is not None) != fmt.has_mins:
            raise ValueError(f"{name}: mins are required for formats with an offset per block, and only for them")
        if (self.super_scales is not None) != fmt.is_k_quant:
            raise ValueError(f"{name}: super-block scales are required for K-quants, and only for them")
        if (self.super_mins is not None) != (fmt.is_k_quant and fmt.has_mins):
            raise ValueError(f"{name}: super-block mins are required for Q4_K and Q5_K, and only for them")

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1])

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors() if t is not None)

    def _tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (self.codes, self.scales, self.mins, self.super_scales, self.super_mins)

    def block_scales(self) -> torch.Tensor:
        """float32 [N, K / sub_block]: each sub-block's scale (D * sc for K-quants)."""
        return self.scales if self.super_scales is None else self.scales * self._per_sub_block(self.super_scales)

    def block_mins(self) -> torch.Tensor | None:
        """float32 [N, K / sub_block]: each sub-block's offset (-Dmin * mn for K-quants), or None."""
        if self.mins is None or self.super_mins is None:
            return self.mins
        return self.mins * self._per_sub_block(self.super_mins)

    def _per_sub_block(self, per_super_block: torch.Tensor) -> torch.Tensor:
        return per_super_block.repeat_interleave(SUPER_BLOCK // self.format.sub_block, dim=1)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        n, k = self.shape
        codes = self.codes.view(torch.int8) if self.format is QuantFormat.Q8_0 else self.codes
        values = codes.float().view(n, -1, self.format.sub_block)
        if self.format.offset:
            values = values - self.format.offset
        weight = values * self.block_scales().unsqueeze(-1)
        mins = self.block_mins()
        if mins is not None:
            weight = weight + mins.unsqueeze(-1)
        return weight.reshape(n, k)

    def index_rows(self, rows: torch.Tensor) -> QuantizedWeight:
        """The same weight with its output rows reordered or selected (`rows` int64)."""
        picked = [None if t is None else t[rows].contiguous() for t in self._tensors()]
        return QuantizedWeight(self.format, *picked)  # type: ignore[arg-type]

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stack the rows of weights of one format (`kernels.packing.pack` takes mixed formats)."""
        formats = {p.format for p in parts}
        if len(formats) != 1:
            raise ValueError(f"cannot fuse weights of formats {sorted(f.name for f in formats)}")
        columns = zip(*(p._tensors() for p in parts))  # a field is None in every part or in none: one format
        stacked = [None if column[0] is None else torch.cat(column) for column in columns]  # type: ignore[arg-type]
        return QuantizedWeight(parts[0].format, *stacked)  # type: ignore[arg-type]


def quantize(weight: torch.Tensor, fmt: QuantFormat) -> QuantizedWeight:
    """Quantize a float [N, K] weight (K a multiple of 32) to Q8_0, Q4_0 or Q4_1 as llama.cpp's
    reference quantizers do: codes from the float32 scale, scales and offsets stored rounded to
    float16 (as GGUF keeps them)."""
    n, k = weight.shape
    if fmt not in (QuantFormat.Q8_0, QuantFormat.Q4_0, QuantFormat.Q4_1):
        raise ValueError(f"cannot quantize to {fmt.name}: only Q8_0, Q4_0 and Q4_1 are produced here")
    if k % BLOCK:
        raise ValueError(f"cannot quantize a weight with {k} input features to {fmt.name}: not a multiple of {BLOCK}")
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    if fmt is QuantFormat.Q8_0:
        amax = blocks.abs().amax(-1)
        scales = amax / 127
        inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        q = torch.round(blocks * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight(fmt, q.view(torch.uint8).reshape(n, k), _as_fp16(scales))
    if fmt is QuantFormat.Q4_0:
        # llama.cpp: the element of largest magnitude maps to -8, keeping its sign
        idx = blocks.abs().argmax(-1, keepdim=True)
        peak = blocks.gather(-1, idx).squeeze(-1)
        scales = peak / -8
        inv = torch.where(scales != 0, 1 / scales, torch.zeros_like(scales))
        q = torch.clamp(torch.floor(blocks * inv.unsqueeze(-1) + 8.5), 0, 15).to(torch.uint8)
        mins = None
    else:
        low, high = blocks.amin(-1), blocks.amax(-1)
        scales = (high - low) / 15
        inv = torch.where(scales != 0, 1 / scales, torch.zeros_like(scales))
        q = torch.clamp(torch.floor((blocks - low.unsqueeze(-1)) * inv.unsqueeze(-1) + 0.5), 0, 15).to(torch.uint8)
        mins = _as_fp16(low)
    return QuantizedWeight(fmt, q.reshape(n, k).contiguous(), _as_fp16(scales), mins)


def _as_fp16(values: torch.Tensor) -> torch.Tensor:
    """float32 holding the nearest float16 values."""
    return values.half().float().contiguous()


def reference_matmul(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """The oracle: x times the dequantized weight, in float32."""
    return x.float() @ weight.dequantize().T
