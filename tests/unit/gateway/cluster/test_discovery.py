"""Worker discovery: static addresses and `dns:///name:port` names, resolved by the system resolver.

Every resolution here is real (`getaddrinfo`) and stays on this machine: `localhost` comes from
/etc/hosts, and the add/remove scenario runs in a private mount namespace whose /etc/hosts and
/etc/nsswitch.conf ("hosts: files") the test writes, so names appear and vanish without a DNS server.
The workers are real gRPC servers on loopback addresses that answer health and GetModelInfo.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.cluster.discovery import REFRESH_INTERVAL_S, RoleDiscovery, WorkerSpec, check_worker_spec, resolve_all
from gateway.cluster.pool import WorkerPool
from gateway.errors import APIError
from tandem.v1 import common_pb2, worker_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[3]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _Info(worker_pb2_grpc.WorkerServiceServicer):
    async def GetModelInfo(self, request, context):
        return common_pb2.GetModelInfoResponse(model_path="m", architecture="LlamaForCausalLM", context_len=2048,
                                               vocab_size=100, eos_token_ids=[2])


async def start_worker(role: str, address: str) -> grpc.aio.Server:
    """A gRPC server on `address` that is SERVING and answers GetModelInfo (for any role)."""
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(_Info(), server)
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    assert server.add_insecure_port(address) != 0
    await server.start()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server


@pytest.mark.parametrize("spec, parsed", [
    ("10.0.0.5:30001", WorkerSpec("10.0.0.5", 30001, False)),
    ("prefill:30001", WorkerSpec("prefill", 30001, False)),
    ("[::1]:30002", WorkerSpec("::1", 30002, False)),
    ("dns:///tandem-prefill-headless.default.svc.cluster.local:30001",
     WorkerSpec("tandem-prefill-headless.default.svc.cluster.local", 30001, True)),
])
def test_parse(spec, parsed):
    assert WorkerSpec.parse(spec) == parsed
    assert check_worker_spec(spec) == spec


def test_ipv6_literal_keeps_its_brackets():
    assert WorkerSpec.parse("[::1]:30002").address == "[::1]:30002"


@pytest.mark.parametrize("spec", ["prefill", "prefill:", ":30001", "prefill:http", "prefill:70000",
                                  "dns:///:30001", "dns:///a/b:30001", "dns:///name"])
def test_bad_specs_are_rejected_with_the_value(spec):
    with pytest.raises(ValueError, match="worker address"):
        WorkerSpec.parse(spec)
    with pytest.raises(argparse.ArgumentTypeError):
        check_worker_spec(spec)


def test_gateway_cli_rejects_a_bad_worker_address(capsys):
    from launcher.flags import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gateway", "--prefill", "dns:///nameonly", "--decode", "d:1"])
    assert "dns:///nameonly" in capsys.readouterr().err
    args = build_parser().parse_args(["gateway", "--prefill", "dns:///p:30001", "--decode", "d:30002"])
    assert args.prefill == ["dns:///p:30001"]


def test_localhost_resolves_to_its_loopback_address():
    assert "127.0.0.1:30001" in asyncio.run(resolve_all("localhost", 30001))
    assert asyncio.run(resolve_all("127.0.0.1", 5)) == ("127.0.0.1:5",)


def test_role_discovery_mixes_static_and_resolved_and_waits_for_its_interval():
    asyncio.run(_role_discovery())


async def _role_discovery() -> None:
    now = [0.0]
    discovery = RoleDiscovery("prefill", ["10.1.2.3:30001", "dns:///localhost:30001"], refresh_interval_s=5.0,
                              clock=lambda: now[0])
    assert discovery.has_dns and discovery.static_addresses == ("10.1.2.3:30001",)
    assert discovery.addresses() == ("10.1.2.3:30001",)            # nothing resolved before the first refresh
    addresses = await discovery.refresh()
    assert addresses[0] == "10.1.2.3:30001" and "127.0.0.1:30001" in addresses
    now[0] = 4.0
    assert await discovery.refresh() == addresses                  # within the interval: no new lookup
    now[0] = 5.0
    assert await discovery.refresh() == addresses
    assert RoleDiscovery("decode", ["d:1"]).has_dns is False
    with pytest.raises(ValueError):
        RoleDiscovery("decode", ["d:1"], refresh_interval_s=0)


def test_pool_expands_a_dns_name_and_drops_a_worker_that_stops_serving():
    asyncio.run(_pool_with_localhost())


async def _pool_with_localhost() -> None:
    port, decode_port = free_port(), free_port()
    prefill = await start_worker("prefill", f"127.0.0.1:{port}")
    decode = await start_worker("decode", f"127.0.0.1:{decode_port}")
    pool = WorkerPool((f"dns:///localhost:{port}",), (f"127.0.0.1:{decode_port}",))
    try:
        await pool.probe_all()
        assert f"127.0.0.1:{port}" in [w.address for w in pool.workers["prefill"]]
        assert pool.is_ready
        assert pool.pick("prefill").address == f"127.0.0.1:{port}"
        assert pool.limits().context_len == 2048
        await prefill.stop(None)
        await pool.probe_all()
        assert not pool.is_ready
        with pytest.raises(APIError) as caught:
            pool.pick("prefill")
        assert caught.value.status == 503
    finally:
        await pool.close()
        await prefill.stop(None)
        await decode.stop(None)


# -- names that appear and vanish: a private /etc/hosts in a mount namespace -------------------------

def _write_hosts(path: str, lines: list[str]) -> None:
    # Rewrite in place: the bind mount follows the inode, so a rename would not be seen.
    with open(path, "w") as f:
        f.write("".join(f"{line}\n" for line in lines))


async def _hosts_scenario(hosts_path: str) -> None:
    """Runs inside the namespace: the pool follows /etc/hosts as DNS answers change."""
    port, decode_port = free_port("127.0.0.2"), free_port()
    interval = 0.05
    _write_hosts(hosts_path, ["127.0.0.1 tandem-prefill", "127.0.0.2 tandem-prefill", "127.0.0.1 tandem-decode"])
    servers = [await start_worker("prefill", f"127.0.0.1:{port}"), await start_worker("prefill", f"127.0.0.2:{port}"),
               await start_worker("decode", f"127.0.0.1:{decode_port}")]
    pool = WorkerPool((f"dns:///tandem-prefill:{port}",), (f"dns:///tandem-decode:{decode_port}",),
                      refresh_interval_s=interval)
    both = {f"127.0.0.1:{port}", f"127.0.0.2:{port}"}
    try:
        await pool.probe_all()
        assert {w.address for w in pool.workers["prefill"]} == both and pool.is_ready
        assert {pool.pick("prefill").address for _ in range(4)} == both       # round-robin over every pod

        _write_hosts(hosts_path, ["127.0.0.1 tandem-prefill", "127.0.0.1 tandem-decode"])   # a pod went away
        await asyncio.sleep(interval)
        await pool.probe_all()
        assert [w.address for w in pool.workers["prefill"]] == [f"127.0.0.1:{port}"]
        assert {pool.pick("prefill").address for _ in range(4)} == {f"127.0.0.1:{port}"}

        _write_hosts(hosts_path, ["127.0.0.1 tandem-prefill"])                # no decode pod at all: NXDOMAIN
        await asyncio.sleep(interval)
        await pool.probe_all()
        assert pool.workers["decode"] == [] and not pool.is_ready
        with pytest.raises(APIError):
            pool.pick("decode")

        _write_hosts(hosts_path, ["127.0.0.1 tandem-prefill", "127.0.0.2 tandem-prefill",
                                  "127.0.0.1 tandem-decode"])                  # both come back
        await asyncio.sleep(interval)
        await pool.probe_all()
        assert {w.address for w in pool.workers["prefill"] if w.is_ready} == both and pool.is_ready
    finally:
        await pool.close()
        for server in servers:
            await server.stop(None)


def test_pool_follows_names_that_appear_and_vanish(tmp_path):
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("needs root and unshare(1) to give the test its own /etc/hosts in a mount namespace")
    hosts, nsswitch = tmp_path / "hosts", tmp_path / "nsswitch.conf"
    hosts.write_text("")
    nsswitch.write_text("hosts: files\n")     # never ask a DNS server: a name absent from hosts does not exist
    script = (f"mount --bind {hosts} /etc/hosts && mount --bind {nsswitch} /etc/nsswitch.conf && "
              f"exec {sys.executable} {Path(__file__).resolve()} {hosts}")
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a mount namespace here: {probe.stderr.decode().strip()}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "protos")]))
    result = subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "scenario passed" in result.stdout


def test_default_refresh_interval_is_a_few_seconds():
    assert 1.0 <= REFRESH_INTERVAL_S <= 30.0


if __name__ == "__main__":
    asyncio.run(_hosts_scenario(sys.argv[1]))
    print("scenario passed")
