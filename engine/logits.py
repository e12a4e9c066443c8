"""From a batch of requests to adjusted logits and logprob extras (penalties, bias, min tokens).

Reported logprobs always come from the raw logits; adjustments only steer which token is chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.request import PromptLogprobs, Request, SamplingParams
from kernels.logits_processors import PenaltyBatch, apply_logit_bias, apply_penalties, mask_tokens, token_histories


@dataclass(frozen=True, slots=True)
class LogprobExtras:
    """Per request: top (token_id, logprob) pairs and the logprobs of requested ids."""

    top: list[tuple[tuple[int, float], ...]]
    requested: list[tuple[tuple[int, float], ...]]


def adjust_logits(logits: torch.Tensor, requests: list[Request], eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """Return `logits` itself when no request needs an adjustment, else an adjusted copy (same device)."""
    params = [r.sampling for r in requests]
    vocab = logits.shape[1]
    if any(p.has_penalties for p in params):
        histories = [r.prompt_ids + r.output_ids for r in requests]
        outputs = [r.output_ids for r in requests]
        device = logits.device
        logits = apply_penalties(
            logits,
            PenaltyBatch(
                presence=torch.tensor([p.presence_penalty for p in params], device=device),
                frequency=torch.tensor([p.frequency_penalty for p in params], device=device),
                repetition=torch.tensor([p.repetition_penalty for p in params], device=device),
                output_counts=token_histories(outputs, vocab, device),
                seen=token_histories(histories, vocab, device) > 0,
            ),
        )
    if any(p.logit_bias for p in params):
        logits = apply_logit_bias(logits, [dict(p.logit_bias) for p in params])
    banned = [_banned_before_min(r, eos_token_ids) for r in requests]
    if any(banned):
        logits = mask_tokens(logits, banned)
    return logits


def _banned_before_min(req: Request, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    params = req.sampling
    if len(req.output_ids) >= params.min_new_tokens:
        return ()
    return tuple(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids)))


def logprob_extras(raw_logprobs: torch.Tensor, requests: list[Request]) -> LogprobExtras | None:
    """Top-k and requested-id logprobs for the requests that asked; None if none did."""
    params = [r.sampling for r in requests]
    max_k = max(p.top_logprobs_num for p in params)
    if max_k == 0 and not any(p.token_ids_logprob for p in params):
        return None
    top: list[tuple[tuple[int, float], ...]] = [() for _ in requests]
    if max_k:
        values, ids = raw_logprobs.topk(max_k, dim=-1)
        for row, p in enumerate(params):
            k = p.top_logprobs_num
            top[row] = tuple(zip(ids[row, :k].tolist(), values[row, :k].tolist()))
    requested = [tuple((t, float(raw_logprobs[row, t])) for t in p.token_ids_logprob) for row, p in enumerate(params)]
    return LogprobExtras(top, requested)


_PROMPT_ROWS_PER_CHUNK = 256  # bounds the [rows, vocab] fp32 logits held at once


def score_prompt(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    rows: torch.Tensor,
    prompt_ids: list[int],
    first: int,
    params: SamplingParams,
) -> PromptLogprobs:
    """Raw logprobs of prompt_ids[first:], where `rows` [len(prompt_ids) - first, hidden] holds
    the hidden states of positions first - 1 ... len - 2, plus top / requested logprobs per
    `params`. Computed in chunks so a long prompt never holds all its logits at once."""
    targets = torch.tensor(prompt_ids[first:], dtype=torch.int64, device=rows.device)
    chosen: list[float] = []
    top: list[tuple[tuple[int, float], ...]] = []
    requested: list[tuple[tuple[int, float], ...]] = []
    k, wanted = params.top_logprobs_num, list(params.token_ids_logprob)
    for begin in range(0, len(targets), _PROMPT_ROWS_PER_CHUNK):
        chunk = slice(begin, begin + _PROMPT_ROWS_PER_CHUNK)
        logprobs = torch.log_softmax(compute_logits(rows[chunk]), dim=-1)
        chosen += logprobs.gather(1, targets[chunk].unsqueeze(1)).squeeze(1).tolist()
        if k:
            values, ids = logprobs.topk(k, dim=-1)
            top += [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        if wanted:
            requested += [tuple(zip(wanted, v)) for v in logprobs[:, wanted].tolist()]
    n = len(targets)
    return PromptLogprobs(
        tuple(prompt_ids[first:]),
        tuple(chosen),
        tuple(top) if k else ((),) * n,
        tuple(requested) if wanted else ((),) * n,
    )
