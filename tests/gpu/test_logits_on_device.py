"""Logits processors and the torch sampler on CUDA tensors give what they give on the CPU: penalties,
logit bias and the min-tokens mask (engine/logits.py), grammar masks (xgrammar's CUDA kernel), and a
seeded request's draws (a CPU generator on every device). The device checks that need no GPU are in
tests/unit/engine/test_logits.py (on `meta`). Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from engine.grammar import GrammarBackend  # noqa: E402
from tandem.sampling import GrammarKind, GrammarSpec  # noqa: E402
from engine.logits import adjust_logits  # noqa: E402
from engine.request import Request, SamplingParams  # noqa: E402
from kernels.sampling import SamplingBatch, sample  # noqa: E402

CUDA = torch.device("cuda")


def _logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_penalties_bias_and_min_tokens_adjust_cuda_logits_as_cpu_logits() -> None:
    requests = [
        Request("p", [5, 6, 5], SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
                output_ids=[6, 7, 7]),
        Request("b", [1, 2], SamplingParams(logit_bias=((3, 5.0), (9, -100.0)))),
        Request("m", [1, 2], SamplingParams(min_new_tokens=2, stop_token_ids=(4,))),
        Request("n", [1, 2], SamplingParams()),
    ]
    logits = _logits(4, 64)
    on_cpu = adjust_logits(logits, requests, eos_token_ids=(2,))
    on_cuda = adjust_logits(logits.to(CUDA), requests, eos_token_ids=(2,))
    assert on_cuda.device.type == "cuda"
    torch.testing.assert_close(on_cuda.cpu(), on_cpu, rtol=1e-6, atol=1e-6)


def test_a_grammar_mask_limits_cuda_logits_as_cpu_logits(smollm2_path: Path) -> None:
    backend = GrammarBackend(str(smollm2_path), 49152)
    spec = GrammarSpec(GrammarKind.REGEX, "(yes|no)")
    logits = _logits(2, 49152, seed=1)
    on_cpu = backend.mask_logits(logits, [backend.new_matcher(spec), None])
    on_cuda = backend.mask_logits(logits.to(CUDA), [backend.new_matcher(spec), None])
    assert on_cuda.device.type == "cuda"
    assert torch.equal(torch.isinf(on_cuda.cpu()), torch.isinf(on_cpu))
    assert torch.isinf(on_cpu[0]).sum() > 49000 and not torch.isinf(on_cpu[1]).any()


def _batch(rows: int, device: torch.device, seeds: tuple[int | None, ...]) -> SamplingBatch:
    def full(value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype, device=device)
    return SamplingBatch(temperatures=full(0.8, torch.float32), top_ps=full(0.9, torch.float32),
                         top_ks=full(50, torch.int64), min_ps=full(0.0, torch.float32),
                         is_greedy=full(False, torch.bool), seeds=seeds, steps=tuple(range(rows)))


def test_seeded_requests_draw_the_same_tokens_on_cuda_as_on_the_cpu() -> None:
    seeds = (7, 1234, 2**40, 0)
    logits = _logits(len(seeds), 4096, seed=2)
    on_cpu, _ = sample(logits, _batch(len(seeds), torch.device("cpu"), seeds))
    on_cuda, logprobs = sample(logits.to(CUDA), _batch(len(seeds), CUDA, seeds))
    assert on_cuda.device.type == "cuda" and logprobs.device.type == "cuda"
    assert on_cuda.cpu().tolist() == on_cpu.tolist()
