"""Make Mooncake's listeners bind to the KV address instead of every interface.

Mooncake's TransferEngine (checked in kvcache-ai/Mooncake at 3b5a594, and empirically in the
installed 0.3.13.post1) opens two listening TCP sockets, both on every interface, whatever
hostname it is given, and no setting changes that:

- the handshake listener: `findAvailableTcpPort` (transfer_metadata_plugin.cpp:1309) binds
  `INADDR_ANY` (or `IN6ADDR_ANY_INIT` under `MC_USE_IPV6`) at lines 1371/1359, and with the P2P
  handshake `startDaemon` listens on that very socket (line 665);
- the TCP data listener: `TcpContext` (tcp_transport_session_impl.h:769) binds an asio acceptor to
  `[::]` dual-stack, falling back to `0.0.0.0`.

`MC_TCP_BIND_ADDRESS` only names the address advertised outside P2P mode
(transfer_engine_impl.cpp:159) and binds nothing. So this module redirects the binds themselves:
while the engine is created, the GOT slots through which Mooncake's shared objects call libc
`bind` point at a hook that replaces a wildcard address by the KV address; the slots are restored
as soon as the engine has started. Both binds happen on the thread that calls `initialize`, which
holds the GIL, so the Python hook runs there without waiting on another thread. (`LD_PRELOAD` would
do the same from outside, but needs a compiled shim and the environment of a process not yet
started.) Linux with glibc, 64-bit little-endian ELF (x86-64, aarch64): elsewhere, or for a
Mooncake build with no `bind` call site found, the transport refuses to start rather than listen
everywhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import ipaddress
import logging
import mmap
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from kv_transfer.base import KVTransferError

logger = logging.getLogger(__name__)

_BindFunction = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32, use_errno=True)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
# ELF relocation types that fill a GOT slot with a function's address (GLOB_DAT, JUMP_SLOT).
_GOT_RELOCATIONS = {62: (6, 7), 183: (1025, 1026)}  # e_machine: x86-64, aarch64
_SHT_RELA = 4
_RTLD_DI_LINKMAP = 2

# The GOT slots are process-wide: two engines starting at once must not patch them together.
_PATCH_LOCK = threading.Lock()


def resolve_bind_address(hostname: str) -> str | None:
    """The IP address of this machine that `hostname` (`TransportConfig.hostname`: an IP or DNS
    name, optionally with `:port`) names, IPv4 preferred; None when it is a wildcard address
    (0.0.0.0 or ::), which leaves Mooncake listening everywhere. Raises `KVTransferError` when it
    does not resolve or names no address of this machine."""
    host = _strip_port(hostname)
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise KVTransferError(f"KV host {hostname!r} does not resolve: {exc}") from exc
    addresses = sorted(dict.fromkeys(str(info[4][0]) for info in infos), key=lambda a: ":" in a)
    if any(ipaddress.ip_address(address).is_unspecified for address in addresses):
        return None
    for address in addresses:
        if _is_local(address):
            return address
    raise KVTransferError(
        f"KV host {hostname!r} resolves to {', '.join(addresses)}, none of them an address of this "
        f"machine; Mooncake listens on the KV address, so it must be one of this machine's"
    )


def _strip_port(hostname: str) -> str:
    if hostname.startswith("["):
        return hostname[1:].split("]", 1)[0]
    if hostname.count(":") == 1:
        return hostname.split(":", 1)[0]
    return hostname


def _is_local(address: str) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def wildcard_binds_redirected(library_dir: Path, address: str) -> Iterator[None]:
    """While the block runs, a `bind` to 0.0.0.0 or :: made by a shared object loaded from
    `library_dir` (or a `mooncake*.libs` folder beside it) binds to `address` instead; :: gets
    `address` itself or, for an IPv4 address, its IPv4-mapped form. Other binds pass unchanged; an
    IPv4 wildcard bind fails with EADDRNOTAVAIL when `address` is IPv6.

    Process-wide while active: wrap only code that binds from Mooncake and nothing else, and keep
    it short. Raises `KVTransferError` if no `bind` call site is found (an unsupported build)."""
    with _PATCH_LOCK:
        slots = [slot for path in _loaded_libraries(library_dir) for slot in _bind_slots(path)]
        originals = {_non_null(ctypes.c_void_p.from_address(slot).value, "a `bind` slot") for slot in slots}
        if len(originals) != 1:
            raise KVTransferError(
                f"cannot pin Mooncake's listeners to {address}: found {len(slots)} `bind` call "
                f"sites in {library_dir} resolving to {len(originals)} functions; this Mooncake "
                f"build is not supported"
            )
        original = _BindFunction(originals.pop())
        hook = _BindFunction(_WildcardRedirect(address, original))
        hook_address = _non_null(ctypes.cast(hook, ctypes.c_void_p).value, "the bind hook")
        original_address = _non_null(ctypes.cast(original, ctypes.c_void_p).value, "the original bind")
        patched = []
        try:
            for slot in slots:
                _write_pointer(slot, hook_address)
                patched.append(slot)
            yield
        finally:
            for slot in patched:
                _write_pointer(slot, original_address)


class _WildcardRedirect:
    """The `bind` hook: rewrites a wildcard `sockaddr_in`/`sockaddr_in6` to the KV address."""

    def __init__(self, address: str, bind: Callable[[int, object, int], int]) -> None:
        ip = ipaddress.ip_address(address)
        self._ipv4 = ip.packed if ip.version == 4 else None
        self._ipv6 = ip.packed if ip.version == 6 else ipaddress.IPv6Address(f"::ffff:{ip}").packed
        self._bind = bind

    def __call__(self, fd: int, sockaddr: int, length: int) -> int:
        # An exception escaping a ctypes callback makes it return 0: Mooncake would then listen on
        # an unbound socket, which the kernel binds to every interface. Fail the bind instead.
        try:
            replaced = self._replace(ctypes.string_at(sockaddr, length)) if sockaddr else None
            if replaced is None:
                return self._bind(fd, sockaddr, length)
            return self._bind(fd, ctypes.create_string_buffer(replaced, length), length)
        except OSError as exc:
            ctypes.set_errno(exc.errno or errno.EINVAL)
        except BaseException:  # noqa: BLE001 - see above
            logger.exception("redirecting a Mooncake bind failed")
            ctypes.set_errno(errno.EINVAL)
        return -1

    def _replace(self, sockaddr: bytes) -> bytes | None:
        family = struct.unpack_from("=H", sockaddr)[0]
        if family == socket.AF_INET and len(sockaddr) >= 8 and sockaddr[4:8] == bytes(4):
            if self._ipv4 is None:
                raise OSError(errno.EADDRNOTAVAIL, "an IPv4 socket cannot bind an IPv6 KV address")
            return sockaddr[:4] + self._ipv4 + sockaddr[8:]
        if family == socket.AF_INET6 and len(sockaddr) >= 24 and sockaddr[8:24] == bytes(16):
            return sockaddr[:8] + self._ipv6 + sockaddr[24:]
        return None


def _loaded_libraries(library_dir: Path) -> list[str]:
    """Paths of the shared objects mapped into this process from Mooncake's folders."""
    root = library_dir.resolve()
    paths = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            path = fields[5].strip() if len(fields) == 6 else ""
            if not path.startswith("/"):
                continue
            folder = Path(path).parent
            is_wheel_libs = (
                folder.parent == root.parent and folder.name.startswith("mooncake") and folder.name.endswith(".libs")
            )
            if folder == root or is_wheel_libs:
                paths.add(path)
    return sorted(paths)


