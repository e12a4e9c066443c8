"""Where a real Mooncake transport listens: only on its KV address, never on every interface.

The transport under test runs in its own process, so that every listening socket of that process
is one Mooncake opened; they are read from /proc/<pid>/net/tcp{,6}, matched to the process by the
socket inodes of its fds. Skips itself where Mooncake is not installed."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("mooncake.engine", reason="Mooncake transfer engine is not installed")

from kv_transfer import RemotePages, TransportConfig, create_transport  # noqa: E402 - after the skip

REPO_ROOT = Path(__file__).resolve().parents[2]
POOL_SHAPE = (64, 256)  # pages of 1 KiB in float32
TCP_LISTEN = "0A"

_PEER_SCRIPT = """
import hashlib, sys, torch
from kv_transfer import TransportConfig, create_transport
pool = torch.zeros(64, 256, dtype=torch.float32)
transport = create_transport(TransportConfig(backend="mooncake", hostname=sys.argv[1]))
transport.register(pool.data_ptr(), pool.numel() * pool.element_size())
print(transport.session_id, pool.data_ptr(), flush=True)
for _ in sys.stdin:
    print(hashlib.sha256(pool.numpy().tobytes()).hexdigest(), flush=True)
"""


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _decode_address(hex_address: str) -> str:
    """A /proc/net/tcp{,6} address (32-bit words in host order, little-endian here) as text;
    IPv4-mapped IPv6 addresses come back as the IPv4 address."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    if len(words) == 4:
        return str(ipaddress.IPv4Address(words))
    address = ipaddress.IPv6Address(words)
    return str(address.ipv4_mapped or address)


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket that process `pid` holds in LISTEN state."""
    inodes = _socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as rows:
            next(rows)
            for row in rows:
                fields = row.split()
                if fields[3] == TCP_LISTEN and fields[9] in inodes:
                    host, port = fields[1].split(":")
                    found.append((_decode_address(host), int(port, 16)))
    return sorted(found)


@pytest.fixture
def peer() -> Iterator[tuple[subprocess.Popen[str], str, int]]:
    """(process, session id, pool base address) of a Mooncake transport started with
    hostname 127.0.0.1 in a process of its own."""
    process = subprocess.Popen([sys.executable, "-c", _PEER_SCRIPT, "127.0.0.1"], cwd=REPO_ROOT,
                               text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)
    try:
        assert process.stdout is not None
        session_id, base_addr = process.stdout.readline().split()
        yield process, session_id, int(base_addr)
    finally:
        process.kill()
        process.wait(timeout=10)


def _pool_digest(process: subprocess.Popen[str]) -> str:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write("digest\n")
    process.stdin.flush()
    return process.stdout.readline().strip()


def test_every_listener_is_on_the_kv_address_only(peer: tuple[subprocess.Popen[str], str, int]
                                                  ) -> None:
    process, session_id, _ = peer
    listening = listening_sockets(process.pid)
    rpc_port = int(session_id.rsplit(":", 1)[1])
    assert len(listening) >= 2  # the handshake RPC listener and the TCP data listener
    assert rpc_port in {port for _, port in listening}
    assert {host for host, _ in listening} == {"127.0.0.1"}, listening
    for _, port in listening:
        # 127.0.0.2 is this machine too: a listener on every interface would accept it.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", port), timeout=2).close()


def test_write_into_a_bound_peer_lands_and_opens_no_other_listener(
        peer: tuple[subprocess.Popen[str], str, int]) -> None:
    process, session_id, base_addr = peer
    before = listening_sockets(process.pid)
    src_pool = torch.randn(POOL_SHAPE, dtype=torch.float32)
    page_bytes = POOL_SHAPE[1] * src_pool.element_size()
    ids = list(range(POOL_SHAPE[0]))
    with create_transport(TransportConfig(backend="mooncake", hostname="127.0.0.1")) as sender:
        sender.register(src_pool.data_ptr(), src_pool.numel() * src_pool.element_size())
        dst = RemotePages(session_id=session_id, base_addr=base_addr, page_bytes=page_bytes,
                          page_ids=tuple(ids))
        stats = sender.write_pages(src_pool.data_ptr(), ids, dst).result(timeout=10.0)
    assert stats.num_bytes == src_pool.numel() * src_pool.element_size()
    assert _pool_digest(process) == hashlib.sha256(src_pool.numpy().tobytes()).hexdigest()
    assert listening_sockets(process.pid) == before
