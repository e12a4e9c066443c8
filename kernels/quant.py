"""Block-quantized weights (GGUF's Q8_0, Q4_0, Q4_1) and the layers that compute with them.

A weight [N, K] is stored per output row in blocks of 32 input elements, each with its own scale:
- Q8_0: w = d * q, q int8;
- Q4_0: w = d * (q - 8), q in 0..15;
- Q4_1: w = d * q + m, q in 0..15.
4-bit values are packed two per byte in GGUF's order: byte i of a block holds element i in its low
nibble and element i + 16 in its high nibble. Scales are kept as float32.

This is the form checkpoints are read, quantized, fused and checked in; `kernels.packing` repacks
it for the matmul (`kernels.quant_linear`). `reference_matmul` is the torch oracle: the
dequantized weight in float32.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

BLOCK = 32


class QuantFormat(enum.Enum):
    Q8_0 = 0  # values are the kernel's format codes
    Q4_0 = 1
    Q4_1 = 2

    @property
    def bits(self) -> int:
        return 8 if self is QuantFormat.Q8_0 else 4


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """`qs` uint8 [N, K] (Q8_0, int8 bytes) or [N, K / 2] (Q4_x); `scales`, `mins` float32 [N, K / 32]
    (float16 values in GGUF files and from `quantize`; the packed form for the matmul keeps float16)."""

    format: QuantFormat
    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = self.qs.shape[0]
        if self.scales.shape != (n, self.in_features // BLOCK):
            raise ValueError(
                f"{self.format.name}: scales {tuple(self.scales.shape)} do not fit qs {tuple(self.qs.shape)}"
            )
        if (self.mins is not None) != (self.format is QuantFormat.Q4_1):
            raise ValueError(f"{self.format.name}: mins are required for Q4_1 and only for it")

    @property
    def in_features(self) -> int:
        return self.qs.shape[1] * (1 if self.format is QuantFormat.Q8_0 else 2)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qs.shape[0], self.in_features)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.mins) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        qs, scales, mins = self.qs, self.scales, self.mins
        n = qs.shape[0]
        if self.format is QuantFormat.Q8_0:
            values = qs.view(torch.int8).float().view(n, -1, BLOCK)
        else:
            packed = qs.view(n, -1, BLOCK // 2)
            values = torch.cat((packed & 0x0F, packed >> 4), dim=-1).float()
            if self.format is QuantFormat.Q4_0:
                values = values - 8
        weight = values * scales.unsqueeze(-1)
        if mins is not None:
            weight = weight + mins.unsqueeze(-1)
        return weight.reshape(n, -1)

    def index_rows(self, rows: torch.Tensor) -> QuantizedWeight:
        """The same weight with its output rows reordered or selected (`rows` int64)."""
        return QuantizedWeight(
            self.format,
            self.qs[rows].contiguous(),
            self.scales[rows].contiguous(),
            None if self.mins is None else self.mins[rows].contiguous(),
        )

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stack the rows of weights of one format (fused projections)."""
        formats = {p.format for p in parts}
        if len(formats) != 1:
            raise ValueError(f"cannot fuse weights of formats {sorted(f.name for f in formats)}")
        mins = [p.mins for p in parts if p.mins is not None]  # all or none: one format
        return QuantizedWeight(
            parts[0].format,
            torch.cat([p.qs for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat(mins) if mins else None,
        )


def quantize(weight: torch.Tensor, fmt: QuantFormat) -> QuantizedWeight:
    """Quantize a float [N, K] weight (K a multiple of 32) as llama.cpp's reference quantizers do:
    values from the float32 scale, scales and offsets stored rounded to float16 (as GGUF keeps them)."""
    n, k = weight.shape
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
    packed = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)
    return QuantizedWeight(fmt, packed.reshape(n, k // 2).contiguous(), _as_fp16(scales), mins)


def _as_fp16(values: torch.Tensor) -> torch.Tensor:
    """float32 holding the nearest float16 values."""
    return values.half().float().contiguous()


def reference_matmul(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """The oracle: x times the dequantized weight, in float32."""
    return x.float() @ weight.dequantize().T
