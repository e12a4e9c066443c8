"""Penalties, logit bias and token masks against their definitions (and HF's repetition penalty)."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from kernels.logits_processors import PenaltyBatch, apply_logit_bias, apply_penalties, mask_tokens, token_histories


def _batch(presence=0.0, frequency=0.0, repetition=1.0, outputs=(), prompts=(), vocab=8) -> PenaltyBatch:
    outs, prompt = [list(outputs)], [list(prompts) + list(outputs)]
    return PenaltyBatch(torch.tensor([presence]), torch.tensor([frequency]), torch.tensor([repetition]),
                        token_histories(outs, vocab), token_histories(prompt, vocab) > 0)


def test_frequency_and_presence_follow_the_openai_formula() -> None:
    logits = torch.randn(1, 8)
    out = apply_penalties(logits, _batch(presence=0.5, frequency=0.25, outputs=[3, 3, 5]))
    expected = logits.clone()
    expected[0, 3] -= 0.25 * 2 + 0.5
    expected[0, 5] -= 0.25 * 1 + 0.5
    torch.testing.assert_close(out, expected)


def test_repetition_penalty_equals_hf_over_prompt_and_output() -> None:
    logits = torch.randn(1, 8) * 3
    out = apply_penalties(logits, _batch(repetition=1.3, outputs=[1, 6], prompts=[2, 6, 0]))
    hf = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([[2, 6, 0, 1, 6]]), logits.clone())
    torch.testing.assert_close(out, hf)


def test_rows_without_penalties_are_untouched() -> None:
    logits = torch.randn(1, 8)
    torch.testing.assert_close(apply_penalties(logits, _batch(outputs=[1, 2, 3], prompts=[4])), logits)


def test_logit_bias_adds_per_row_and_mask_bans() -> None:
    logits = torch.zeros(2, 5)
    biased = apply_logit_bias(logits, [{1: 5.0, 4: -100.0}, {}])
    assert biased[0].tolist() == [0, 5, 0, 0, -100] and biased[1].tolist() == [0] * 5
    masked = mask_tokens(logits, [(), (0, 2)])
    assert masked[0].tolist() == [0] * 5
    assert masked[1, 0] == float("-inf") and masked[1, 2] == float("-inf") and masked[1, 1] == 0
    assert logits.abs().sum() == 0   # inputs are not modified in place
