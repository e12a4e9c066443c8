"""The C++ repack (kernels/csrc/repack.cpp): a tensor's raw GGUF blocks -> the bytes `pack` makes of
them read as a `QuantizedWeight` (engine.weights.gguf_blocks), for every format, with and without a
row order, for row counts that leave a partial last panel; and packed parts stacked by `pack` /
`PackedWeight.cat` as the loader stacks a fused projection's."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from engine.weights.gguf_blocks import to_packed, to_quantized
from kernels import native
from kernels.packing import PackedWeight, pack, pack_gguf_blocks
from kernels.quant import QuantFormat
from tests.unit.kernels.gguf_random import random_blocks

pytestmark = pytest.mark.skipif(not native.is_available(), reason="the C++ kernels are not built")


def _oracle(raw, fmt: QuantFormat, rows: int, cols: int, order: torch.Tensor | None = None) -> PackedWeight:
    weight = to_quantized(raw, GGML[fmt.name], (rows, cols))
    return pack(weight if order is None else weight.index_rows(order))


def _assert_same(got: PackedWeight, expected: PackedWeight) -> None:
    assert got.shape == expected.shape
    assert got.segments == expected.segments
    assert torch.equal(got.data, expected.data)


@pytest.mark.parametrize("fmt", list(QuantFormat), ids=lambda f: f.name)
@pytest.mark.parametrize("rows", [1, 16, 37])
def test_repack_equals_packing_the_read_blocks(fmt: QuantFormat, rows: int) -> None:
    cols = 512
    raw = random_blocks(GGML[fmt.name], rows, cols, seed=fmt.value * 100 + rows)
    _assert_same(pack_gguf_blocks(raw, fmt, rows, cols), _oracle(raw, fmt, rows, cols))
    _assert_same(pack_gguf_blocks(torch.from_numpy(raw), fmt, rows, cols), _oracle(raw, fmt, rows, cols))


@pytest.mark.parametrize("fmt", list(QuantFormat), ids=lambda f: f.name)
def test_repack_reorders_rows(fmt: QuantFormat) -> None:
    rows, cols = 40, 768
    raw = random_blocks(GGML[fmt.name], rows, cols, seed=fmt.value)
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(fmt.value))
    _assert_same(pack_gguf_blocks(raw, fmt, rows, cols, order), _oracle(raw, fmt, rows, cols, order))
    picked = order[:21]  # a selection: fewer rows out than in
    _assert_same(pack_gguf_blocks(raw, fmt, rows, cols, picked), _oracle(raw, fmt, rows, cols, picked))


def test_to_packed_is_the_repack_and_the_fallback_the_same_bytes() -> None:
    raw = random_blocks(GGML.Q5_0, 24, 256, seed=3)
    order = torch.arange(24).flip(0)
    _assert_same(to_packed(raw, GGML.Q5_0, (24, 256), order), _oracle(raw, QuantFormat.Q5_0, 24, 256, order))


def test_bad_inputs_raise() -> None:
    raw = random_blocks(GGML.Q4_0, 4, 64, seed=0)
    with pytest.raises(RuntimeError, match="bytes"):
        pack_gguf_blocks(raw, QuantFormat.Q4_0, 5, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        pack_gguf_blocks(raw, QuantFormat.Q4_0, 4, 64, torch.tensor([0, 4]))
    with pytest.raises(RuntimeError, match="multiple"):
        pack_gguf_blocks(raw, QuantFormat.Q4_K, 4, 64)


def test_stacking_packed_parts_of_mixed_formats_equals_packing_them_together() -> None:
    cols = 256
    specs = [
        (QuantFormat.Q5_0, 32),
        (QuantFormat.Q5_0, 16),
        (QuantFormat.Q8_0, 21),
        (QuantFormat.Q6_K, 19),
        (QuantFormat.Q6_K, 16),
        (QuantFormat.Q4_K, 48),
    ]
    raws = [random_blocks(GGML[fmt.name], rows, cols, seed=i) for i, (fmt, rows) in enumerate(specs)]
    packed = [pack_gguf_blocks(raw, fmt, rows, cols) for raw, (fmt, rows) in zip(raws, specs)]
    read = [to_quantized(raw, GGML[fmt.name], (rows, cols)) for raw, (fmt, rows) in zip(raws, specs)]
    stacked = pack(packed)
    # runs of one format whose earlier parts fill their panels merge into one segment, as `pack` of the reads
    assert stacked.formats == (QuantFormat.Q5_0, QuantFormat.Q8_0, QuantFormat.Q6_K, QuantFormat.Q6_K, QuantFormat.Q4_K)
    assert [s.rows for s in stacked.segments] == [48, 21, 19, 16, 48]
    assert torch.equal(stacked.dequantize(), torch.cat([w.dequantize() for w in read]))
    together = pack(read[:3])
    _assert_same(pack(packed[:3]), together)
    _assert_same(pack([read[0], packed[1], read[2]]), together)  # packed and unpacked parts mix
    x = torch.randn(3, cols)
    out = native.load().qmatmul(x, stacked.data, stacked.table, 32767)
    parts = [native.load().qmatmul(x, p.data, p.table, 32767) for p in packed]
    assert torch.equal(out, torch.cat(parts, dim=1))
