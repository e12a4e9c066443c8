"""GGUF's block types read into `QuantizedWeight`s (engine.weights.gguf_blocks), packed and multiplied:
random raw blocks (every code and sub-scale bit random, sane float16 scales) give exactly gguf-py's
dequantized weights, before and after packing; the C++ matmul over them is close to x @ W^T; a real
Q4_K_M file's tensors of every type read exactly too, when the model cache holds it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGML
from gguf import GGUFReader

from engine.weights.gguf_blocks import PACKED_TYPES, to_quantized
from kernels.packing import pack
from kernels.quant import QuantFormat
from kernels.quant_linear import quantized_matmul
from tests.unit.kernels.gguf_random import gguf_dequantize_reference, random_blocks

PACKED = [GGML.Q8_0, GGML.Q4_0, GGML.Q4_1, GGML.Q5_0, GGML.Q5_1, GGML.Q4_K, GGML.Q5_K, GGML.Q6_K]
REAL_MODEL = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"  # scripts/fetch_models.py fetches it


@pytest.mark.parametrize("qtype", PACKED, ids=lambda t: t.name)
def test_random_blocks_read_and_pack_to_exactly_gguf_pys_weights(qtype: GGML) -> None:
    raw = random_blocks(qtype, 40, 512, seed=qtype.value)
    weight = to_quantized(raw, qtype, (40, 512))
    assert weight.format is QuantFormat[qtype.name] and weight.shape == (40, 512)
    reference = gguf_dequantize_reference(raw, qtype)
    assert torch.equal(weight.dequantize(), reference)
    packed = pack(weight)
    assert torch.equal(packed.dequantize(), reference)
    rows = torch.tensor([39, 0, 17, 17])
    assert torch.equal(packed.dequantize(rows), reference[rows])
    order = torch.tensor([5, 39, 0])
    assert torch.equal(weight.index_rows(order).dequantize(), reference[order])


@pytest.mark.parametrize("qtype", PACKED, ids=lambda t: t.name)
def test_the_matmul_over_gguf_blocks_is_close_to_the_float_product(qtype: GGML) -> None:
    raw = random_blocks(qtype, 72, 768, seed=100 + qtype.value)
    weight = to_quantized(raw, qtype, (72, 768))
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(1))
    reference = x @ gguf_dequantize_reference(raw, qtype).T
    for int8_activations, error in ((False, 1e-4), (True, 0.02)):
        out = quantized_matmul(x, pack(weight), int8_activations)
        assert ((out - reference).norm() / reference.norm()).item() < error


@pytest.mark.parametrize("qtype", PACKED, ids=lambda t: t.name)
def test_packed_bytes_stay_within_a_few_percent_of_the_files(qtype: GGML) -> None:
    raw = random_blocks(qtype, 64, 1024, seed=3)
    ratio = pack(to_quantized(raw, qtype, (64, 1024))).num_bytes / raw.nbytes
    assert ratio <= (20 / 18 if qtype is GGML.Q4_0 else 148 / 144)   # Q4_0 stores m; K-quants one byte more


def test_types_without_a_packed_form_are_left_to_the_float_path() -> None:
    assert PACKED_TYPES == frozenset(PACKED)
    assert GGML.Q2_K not in PACKED_TYPES and GGML.Q3_K not in PACKED_TYPES


def _real_model() -> Path:
    cache = os.environ.get("TANDEM_MODEL_CACHE") or Path.home() / ".cache" / "tandem" / "models"
    return Path(cache) / REAL_MODEL


@pytest.mark.skipif(not _real_model().exists(), reason=f"{REAL_MODEL} is not in the model cache")
def test_a_real_q4_k_m_files_tensors_of_every_type_read_exactly() -> None:
    """Qwen2.5-Coder-0.5B Q4_K_M: Q5_0, Q8_0, Q4_K and Q6_K matrices; the first of each type (but the
    vocabulary-sized ones, for time) against gguf-py, and through the matmul."""
    seen = set()
    for tensor in GGUFReader(_real_model()).tensors:
        if tensor.tensor_type not in PACKED_TYPES or tensor.tensor_type in seen or len(tensor.shape) != 2:
            continue
        rows, cols = (int(d) for d in reversed(tensor.shape))
        if rows > 10000:
            continue
        seen.add(tensor.tensor_type)
        weight = to_quantized(tensor.data, tensor.tensor_type, (rows, cols))
        reference = gguf_dequantize_reference(np.asarray(tensor.data), tensor.tensor_type).reshape(rows, cols)
        assert torch.equal(weight.dequantize(), reference), tensor.name
        x = torch.randn(2, cols, generator=torch.Generator().manual_seed(0))
        expected = x @ reference.T
        assert ((quantized_matmul(x, weight) - expected).norm() / expected.norm()).item() < 1e-4, tensor.name
    assert seen == {GGML.Q5_0, GGML.Q8_0, GGML.Q4_K, GGML.Q6_K}
