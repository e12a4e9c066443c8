"""Tests for server_runtime.convert: proto presence decides defaults, layouts must match exactly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.kv_pool import KVLayout
from engine.request import FinishReason, SamplingParams, StepOutput
from gateway.cluster.convert import sampling_to_proto
from server_runtime.convert import (
    check_layout_matches,
    finish_to_proto,
    layout_to_proto,
    sampling_from_proto,
    spec_from_proto,
    token_to_proto,
)
from tandem.limits import DEFAULT_MAX_NEW_TOKENS
from tandem.sampling import GrammarKind, GrammarSpec, SamplingSpec
from tandem.v1 import common_pb2


def test_unset_fields_get_defaults() -> None:
    params = sampling_from_proto(common_pb2.SamplingParams())
    assert params == SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=None,
                                    max_new_tokens=DEFAULT_MAX_NEW_TOKENS, stop_token_ids=(), ignore_eos=False)
    assert not params.is_greedy


def test_explicit_zeros_are_kept() -> None:
    params = sampling_from_proto(common_pb2.SamplingParams(temperature=0.0, top_k=0, min_p=0.0, seed=0,
                                                           ignore_eos=False))
    assert params.temperature == 0.0 and params.is_greedy
    assert params.seed == 0  # seed 0 is a seed, not "unseeded"
    assert (params.top_k, params.min_p, params.ignore_eos) == (0, 0.0, False)


@pytest.mark.parametrize("fields", [dict(max_new_tokens=0), dict(top_p=0.0), dict(temperature=-1.0),
                                    dict(top_k=-2), dict(min_p=2.0), dict(seed=2**63)])
def test_explicit_invalid_values_are_rejected_not_defaulted(fields: dict) -> None:
    with pytest.raises(InvalidRequestError):
        sampling_from_proto(common_pb2.SamplingParams(**fields))


def test_set_fields_are_copied() -> None:
    msg = common_pb2.SamplingParams(temperature=0.5, top_p=0.25, top_k=7, min_p=0.125, seed=2**63 - 1,
                                    max_new_tokens=9, stop_token_ids=[5, 9], ignore_eos=True)
    assert sampling_from_proto(msg) == SamplingParams(temperature=0.5, top_p=0.25, top_k=7, min_p=0.125,
                                                      seed=2**63 - 1, max_new_tokens=9, stop_token_ids=(5, 9),
                                                      ignore_eos=True)


@pytest.mark.parametrize("grammar", [None, GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "object"}'),
                                     GrammarSpec(GrammarKind.JSON_OBJECT), GrammarSpec(GrammarKind.EBNF, 'root ::= "a"')])
def test_the_gateways_spec_arrives_as_it_was_sent(grammar: GrammarSpec | None) -> None:
    """One record from the gateway's routes to the engine: the worker reads back the spec the gateway sent."""
    spec = SamplingSpec(temperature=0.5, top_p=0.25, top_k=7, min_p=0.125, seed=0, max_new_tokens=9,
                        stop_token_ids=(5, 9), ignore_eos=False, min_new_tokens=2, presence_penalty=-0.5,
                        frequency_penalty=0.5, repetition_penalty=1.25, logit_bias=((3, -1.0), (8, 2.0)),
                        top_logprobs_num=3, token_ids_logprob=(4,), grammar=grammar)
    assert spec_from_proto(sampling_to_proto(spec)) == spec
    assert spec_from_proto(sampling_to_proto(SamplingSpec())) == SamplingSpec()


LAYOUT = KVLayout(num_layers=2, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)


def test_layout_to_proto() -> None:
    msg = layout_to_proto(LAYOUT)
    assert (msg.num_layers, msg.page_size, msg.num_kv_heads, msg.head_dim) == (2, 16, 2, 64)
    assert msg.dtype == "bfloat16"
    assert msg.page_bytes == LAYOUT.page_bytes == 2 * 2 * 16 * 2 * 64 * 2


def test_matching_layout_passes() -> None:
    check_layout_matches(LAYOUT, common_pb2.KvLayout(num_layers=2, page_size=16, num_kv_heads=2, head_dim=64,
                                                     dtype="bfloat16", page_bytes=LAYOUT.page_bytes,
                                                     order="page,layer,kv,offset,kv_head,head_dim"))


def test_pages_laid_out_in_another_axis_order_are_rejected() -> None:
    remote = layout_to_proto(LAYOUT)
    remote.order = "page,kv,layer,offset,kv_head,head_dim"
    with pytest.raises(InvalidRequestError, match="order=page,kv,layer"):
        check_layout_matches(LAYOUT, remote)


@pytest.mark.parametrize("change", [dict(num_layers=3), dict(page_size=32), dict(num_kv_heads=4),
                                    dict(head_dim=128), dict(dtype=torch.float16)])
def test_any_layout_difference_is_rejected(change: dict) -> None:
    remote = layout_to_proto(dataclasses.replace(LAYOUT, **change))
    with pytest.raises(InvalidRequestError, match="KV layout mismatch"):
        check_layout_matches(LAYOUT, remote)


def test_page_bytes_difference_alone_is_rejected() -> None:
    remote = layout_to_proto(LAYOUT)
    remote.page_bytes += 1
    with pytest.raises(InvalidRequestError):
        check_layout_matches(LAYOUT, remote)


@pytest.mark.parametrize(("reason", "expected"), [
    (FinishReason.STOP, common_pb2.FINISH_REASON_STOP), (FinishReason.LENGTH, common_pb2.FINISH_REASON_LENGTH),
    (FinishReason.ABORT, common_pb2.FINISH_REASON_ABORT), (None, common_pb2.FINISH_REASON_UNSPECIFIED)])
def test_finish_to_proto(reason: FinishReason | None, expected: int) -> None:
    assert finish_to_proto(reason) == expected


def test_token_to_proto() -> None:
    msg = token_to_proto(StepOutput("r", 42, -0.5))
    assert (msg.token_id, msg.logprob) == (42, -0.5)
