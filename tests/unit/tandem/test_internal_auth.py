"""The internal plane's credentials over real gRPC on loopback: the token check on unary, streaming and
reflection calls, health left open, and TLS / mTLS with certificates made by openssl."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from tandem.internal_auth import InternalCredentials, is_loopback_host, read_token_file, write_token_file
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, worker_pb2, worker_pb2_grpc

TOKEN = "a-test-token-of-sufficient-length"


class _Worker(worker_pb2_grpc.WorkerServiceServicer):
    async def GetModelInfo(self, request, context):
        return common_pb2.GetModelInfoResponse(model_path="m", context_len=7)


class _Decode(decode_pb2_grpc.DecodeServiceServicer):
    async def Generate(self, request, context):
        for i in range(3):
            yield decode_pb2.GenerateResponse(request_id=request.request_id, tokens=[common_pb2.TokenOutput(token_id=i)])


async def _serve(credentials: InternalCredentials) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=credentials.server_interceptors())
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(_Worker(), server)
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(_Decode(), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name,
                                         reflection.SERVICE_NAME), server)
    port = credentials.add_port(server, "127.0.0.1:0")
    assert port != 0
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, port


async def _calls(channel: grpc.aio.Channel, metadata=()) -> dict[str, grpc.StatusCode]:
    """The status of one call of each shape (unary, server-streaming, reflection's bidi, health)."""
    outcomes = {}

    async def attempt(name, coro):
        try:
            await coro
            outcomes[name] = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            outcomes[name] = exc.code()

    async def stream():
        call = decode_pb2_grpc.DecodeServiceStub(channel).Generate(decode_pb2.GenerateRequest(request_id="r"),
                                                                   metadata=metadata, timeout=5)
        assert [m.tokens[0].token_id async for m in call] == [0, 1, 2]

    async def reflect():
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=metadata, timeout=5)
        assert [r async for r in call]

    await attempt("unary", worker_pb2_grpc.WorkerServiceStub(channel).GetModelInfo(
        common_pb2.GetModelInfoRequest(), metadata=metadata, timeout=5))
    await attempt("stream", stream())
    await attempt("reflection", reflect())
    await attempt("health", health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5))
    return outcomes


def test_every_rpc_but_health_needs_the_token() -> None:
    async def run():
        credentials = InternalCredentials(token=TOKEN)
        server, port = await _serve(credentials)
        try:
            address = f"127.0.0.1:{port}"
            async with grpc.aio.insecure_channel(address) as bare:
                without = await _calls(bare)
                wrong = await _calls(bare, (("authorization", "Bearer not-the-token-at-all"),))
                twice = await _calls(bare, (*credentials.metadata(), *credentials.metadata()))
            async with credentials.open_channel(address) as channel:   # adds the token by itself
                right = await _calls(channel)
            return without, wrong, twice, right
        finally:
            await server.stop(None)

    without, wrong, twice, right = asyncio.run(run())
    refused = {"unary": grpc.StatusCode.UNAUTHENTICATED, "stream": grpc.StatusCode.UNAUTHENTICATED,
               "reflection": grpc.StatusCode.UNAUTHENTICATED, "health": grpc.StatusCode.OK}
    assert without == wrong == twice == refused
    assert right == dict.fromkeys(refused, grpc.StatusCode.OK)


def test_no_token_means_an_open_server() -> None:
    async def run():
        server, port = await _serve(InternalCredentials())
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await _calls(channel)
        finally:
            await server.stop(None)

    assert set(asyncio.run(run()).values()) == {grpc.StatusCode.OK}


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1, a client certificate (both CA-signed), and a stranger's
    self-signed certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=tandem-test-ca", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext", cwd=d)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "stranger.key", "-out", "stranger.pem",
             "-days", "2", "-subj", "/CN=stranger", cwd=d)
    return d


def test_mutual_tls_with_the_token(pki: Path) -> None:
    server_side = InternalCredentials(TOKEN, str(pki / "server.pem"), str(pki / "server.key"), str(pki / "ca.pem"))
    client = InternalCredentials(TOKEN, str(pki / "client.pem"), str(pki / "client.key"), str(pki / "ca.pem"))
    stranger = InternalCredentials(TOKEN, str(pki / "stranger.pem"), str(pki / "stranger.key"), str(pki / "ca.pem"))

    async def run():
        server, port = await _serve(server_side)
        try:
            address = f"127.0.0.1:{port}"
            async with client.open_channel(address) as channel:
                trusted = await _calls(channel)
            async with stranger.open_channel(address) as channel:
                untrusted = await _calls(channel)
            async with grpc.aio.insecure_channel(address) as channel:   # plaintext to a TLS port
                plaintext = await _calls(channel, client.metadata())
            return trusted, untrusted, plaintext
        finally:
            await server.stop(None)

    trusted, untrusted, plaintext = asyncio.run(run())
    assert set(trusted.values()) == {grpc.StatusCode.OK}
    assert set(untrusted.values()) == {grpc.StatusCode.UNAVAILABLE}   # the handshake fails: no call is made
    assert set(plaintext.values()) == {grpc.StatusCode.UNAVAILABLE}


def test_credentials_are_validated_and_the_token_stays_out_of_reprs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least"):
        InternalCredentials(token="short")
    with pytest.raises(ValueError, match="go together"):
        InternalCredentials(tls_cert=str(tmp_path))
    with pytest.raises(ValueError, match="needs --tls-cert"):
        InternalCredentials(tls_ca=str(tmp_path))
    assert TOKEN not in repr(InternalCredentials(token=TOKEN))


def test_token_file_is_written_once_and_private(tmp_path: Path) -> None:
    path = tmp_path / "secrets" / "token"
    assert write_token_file(str(path)) is True
    first = read_token_file(str(path))
    assert len(first) >= 32 and path.stat().st_mode & 0o777 == 0o600
    assert write_token_file(str(path)) is False and read_token_file(str(path)) == first
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_token_file(str(tmp_path / "empty"))


@pytest.mark.parametrize("host, expected", [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                            ("[::1]", True), ("0.0.0.0", False), ("::", False), ("", False),
                                            ("10.1.2.3", False), ("no-such-host.invalid", False)])
def test_loopback_hosts(host: str, expected: bool) -> None:
    assert is_loopback_host(host) is expected


def test_healthcheck_probes_a_mutual_tls_worker_with_its_certificate(pki: Path) -> None:
    from launcher.healthcheck import probe_grpc
    server_side = InternalCredentials(TOKEN, str(pki / "server.pem"), str(pki / "server.key"), str(pki / "ca.pem"))
    client = InternalCredentials(None, str(pki / "client.pem"), str(pki / "client.key"), str(pki / "ca.pem"))

    async def run():
        server, port = await _serve(server_side)
        try:
            address = f"127.0.0.1:{port}"
            return await asyncio.gather(asyncio.to_thread(probe_grpc, address, "", 5, client),
                                        asyncio.to_thread(probe_grpc, address, "", 2))
        finally:
            await server.stop(None)

    with_certificate, plaintext = asyncio.run(run())
    assert with_certificate.is_healthy and not plaintext.is_healthy
