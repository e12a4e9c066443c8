"""Mixture-of-experts feed-forward (Qwen2-MoE, Mixtral) and the count of tokens routed to each expert.

Routing is HF's: softmax of the router logits in fp32, the `num_experts_per_tok` most likely experts,
their weights renormalized to sum to 1 when `norm_topk_prob`. Each expert runs only on the rows routed
to it (gathered once by a sort, added back with `index_add_`), so compute grows with tokens x experts
per token, not with the number of experts. Qwen2-MoE adds a shared expert that every token passes
through, scaled by a sigmoid gate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.errors import InvalidRequestError


class MixtralExpert(nn.Module):
    """Mixtral's expert, with its HF names: `w2(silu(w1 x) * w3 x)`."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, top_k] fp32, expert ids [T, top_k] int64), most likely first."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


class SparseMoeBlock(nn.Module):
    """The parameters of HF's `Qwen2MoeSparseMoeBlock` (`mlp`) or `MixtralSparseMoeBlock`
    (`block_sparse_moe`): `gate` (the router, [num_experts, hidden]), `experts.<e>.*`, and for Qwen2-MoE
    `shared_expert.*` plus `shared_expert_gate` ([1, hidden])."""

    def __init__(self, config: ModelConfig, experts: list[nn.Module], shared_expert: nn.Module | None) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(experts)
        self.has_shared_expert = shared_expert is not None
        if shared_expert is not None:
            self.shared_expert = shared_expert
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, expert_counts: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden].

        `expert_counts` ([num_experts] int64), when given, is incremented by the number of tokens routed
        to each expert: once per token and chosen expert, so it grows by T x num_experts_per_tok.
        """
        weights, expert_ids = route(self.gate(x), self.top_k, self.renormalize)
        flat_ids = expert_ids.flatten()
        tokens_per_expert = torch.bincount(flat_ids, minlength=len(self.experts))
        if expert_counts is not None:
            expert_counts.add_(tokens_per_expert)
        # Slots (token, k) sorted by expert; expert e owns the next tokens_per_expert[e] of them.
        slots = torch.argsort(flat_ids, stable=True)
        flat_weights = weights.flatten().to(x.dtype)
        out = torch.zeros_like(x)
        start = 0
        for expert, num_tokens in zip(self.experts, tokens_per_expert.tolist()):
            if num_tokens == 0:
                continue
            chosen = slots[start : start + num_tokens]
            start += num_tokens
            rows = chosen // self.top_k
            out.index_add_(0, rows, expert(x.index_select(0, rows)) * flat_weights[chosen, None])
        if self.has_shared_expert:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


@dataclass(frozen=True, slots=True)
class ExpertDistribution:
    """Tokens routed to each expert while recording: `counts[i][e]` for expert e of decoder layer `layer_ids[i]`.

    Every token a MoE layer computes adds 1 to `num_experts_per_tok` of its layer's counts.
    """

    layer_ids: tuple[int, ...]
    num_experts: int
    num_experts_per_tok: int
    counts: tuple[tuple[int, ...], ...]


class ExpertRecorder:
    """Counts, while recording is on, the tokens every MoE layer routes to each of its experts.

    Owned by the model runner and used on the engine thread only; the counts live on the model's
    device. While recording is off, `step_counts()` is None and the MoE layers do no counting at all.
    """

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.layer_ids = config.moe_layer_ids
        self.num_experts = config.num_experts
        self.num_experts_per_tok = config.num_experts_per_tok
        self._totals = torch.zeros(config.num_layers, config.num_experts, dtype=torch.int64, device=device)
        self.is_recording = False

    def step_counts(self) -> torch.Tensor | None:
        """The [num_layers, num_experts] int64 tensor a forward pass adds to, or None when not recording."""
        return self._totals if self.is_recording else None

    def start(self) -> None:
        """Clear the counts and start counting. Raises `InvalidRequestError` for a model without experts."""
        self._require_experts()
        self._totals.zero_()
        self.is_recording = True

    def stop(self) -> None:
        """Stop counting; the counts so far are kept for `dump`."""
        self._require_experts()
        self.is_recording = False

    def dump(self) -> ExpertDistribution:
        """The counts since `start` (or the last dump), which are then cleared; recording goes on if on."""
        self._require_experts()
        counts = tuple(tuple(self._totals[layer].tolist()) for layer in self.layer_ids)
        self._totals.zero_()
        return ExpertDistribution(self.layer_ids, self.num_experts, self.num_experts_per_tok, counts)

    def _require_experts(self) -> None:
        if not self.layer_ids:
            raise InvalidRequestError(
                "the served model has no mixture-of-experts layers: there is no expert distribution to record"
            )
