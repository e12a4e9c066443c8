"""Verification of draft tokens (speculative decoding) by rejection sampling, which keeps the target
model's distribution exactly (Leviathan et al., "Fast Inference from Transformers via Speculative
Decoding", 2023).

Request i of a batch feeds its last token and `k_i` draft tokens, so it owns `k_i + 1` consecutive
rows of target logits; row j is the target distribution p_j of the token after its j-th fed token.
Draft j is accepted with probability min(1, p_j(d) / q_j(d)), q_j being the distribution the draft
was drawn from (one-hot on the draft for a deterministic proposer such as n-gram lookup). At the
first rejection, the request's next token is drawn from norm(max(p_j - q_j, 0)) instead; when all
drafts are accepted, a bonus token is drawn from p_k. A request thus emits between 1 and k_i + 1
tokens per step, each distributed exactly as step-by-step sampling would draw it.

p is the processed distribution `kernels.sampling.sample` draws from (temperature, top-k, top-p,
min-p); greedy rows compare drafts with the argmax and emit exactly what greedy decoding would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from kernels.sampling import Sampler, SamplingBatch, row_uniforms, truncated


@dataclass(frozen=True, slots=True)
class Verified:
    """Per request, the tokens a verification step emits: the accepted draft prefix, then one more
    token (the correction at the first rejection, or the bonus after the last draft); `logprobs`
    are log_softmax of the raw logits of the row each token was emitted from."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]

    @property
    def num_accepted(self) -> list[int]:
        """Draft tokens accepted, per request."""
        return [len(tokens) - 1 for tokens in self.token_ids]


def verify(
    logits: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: torch.Tensor | None,
    batch: SamplingBatch,
) -> Verified:
    """Accept or reject each request's drafts against the target logits.

    logits: [R, V] fp32, R = sum(k_i + 1), request i's rows consecutive and in batch order, k_i =
    len(draft_token_ids[i]) (0 is allowed: the request then samples one token as `sample` would).
    draft_probs: [sum(k_i), V] fp32 on the logits' device, row t the distribution draft t (requests'
    drafts concatenated in order) was drawn from; None when the proposer is deterministic.
    batch: one entry per request ([N] tensors on the logits' device); `steps[i]` is the output
    position of request i's row 0, so row j of a seeded request draws from (seed, steps[i] + j) and
    gives the same tokens wherever it runs. Reads its arguments only. Raises ValueError when the
    shapes do not agree.
    """
    num_drafts = [len(drafts) for drafts in draft_token_ids]
    check_shapes(logits, num_drafts, draft_probs, batch)
    rows = expand_to_rows(batch, num_drafts)
    firsts = first_rows(num_drafts)
    draft_rows = [first + j for first, k in zip(firsts, num_drafts) for j in range(k)]
    flat_drafts = [token for drafts in draft_token_ids for token in drafts]
    argmax = logits.argmax(dim=-1)
    if rows.all_greedy:
        is_accepted = [a == d for a, d in zip(argmax[draft_rows].tolist(), flat_drafts)]
        next_tokens = argmax.tolist()
    else:
        is_accepted, next_tokens = _sample_rows(logits, rows, draft_rows, flat_drafts, draft_probs, argmax)
    token_ids: list[list[int]] = []
    draft_at = 0  # index of the request's first draft in `flat_drafts`
    for first, drafts in zip(firsts, draft_token_ids):
        num_accepted = 0
        while num_accepted < len(drafts) and is_accepted[draft_at + num_accepted]:
            num_accepted += 1
        draft_at += len(drafts)
        token_ids.append([*drafts[:num_accepted], next_tokens[first + num_accepted]])
    return with_logprobs(logits, num_drafts, token_ids)


def with_logprobs(logits: torch.Tensor, num_drafts: Sequence[int], token_ids: list[list[int]]) -> Verified:
    """`token_ids` (each request's emitted tokens, from its row 0 on) with their logprobs: log_softmax
    of the raw `logits` of the row each token was emitted from."""
    emitted_rows = [first + j for first, tokens in zip(first_rows(num_drafts), token_ids) for j in range(len(tokens))]
    flat_emitted = torch.tensor([t for tokens in token_ids for t in tokens], device=logits.device)
    logprobs = torch.log_softmax(logits[emitted_rows], dim=-1).gather(1, flat_emitted.unsqueeze(1)).squeeze(1)
    return Verified(token_ids, _split(logprobs.tolist(), [len(tokens) for tokens in token_ids]))


@runtime_checkable
class DraftVerifier(Protocol):
    """A sampler with its own verification of drafts (FlashInfer's chain kernel), under `verify`'s contract."""

    def verify(
        self,
        logits: torch.Tensor,
        draft_token_ids: Sequence[Sequence[int]],
        draft_probs: torch.Tensor | None,
        batch: SamplingBatch,
    ) -> Verified: ...


def verify_drafts(
    sampler: Sampler,
    logits: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: torch.Tensor | None,
    batch: SamplingBatch,
) -> Verified:
    """`sampler`'s own verification where it has one (a `DraftVerifier`), else `verify`."""
    if isinstance(sampler, DraftVerifier):
        return sampler.verify(logits, draft_token_ids, draft_probs, batch)
    return verify(logits, draft_token_ids, draft_probs, batch)


