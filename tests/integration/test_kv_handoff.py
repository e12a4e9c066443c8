"""A real Mooncake TCP handoff between a prefill engine and a decode engine (two pools, one process)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import Request, SamplingParams
from engine.weights import open_checkpoint
from kv_transfer import RemotePages, TransportConfig, create_transport
from server_runtime.kv_send import KVSend, KVSendConnector
from tests.local_handoff import confirm, take_kv_in

pytest.importorskip("mooncake.engine")

PROMPT = list(range(100, 137))   # 37 tokens: three pages of 16, the last one partly filled
GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(smollm2_path: Path):
    checkpoint = open_checkpoint(str(smollm2_path))
    config = EngineConfig(dtype="float32", max_total_tokens=1024)
    prefill, decode = (Engine(checkpoint, config, progress=False) for _ in range(2))
    transports = []
    for engine in (prefill, decode):
        transport = create_transport(TransportConfig(backend="mooncake", hostname="127.0.0.1"))
        transport.register(engine.runner.kv_pool.base_addr, engine.runner.kv_pool.num_bytes)
        transports.append(transport)
    take_kv_in(decode)
    yield prefill, decode, transports[0], transports[1]
    for transport in transports:
        transport.close()


def _run_to_end(engine: Engine) -> list[int]:
    tokens = []
    while engine.has_work:
        tokens += [o.token_id for o in engine.step() if o.token_id is not None]
    return tokens


def test_decode_pages_hold_exactly_the_prefill_kv_and_decoding_continues(engines) -> None:
    prefill, decode, prefill_transport, decode_transport = engines
    # the decode pool is dirty where the KV will land: stale bytes must all be overwritten
    decode.runner.kv_pool.tensor.normal_()
    dst_pages = decode.reserve("h1", len(PROMPT)).page_ids
    woken = threading.Event()
    prefill.kv_connector = KVSendConnector(prefill_transport, prefill.runner.kv_pool.base_addr, woken.set)
    dst = RemotePages(decode_transport.session_id, decode.runner.kv_pool.base_addr,
                      decode.runner.layout.page_bytes, tuple(dst_pages))
    send = KVSend(dst, 0, int((time.time() + 30) * 1000), timeout_s=10)
    req = Request("h1", list(PROMPT), GREEDY, is_prefill_only=True, kv_params=send)
    prefill.add_request(req)
    [first] = prefill.step()
    src_pages = list(req.page_ids)   # held by the connector until its poll reports the write over
    assert len(src_pages) == len(dst_pages) == 3

    stats = send.written.result(timeout=10)
    assert woken.wait(5)   # the transport's thread wakes the engine loop
    assert prefill.holds("h1") and prefill.poll_kv() == ["h1"] and not prefill.holds("h1")

    assert stats.num_bytes == 3 * prefill.runner.layout.page_bytes
    sent = prefill.runner.kv_pool.read_tokens(src_pages, len(PROMPT))
    received = decode.runner.kv_pool.read_tokens(dst_pages, len(PROMPT))
    assert torch.equal(sent, received)
    assert sent.abs().sum() > 0

    assert confirm(decode, "h1", list(PROMPT), first.token_id, first.logprob, GREEDY) is None
    handed_off = [first.token_id] + _run_to_end(decode)

    # the same request run start to finish on one engine gives the same tokens
    prefill.add_request(Request("whole", list(PROMPT), GREEDY))
    assert handed_off == _run_to_end(prefill)
    for engine in (prefill, decode):
        assert engine.allocator.num_free == engine.allocator.num_pages


def test_unused_reservation_expires_and_frees_its_pages(engines) -> None:
    _, decode, _, _ = engines
    now = [0.0]
    receiver = decode.kv_connector
    take_kv_in(decode, ttl_s=30.0, clock=lambda: now[0])
    try:
        before = decode.allocator.num_free
        decode.reserve("stale", 40)
        assert decode.allocator.num_free == before - 3 and decode.poll_kv() == []
        now[0] = 31.0
        assert decode.poll_kv() == ["stale"]
        assert decode.allocator.num_free == before and not decode.holds("stale")
    finally:
        decode.kv_connector = receiver


def test_dropped_reservation_pages_sit_out_the_write_grace_period(engines) -> None:
    # a prefill server may still be writing into them: they must not go to another request yet
    _, decode, _, _ = engines
    now = [0.0]
    receiver = decode.kv_connector
    quarantine = take_kv_in(decode, ttl_s=30.0, grace_s=5.0, clock=lambda: now[0])
    try:
        before = decode.allocator.num_free
        decode.reserve("late", 20)
        decode.abort("late")
        assert decode.allocator.num_free == before - 2 and quarantine.num_quarantined_pages == 2
        assert not decode.holds("late")   # the id is free again; its pages are not
        now[0] = 4.9
        decode.poll_kv()
        assert decode.allocator.num_free == before - 2
        now[0] = 5.0
        decode.poll_kv()
        assert decode.allocator.num_free == before and quarantine.num_quarantined_pages == 0
        decode.reserve("settled", 20)
        decode.abort("settled", write_settled=True)   # the write is known to be over: no quarantine
        assert decode.allocator.num_free == before and quarantine.num_quarantined_pages == 0
    finally:
        decode.kv_connector = receiver
