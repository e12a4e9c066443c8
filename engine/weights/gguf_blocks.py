"""A GGUF tensor's raw blocks -> `kernels.quant.QuantizedWeight`, for the block types kept packed,
or straight to the matmul's panels (`to_packed`: the C++ repack, this reading packed without it).

Sizes come from gguf-py (`GGML_QUANT_SIZES`, `QK_K`) and the K-quants' 6-bit scales are unpacked by
its `Q4_K.get_scale_min`; the bit layouts of the codes are those of gguf.quants' dequantizers
(llama.cpp's ggml-quants.c), against which tests/unit/kernels/test_kquants.py checks every type on
random blocks. Each type is a few numpy operations over all of a tensor's blocks at once (no loop
per block): the largest tensors (a 151936 x 1536 Q6_K head) unpack in seconds.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType
from gguf.quants import Q4_K

from kernels import native
from kernels.packing import PackedWeight, pack, pack_gguf_blocks
from kernels.quant import QuantFormat, QuantizedWeight

Blocks = np.ndarray  # uint8 [rows, blocks per row, bytes per block]


def to_quantized(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> QuantizedWeight:
    """The weight [rows, cols] (`shape`, torch order) whose GGUF blocks are `raw` (uint8, any shape
    holding rows * cols / block_size blocks of `qtype`, a key of `PACKED_TYPES`)."""
    rows, cols = shape
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // block_size, type_size)
    return _READERS[qtype](blocks)


def to_packed(
    raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int], row_order: torch.Tensor | None = None
) -> PackedWeight:
    """The panels of the weight `to_quantized` reads (rows reordered by `row_order`, int64, when
    given): by the C++ repack from the blocks as they are (a view of the file's mapping does), or
    without the kernels `pack` of `to_quantized` (the same bytes, 10x slower)."""
    rows, cols = shape
    if native.is_available():
        blocks = np.ascontiguousarray(raw, dtype=np.uint8)
        return pack_gguf_blocks(blocks, QuantFormat[qtype.name], rows, cols, row_order)
    weight = to_quantized(raw, qtype, shape)
    return pack(weight if row_order is None else weight.index_rows(row_order))


def _fields(blocks: Blocks, *sizes: int) -> list[np.ndarray]:
    """The block's consecutive fields of `sizes` bytes (the last one: the rest)."""
    return np.split(blocks, np.cumsum(sizes), axis=-1)


def _half(raw: Blocks) -> torch.Tensor:
    """[R, B, 2] bytes -> float32 [R, B]: the float16 they hold."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def _codes(per_element: np.ndarray) -> torch.Tensor:
    """[R, ..., elements] uint8 in element order -> uint8 [R, K]."""
    return torch.from_numpy(np.ascontiguousarray(per_element).reshape(per_element.shape[0], -1))


def _nibbles(qs: Blocks) -> np.ndarray:
    """[R, B, 16] -> [R, B, 32]: byte i holds element i (low nibble) and i + 16 (high nibble)."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _q8_0(blocks: Blocks) -> QuantizedWeight:
    d, qs = _fields(blocks, 2)
    return QuantizedWeight(QuantFormat.Q8_0, _codes(qs), _half(d))


def _q4_0(blocks: Blocks) -> QuantizedWeight:
    d, qs = _fields(blocks, 2)
    return QuantizedWeight(QuantFormat.Q4_0, _codes(_nibbles(qs)), _half(d))


def _q4_1(blocks: Blocks) -> QuantizedWeight:
    d, m, qs = _fields(blocks, 2, 2)
    return QuantizedWeight(QuantFormat.Q4_1, _codes(_nibbles(qs)), _half(d), _half(m))


def _five_bits(qh: Blocks, qs: Blocks) -> torch.Tensor:
    """Q5_0 / Q5_1 codes: nibbles, and bit e of the little-endian 32-bit `qh` above element e's."""
    return _codes(_nibbles(qs) | (np.unpackbits(qh, axis=-1, bitorder="little") << 4))


def _q5_0(blocks: Blocks) -> QuantizedWeight:
    d, qh, qs = _fields(blocks, 2, 4)
    return QuantizedWeight(QuantFormat.Q5_0, _five_bits(qh, qs), _half(d))


def _q5_1(blocks: Blocks) -> QuantizedWeight:
    d, m, qh, qs = _fields(blocks, 2, 2, 4)
    return QuantizedWeight(QuantFormat.Q5_1, _five_bits(qh, qs), _half(d), _half(m))


def _k_nibbles(qs: Blocks) -> np.ndarray:
    """[R, S, 128] -> [R, S, 8, 32]: 32 bytes per pair of blocks, the first's low nibbles, the second's high."""
    pairs = qs.reshape(*qs.shape[:2], 4, 1, 32)
    return np.concatenate((pairs & 0x0F, pairs >> 4), axis=-2).reshape(*qs.shape[:2], 8, 32)


def _k_quant(fmt: QuantFormat, d: Blocks, dmin: Blocks, packed_scales: Blocks, codes: np.ndarray) -> QuantizedWeight:
    """Q4_K / Q5_K: 6-bit sc and mn per block packed in 12 bytes (gguf-py unpacks them), D, Dmin."""
    rows = codes.shape[0]
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(packed_scales).reshape(-1, Q4_K.K_SCALE_SIZE))
    scales = torch.from_numpy(sc.reshape(rows, -1).astype(np.float32))
    mins = torch.from_numpy(mn.reshape(rows, -1).astype(np.float32))
    return QuantizedWeight(fmt, _codes(codes), scales, mins, _half(d), -_half(dmin))


def _q4_k(blocks: Blocks) -> QuantizedWeight:
    d, dmin, scales, qs = _fields(blocks, 2, 2, Q4_K.K_SCALE_SIZE)
    return _k_quant(QuantFormat.Q4_K, d, dmin, scales, _k_nibbles(qs))


def _q5_k(blocks: Blocks) -> QuantizedWeight:
    """The bit above block j's element l's nibble: bit j of qh[l]."""
    d, dmin, scales, qh, qs = _fields(blocks, 2, 2, Q4_K.K_SCALE_SIZE, QK_K // 8)
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    return _k_quant(QuantFormat.Q5_K, d, dmin, scales, _k_nibbles(qs) | (high << 4))


def _q6_k(blocks: Blocks) -> QuantizedWeight:
    """Nibbles (64 bytes per half: elements l, l + 64 low / high), 2-bit pairs (32 bytes per half:
    elements l + 32 s at bits 2s), 16 int8 scales, D."""
    rows, supers = blocks.shape[:2]
    ql, qh, scales, d = _fields(blocks, QK_K // 2, QK_K // 4, QK_K // 16)
    low = ql.reshape(rows, supers, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    high = qh.reshape(rows, supers, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    codes = (low & 0x0F).reshape(rows, supers, 8, 32) | ((high & 0x03).reshape(rows, supers, 8, 32) << 4)
    sc = torch.from_numpy(np.ascontiguousarray(scales).view(np.int8).reshape(rows, -1).astype(np.float32))
    return QuantizedWeight(QuantFormat.Q6_K, _codes(codes), sc, super_scales=_half(d))


_READERS: dict[GGMLQuantizationType, Callable[[Blocks], QuantizedWeight]] = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}
# the GGUF block types a 2-D tensor of is kept packed (every other type is dequantized to float)
PACKED_TYPES = frozenset(_READERS)
