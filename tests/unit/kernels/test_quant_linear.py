"""Tests for kernels.quant_linear: the C++ matmul over packed weights of every format against an exact
emulation of its arithmetic (activations rounded to int16 or int8 blocks, integer block dots) and
against the dequantized float reference; weights of segments in different formats (one call gives
the bits of one call per segment); row invariance (each row's bits independent of the rest of the
batch, across row tiles); non-finite activations; the Linear and Embedding layers."""

from __future__ import annotations

import os

import pytest
import torch

from kernels import native
from kernels.packing import pack
from kernels.quant import BLOCK, QuantFormat, QuantizedWeight, quantize, reference_matmul
from kernels.quant_linear import INT8_QMAX, INT16_QMAX, QuantizedEmbedding, QuantizedLinear, quantized_matmul
from tests.unit.kernels.gguf_random import random_weight

FORMATS = list(QuantFormat)


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def _emulated(x: torch.Tensor, weight: QuantizedWeight, qmax: int) -> torch.Tensor:
    """The kernel's arithmetic in float64: each row rounded to blocks of `qmax`-scaled integers
    (float32 scale, round half to even), exact integer dots per sub-block, scaled per sub-block."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    d = (amax / qmax).double().squeeze(-1)
    inv = torch.where(amax > 0, qmax / amax, torch.zeros_like(amax))
    xq = torch.round(blocks * inv).double()          # torch.round: half to even, as the kernel
    n, sub = weight.shape[0], weight.format.sub_block
    codes = weight.codes.view(torch.int8) if weight.format is QuantFormat.Q8_0 else weight.codes
    wq = codes.double().reshape(n, -1, sub) - weight.format.offset
    dots = torch.einsum("mbi,nbi->mnb", xq.reshape(m, -1, sub), wq)
    dx = d.repeat_interleave(BLOCK // sub, dim=1)
    out = (dots * (dx[:, None, :] * weight.block_scales().double()[None])).sum(-1)
    mins = weight.block_mins()
    if mins is not None:
        out = out + (d * xq.sum(-1)) @ mins.double().T        # d * sum(q) per activation block
    return out


def _random(fmt: QuantFormat, n: int, k: int, seed: int) -> QuantizedWeight:
    """Q8_0 / Q4_x quantized from floats; the GGUF-only formats from random blocks."""
    if fmt in (QuantFormat.Q8_0, QuantFormat.Q4_0, QuantFormat.Q4_1):
        return quantize(_weight(n, k, seed), fmt)
    return random_weight(fmt, n, k, seed)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m,n,k", [(1, 40, 256), (5, 72, 768), (67, 33, 256), (9, 16, 512)])
def test_the_matmul_is_its_integer_arithmetic_and_close_to_the_float_reference(fmt: QuantFormat, m: int, n: int,
                                                                               k: int) -> None:
    weight = _random(fmt, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    reference = reference_matmul(x, weight)      # dequantized weights, float activations
    for int8, qmax, error in ((False, INT16_QMAX, 1e-4), (True, INT8_QMAX, 0.01)):
        out = quantized_matmul(x, weight, int8_activations=int8)
        assert out.shape == (m, n) and out.dtype == torch.float32
        emulated = _emulated(x, weight, qmax)
        scale = max(1.0, emulated.abs().max().item())   # float32 sums err in proportion to their terms
        torch.testing.assert_close(out.double(), emulated, rtol=1e-5, atol=1e-5 * scale)
        assert ((out - reference).norm() / reference.norm()).item() < error


@pytest.mark.parametrize("m", [1, 7, 20])
def test_a_weight_of_mixed_formats_is_one_call_with_the_bits_of_one_call_per_segment(m: int) -> None:
    """Qwen's q/k in Q5_0 and v in Q8_0, and a gate/up of Q4_K and Q6_K: packed as segments, each
    segment's columns computed exactly as alone, and the whole close to the float product."""
    parts = [_random(QuantFormat.Q5_0, 24, 512, 1), _random(QuantFormat.Q5_0, 8, 512, 2),
             _random(QuantFormat.Q8_0, 8, 512, 3), _random(QuantFormat.Q4_K, 30, 512, 4),
             _random(QuantFormat.Q6_K, 19, 512, 5)]
    packed = pack(parts)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    for int8 in (False, True):
        out = quantized_matmul(x, packed, int8)
        alone = [quantized_matmul(x, pack(QuantizedWeight.cat(parts[:2])), int8)]
        alone += [quantized_matmul(x, part, int8) for part in parts[2:]]
        assert torch.equal(out, torch.cat(alone, dim=1))
    reference = x @ torch.cat([p.dequantize() for p in parts]).T
    assert ((quantized_matmul(x, packed) - reference).norm() / reference.norm()).item() < 1e-4


