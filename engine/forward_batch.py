"""`ForwardBatch`: everything one forward pass reads that changes from step to step, built on the host
from the scheduled requests.

It is the model's one per-step argument (`CausalLM.forward(batch, rotary, backend, kv_pool)`), so a
new per-token field reaches every layer by being added here. It is built once per step in host
memory, pinned when the device is CUDA so that `to` copies it without blocking; the attention backend
plans from the host copy and the model computes with the device copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from engine.lora_slots import LoraBatch
from engine.request import Request
from kernels.attention import AttentionMetadata, host_tensor


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """`input_ids`, `positions`: [T] int64, every new token of the batch, requests in order;
    `logit_rows`: [B] int64, the row of each request's last new token (whose logits pick its next
    token); `meta`: the step's page table; `expert_counts`: [num_layers, num_experts] int64 on the
    model's device, which each MoE layer adds its routed tokens to (`ExpertRecorder.step_counts`),
    or None to count nothing; `lora`: which LoRA adapter each row takes (None: no row takes one)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    logit_rows: torch.Tensor
    meta: AttentionMetadata
    expert_counts: torch.Tensor | None = None
    lora: LoraBatch | None = None

    @property
    def query_lens(self) -> tuple[int, ...]:
        """How many new tokens (rows) each request has."""
        return self.meta.query_lens

    def to(self, device: torch.device | str, non_blocking: bool = True) -> ForwardBatch:
        """The same batch on `device` (itself when it is there already); `expert_counts` is carried as
        it is (it lives on the device). With `non_blocking` the copies from pinned memory are
        asynchronous: the host tensors must not be written again (they never are: each step builds
        new ones)."""
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        return ForwardBatch(
            self.input_ids.to(device, non_blocking=non_blocking),
            self.positions.to(device, non_blocking=non_blocking),
            self.logit_rows.to(device, non_blocking=non_blocking),
            self.meta.to(device, non_blocking),
            self.expert_counts,
            self.lora,
        )


def build_forward_batch(
    requests: Sequence[Request],
    num_new_tokens: Sequence[int],
    page_size: int,
    pin: bool = False,
    expert_counts: torch.Tensor | None = None,
) -> ForwardBatch:
    """The host batch (pinned when `pin`) of one step in which request i computes `num_new_tokens[i]`
    tokens of its sequence from `num_computed` on; their pages are allocated."""
    new_token_ids = [r.token_ids(r.num_computed, r.num_computed + n) for r, n in zip(requests, num_new_tokens)]
    starts = [r.num_computed for r in requests]
    page_ids = [r.page_ids for r in requests]
    return paged_forward_batch(new_token_ids, starts, page_ids, page_size, pin, expert_counts)


def decode_tokens(requests: Sequence[Request]) -> tuple[list[list[int]], list[int]]:
    """Each request's newest token (as a one-token list) and its position: a decode step's feed,
    as `paged_forward_batch` takes it."""
    return [r.token_ids(r.seq_len - 1, r.seq_len) for r in requests], [r.seq_len - 1 for r in requests]


def paged_forward_batch(
    new_token_ids: Sequence[Sequence[int]],
    starts: Sequence[int],
    page_ids: Sequence[Sequence[int]],
    page_size: int,
    pin: bool = False,
    expert_counts: torch.Tensor | None = None,
) -> ForwardBatch:
    """The host batch (pinned when `pin`) of one forward pass over paged sequences: sequence i feeds
    `new_token_ids[i]` at positions `starts[i]` on, after `starts[i]` tokens whose KV is already in
    its pages `page_ids[i]`, which must have room for the new tokens too (their KV is written there)."""
    query_lens = [len(new) for new in new_token_ids]
    seq_lens = [start + num_new for start, num_new in zip(starts, query_lens)]
    ids = [token_id for new in new_token_ids for token_id in new]
    pos = [p for start, seq_len in zip(starts, seq_lens) for p in range(start, seq_len)]
    meta = AttentionMetadata.build(page_ids, query_lens, seq_lens, page_size, pin=pin)
    logit_rows = [end - 1 for end in accumulate(query_lens)]
    int64 = torch.int64
    return ForwardBatch(
        host_tensor(ids, int64, pin),
        host_tensor(pos, int64, pin),
        host_tensor(logit_rows, int64, pin),
        meta,
        expert_counts,
    )
