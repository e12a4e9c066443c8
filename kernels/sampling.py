"""Token sampling over a batch of logits: greedy, temperature, top-k, top-p, min-p, seeds.

Samplers are chosen by name at start-up (`create_sampler`): `torch` (below: the implementation on
every device, the oracle and the fallback) and `flashinfer` (CUDA; `kernels/flashinfer_sampling.py`,
imported only when asked for).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.registry import BackendRegistry, as_device, is_flashinfer_installed

SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, step) pairs over the generator's seed space


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Per-row settings, each a [B] tensor on the logits' device, except `seeds` (None: unseeded)
    and `steps`.

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


class Sampler(ABC):
    """Picks one token per row of a batch of logits, on `device`."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = as_device(device)

    @abstractmethod
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [B, V] fp32 on the device. Returns (token_ids [B] int64, logprobs [B] fp32) on the
        device; logprobs are log_softmax of the raw logits (before temperature and truncation).
        Greedy rows are exactly argmax; a seeded row's draw depends only on (seed, step)."""


_SAMPLERS: BackendRegistry[Sampler] = BackendRegistry("sampling", {"flashinfer": "kernels.flashinfer_sampling"})


def register_sampler(name: str) -> Callable[[type[Sampler]], type[Sampler]]:
    """Class decorator: make the sampler creatable as `name`."""
    return _SAMPLERS.register(name)


def resolve_sampler(name: str, device: torch.device | str) -> str:
    """The sampler `name` means on `device`. `auto`: FlashInfer on CUDA when installed, else torch.
    Raises ValueError for an unknown name or `flashinfer` off CUDA."""
    device = as_device(device)
    if name == "auto":
        return "flashinfer" if device.type == "cuda" and is_flashinfer_installed() else "torch"
    _SAMPLERS.check_known(name)
    if name == "flashinfer" and device.type != "cuda":
        raise ValueError(f"the flashinfer sampler needs a CUDA device, not {device}")
    return name


def create_sampler(name: str, device: torch.device | str) -> Sampler:
    """The sampler `name` (resolved for `device`). Raises ValueError as `resolve_sampler` does, and
    for a sampler that is not installed."""
    return _SAMPLERS.get(resolve_sampler(name, device))(as_device(device))


@register_sampler("torch")
class TorchSampler(Sampler):
    """`sample` below, on any device."""

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return sample(logits, batch)


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


def truncated_sorted(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, sorted_ids), both [B, V]: each row's probabilities after temperature, top-k, top-p and
    min-p, in descending order and unnormalised (dropped tokens 0), and their token ids. What a
    sampled row draws from, here and in `kernels.rejection_sampling`."""
    scaled = logits / batch.temperatures.clamp(min=1e-5).unsqueeze(1)
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    top_ks = torch.where(batch.top_ks > 0, batch.top_ks, vocab).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_ks, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before > batch.top_ps.unsqueeze(1)) | (probs < batch.min_ps.unsqueeze(1) * probs[:, :1])
    drop[:, 0] = False  # the most likely token always survives
    return probs.masked_fill(drop, 0.0), sorted_ids


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    probs, sorted_ids = truncated_sorted(logits, batch)
    noise = torch.empty_like(probs)
    for row, (seed, step) in enumerate(zip(batch.seeds, batch.steps)):
        if seed is None:
            noise[row].exponential_()
        else:
            _seeded_exponential(noise[row], (seed * SEED_MIX + step) % (2**63))
    choice = (probs / noise).argmax(dim=-1)  # exponential race: picks i with probability probs[i]
    return sorted_ids.gather(1, choice.unsqueeze(1)).squeeze(1)


def _seeded_exponential(out: torch.Tensor, seed: int) -> None:
    """Fill the contiguous row `out` with Exp(1) draws from a CPU generator seeded with `seed`: the
    same numbers on every device (CUDA generators draw other sequences), so a seeded request gives
    the same tokens wherever it runs."""
    gen = torch.Generator().manual_seed(seed)
    if out.device.type == "cpu":
        out.exponential_(generator=gen)
    else:
        out.copy_(torch.empty(out.shape, dtype=out.dtype).exponential_(generator=gen))
