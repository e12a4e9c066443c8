"""Resolving the KV listen address and redirecting wildcard binds (kv_transfer/mooncake_binding.py).

The redirect is exercised on CPython's own `_socket` extension, which calls libc `bind` through its
GOT just as Mooncake's libraries do; Mooncake's listeners are checked in
tests/integration/test_mooncake_binding.py."""

from __future__ import annotations

import errno
import socket
from pathlib import Path

import pytest

from kv_transfer import KVTransferError
from kv_transfer.mooncake_binding import resolve_bind_address, wildcard_binds_redirected


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("hostname", ["127.0.0.1", "localhost", "127.0.0.1:17000"])
def test_loopback_names_resolve_to_the_ipv4_loopback(hostname: str) -> None:
    assert resolve_bind_address(hostname) == "127.0.0.1"


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback")
@pytest.mark.parametrize("hostname", ["::1", "[::1]:17000"])
def test_ipv6_loopback_resolves(hostname: str) -> None:
    assert resolve_bind_address(hostname) == "::1"


@pytest.mark.parametrize("hostname", ["0.0.0.0", "::", "0.0.0.0:17000"])
def test_wildcard_keeps_listening_everywhere(hostname: str) -> None:
    assert resolve_bind_address(hostname) is None


def test_address_of_another_machine_is_refused() -> None:
    with pytest.raises(KVTransferError, match="none of them an address of this machine"):
        resolve_bind_address("203.0.113.7")  # TEST-NET-3, never local


@pytest.fixture
def socket_library_dir() -> Path:
    import _socket

    if not getattr(_socket, "__file__", None):
        pytest.skip("_socket is built into this Python, not a shared object")
    return Path(_socket.__file__).parent


def _bound_host(family: socket.AddressFamily, host: str) -> str:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[0]


def test_wildcard_binds_go_to_the_address_only_inside_the_block(socket_library_dir: Path) -> None:
    with wildcard_binds_redirected(socket_library_dir, "127.0.0.1"):
        assert _bound_host(socket.AF_INET, "0.0.0.0") == "127.0.0.1"
        assert _bound_host(socket.AF_INET6, "::") == "::ffff:127.0.0.1"
        assert _bound_host(socket.AF_INET, "127.0.0.2") == "127.0.0.2"  # not a wildcard: kept
    assert _bound_host(socket.AF_INET, "0.0.0.0") == "0.0.0.0"


def test_failed_bind_reports_its_errno(socket_library_dir: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with wildcard_binds_redirected(socket_library_dir, "127.0.0.1"), socket.socket() as sock:
            with pytest.raises(OSError) as info:
                sock.bind(("0.0.0.0", port))
    assert info.value.errno == errno.EADDRINUSE


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback")
def test_ipv4_wildcard_cannot_take_an_ipv6_address(socket_library_dir: Path) -> None:
    with wildcard_binds_redirected(socket_library_dir, "::1"):
        assert _bound_host(socket.AF_INET6, "::") == "::1"
        with pytest.raises(OSError) as info:
            _bound_host(socket.AF_INET, "0.0.0.0")
    assert info.value.errno == errno.EADDRNOTAVAIL


def test_folder_without_bind_call_sites_is_refused(tmp_path: Path) -> None:
    with pytest.raises(KVTransferError, match="not supported"):
        with wildcard_binds_redirected(tmp_path, "127.0.0.1"):
            pass
