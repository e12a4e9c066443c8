"""Token sampling with FlashInfer's kernels (CUDA), the torch sampler (`kernels.sampling.sample`)
being its oracle and fallback. Imported only when the `flashinfer` sampler is asked for.

Same contract as the torch sampler: greedy rows are exactly `argmax` of the logits; other rows draw
from softmax(logits / temperature) truncated to the top-k tokens, then to the top-p nucleus of what
is left, and to the tokens of at least min-p times the largest probability; logprobs are
log_softmax of the raw logits at the chosen token.

Where it differs from the torch sampler, because FlashInfer works so:
- Draws come from Philox (FlashInfer's rejection sampling), not from torch generators, so even a
  seeded request draws other tokens than the torch sampler would; seeded draws are reproducible
  among FlashInfer runs, on any batch position.
- A seeded row's draw depends only on (seed, step), as in the torch sampler: it is drawn alone
  (FlashInfer's kernels fold the row's batch position into the Philox subsequence, so a batched
  draw would change with it) with Philox seed `kernels.sampling.mixed_seed(seed, step)` at offset 0.
  One kernel launch per seeded row.
- Unseeded rows are drawn together from torch's default CUDA generator (`torch.manual_seed` seeds it).
- Top-p keeps a token when the mass of strictly more likely tokens is below top_p; the torch sampler
  keeps it when the mass before it in sorted order is at most top_p. They differ only on exact
  boundaries and on ties straddling the boundary (FlashInfer keeps or drops tied tokens together).

Verifying draft tokens (`verify`, speculative decoding): the requests that sample, have no seed and have
drafts go to FlashInfer's chain speculative sampling, over the distributions the torch sampler draws
from; the others keep the torch verification (`kernels/rejection_sampling.py`), so greedy and seeded
requests get exactly its tokens.

Every FlashInfer call is built as a `SamplingCall` (or, for the chain kernel, `chain_kwargs`) by a plain
function, so CPU tests bind its arguments against the installed API's signatures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import flashinfer.sampling
import torch

from kernels.rejection_sampling import Verified, check_shapes, expand_to_rows, first_rows, verify, with_logprobs
from kernels.sampling import Sampler, SamplingBatch, mixed_seed, register_sampler

MIN_TEMPERATURE = 1e-5  # as the torch sampler clamps it
MIN_TOP_P = 1e-6  # top_p 0 means "the most likely token only"; FlashInfer needs a positive value


@dataclass(frozen=True, slots=True)
class SamplingCall:
    """One `flashinfer.sampling` function applied to the running tensor: `x = fn(x, **kwargs)`."""

    fn: str
    kwargs: dict[str, Any]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(flashinfer.sampling, self.fn)(x, **self.kwargs)


@dataclass(frozen=True, slots=True)
class RowFilters:
    """A batch's settings in FlashInfer's terms, each [B] on the logits' device: temperatures
    float32 >= MIN_TEMPERATURE, top_ks int32 in 1..V (V: off), top_ps float32 in [MIN_TOP_P, 1],
    min_ps float32 (0: off); and whether any row truncates by each filter."""

    temperatures: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor
    min_ps: torch.Tensor
    has_top_k: bool
    has_top_p: bool
    has_min_p: bool

    def row(self, i: int) -> RowFilters:
        """Row i alone, as a batch of one."""
        rows = slice(i, i + 1)
        return RowFilters(
            self.temperatures[rows],
            self.top_ks[rows],
            self.top_ps[rows],
            self.min_ps[rows],
            self.has_top_k,
            self.has_top_p,
            self.has_min_p,
        )


def row_filters(batch: SamplingBatch, vocab_size: int) -> tuple[RowFilters, list[bool]]:
    """The batch's filters, and which rows are greedy; reads four flags per row to the host, once."""
    top_ks = torch.where((batch.top_ks > 0) & (batch.top_ks < vocab_size), batch.top_ks, vocab_size)
    flags = torch.stack([batch.is_greedy, top_ks < vocab_size, batch.top_ps < 1.0, batch.min_ps > 0.0]).cpu()
    has_top_k, has_top_p, has_min_p = (bool(f) for f in flags[1:].any(dim=1))
    filters = RowFilters(
        temperatures=batch.temperatures.float().clamp(min=MIN_TEMPERATURE),
        top_ks=top_ks.to(torch.int32),
        top_ps=batch.top_ps.float().clamp(min=MIN_TOP_P, max=1.0),
        min_ps=batch.min_ps.float(),
        has_top_k=has_top_k,
        has_top_p=has_top_p,
        has_min_p=has_min_p,
    )
    return filters, flags[0].tolist()


