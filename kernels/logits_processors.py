"""Logit adjustments applied before sampling: penalties, logit bias, min-token eos masking (torch).

Each function takes fp32 logits [B, V] and returns adjusted logits, on the logits' device; rows
without the feature are left unchanged. Logprobs reported to users are computed from the raw logits, not these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PenaltyBatch:
    """Per-row settings ([B] tensors) and the token history they apply to, all on the logits' device.

    `output_counts[i, t]` counts token t among row i's generated tokens; `seen[i, t]` is True for
    tokens in row i's prompt or output (what repetition_penalty looks at).
    """

    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    output_counts: torch.Tensor
    seen: torch.Tensor


def apply_penalties(logits: torch.Tensor, batch: PenaltyBatch) -> torch.Tensor:
    """OpenAI presence/frequency penalties on generated tokens, and HF-style repetition penalty
    (divide positive logits, multiply negative ones) on every token seen so far."""
    counts = batch.output_counts
    logits = logits - batch.frequency.unsqueeze(1) * counts
    logits = logits - batch.presence.unsqueeze(1) * (counts > 0).float()
    rep = batch.repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    return torch.where(batch.seen, penalized, logits)


def token_histories(histories: list[list[int]], vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Counts [B, V] (fp32, on `device`) of the token ids in each row's history."""
    counts = torch.zeros(len(histories), vocab_size, device=device)
    for row, ids in enumerate(histories):
        if ids:
            counts[row].index_add_(
                0, torch.tensor(ids, dtype=torch.int64, device=device), torch.ones(len(ids), device=device)
            )
    return counts


def apply_logit_bias(logits: torch.Tensor, biases: list[dict[int, float]]) -> torch.Tensor:
    """Add each row's {token_id: bias}; a bias of -100 or less effectively bans the token."""
    logits = logits.clone()
    for row, bias in enumerate(biases):
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.int64, device=logits.device)
            logits[row, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    return logits


def mask_tokens(logits: torch.Tensor, banned: list[tuple[int, ...]]) -> torch.Tensor:
    """Set the listed token ids of each row to -inf (e.g. eos before min_new_tokens is reached)."""
    logits = logits.clone()
    for row, ids in enumerate(banned):
        if ids:
            logits[row, list(ids)] = float("-inf")
    return logits
