"""Tests for kernels.packing: the panel layout holds every value of the weight it was packed from
(unpacking gives it back, dequantizing either gives the same matrix), padded tails included, for
every format and for weights of row segments in different formats; it gives back any selection of
rows (the embedding lookup of a table shared with the LM head); its bytes are the documented ones."""

from __future__ import annotations

import pytest
import torch

from kernels.packing import PANEL, pack, panel_bytes
from kernels.quant import QuantFormat, QuantizedWeight, quantize
from tests.unit.kernels.gguf_random import random_weight

# bytes per 256 weights of a column, packed: the file's, but Q4_0 (m stored) and Q4_K / Q5_K (one byte
# more per super-block)
BYTES_PER_256 = {QuantFormat.Q8_0: 272, QuantFormat.Q4_0: 160, QuantFormat.Q4_1: 160, QuantFormat.Q5_0: 176,
                 QuantFormat.Q5_1: 192, QuantFormat.Q4_K: 148, QuantFormat.Q5_K: 180, QuantFormat.Q6_K: 210}


def _fields_equal(a: QuantizedWeight, b: QuantizedWeight) -> bool:
    pairs = zip(a._tensors(), b._tensors())
    return a.format is b.format and all(x is y or torch.equal(x, y) for x, y in pairs)


@pytest.mark.parametrize("fmt", list(QuantFormat), ids=lambda f: f.name)
@pytest.mark.parametrize("n", [16, 40, 3])
def test_packing_keeps_every_value(fmt: QuantFormat, n: int) -> None:
    weight = random_weight(fmt, n, 512, seed=n)
    packed = pack(weight)
    panels = -(-n // PANEL)
    assert packed.data.shape == (panels * panel_bytes(fmt, 512),) and packed.data.dtype == torch.uint8
    assert (packed.shape, packed.format, packed.in_features) == ((n, 512), fmt, 512)
    assert panel_bytes(fmt, 512) == 2 * PANEL * BYTES_PER_256[fmt]
    (unpacked,) = packed.unpack()
    if fmt is QuantFormat.Q4_0:  # the packed offset -8 d is derived, not stored by the weight
        assert torch.equal(unpacked.codes, weight.codes) and torch.equal(unpacked.scales, weight.scales)
    else:
        assert _fields_equal(unpacked, weight)
    assert torch.equal(packed.dequantize(), weight.dequantize())
    rows = torch.tensor([n - 1, 0, n // 2, 0])
    assert torch.equal(packed.dequantize(rows), weight.dequantize()[rows])
    with pytest.raises(IndexError):
        packed.dequantize(torch.tensor([n]))


def test_segments_in_different_formats_stack_their_rows() -> None:
    """q/k in Q5_0, v in Q8_0, then Q5_0 again: three segments (runs of one format), each padded."""
    parts = [random_weight(QuantFormat.Q5_0, 20, 256, 1), random_weight(QuantFormat.Q5_0, 12, 256, 2),
             random_weight(QuantFormat.Q8_0, 8, 256, 3), random_weight(QuantFormat.Q6_K, 5, 256, 4)]
    packed = pack(parts)
    assert packed.formats == (QuantFormat.Q5_0, QuantFormat.Q8_0, QuantFormat.Q6_K)
    assert [s.rows for s in packed.segments] == [32, 8, 5]
    q5_bytes, q8_bytes = 2 * panel_bytes(QuantFormat.Q5_0, 256), panel_bytes(QuantFormat.Q8_0, 256)
    assert packed.table.tolist() == [[3, 32, 0], [0, 8, q5_bytes], [7, 5, q5_bytes + q8_bytes]]
    assert packed.num_bytes == packed.table[-1, 2] + panel_bytes(QuantFormat.Q6_K, 256)
    expected = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(packed.dequantize(), expected)
    rows = torch.tensor([44, 3, 33, 31, 40])
    assert torch.equal(packed.dequantize(rows), expected[rows])
    with pytest.raises(ValueError, match="no single format"):
        _ = packed.format
    with pytest.raises(ValueError, match="input features"):
        pack([parts[0], random_weight(QuantFormat.Q5_0, 4, 512, 5)])


def test_the_4_bit_layout_is_the_documented_one() -> None:
    """Byte 2j+t of 4-bit chunk i holds q[j][4i+t] | q[j][4i+2+t] << 4; then 16 scales, 16 offsets (float16)."""
    q = torch.randint(0, 16, (16, 32), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    scales, mins = torch.rand(16, 1) + 0.5, torch.randn(16, 1)
    weight = quantize(q.float() * scales + mins, QuantFormat.Q4_1)
    q = weight.codes
    data = pack(weight).data
    for i in range(8):
        for j in range(16):
            for t in range(2):
                assert data[32 * i + 2 * j + t] == q[j, 4 * i + t] | (q[j, 4 * i + 2 + t] << 4)
    assert torch.equal(data[256:288].view(torch.float16).float(), weight.scales[:, 0])
    assert torch.equal(data[288:320].view(torch.float16).float(), weight.mins[:, 0])


@pytest.mark.parametrize("fmt", [QuantFormat.Q5_0, QuantFormat.Q6_K], ids=lambda f: f.name)
def test_the_high_bits_and_k_quant_scales_are_where_documented(fmt: QuantFormat) -> None:
    """With h bits above the nibble, q[j][4i+2u+t] >> 4 is at bit h(2i+u) of rows (256 + 32 r) byte
    2j+t read as one number; Q6_K: block b's two int8 scales per column after its codes, D at the
    end of the super-block."""
    weight = random_weight(fmt, 16, 256, seed=9)
    data, h = pack(weight).data, fmt.bits - 4
    for j, t, i, u in ((0, 0, 0, 0), (5, 1, 3, 1), (15, 1, 7, 1), (9, 0, 6, 0)):
        position = h * (2 * i + u)
        byte = int(data[256 + 32 * (position // 8) + 2 * j + t])
        assert (byte >> (position % 8)) & ((1 << h) - 1) == int(weight.codes[j, 4 * i + 2 * u + t]) >> 4
    if fmt is QuantFormat.Q6_K:
        block = 384 + 32  # codes, then the block's scales
        second = data[block + 384 : block + 416].view(torch.int8).float()   # block 1's sc of elements 0-15, 16-31
        assert torch.equal(second, weight.scales[:, 2:4].T.reshape(-1))
        assert torch.equal(data[8 * block : 8 * block + 32].view(torch.float16).float(), weight.super_scales[:, 0])