def renorm_calls(filters: RowFilters) -> list[SamplingCall]:
    """logits [B, V] -> probs [B, V]: the tempered softmax, then top-k and top-p renormalisation where
    some row truncates by them (min-p is left to the draw, or to `min_p_renorm`)."""
    calls = [SamplingCall("softmax", {"temperature": filters.temperatures})]
    if filters.has_top_k:
        calls.append(SamplingCall("top_k_renorm_probs", {"top_k": filters.top_ks}))
    if filters.has_top_p:
        calls.append(SamplingCall("top_p_renorm_probs", {"top_p": filters.top_ps}))
    return calls


def filter_calls(filters: RowFilters) -> list[SamplingCall]:
    """logits [B, V] -> probs [B, V] for `draw_call`: the tempered softmax, then, only when some row
    uses min-p (which FlashInfer's fused top-k/top-p draw cannot add), top-k and top-p renormalisation."""
    calls = renorm_calls(filters)
    return calls if filters.has_min_p else calls[:1]


def min_p_renorm(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """probs [B, V] without the tokens below min_ps[b] times the row's largest probability, renormalised
    (FlashInfer has min-p only as a draw)."""
    kept = probs * (probs >= min_ps.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values)
    return kept / kept.sum(dim=-1, keepdim=True)


def draw_call(filters: RowFilters, philox_seed: int | None) -> SamplingCall:
    """probs [B, V] (after `filter_calls`) -> token ids [B] int32. `philox_seed` None draws from
    torch's default CUDA generator; an int seeds Philox at offset 0."""
    rng = {"deterministic": True, "seed": philox_seed, "offset": None if philox_seed is None else 0}
    if filters.has_min_p:
        return SamplingCall("min_p_sampling_from_probs", {"min_p": filters.min_ps, **rng})
    if filters.has_top_k or filters.has_top_p:
        return SamplingCall(
            "top_k_top_p_sampling_from_probs",
            {"top_k": filters.top_ks, "top_p": filters.top_ps, "filter_apply_order": "top_k_first", **rng},
        )
    return SamplingCall("sampling_from_probs", rng)


def chain_kwargs() -> dict[str, Any]:
    """`flashinfer.sampling.chain_speculative_sampling`'s settings beyond its three tensors: unseeded,
    from torch's default CUDA generator, deterministic."""
    return {"deterministic": True}


def philox_seed(seed: int, step: int) -> int:
    """The Philox seed of a seeded row's draw at `step` (the torch sampler's mixing of the two)."""
    return mixed_seed(seed, step)


@register_sampler("flashinfer")
class FlashInferSampler(Sampler):
    """FlashInfer's sampling kernels on one CUDA device (module docstring: how it differs from torch)."""

    def __init__(self, device: torch.device | str) -> None:
        super().__init__(device)
        if self.device.type != "cuda":
            raise ValueError(f"the FlashInfer sampler needs a CUDA device, not {self.device}")

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, V] float32 on the device; batch tensors on the same device. Returns
        (token_ids [B] int64, logprobs [B] float32) there. Reads the rows' flags to the host once."""
        token_ids = logits.argmax(dim=-1)
        logprobs_all = torch.log_softmax(logits, dim=-1)
        filters, is_greedy = row_filters(batch, logits.shape[-1])
        if not all(is_greedy):
            probs = logits
            for call in filter_calls(filters):
                probs = call.apply(probs)
            sampled = token_ids.clone()
            if any(not greedy and seed is None for greedy, seed in zip(is_greedy, batch.seeds)):
                sampled = draw_call(filters, None).apply(probs).long()
            for i, (greedy, seed, step) in enumerate(zip(is_greedy, batch.seeds, batch.steps)):
                if not greedy and seed is not None:
                    sampled[i] = draw_call(filters.row(i), philox_seed(seed, step)).apply(probs[i : i + 1])[0]
            token_ids = torch.where(batch.is_greedy, token_ids, sampled)
        return token_ids, logprobs_all.gather(1, token_ids.unsqueeze(1)).squeeze(1)

    def verify(
        self,
        logits: torch.Tensor,
        draft_token_ids: Sequence[Sequence[int]],
        draft_probs: torch.Tensor | None,
        batch: SamplingBatch,
    ) -> Verified:
        """`kernels.rejection_sampling.verify`'s contract, with FlashInfer's chain speculative sampling
        for the requests it suits: sampled, unseeded and with drafts, one kernel call per number of
        drafts. Greedy and seeded requests, and those without drafts, go through the torch verification
        and get exactly its tokens (a seeded request the same on every device)."""
        num_drafts = [len(drafts) for drafts in draft_token_ids]
        check_shapes(logits, num_drafts, draft_probs, batch)
        is_greedy = batch.is_greedy.tolist()
        settings = zip(num_drafts, is_greedy, batch.seeds)
        chained = [i for i, (k, greedy, seed) in enumerate(settings) if k and not greedy and seed is None]
        if not chained:
            return verify(logits, draft_token_ids, draft_probs, batch)
        requests = _RequestRows(num_drafts, logits.device)
        token_ids: list[list[int]] = [[] for _ in num_drafts]
        others = sorted(set(range(len(num_drafts))) - set(chained))
        if others:
            verified = verify(
                logits[requests.rows(others)],
                [draft_token_ids[i] for i in others],
                None if draft_probs is None else draft_probs[requests.draft_rows(others)],
                select_requests(batch, others),
            )
            for i, tokens in zip(others, verified.token_ids):
                token_ids[i] = tokens
        by_num_drafts: dict[int, list[int]] = {}
        for i in chained:
            by_num_drafts.setdefault(num_drafts[i], []).append(i)
        for group in by_num_drafts.values():
            probs = None if draft_probs is None else draft_probs[requests.draft_rows(group)]
            drafts = [draft_token_ids[i] for i in group]
            emitted = _chain(logits[requests.rows(group)], drafts, probs, select_requests(batch, group))
            for i, tokens in zip(group, emitted):
                token_ids[i] = tokens
        return with_logprobs(logits, num_drafts, token_ids)


