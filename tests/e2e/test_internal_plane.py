"""The internal plane against an attacker on the network, with the real stack's processes: every
tandem.v1 RPC needs the internal token, and a forged Prefill cannot write into a running request's
pages (its grant does not cover them), so the victim's greedy output stays byte-identical."""

from __future__ import annotations

import threading

import grpc
import httpx
import pytest

from tests.e2e.stack import WORKER_METADATA, Stack
from tandem.v1 import (common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, worker_pb2,
                       worker_pb2_grpc)

_SERVICES = (("prefill", prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"]),
             ("decode", decode_pb2.DESCRIPTOR.services_by_name["DecodeService"]),
             ("prefill", worker_pb2.DESCRIPTOR.services_by_name["WorkerService"]),
             ("decode", worker_pb2.DESCRIPTOR.services_by_name["WorkerService"]))


def _call_raw(channel: grpc.Channel, service, method, metadata) -> grpc.StatusCode:
    """One call of `method` with an empty request, as an attacker with only the port would send it."""
    path = f"/{service.full_name}/{method.name}"
    try:
        if method.server_streaming:
            list(channel.unary_stream(path)(b"", timeout=10, metadata=metadata))
        else:
            channel.unary_unary(path)(b"", timeout=10, metadata=metadata)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer guessed-wrong-token-000000"),),
                                      (("authorization", WORKER_METADATA[0][1].removeprefix("Bearer ")),)],
                         ids=["no-token", "wrong-token", "token-without-bearer"])
def test_every_worker_rpc_without_the_token_is_unauthenticated(stack: Stack, metadata) -> None:
    for role, service in _SERVICES:
        port = stack.prefill_port if role == "prefill" else stack.decode_port
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            codes = {m.name: _call_raw(channel, service, m, metadata) for m in service.methods}
        assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, (role, service.name, codes)


def test_worker_rpcs_with_the_token_work(stack: Stack) -> None:
    for port in (stack.prefill_port, stack.decode_port):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            assert stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=5, metadata=WORKER_METADATA).num_pages
            assert stub.GetLoad(common_pb2.GetLoadRequest(), timeout=5, metadata=WORKER_METADATA).num_total_pages


_VICTIM = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 160,
           "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]}


def _victim_text(stack: Stack) -> str:
    reply = httpx.post(f"{stack.url}/v1/chat/completions", json=_VICTIM, timeout=600)
    reply.raise_for_status()
    return reply.json()["choices"][0]["message"]["content"]