def expand_to_rows(batch: SamplingBatch, num_drafts: Sequence[int]) -> SamplingBatch:
    """Per-request settings repeated over each request's `num_drafts[i] + 1` rows, with steps
    `steps[i] + j` for row j (the output position that row's token takes)."""
    repeats = torch.tensor([k + 1 for k in num_drafts], device=batch.temperatures.device)
    return SamplingBatch(
        temperatures=batch.temperatures.repeat_interleave(repeats),
        top_ps=batch.top_ps.repeat_interleave(repeats),
        top_ks=batch.top_ks.repeat_interleave(repeats),
        min_ps=batch.min_ps.repeat_interleave(repeats),
        is_greedy=batch.is_greedy.repeat_interleave(repeats),
        seeds=tuple(seed for seed, k in zip(batch.seeds, num_drafts) for _ in range(k + 1)),
        steps=tuple(step + j for step, k in zip(batch.steps, num_drafts) for j in range(k + 1)),
    )


def target_probs(logits: torch.Tensor, rows: SamplingBatch) -> torch.Tensor:
    """logits: [R, V] fp32, `rows` one entry per row. Returns [R, V] fp32: the distribution
    `kernels.sampling.sample` draws each row's token from (one-hot on the argmax for greedy rows)."""
    candidates = truncated(logits, rows)
    probs = candidates.spread(candidates.normalised(), logits.shape[-1])
    greedy = torch.zeros_like(logits).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(rows.is_greedy.unsqueeze(1), greedy, probs)


def _sample_rows(
    logits: torch.Tensor,
    rows: SamplingBatch,
    draft_rows: list[int],
    flat_drafts: list[int],
    draft_probs: torch.Tensor | None,
    argmax: torch.Tensor,
) -> tuple[list[bool], list[int]]:
    """(whether each draft is accepted, the token each row emits if it is the first rejected or the
    bonus row), for a batch with sampled rows; greedy rows compare with and emit the argmax."""
    candidates = truncated(logits, rows)
    p_candidates = candidates.normalised()
    p = candidates.spread(p_candidates, logits.shape[-1])
    # Per row: first the uniform its emitted token is drawn with (as `sample` draws it), then the one that
    # accepts or rejects its draft.
    uniforms = row_uniforms(rows, logits.device, draws=2)

    drafts = torch.tensor(flat_drafts, dtype=torch.int64, device=logits.device)
    q = torch.zeros(len(draft_rows), logits.shape[-1], device=logits.device)
    if draft_probs is None:
        q.scatter_(1, drafts.unsqueeze(1), 1.0)
    else:
        q.copy_(draft_probs)
    p_draft = p[draft_rows].gather(1, drafts.unsqueeze(1)).squeeze(1)
    q_draft = q.gather(1, drafts.unsqueeze(1)).squeeze(1)
    is_greedy_draft = rows.is_greedy[draft_rows]
    # u < p/q, written without the division: q may be 0 where the draft model was sure it was not
    is_accepted = torch.where(
        is_greedy_draft, drafts == argmax[draft_rows], uniforms[draft_rows, 1] * q_draft < p_draft
    )

    # Draft rows draw from the residual max(p - q, 0); the others (each request's last row) from the
    # weights `sample` draws from, so a request with no drafts gets exactly the token `sample` gives.
    weights = candidates.weights.clone()
    q_candidates = q if candidates.token_ids is None else q.gather(1, candidates.token_ids[draft_rows])
    residual = (p_candidates[draft_rows] - q_candidates).clamp(min=0.0)
    # A rejection implies some residual mass; an all-zero residual is rounding, where p is right.
    has_residual = residual.sum(dim=-1, keepdim=True) > 0
    weights[draft_rows] = torch.where(has_residual, residual, p_candidates[draft_rows])
    sampled = candidates.draw(uniforms[:, 0], weights)
    next_tokens = torch.where(rows.is_greedy, argmax, sampled)
    return is_accepted.tolist(), next_tokens.tolist()


def first_rows(num_drafts: Sequence[int]) -> list[int]:
    """Index of each request's row 0."""
    firsts, at = [], 0
    for k in num_drafts:
        firsts.append(at)
        at += k + 1
    return firsts


def _split(values: list[float], lengths: Sequence[int]) -> list[list[float]]:
    out, at = [], 0
    for length in lengths:
        out.append(values[at : at + length])
        at += length
    return out


def check_shapes(
    logits: torch.Tensor, num_drafts: Sequence[int], draft_probs: torch.Tensor | None, batch: SamplingBatch
) -> None:
    num_rows = sum(num_drafts) + len(num_drafts)
    if logits.dim() != 2 or logits.shape[0] != num_rows:
        raise ValueError(f"logits must be [{num_rows}, V] for these drafts, got {list(logits.shape)}")
    if len(batch.steps) != len(num_drafts) or len(batch.seeds) != len(num_drafts):
        raise ValueError(f"the sampling batch has {len(batch.steps)} requests, the drafts {len(num_drafts)}")
    if draft_probs is not None and draft_probs.shape != (sum(num_drafts), logits.shape[1]):
        raise ValueError(f"draft_probs must be [{sum(num_drafts)}, {logits.shape[1]}], got {list(draft_probs.shape)}")