class _RequestRows:
    """Where each request's logit rows and draft rows are, for picking some requests out of a batch."""

    def __init__(self, num_drafts: list[int], device: torch.device) -> None:
        self.num_drafts = num_drafts
        self.device = device
        self.firsts = first_rows(num_drafts)
        self.first_drafts = list(accumulate(num_drafts, initial=0))

    def rows(self, requests: list[int]) -> torch.Tensor:
        rows = [self.firsts[i] + j for i in requests for j in range(self.num_drafts[i] + 1)]
        return torch.tensor(rows, device=self.device)

    def draft_rows(self, requests: list[int]) -> torch.Tensor:
        rows = [self.first_drafts[i] + j for i in requests for j in range(self.num_drafts[i])]
        return torch.tensor(rows, device=self.device)


def select_requests(batch: SamplingBatch, requests: list[int]) -> SamplingBatch:
    """The settings of `requests` (indexes into `batch`), in that order."""
    at = torch.tensor(requests, device=batch.temperatures.device)
    return SamplingBatch(
        temperatures=batch.temperatures[at],
        top_ps=batch.top_ps[at],
        top_ks=batch.top_ks[at],
        min_ps=batch.min_ps[at],
        is_greedy=batch.is_greedy[at],
        seeds=tuple(batch.seeds[i] for i in requests),
        steps=tuple(batch.steps[i] for i in requests),
    )


def _chain(
    logits: torch.Tensor, draft_token_ids: list[Sequence[int]], draft_probs: torch.Tensor | None, batch: SamplingBatch
) -> list[list[int]]:
    """Each request's emitted tokens by FlashInfer's chain speculative sampling: G requests with k drafts
    each, `logits` their G * (k + 1) rows, `draft_probs` their G * k draft rows (None: one-hot on the drafts).
    The target rows are the distributions the torch sampler draws from (`kernels.rejection_sampling`)."""
    num_requests, k = len(draft_token_ids), len(draft_token_ids[0])
    vocab = logits.shape[-1]
    filters, _ = row_filters(expand_to_rows(batch, [k] * num_requests), vocab)
    target = logits
    for call in renorm_calls(filters):
        target = call.apply(target)
    if filters.has_min_p:
        target = min_p_renorm(target, filters.min_ps)
    drafts = torch.tensor(draft_token_ids, dtype=torch.int32, device=logits.device)
    if draft_probs is None:
        q = torch.zeros(num_requests, k, vocab, device=logits.device)
        q.scatter_(2, drafts.long().unsqueeze(2), 1.0)
    else:
        q = draft_probs.reshape(num_requests, k, vocab)
    out, _, emitted = flashinfer.sampling.chain_speculative_sampling(
        q, drafts, target.reshape(num_requests, k + 1, vocab), **chain_kwargs()
    )
    return [tokens[: n + 1] for tokens, n in zip(out.tolist(), emitted.tolist())]
