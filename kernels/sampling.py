"""Token sampling over a batch of logits (torch): greedy, temperature, top-k, top-p, min-p, seeds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, step) pairs over the generator's seed space


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Per-row settings, each a [B] tensor except `seeds` (None: unseeded) and `steps`.

    `steps[i]` is how many tokens row i has generated so far; with a seed, the draw for a row
    depends only on (seed, step), so the same request gives the same tokens wherever it runs.
    """

    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    is_greedy: torch.Tensor
    seeds: tuple[int | None, ...]
    steps: tuple[int, ...]

    @property
    def all_greedy(self) -> bool:
        return bool(self.is_greedy.all())


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [B, V] fp32. Returns (token_ids [B] int64, logprobs [B] fp32).

    Logprobs are log_softmax of the raw logits (before temperature and truncation).
    """
    logprobs_all = torch.log_softmax(logits, dim=-1)
    token_ids = logits.argmax(dim=-1)
    if not batch.all_greedy:
        sampled = _sample_random(logits, batch)
        token_ids = torch.where(batch.is_greedy, token_ids, sampled)
    return token_ids, logprobs_all.gather(1, token_ids.unsqueeze(1)).squeeze(1)


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    scaled = logits / batch.temperatures.clamp(min=1e-5).unsqueeze(1)
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab).unsqueeze(0)
    top_ks = torch.where(batch.top_ks > 0, batch.top_ks, vocab).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_ks, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before > batch.top_ps.unsqueeze(1)) | (probs < batch.min_ps.unsqueeze(1) * probs[:, :1])
    drop[:, 0] = False  # the most likely token always survives
    probs = probs.masked_fill(drop, 0.0)
    noise = torch.empty_like(probs)
    for row, (seed, step) in enumerate(zip(batch.seeds, batch.steps)):
        if seed is None:
            noise[row].exponential_()
        else:
            gen = torch.Generator().manual_seed((seed * _SEED_MIX + step) % (2**63))
            noise[row].exponential_(generator=gen)
    choice = (probs / noise).argmax(dim=-1)  # exponential race: picks i with probability probs[i]
    return sorted_ids.gather(1, choice.unsqueeze(1)).squeeze(1)