def _forged_prefill(prefill: prefill_pb2_grpc.PrefillServiceStub, rid: str, target: common_pb2.KvTarget,
                    num_tokens: int) -> grpc.StatusCode:
    try:
        prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, token_ids=[42] * num_tokens, kv_target=target,
            sampling_params=common_pb2.SamplingParams(max_new_tokens=1)), timeout=30, metadata=WORKER_METADATA)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_forged_prefills_write_nothing_and_the_victim_output_is_unchanged(stack: Stack) -> None:
    """Even a caller holding the token (a compromised service) cannot name pages: a made-up grant, or its
    own genuine grant aimed at other pages, is refused while a greedy chat runs; the chat's text is
    byte-identical to a run with no attack."""
    expected = _victim_text(stack)
    with grpc.insecure_channel(f"127.0.0.1:{stack.prefill_port}") as p_channel, \
            grpc.insecure_channel(f"127.0.0.1:{stack.decode_port}") as d_channel:
        prefill, decode = prefill_pb2_grpc.PrefillServiceStub(p_channel), decode_pb2_grpc.DecodeServiceStub(d_channel)
        control = worker_pb2_grpc.WorkerServiceStub(d_channel)
        num_pages = control.GetModelInfo(common_pb2.GetModelInfoRequest(), metadata=WORKER_METADATA).num_pages
        result: dict[str, str] = {}
        victim = threading.Thread(target=lambda: result.update(text=_victim_text(stack)))
        victim.start()
        codes = set()
        try:
            page = 0
            while victim.is_alive() or page < 64:
                # the attacker's own reservation, with a genuine grant for its one page
                own = decode.Reserve(decode_pb2.ReserveRequest(request_id=f"attacker-{page}", prompt_len=16),
                                     timeout=10, metadata=WORKER_METADATA).kv_target
                pages = [(page + i) % num_pages for i in range(8)]
                made_up = common_pb2.KvTarget(session_id=own.session_id, base_addr=own.base_addr, layout=own.layout,
                                              page_ids=pages, grant="ab" * 32,
                                              grant_expires_unix_ms=own.grant_expires_unix_ms)
                codes.add(_forged_prefill(prefill, f"forged-{page}", made_up, 16 * 8))
                aimed = common_pb2.KvTarget()
                aimed.CopyFrom(own)
                aimed.page_ids[:] = [p for p in pages if p not in own.page_ids][:1]   # someone else's page
                codes.add(_forged_prefill(prefill, f"attacker-{page}", aimed, 16))
                assert control.Abort(common_pb2.AbortRequest(request_id=f"attacker-{page}", kv_write_settled=True),
                                     metadata=WORKER_METADATA).found
                page += 8
        finally:
            victim.join()
        assert codes == {grpc.StatusCode.PERMISSION_DENIED}
        assert result["text"] == expected

        # A genuine grant works once, for its own pages; Generate needs it too.
        own = decode.Reserve(decode_pb2.ReserveRequest(request_id="insider", prompt_len=16), timeout=10,
                             metadata=WORKER_METADATA).kv_target
        try:
            assert _forged_prefill(prefill, "insider", own, 16) == grpc.StatusCode.OK
            assert _forged_prefill(prefill, "insider", own, 16) == grpc.StatusCode.PERMISSION_DENIED   # replayed
            with pytest.raises(grpc.RpcError) as refused:
                list(decode.Generate(decode_pb2.GenerateRequest(
                    request_id="insider", prompt_token_ids=[42] * 16, first_token=common_pb2.TokenOutput(token_id=1),
                    sampling_params=common_pb2.SamplingParams(max_new_tokens=1), kv_grant="cd" * 32),
                    timeout=10, metadata=WORKER_METADATA))
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        finally:
            assert control.Abort(common_pb2.AbortRequest(request_id="insider", kv_write_settled=True),
                                 metadata=WORKER_METADATA).found


def test_cancel_prefill_spends_the_grant_and_checks_it(stack: Stack) -> None:
    """CancelPrefill before a Prefill arrives: the late Prefill is refused, so the decode pages may be
    freed at once. Another request's id with the grant is refused."""
    with grpc.insecure_channel(f"127.0.0.1:{stack.prefill_port}") as p_channel, \
            grpc.insecure_channel(f"127.0.0.1:{stack.decode_port}") as d_channel:
        prefill, decode = prefill_pb2_grpc.PrefillServiceStub(p_channel), decode_pb2_grpc.DecodeServiceStub(d_channel)
        control = worker_pb2_grpc.WorkerServiceStub(d_channel)
        own = decode.Reserve(decode_pb2.ReserveRequest(request_id="cancelled", prompt_len=16), timeout=10,
                             metadata=WORKER_METADATA).kv_target
        try:
            with pytest.raises(grpc.RpcError) as refused:
                prefill.CancelPrefill(prefill_pb2.CancelPrefillRequest(request_id="someone-else", kv_target=own),
                                      timeout=10, metadata=WORKER_METADATA)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            answer = prefill.CancelPrefill(prefill_pb2.CancelPrefillRequest(request_id="cancelled", kv_target=own),
                                           timeout=10, metadata=WORKER_METADATA)
            assert not answer.was_running
            assert _forged_prefill(prefill, "cancelled", own, 16) == grpc.StatusCode.PERMISSION_DENIED
        finally:
            assert control.Abort(common_pb2.AbortRequest(request_id="cancelled", kv_write_settled=True),
                                 metadata=WORKER_METADATA).found
