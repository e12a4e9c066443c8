"""Tests for kernels.quant_linear: the C++ matmul over packed weights against an exact emulation of
its arithmetic (activations rounded to int16 or int8 blocks, integer block dots) and against the
dequantized float reference; row invariance (each row's bits independent of the rest of the batch,
across row tiles); non-finite activations; the Linear and Embedding layers."""

from __future__ import annotations

import pytest
import torch

from kernels.packing import pack
from kernels.quant import BLOCK, QuantFormat, QuantizedWeight, quantize, reference_matmul
from kernels.quant_linear import INT8_QMAX, INT16_QMAX, QuantizedEmbedding, QuantizedLinear, quantized_matmul

FORMATS = list(QuantFormat)


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def _emulated(x: torch.Tensor, weight: QuantizedWeight, qmax: int) -> torch.Tensor:
    """The kernel's arithmetic in float64: each row rounded to blocks of `qmax`-scaled integers
    (float32 scale, round half to even), exact integer block dots, scaled per block."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    d = amax / qmax
    inv = torch.where(amax > 0, qmax / amax, torch.zeros_like(amax))
    xq = torch.round(blocks * inv).double()          # torch.round: half to even, as the kernel
    n = weight.shape[0]
    if weight.format is QuantFormat.Q8_0:
        wq = weight.qs.view(torch.int8).double().reshape(n, -1, BLOCK)
    else:
        packed = weight.qs.reshape(n, -1, BLOCK // 2)
        wq = torch.cat((packed & 0x0F, packed >> 4), dim=-1).double()
    dots = torch.einsum("mbi,nbi->mnb", xq, wq)
    out = (dots * (d.double().squeeze(-1)[:, None, :] * weight.scales.double()[None])).sum(-1)
    mins = weight.mins if weight.format is QuantFormat.Q4_1 else (-8 * weight.scales if weight.format is QuantFormat.Q4_0 else None)
    if mins is not None:
        block_sums = d.double().squeeze(-1) * xq.sum(-1)          # d * sum(q) per activation block
        out = out + block_sums @ mins.double().T
    return out


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (5, 72, 576), (67, 33, 96), (9, 16, 32)])
def test_the_matmul_is_its_integer_arithmetic_and_close_to_the_float_reference(fmt: QuantFormat, m: int, n: int,
                                                                               k: int) -> None:
    weight = quantize(_weight(n, k, seed=m), fmt)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    reference = reference_matmul(x, weight)      # dequantized weights, float activations
    for int8, qmax, error in ((False, INT16_QMAX, 1e-4), (True, INT8_QMAX, 0.01)):
        out = quantized_matmul(x, weight, int8_activations=int8)
        assert out.shape == (m, n) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), _emulated(x, weight, qmax), rtol=1e-5, atol=1e-5)
        assert ((out - reference).norm() / reference.norm()).item() < error


@pytest.mark.parametrize("int8_activations", [False, True], ids=["int16-activations", "int8-activations"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_each_row_is_the_same_whatever_else_is_in_the_batch(fmt: QuantFormat, int8_activations: bool) -> None:
    weight = pack(quantize(_weight(100, 192, seed=4), fmt))    # 7 panels, the last one partial
    x = torch.randn(137, 192, generator=torch.Generator().manual_seed(9))
    together = quantized_matmul(x, weight, int8_activations)
    for rows in (slice(0, 1), slice(3, 4), slice(5, 9), slice(9, 137), slice(70, 131), slice(1, 17)):
        assert torch.equal(quantized_matmul(x[rows], weight, int8_activations), together[rows])


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
    weight = pack(quantize(_weight(200, 192, seed=5), fmt))
    x = torch.randn(37, 192, generator=torch.Generator().manual_seed(6))
    threads = torch.get_num_threads()
    try:
        outputs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outputs.append(quantized_matmul(x, weight))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outputs[0]) for out in outputs[1:])
