"""Tests for engine.forward_batch: the host tensors of one step (values, pinning) and their move to a device."""

from __future__ import annotations

import pytest
import torch

from engine.forward_batch import ForwardBatch, build_forward_batch
from engine.request import Request, SamplingParams

PAGE_SIZE = 4


def _requests() -> tuple[list[Request], list[int]]:
    """A whole prompt and a prompt's second chunk (2 tokens after 3 computed), with their token counts."""
    whole = Request("a", [10, 11, 12, 13, 14], SamplingParams(), page_ids=[7, 2])
    chunk = Request("b", [20, 21, 22, 23, 24, 25], SamplingParams(), page_ids=[5, 9], num_computed=3)
    return [whole, chunk], [5, 2]


def _tensors(batch: ForwardBatch) -> list[torch.Tensor]:
    meta = batch.meta
    return [batch.input_ids, batch.positions, batch.logit_rows, meta.qo_indptr, meta.kv_indptr,
            meta.kv_indices, meta.kv_last_page_len, meta.write_pages, meta.write_offsets]


def test_prefill_inputs_hold_each_requests_new_tokens() -> None:
    batch = build_forward_batch(*_requests(), page_size=PAGE_SIZE)
    assert batch.input_ids.tolist() == [10, 11, 12, 13, 14, 23, 24]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 3, 4]
    assert batch.logit_rows.tolist() == [4, 6]
    assert batch.query_lens == (5, 2) and batch.meta.seq_lens == (5, 5)
    assert batch.meta.write_pages.tolist() == [7, 7, 7, 7, 2, 5, 9]
    assert all(t.device.type == "cpu" and not t.is_pinned() for t in _tensors(batch))


def test_decode_inputs_feed_only_the_newest_token() -> None:
    requests, _ = _requests()
    for req, token in zip(requests, (99, 98)):
        req.num_computed, req.output_ids = req.prompt_len, [token]
    batch = build_forward_batch(requests, [1, 1], page_size=PAGE_SIZE)
    assert batch.input_ids.tolist() == [99, 98]
    assert batch.positions.tolist() == [5, 6]
    assert batch.logit_rows.tolist() == [0, 1]
    assert batch.meta.kv_last_page_len.tolist() == [2, 3]


def test_a_mixed_step_feeds_a_decode_row_and_a_prompt_chunk_together() -> None:
    (decoding, chunk), _ = _requests()
    decoding.num_computed, decoding.output_ids = decoding.prompt_len, [99]
    batch = build_forward_batch([decoding, chunk], [1, 2], page_size=PAGE_SIZE)
    assert batch.input_ids.tolist() == [99, 23, 24]
    assert batch.positions.tolist() == [5, 3, 4]
    assert batch.logit_rows.tolist() == [0, 2]
    assert batch.query_lens == (1, 2) and batch.meta.seq_lens == (6, 5)
    assert batch.meta.write_pages.tolist() == [2, 5, 9] and batch.meta.write_offsets.tolist() == [1, 3, 0]


def test_a_resumed_request_feeds_its_prompt_then_its_output() -> None:
    req = Request("r", [1, 2, 3], SamplingParams(), page_ids=[4, 6], output_ids=[7, 8], num_computed=2)
    batch = build_forward_batch([req], [3], page_size=PAGE_SIZE)
    assert batch.input_ids.tolist() == [3, 7, 8] and batch.positions.tolist() == [2, 3, 4]
    assert req.token_ids(0, 5) == [1, 2, 3, 7, 8] and req.token_ids(3, 5) == [7, 8] and req.token_ids(0, 2) == [1, 2]


def test_pin_puts_every_host_tensor_in_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine has no CUDA to pin for, so `pin_memory` is replaced by a recorder: every tensor the
    step hands over must have gone through it, and none without `pin`."""
    pinned: set[int] = set()

    def pin_memory(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        copy = self.clone()
        pinned.add(id(copy))
        return copy
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    batch = build_forward_batch(*_requests(), page_size=PAGE_SIZE, pin=True)
    assert [id(t) in pinned for t in _tensors(batch)] == [True] * 9
    pinned.clear()
    build_forward_batch(*_requests(), page_size=PAGE_SIZE, pin=False)
    assert not pinned


def test_to_moves_every_tensor_and_keeps_the_lengths_as_ints() -> None:
    host = build_forward_batch(*_requests(), page_size=PAGE_SIZE)
    assert host.to("cpu") is host
    moved = host.to("meta")
    assert all(t.device.type == "meta" for t in _tensors(moved))
    assert [t.shape for t in _tensors(moved)] == [t.shape for t in _tensors(host)]
    assert [t.dtype for t in _tensors(moved)] == [t.dtype for t in _tensors(host)]
    assert moved.query_lens == (5, 2) and moved.meta.seq_lens == (5, 5)


def test_the_expert_counts_are_carried_as_they_are_never_copied() -> None:
    """The MoE layers add to the recorder's own tensor, so `to` must hand that very tensor on."""
    counts = torch.zeros(2, 4, dtype=torch.int64)
    host = build_forward_batch(*_requests(), page_size=PAGE_SIZE, expert_counts=counts)
    assert host.expert_counts is counts and host.to("meta").expert_counts is counts
    assert build_forward_batch(*_requests(), page_size=PAGE_SIZE).expert_counts is None


@pytest.mark.gpu
def test_pinned_inputs_reach_the_gpu_intact() -> None:
    host = build_forward_batch(*_requests(), page_size=PAGE_SIZE, pin=True)
    assert all(t.is_pinned() for t in _tensors(host))
    moved = host.to("cuda")
    assert all(t.device.type == "cuda" for t in _tensors(moved))
    assert [t.cpu().tolist() for t in _tensors(moved)] == [t.tolist() for t in _tensors(host)]
