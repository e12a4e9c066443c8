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
        sampled = truncated(logits, batch).draw(row_uniforms(batch, logits.device)[:, 0])
        token_ids = torch.where(batch.is_greedy, token_ids, sampled)
    return token_ids, logprobs_all.gather(1, token_ids.unsqueeze(1)).squeeze(1)


# A top-k or top-p row's candidates are found among its best _FIRST_CANDIDATES tokens, or four times as
# many while that does not settle which tokens it keeps: no sort of the whole vocabulary.
_FIRST_CANDIDATES = 64


@dataclass(frozen=True, slots=True)
class Candidates:
    """What each row of a batch draws from: `weights` [B, C], its tokens' probabilities after temperature,
    top-k, top-p and min-p, unnormalised (0: dropped, or padding), at `token_ids` [B, C] (None: C is the
    vocabulary, in token order, for every row). A row with top-k or top-p (and a greedy row) lists its best
    tokens in descending order; a row with neither lists the whole vocabulary in token order. Every row's
    order depends on that row alone, so a seeded draw does too."""

    weights: torch.Tensor
    token_ids: torch.Tensor | None

    def normalised(self) -> torch.Tensor:
        """[B, C]: the weights as probabilities (each row sums to 1)."""
        return self.weights / self.weights.sum(dim=-1, keepdim=True)

    def spread(self, values: torch.Tensor, vocab: int) -> torch.Tensor:
        """`values` [B, C], one per candidate, at their tokens of a [B, vocab] tensor (0 elsewhere; a
        padding candidate's value is 0, so adding it changes nothing)."""
        if self.token_ids is None:
            return values
        return torch.zeros(values.shape[0], vocab, device=values.device).scatter_add_(1, self.token_ids, values)

    def draw(self, uniforms: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """[B] token ids: row i's by inverse transform of `uniforms[i]` (U[0, 1)) over its weights (or the
        `weights` given, [B, C] in the same order), so it takes token j with probability weight j / total."""
        index = draw_index(self.weights if weights is None else weights, uniforms)
        return (index if self.token_ids is None else self.token_ids.gather(1, index)).squeeze(1)


def draw_index(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[B, 1]: the column that `uniforms` [B] picks in each row of `weights` [B, C] by inverse transform:
    the first whose cumulative weight passes u * total, which has a weight above 0 (the target is kept below
    the total, where rounding could put it)."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1]
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True)


def truncated(logits: torch.Tensor, batch: SamplingBatch) -> Candidates:
    """Each row's `Candidates` after temperature, top-k, top-p and min-p: what a sampled row draws from, here
    and in `kernels.rejection_sampling`. A greedy row's are its best token (its draw is not used)."""
    scaled = logits / batch.temperatures.clamp(min=1e-5).unsqueeze(1)
    num_rows, vocab = scaled.shape
    top_ks = torch.where(
        batch.is_greedy, 1, torch.where((batch.top_ks > 0) & (batch.top_ks < vocab), batch.top_ks, vocab)
    )
    is_ordered = (top_ks < vocab) | (batch.top_ps < 1)
    ordered = is_ordered.nonzero().flatten().tolist()
    if len(ordered) == num_rows:
        return _best_tokens(scaled, top_ks, batch.top_ps, batch.min_ps)
    # Some row keeps every token but those min-p drops: the rows list the whole vocabulary.
    weights = torch.exp(scaled - scaled.amax(dim=-1, keepdim=True))
    if bool((batch.min_ps > 0).any()):
        weights = weights.masked_fill(weights < batch.min_ps.unsqueeze(1), 0.0)  # relative to the top token's 1
    if not ordered:
        return Candidates(weights, None)
    token_ids = torch.arange(vocab, device=logits.device).expand(num_rows, vocab).clone()
    rows = torch.tensor(ordered, device=logits.device)
    best = _best_tokens(scaled[rows], top_ks[rows], batch.top_ps[rows], batch.min_ps[rows])
    assert best.token_ids is not None
    width = best.weights.shape[-1]
    weights[rows] = torch.nn.functional.pad(best.weights, (0, vocab - width))
    token_ids[rows] = torch.nn.functional.pad(best.token_ids, (0, vocab - width))
    return Candidates(weights, token_ids)


def _best_tokens(scaled: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor) -> Candidates:
    """Candidates of rows that each have a top-k or a top-p, in descending order: the first `count` of
    every row's best tokens, with `count` grown until each row's kept tokens lie within it (its top-k, or
    the prefix whose mass passes its top-p: every token after it is dropped)."""
    vocab = scaled.shape[-1]
    has_top_k = top_ks < vocab
    values, token_ids = scaled.topk(min(vocab, max(_FIRST_CANDIDATES, int(torch.where(has_top_k, top_ks, 0).max()))))
    top = values[:, :1]
    # A row without top-k normalises over every token.
    untruncated_total = None if bool(has_top_k.all()) else torch.exp(scaled - top).sum(dim=-1, keepdim=True)
    while True:
        count = values.shape[-1]
        ranks = torch.arange(count, device=scaled.device).unsqueeze(0)
        exp = torch.exp(values - top).masked_fill(ranks >= top_ks.unsqueeze(1), 0.0)
        total = exp.sum(dim=-1, keepdim=True)
        if untruncated_total is not None:
            total = torch.where(has_top_k.unsqueeze(1), total, untruncated_total)
        probs = exp / total
        mass = probs.cumsum(dim=-1)
        if count == vocab or bool(((top_ks <= count) | (mass[:, -1] > top_ps)).all()):
            break
        values, token_ids = scaled.topk(min(vocab, 4 * count))
    drop = (mass - probs > top_ps.unsqueeze(1)) | (probs < min_ps.unsqueeze(1) * probs[:, :1])
    drop[:, 0] = False  # the most likely token always survives
    return Candidates(probs.masked_fill(drop, 0.0), token_ids)


def mixed_seed(seed: int, step: int) -> int:
    """The generator seed of a seeded row's draws at output position `step`."""
    return (seed * SEED_MIX + step) % (2**63)


def row_uniforms(batch: SamplingBatch, device: torch.device, draws: int = 1) -> torch.Tensor:
    """[B, draws] U[0, 1) on `device`. A seeded row takes them from a CPU generator seeded with
    `mixed_seed(seed, step)`, in order: the same numbers on every device, so a seeded request gives the same
    tokens wherever it runs."""
    uniforms = torch.rand(len(batch.steps), draws, device=device)
    seeded = [(row, seed) for row, seed in enumerate(batch.seeds) if seed is not None]
    if seeded:
        drawn = torch.empty(len(seeded), draws)
        for at, (row, seed) in enumerate(seeded):
            drawn[at].uniform_(generator=torch.Generator().manual_seed(mixed_seed(seed, batch.steps[row])))
        uniforms[[row for row, _ in seeded]] = drawn.to(device)
    return uniforms