@pytest.mark.parametrize("int8_activations", [False, True], ids=["int16-activations", "int8-activations"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_each_row_is_the_same_whatever_else_is_in_the_batch(fmt: QuantFormat, int8_activations: bool) -> None:
    weight = pack(_random(fmt, 100, 256, seed=4))    # 7 panels, the last one partial
    x = torch.randn(137, 256, generator=torch.Generator().manual_seed(9))
    together = quantized_matmul(x, weight, int8_activations)
    for rows in (slice(0, 1), slice(3, 4), slice(5, 9), slice(9, 137), slice(70, 131), slice(1, 17)):
        assert torch.equal(quantized_matmul(x[rows], weight, int8_activations), together[rows])


def test_on_a_cpu_with_amx_calls_of_many_rows_run_on_its_tiles() -> None:
    """Where the CPU has AMX-INT8 (Xeons since Sapphire Rapids) and the build targets this CPU, the
    kernels say so and calls of 32 rows or more run on the tiles (kernels/csrc/qamx.cpp), so the
    tests above with such calls (137 and 67 rows against slices of one to 16) compare the tiles'
    bits with the vector tiles'."""
    if not native._cpu_has("amx_tile", "amx_int8") or os.environ.get("TANDEM_KERNEL_ARCH", "native") != "native":
        pytest.skip("this CPU has no AMX, or the kernels are built for another")
    assert native.load().isa().endswith("+amx")


def test_a_non_finite_activation_makes_its_row_nan_and_no_other() -> None:
    weight = pack(quantize(_weight(32, 64, seed=3), QuantFormat.Q4_1))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    clean = quantized_matmul(x, weight)
    x[1, 5], x[2, 40] = float("nan"), float("inf")
    out = quantized_matmul(x, weight)
    assert out[1].isnan().all() and out[2].isnan().all()
    assert torch.equal(out[[0, 3]], clean[[0, 3]])


def test_bfloat16_activations_and_layers() -> None:
    weight = quantize(_weight(64, 64, seed=2), QuantFormat.Q4_1)
    bias = torch.randn(64)
    x = torch.randn(3, 2, 64).bfloat16()
    layer = QuantizedLinear(weight, torch.nn.Parameter(bias.bfloat16()))
    out = layer(x)
    assert out.shape == (3, 2, 64) and out.dtype == torch.bfloat16
    expected = quantized_matmul(x.reshape(6, 64), weight).reshape(3, 2, 64) + bias.bfloat16()
    torch.testing.assert_close(out, expected)
    x32 = torch.randn(5, 64)
    assert torch.equal(QuantizedLinear(weight)(x32), quantized_matmul(x32, weight))   # the fast path: same bits
    table = QuantizedEmbedding(weight, torch.float32)
    ids = torch.tensor([[3, 0], [63, 3]])
    torch.testing.assert_close(table(ids), weight.dequantize()[ids])
    tied = QuantizedLinear(table.quantized)            # a tied LM head reads the table's packed panels
    assert tied.quantized is table.quantized and (tied.in_features, tied.out_features) == (64, 64)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_the_bits_do_not_depend_on_the_number_of_threads(fmt: QuantFormat) -> None:
    """Threads split the output columns (panels), never a sum: 1, 2 and 3 threads give the same bits."""
    weight = pack(_random(fmt, 200, 256, seed=5))
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(6))
    threads = torch.get_num_threads()
    try:
        outputs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outputs.append(quantized_matmul(x, weight))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outputs[0]) for out in outputs[1:])


@pytest.mark.parametrize("fmt", [QuantFormat.Q5_0, QuantFormat.Q6_K, QuantFormat.Q4_K], ids=lambda f: f.name)
def test_an_embedding_table_of_a_gguf_format_looks_up_its_rows_and_serves_as_a_tied_head(fmt: QuantFormat) -> None:
    weight = _random(fmt, 50, 256, seed=7)
    table = QuantizedEmbedding(weight, torch.float32)
    ids = torch.tensor([[49, 0], [17, 49]])
    assert torch.equal(table(ids), weight.dequantize()[ids])
    head = QuantizedLinear(table.quantized)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    assert torch.equal(head(x), quantized_matmul(x, weight)) and f"format={fmt.name}" in repr(head)


def test_the_single_format_form_of_the_kernel_gives_the_same_bits() -> None:
    """benchmarks/kernels.py calls qmatmul(x, packed, n, bits, qmax) on Q8_0 and Q4_x panels."""
    from kernels import native

    if not native.is_available():
        pytest.skip("the C++ kernels are not built")
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(2))
    for fmt in (QuantFormat.Q8_0, QuantFormat.Q4_0, QuantFormat.Q4_1):
        packed = pack(_random(fmt, 40, 256, seed=3))
        legacy = native.load().qmatmul(x, packed.data, 40, packed.bits, INT16_QMAX)
        assert torch.equal(legacy, quantized_matmul(x, packed))
