"""Tests for kernels.packing: the panel layout holds every value of the GGUF-order weight it was
packed from (dequantizing either gives the same matrix), padded tails included, and gives back any
selection of rows (the embedding lookup of a table shared with the LM head)."""

from __future__ import annotations

import pytest
import torch

from kernels.packing import PANEL, pack, panel_block_bytes
from kernels.quant import QuantFormat, quantize


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("fmt", list(QuantFormat), ids=lambda f: f.name)
@pytest.mark.parametrize("n", [16, 40, 3])
def test_packing_keeps_every_value(fmt: QuantFormat, n: int) -> None:
    weight = quantize(_weight(n, 96, seed=n), fmt)
    packed = pack(weight)
    panels = -(-n // PANEL)
    assert packed.data.shape == (panels, 3, panel_block_bytes(fmt.bits)) and packed.data.dtype == torch.uint8
    assert (packed.shape, packed.format, packed.in_features) == ((n, 96), fmt, 96)
    # Q4_0's d * (q - 8) is packed as d * q + (-8 d): equal up to the float rounding of the two forms
    tolerance = 1e-7 if fmt is QuantFormat.Q4_0 else 0.0
    torch.testing.assert_close(packed.dequantize(), weight.dequantize(), atol=tolerance, rtol=0)
    rows = torch.tensor([n - 1, 0, n // 2, 0])
    torch.testing.assert_close(packed.dequantize(rows), weight.dequantize()[rows], atol=tolerance, rtol=0)


def test_the_layout_is_the_documented_one() -> None:
    """Byte 2j+t of 4-bit chunk i holds q[j][4i+t] | q[j][4i+2+t] << 4; then 16 scales, 16 offsets (float16)."""
    q = torch.randint(0, 16, (16, 32), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    scales, mins = torch.rand(16, 1) + 0.5, torch.randn(16, 1)
    weight = quantize(q.float() * scales + mins, QuantFormat.Q4_1)
    q = torch.cat((weight.qs & 0x0F, weight.qs >> 4), dim=1)       # element order
    data = pack(weight).data[0, 0]
    for i in range(8):
        for j in range(16):
            for t in range(2):
                assert data[32 * i + 2 * j + t] == q[j, 4 * i + t] | (q[j, 4 * i + 2 + t] << 4)
    assert torch.equal(data[256:288].view(torch.float16).float(), weight.scales[:, 0])
    assert torch.equal(data[288:320].view(torch.float16).float(), weight.mins[:, 0])
