"""FlashInfer's verification of draft tokens on CPU (`FlashInferSampler.verify`): the chain kernel's call
bound against the installed API, and the routing of requests between it and the torch verification, run
over a torch stand-in of the kernel. Skipped where flashinfer is not installed; the kernel itself is
checked on CUDA in tests/gpu/test_flashinfer_vs_torch.py."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

pytest.importorskip("flashinfer")
import flashinfer.sampling  # noqa: E402

from kernels import flashinfer_sampling as fs  # noqa: E402
from kernels import rejection_sampling as rs  # noqa: E402
from tests.unit.kernels.test_flashinfer_api import _batch, _bind, _FakeSamplingKernels, _sampler  # noqa: E402


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch) -> _FakeSamplingKernels:
    fake = _FakeSamplingKernels()
    fake.install(monkeypatch)
    return fake




class _FakeChainKernel:
    """`flashinfer.sampling.chain_speculative_sampling` in torch, bound against the real signature: per
    request, draft j is accepted when u < p_j(d) / q_j(d); the first rejection emits a draw from
    norm(max(p_j - q_j, 0)), and all accepted a bonus draw from p_k. Records each call's tensors."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.gen = torch.Generator().manual_seed(0)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real = flashinfer.sampling.chain_speculative_sampling

        def call(draft_probs: torch.Tensor, draft_token_ids: torch.Tensor, target_probs: torch.Tensor,
                 **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            inspect.signature(real).bind(draft_probs, draft_token_ids, target_probs, **kwargs)
            num_requests, k = draft_token_ids.shape
            assert draft_token_ids.dtype == torch.int32
            assert draft_probs.shape == (num_requests, k, target_probs.shape[-1])
            assert target_probs.shape[:2] == (num_requests, k + 1)
            self.calls.append((draft_probs.clone(), draft_token_ids.clone(), target_probs.clone()))
            return self._sample(draft_probs, draft_token_ids, target_probs)

        monkeypatch.setattr(flashinfer.sampling, "chain_speculative_sampling", call)

    def _sample(self, q: torch.Tensor, drafts: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, ...]:
        num_requests, k = drafts.shape
        out = torch.full((num_requests, k + 1), -1, dtype=torch.int32)
        emitted = torch.zeros(num_requests, dtype=torch.int32)
        for b in range(num_requests):
            for j in range(k + 1):
                if j == k:
                    out[b, j] = int(torch.multinomial(p[b, j], 1, generator=self.gen))
                    break
                d = int(drafts[b, j])
                if float(torch.rand(1, generator=self.gen)) * float(q[b, j, d]) < float(p[b, j, d]):
                    out[b, j] = d
                    emitted[b] += 1
                    continue
                residual = (p[b, j] - q[b, j]).clamp(min=0)
                out[b, j] = int(torch.multinomial(residual, 1, generator=self.gen))
                break
        return out, emitted.clone(), emitted


@pytest.fixture
def chain(monkeypatch: pytest.MonkeyPatch, kernels: _FakeSamplingKernels) -> _FakeChainKernel:
    fake = _FakeChainKernel()
    fake.install(monkeypatch)
    return fake


def test_the_chain_call_binds() -> None:
    q, ids, p = torch.empty(2, 3, 10), torch.empty(2, 3, dtype=torch.int32), torch.empty(2, 4, 10)
    _bind(flashinfer.sampling.chain_speculative_sampling, q, ids, p, **fs.chain_kwargs())


def _verify_logits(num_drafts: list[int], vocab: int = 12, seed: int = 3) -> torch.Tensor:
    return 1.5 * torch.randn(sum(num_drafts) + len(num_drafts), vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_seeded_and_draftless_requests_get_the_torch_verification(chain: _FakeChainKernel) -> None:
    drafts = [[1, 2], [3], [], [4, 5, 6]]
    logits = _verify_logits([len(d) for d in drafts])
    batch = _batch(4, temperature=0.8, is_greedy=[True, False, False, False], seeds=(None, 11, None, 12),
                   steps=(0, 4, 2, 9))
    torch.manual_seed(7)   # the draftless request's draw is unseeded: both runs draw the same numbers
    got = _sampler().verify(logits, drafts, None, batch)
    torch.manual_seed(7)
    assert got == rs.verify(logits, drafts, None, batch)
    assert not chain.calls


SETTINGS_VERIFY = {"plain": {}, "top_k_top_p": {"top_k": 4, "top_p": 0.85}, "everything": {"top_k": 4, "top_p": 0.85,
                                                                                           "min_p": 0.2}}


@pytest.mark.parametrize("settings", SETTINGS_VERIFY.values(), ids=SETTINGS_VERIFY.keys())
def test_sampled_unseeded_requests_go_to_the_chain_kernel_with_the_torch_samplers_targets(
        chain: _FakeChainKernel, settings: dict) -> None:
    """Requests with 2 drafts and with 1 go to two kernel calls; the greedy one in between stays with the
    torch verification. The target rows the kernel gets are the distributions the torch sampler draws
    from, the drafts' rows one-hot; each request emits its accepted drafts and one more token, with the
    raw logits' logprobs."""
    drafts = [[1, 2], [3, 4], [5], [7, 8]]
    num_drafts = [len(d) for d in drafts]
    logits = _verify_logits(num_drafts)
    batch = _batch(4, temperature=0.7, is_greedy=[False, True, False, False], **settings)
    got = _sampler().verify(logits, drafts, None, batch)
    assert [ids.tolist() for _, ids, _ in chain.calls] == [[[1, 2], [7, 8]], [[5]]]
    rows = rs.expand_to_rows(batch, num_drafts)
    firsts = rs.first_rows(num_drafts)
    for (q, ids, p), group in zip(chain.calls, ([0, 3], [2])):
        group_rows = [firsts[i] + j for i in group for j in range(num_drafts[i] + 1)]
        expected = rs.target_probs(logits[group_rows], fs.select_requests(rows, group_rows))
        torch.testing.assert_close(p.reshape(len(group_rows), -1), expected, atol=1e-6, rtol=1e-5)
        assert torch.equal(q.argmax(dim=-1), ids.long()) and torch.equal(q.sum(dim=-1), torch.ones(ids.shape))
    assert got.token_ids[1] == rs.verify(logits[firsts[1]:firsts[1] + 3], [drafts[1]], None,
                                         fs.select_requests(batch, [1])).token_ids[0]
    for tokens, request_drafts, first, logprobs in zip(got.token_ids, drafts, firsts, got.logprobs):
        num_accepted = len(tokens) - 1
        assert tokens[:num_accepted] == request_drafts[:num_accepted]
        expected_logprobs = [float(torch.log_softmax(logits[first + j], -1)[t]) for j, t in enumerate(tokens)]
        assert logprobs == pytest.approx(expected_logprobs, abs=1e-5)


def test_the_chain_kernel_gets_the_draft_models_probabilities(chain: _FakeChainKernel) -> None:
    drafts = [[1, 2], [3, 4]]
    logits = _verify_logits([2, 2])
    draft_probs = torch.softmax(torch.randn(4, 12, generator=torch.Generator().manual_seed(5)), dim=-1)
    _sampler().verify(logits, drafts, draft_probs, _batch(2, temperature=0.9))
    (q, _, _), = chain.calls
    assert torch.equal(q.reshape(4, 12), draft_probs)
