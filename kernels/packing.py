"""Block-quantized weights repacked once at load into the layout the C++ matmul reads (panels).

The matmul (`kernels/csrc/qmatmul.cpp`) computes 16 output columns at a time with integer dot
products. For that it wants, for each panel of 16 columns and each 32-input block, the 16
columns' values interleaved so that one 32-byte load expands to the operand of one vector
instruction, followed by their 16 scales and (4-bit formats) 16 offsets:

- 4-bit: 8 chunks of 32 bytes; byte 2j+t of chunk i holds q[j][4i+t] (low nibble) and
  q[j][4i+2+t] (high nibble), for column j of the panel and t in {0, 1};
- 8-bit: 16 chunks of 32 bytes; byte 2j+t of chunk i holds q[j][2i+t] (int8).

A 4-bit weight is d * q + m: Q4_1 as stored, Q4_0 (d * (q - 8)) with m = -8 d. Scales and
offsets are stored as float16, as GGUF stores them (exact for GGUF files and for `quantize`'s
output, which rounds them so; any other float32 scale is rounded here). The last panel is padded
with zero columns. The packed tensor is [ceil(N / 16), K / 32, panel_block_bytes] uint8: 5/8 of a
byte per 4-bit weight and 17/16 per 8-bit one, as in the GGUF file (decode at batch 1 reads every
byte once per token, so bytes are time).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.quant import BLOCK, QuantFormat, QuantizedWeight

PANEL = 16


def panel_block_bytes(bits: int) -> int:
    """Bytes of one (panel, block): values, 16 float16 scales, and 16 float16 offsets for 4-bit formats."""
    return 512 + 32 if bits == 8 else 256 + 64


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A block-quantized weight [N, K] in panel layout (module docstring); what the matmul reads."""

    format: QuantFormat
    shape: tuple[int, int]
    data: torch.Tensor

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def bits(self) -> int:
        return self.format.bits

    @property
    def num_bytes(self) -> int:
        return self.data.numel()

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [N, K] (d * q + m per block), or only the output rows named by `rows` (int64)."""
        n, k = self.shape
        rows = torch.arange(n) if rows is None else rows.reshape(-1)
        nb, q_bytes = k // BLOCK, 512 if self.bits == 8 else 256
        panel, lane = rows // PANEL, rows % PANEL
        blocks = self.data[panel]  # [T, nb, bytes]
        scales = _floats(blocks[..., q_bytes : q_bytes + 32])[torch.arange(len(rows)), :, lane]  # [T, nb]
        chunks = blocks[..., :q_bytes].reshape(len(rows), nb, -1, PANEL, 2)  # [T, nb, chunk, column, t]
        values = chunks[torch.arange(len(rows)), :, :, lane]  # [T, nb, chunk, t]
        if self.bits == 8:
            q = values.view(torch.int8).float().reshape(len(rows), nb, BLOCK)
            return (q * scales.unsqueeze(-1)).reshape(len(rows), k)
        q = torch.stack((values & 0x0F, values >> 4), dim=-2).float().reshape(len(rows), nb, BLOCK)
        mins = _floats(blocks[..., q_bytes + 32 :])[torch.arange(len(rows)), :, lane]
        return (q * scales.unsqueeze(-1) + mins.unsqueeze(-1)).reshape(len(rows), k)


def _floats(raw: torch.Tensor) -> torch.Tensor:
    """[..., 32] uint8 -> [..., 16] float32 (the float16 values stored)."""
    return raw.contiguous().view(torch.float16).float()


def pack(weight: QuantizedWeight) -> PackedWeight:
    """The panel layout of a GGUF-order `QuantizedWeight` (exact: no value changes but Q4_0's offset)."""
    n, k = weight.shape
    nb, panels = k // BLOCK, -(-n // PANEL)
    pad = panels * PANEL - n
    scales = weight.scales
    if weight.format is QuantFormat.Q8_0:
        q = weight.qs.reshape(n, nb, BLOCK)
    else:
        packed = weight.qs.reshape(n, nb, BLOCK // 2)
        q = torch.cat((packed & 0x0F, packed >> 4), dim=-1)  # [n, nb, 32] values 0..15 in element order
    mins = weight.mins if weight.format is not QuantFormat.Q4_0 else -8 * scales
    if pad:
        q = torch.cat((q, q.new_zeros(pad, nb, BLOCK)))
        scales = torch.cat((scales, scales.new_zeros(pad, nb)))
        mins = None if mins is None else torch.cat((mins, mins.new_zeros(pad, nb)))
    q = q.reshape(panels, PANEL, nb, BLOCK)
    if weight.format is QuantFormat.Q8_0:
        # [panel, column j, block, chunk i, t] -> [panel, block, chunk i, column j, t]
        values = q.reshape(panels, PANEL, nb, 16, 2).permute(0, 2, 3, 1, 4)
    else:
        # k = 4i + 2u + t: nibble u of byte (i, j, t)
        q = q.reshape(panels, PANEL, nb, 8, 2, 2)
        nibbles = q[..., 0, :] | (q[..., 1, :] << 4)  # [panel, j, block, i, t]
        values = nibbles.permute(0, 2, 3, 1, 4)
    parts = [values.reshape(panels, nb, -1), _bytes(scales, panels, nb)]
    if mins is not None:
        parts.append(_bytes(mins, panels, nb))
    data = torch.cat(parts, dim=-1).contiguous()
    return PackedWeight(weight.format, (n, k), data)


def _bytes(per_column: torch.Tensor, panels: int, nb: int) -> torch.Tensor:
    """[N', nb] float32 (N' = panels * 16) -> [panels, nb, 32] uint8: the panel's 16 values per block, float16."""
    by_panel = per_column.half().reshape(panels, PANEL, nb).permute(0, 2, 1).contiguous()
    return by_panel.view(torch.uint8).reshape(panels, nb, 32)
