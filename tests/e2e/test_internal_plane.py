"""The internal plane against an attacker on the network, with the real stack's processes: every
tandem.v1 RPC needs the internal token, and a forged Prefill cannot write into a running request's
pages (its grant does not cover them), even when the caller holds the token and signs grants itself
(the key is the workers' grant secret, which the gateway never holds), so the victim's greedy output
stays byte-identical."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest

from server_runtime.kv_grants import grant_key, sign
from launcher.internal_plane import GRANT_SECRET_ENV, TOKEN_ENV
from tests.e2e.stack import INTERNAL_TOKEN, WORKER_METADATA, Stack, child_pids, start_services
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


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode() for k, v in pairs}


def test_serve_gives_the_grant_secret_to_the_workers_and_not_the_gateway(stack: Stack) -> None:
    """Read from /proc: the gateway child holds the token but no KV grant secret; both workers hold the
    same one, which is not the token and appears on no command line."""
    children = {}
    for pid in child_pids(stack.proc.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        children[argv[argv.index("launcher") + 1]] = (pid, argv)
    assert children.keys() == {"gateway", "prefill", "decode"}
    envs = {role: _environ(pid) for role, (pid, _) in children.items()}
    assert TOKEN_ENV in envs["gateway"] and not any("KV_GRANT" in name for name in envs["gateway"])
    secret = envs["prefill"][GRANT_SECRET_ENV]
    assert envs["decode"][GRANT_SECRET_ENV] == secret and len(secret) >= 32 and secret != INTERNAL_TOKEN
    assert not any(secret in arg for _, argv in children.values() for arg in argv)


# The attacks run paced, one forged write per ATTACK_PACE_S, over every page of the pool while the victim's chat
# runs: hundreds of writes. Unpaced, about 12,000 of them took both cores and slowed the chat to 25-45 s.
ATTACK_PACE_S = 0.005
_VICTIM = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 96,
           "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]}
_UNATTACKED: dict[str, str] = {}   # the victim's greedy text with no attack, by gateway URL: computed once


def _victim_text(stack: Stack) -> str:
    reply = httpx.post(f"{stack.url}/v1/chat/completions", json=_VICTIM, timeout=600)
    reply.raise_for_status()
    return reply.json()["choices"][0]["message"]["content"]


def _unattacked_text(stack: Stack) -> str:
    if stack.url not in _UNATTACKED:
        _UNATTACKED[stack.url] = _victim_text(stack)
    return _UNATTACKED[stack.url]


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
    expected = _unattacked_text(stack)
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
                time.sleep(ATTACK_PACE_S)
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


@pytest.mark.parametrize("forger_secret", [INTERNAL_TOKEN, "a-made-up-grant-secret-0123456789"],
                         ids=["key-from-the-internal-token", "made-up-secret"])
def test_a_token_holder_cannot_mint_a_grant_for_the_victims_pages(stack: Stack, forger_secret: str) -> None:
    """The audit's attack: a caller holding the internal token (as the gateway does) signs its own grants,
    keyed as a grant key derived from the token would be, over every page of the pool while a greedy chat
    runs. The workers' grant secret is not the token, so every write is refused, the prefill worker logs
    each refusal, and the chat's text is byte-identical to a run with no attack."""
    expected = _unattacked_text(stack)
    log_start = stack.log_path.stat().st_size
    with grpc.insecure_channel(f"127.0.0.1:{stack.prefill_port}") as p_channel, \
            grpc.insecure_channel(f"127.0.0.1:{stack.decode_port}") as d_channel:
        prefill, decode = prefill_pb2_grpc.PrefillServiceStub(p_channel), decode_pb2_grpc.DecodeServiceStub(d_channel)
        control = worker_pb2_grpc.WorkerServiceStub(d_channel)
        num_pages = control.GetModelInfo(common_pb2.GetModelInfoRequest(), metadata=WORKER_METADATA).num_pages
        # The destination (session, pool address, layout) from a reservation of the attacker's own.
        own = decode.Reserve(decode_pb2.ReserveRequest(request_id="minter", prompt_len=16), timeout=10,
                             metadata=WORKER_METADATA).kv_target
        assert control.Abort(common_pb2.AbortRequest(request_id="minter", kv_write_settled=True),
                             metadata=WORKER_METADATA).found
        result: dict[str, str] = {}
        victim = threading.Thread(target=lambda: result.update(text=_victim_text(stack)))
        victim.start()
        codes, num_forged = set(), 0
        try:
            page = 0
            while victim.is_alive() or page < 64:
                minted = common_pb2.KvTarget(session_id=own.session_id, base_addr=own.base_addr, layout=own.layout,
                                             page_ids=[(page + i) % num_pages for i in range(8)])
                sign(grant_key(forger_secret), f"minted-{page}", minted, ttl_s=30)
                codes.add(_forged_prefill(prefill, f"minted-{page}", minted, 16 * 8))
                num_forged += 1
                page += 8
                time.sleep(ATTACK_PACE_S)
        finally:
            victim.join()
    assert codes == {grpc.StatusCode.PERMISSION_DENIED}
    assert result["text"] == expected
    with open(stack.log_path, "rb") as log:
        log.seek(log_start)
        lines = log.read().decode(errors="replace").splitlines()
    refusals = [line for line in lines if "refused a KV grant for minted-" in line]
    assert len(refusals) == num_forged
    print(f"{num_forged} minted grants refused while the chat ran")


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


def test_workers_with_different_grant_secrets_refuse_every_prefill_in_plain_words(tmp_path) -> None:
    """A misconfiguration, not an attack: each Prefill is refused, the prefill worker's log names the
    likely cause, and the client gets a 500 that names no internals."""
    services = start_services(tmp_path, "--dtype", "float32", "--max-total-tokens", "2048", "--torch-threads", "1",
                              prefill_env={GRANT_SECRET_ENV: "a-grant-secret-the-decode-worker-lacks"})
    try:
        services.start_gateway("--data-dir", str(tmp_path / "data"), timeout_s=300)
        for _ in range(2):
            reply = httpx.post(f"{services.url}/v1/chat/completions", json={**_VICTIM, "max_tokens": 4}, timeout=120)
            assert reply.status_code == 500
            assert reply.json()["error"]["message"].startswith("the prefill worker failed (request ")
        assert "another --kv-grant-secret-file" in (tmp_path / "prefill.log").read_text()
    finally:
        services.stop()