def _bind_slots(path: str) -> list[int]:
    """Addresses, in this process, of the GOT slots through which the loaded ELF object at `path`
    calls `bind`."""
    with open(path, "rb") as file:
        data = file.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:  # 64-bit little-endian only
        return []
    relocation_types = _GOT_RELOCATIONS.get(struct.unpack_from("<H", data, 0x12)[0], ())
    section_offset = struct.unpack_from("<Q", data, 0x28)[0]
    entry_size, num_sections = struct.unpack_from("<HH", data, 0x3A)
    # (sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, ...)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, section_offset + i * entry_size) for i in range(num_sections)]
    offsets = []
    for section in sections:
        if section[1] != _SHT_RELA:
            continue
        symbols = sections[section[6]]
        names = sections[symbols[6]]
        for entry in range(section[4], section[4] + section[5], 24):
            offset, info = struct.unpack_from("<QQ", data, entry)
            symbol = info >> 32
            if info & 0xFFFFFFFF not in relocation_types or symbol == 0:
                continue
            name_start = names[4] + struct.unpack_from("<I", data, symbols[4] + symbol * 24)[0]
            if data[name_start : data.index(b"\0", name_start)] == b"bind":
                offsets.append(offset)
    if not offsets:
        return []
    return [_load_bias(path) + offset for offset in offsets]


class _LinkMap(ctypes.Structure):
    _fields_ = [("l_addr", ctypes.c_size_t)]  # glibc's struct link_map begins with the load bias


def _load_bias(path: str) -> int:
    handle = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_NOLOAD)._handle  # already loaded
    link_map = ctypes.c_void_p()
    dlinfo = ctypes.CDLL("libdl.so.2").dlinfo
    if dlinfo(ctypes.c_void_p(handle), _RTLD_DI_LINKMAP, ctypes.byref(link_map)) != 0:
        raise KVTransferError(f"dlinfo(RTLD_DI_LINKMAP) failed for {path}")
    return _LinkMap.from_address(_non_null(link_map.value, f"the link map of {path}")).l_addr


def _non_null(pointer: int | None, what: str) -> int:
    """`pointer` (a ctypes pointer's value, None when NULL), refused when NULL."""
    if not pointer:
        raise KVTransferError(f"{what} is a null pointer")
    return pointer


def _write_pointer(address: int, value: int) -> None:
    """Store `value` at `address`, lifting the page's write protection (RELRO) for the store."""
    page = address & ~(mmap.PAGESIZE - 1)
    protection = _page_protection(address)
    if not protection & mmap.PROT_WRITE:
        _mprotect(page, protection | mmap.PROT_WRITE)
    ctypes.c_void_p.from_address(address).value = value
    if not protection & mmap.PROT_WRITE:
        _mprotect(page, protection)


def _page_protection(address: int) -> int:
    with open("/proc/self/maps") as maps:
        for line in maps:
            bounds, permissions = line.split()[:2]
            start, end = (int(bound, 16) for bound in bounds.split("-"))
            if start <= address < end:
                flags = zip("rwx", (mmap.PROT_READ, mmap.PROT_WRITE, mmap.PROT_EXEC))
                return sum(flag for letter, flag in flags if letter in permissions)
    raise KVTransferError(f"address {address:#x} is not mapped")


def _mprotect(page: int, protection: int) -> None:
    if _libc.mprotect(page, mmap.PAGESIZE, protection) != 0:
        code = ctypes.get_errno()
        raise KVTransferError(f"mprotect({page:#x}) failed: {os.strerror(code)}")
