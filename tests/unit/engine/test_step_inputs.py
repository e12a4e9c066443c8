"""Tests for engine.step_inputs: the host tensors of one step (values, pinning) and their move to a device."""

from __future__ import annotations

import pytest
import torch

from engine.request import Request, SamplingParams
from engine.step_inputs import StepInputs, build_step_inputs

PAGE_SIZE = 4


def _requests() -> tuple[list[Request], list[int]]:
    """A whole prompt and a prompt's second chunk (2 tokens after 3 computed), with their token counts."""
    whole = Request("a", [10, 11, 12, 13, 14], SamplingParams(), page_ids=[7, 2])
    chunk = Request("b", [20, 21, 22, 23, 24, 25], SamplingParams(), page_ids=[5, 9], num_computed=3)
    return [whole, chunk], [5, 2]


def _tensors(inputs: StepInputs) -> list[torch.Tensor]:
    meta = inputs.meta
    return [inputs.input_ids, inputs.positions, inputs.logit_rows, meta.qo_indptr, meta.kv_indptr,
            meta.kv_indices, meta.kv_last_page_len, meta.write_pages, meta.write_offsets]


def test_prefill_inputs_hold_each_requests_new_tokens() -> None:
    inputs = build_step_inputs(*_requests(), page_size=PAGE_SIZE)
    assert inputs.input_ids.tolist() == [10, 11, 12, 13, 14, 23, 24]
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4, 3, 4]
    assert inputs.logit_rows.tolist() == [4, 6]
    assert inputs.query_lens == (5, 2) and inputs.meta.seq_lens == (5, 5)
    assert inputs.meta.write_pages.tolist() == [7, 7, 7, 7, 2, 5, 9]
    assert all(t.device.type == "cpu" and not t.is_pinned() for t in _tensors(inputs))


def test_decode_inputs_feed_only_the_newest_token() -> None:
    requests, _ = _requests()
    for req, token in zip(requests, (99, 98)):
        req.num_computed, req.output_ids = req.prompt_len, [token]
    inputs = build_step_inputs(requests, [1, 1], page_size=PAGE_SIZE)
    assert inputs.input_ids.tolist() == [99, 98]
    assert inputs.positions.tolist() == [5, 6]
    assert inputs.logit_rows.tolist() == [0, 1]
    assert inputs.meta.kv_last_page_len.tolist() == [2, 3]


def test_a_mixed_step_feeds_a_decode_row_and_a_prompt_chunk_together() -> None:
    (decoding, chunk), _ = _requests()
    decoding.num_computed, decoding.output_ids = decoding.prompt_len, [99]
    inputs = build_step_inputs([decoding, chunk], [1, 2], page_size=PAGE_SIZE)
    assert inputs.input_ids.tolist() == [99, 23, 24]
    assert inputs.positions.tolist() == [5, 3, 4]
    assert inputs.logit_rows.tolist() == [0, 2]
    assert inputs.query_lens == (1, 2) and inputs.meta.seq_lens == (6, 5)
    assert inputs.meta.write_pages.tolist() == [2, 5, 9] and inputs.meta.write_offsets.tolist() == [1, 3, 0]


def test_a_resumed_request_feeds_its_prompt_then_its_output() -> None:
    req = Request("r", [1, 2, 3], SamplingParams(), page_ids=[4, 6], output_ids=[7, 8], num_computed=2)
    inputs = build_step_inputs([req], [3], page_size=PAGE_SIZE)
    assert inputs.input_ids.tolist() == [3, 7, 8] and inputs.positions.tolist() == [2, 3, 4]
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
    inputs = build_step_inputs(*_requests(), page_size=PAGE_SIZE, pin=True)
    assert [id(t) in pinned for t in _tensors(inputs)] == [True] * 9
    pinned.clear()
    build_step_inputs(*_requests(), page_size=PAGE_SIZE, pin=False)
    assert not pinned


def test_to_moves_every_tensor_and_keeps_the_lengths_as_ints() -> None:
    host = build_step_inputs(*_requests(), page_size=PAGE_SIZE)
    assert host.to("cpu") is host
    moved = host.to("meta")
    assert all(t.device.type == "meta" for t in _tensors(moved))
    assert [t.shape for t in _tensors(moved)] == [t.shape for t in _tensors(host)]
    assert [t.dtype for t in _tensors(moved)] == [t.dtype for t in _tensors(host)]
    assert moved.query_lens == (5, 2) and moved.meta.seq_lens == (5, 5)


@pytest.mark.gpu
def test_pinned_inputs_reach_the_gpu_intact() -> None:
    host = build_step_inputs(*_requests(), page_size=PAGE_SIZE, pin=True)
    assert all(t.is_pinned() for t in _tensors(host))
    moved = host.to("cuda")
    assert all(t.device.type == "cuda" for t in _tensors(moved))
    assert [t.cpu().tolist() for t in _tensors(moved)] == [t.tolist() for t in _tensors(host)]
