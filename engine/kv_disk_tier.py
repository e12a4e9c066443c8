"""The prefix cache's disk tier: full KV pages kept as files, found by what they hold, across restarts.

A page's name is its *digest* (`engine.prefix_cache.page_digest`): a hash chained from a root (the
model's weights, the KV layout and the LoRA namespace) over every page of tokens up to its own, so
two pages share a name exactly when they hold the KV of the same tokens after the same prefix under
the same weights. The prefix cache (engine/prefix_cache.py) hands each page that joins it to `save`,
and when a prompt's walk down the tree stops, asks `contains` / `load` for the pages that follow.

`save` copies the page off the pool at once (a full cached page never changes, but its slot may be
reused as soon as it is evicted) and a background writer (the worker's, given to the engine) puts it in
a file: a header (magic, version, the
digest, the payload's length and CRC-32), then the page's bytes, written to a temporary name and
renamed, so a reader never sees half a file. `load` checks all of it: a truncated, corrupted or
misnamed file is deleted and reported as a miss, never copied into the pool. Files are grouped by
root identity, one directory per weights and layout, and the tier keeps at most `capacity_bytes`
of them, deleting the least recently used first. At start it indexes the files already there, so a
restarted worker finds what it (or another worker sharing the directory) saved before; a page another
process writes later is found by its file when the index misses it.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import struct
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from engine.config import ConfigError
from engine.kv_pool import KVLayout, KVPool
from engine.prefix_cache import DIGEST_BYTES, PageRead

logger = logging.getLogger(__name__)

_MAGIC = b"TKV1"
_VERSION = 1
_HEADER = struct.Struct(f"<4sHH{DIGEST_BYTES}sQI")  # magic, version, reserved, digest, payload bytes, crc32
_SUFFIX = ".kv"


class DiskTier:
    """KV pages of one `pool` as files under `directory`, at most `capacity_bytes`. `identity` names
    the weights the KV was computed with (`Checkpoint.identity`); the pool's layout is added to it.

    Every method runs on the engine thread. File writes go to `background` (a callable that runs a
    function elsewhere, e.g. a one-thread executor's `submit`; None: at once, on the calling thread),
    which reports each finished write through a deque; the engine thread takes those reports (`_settle`)
    before it looks at the index, so the index is only ever touched by one thread, and a page becomes
    visible to `contains` only once its file is complete. The counts of pages written, read back and
    dropped as damaged are kept since start."""

    def __init__(
        self,
        directory: str | Path,
        capacity_bytes: int,
        pool: KVPool,
        identity: str,
        background: Callable[[Callable[[], None]], object] | None = None,
    ) -> None:
        if capacity_bytes < pool.layout.page_bytes:
            raise ValueError(f"the disk tier's capacity ({capacity_bytes} bytes) is less than one KV page")
        self.base_dir = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.pool = pool
        self.num_saved = self.num_loaded = self.num_dropped = 0
        self.num_failed = 0  # a read that fails is a damaged file (dropped); kept for the stats' shape
        self.num_write_failures = 0  # counted on the writer's thread; logged now and then, not per page
        self._background = background
        self._index: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # digest -> file bytes, LRU first
        self._num_bytes = 0
        self._pending: set[bytes] = set()
        self._written: collections.deque[tuple[bytes, int]] = collections.deque()  # (digest, bytes; 0: failed)
        self.set_identity(identity)

    # ---- naming -----------------------------------------------------------------------

    def set_identity(self, identity: str) -> None:
        """Serve pages computed with the weights named `identity` (from now on; after a weight update)."""
        self.flush()
        self._identity = kv_identity(identity, self.pool.layout)
        self.directory = self.base_dir / self._identity.hex()
        try:  # a directory it cannot write is a start-up error, not a warning per page
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".probe.{os.getpid()}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f"--kv-disk-cache-dir {self.base_dir}: cannot write there ({exc.strerror})") from None
        self._index.clear()
        self._num_bytes = 0
        for path in sorted(self.directory.glob(f"*/*{_SUFFIX}*"), key=_mtime):
            if path.name.endswith(_SUFFIX):
                self._index[bytes.fromhex(path.name[: -len(_SUFFIX)])] = size = path.stat().st_size
                self._num_bytes += size
            else:  # a write cut short by a crash
                path.unlink(missing_ok=True)
        if self._index:
            logger.info("KV disk tier: %d pages found in %s", len(self._index), self.directory)

    def root(self, namespace: str) -> bytes:
        return root_digest(self._identity, namespace)

    def _path(self, digest: bytes) -> Path:
        name = digest.hex()
        return self.directory / name[:2] / f"{name}{_SUFFIX}"

    # ---- reads and writes ---------------------------------------------------------------

    @property
    def num_pending(self) -> int:
        """Pages handed to the background writer and not yet seen written (settled on the engine thread)."""
        return len(self._pending)

    def contains(self, digest: bytes) -> bool:
        """Whether the page named `digest` is on disk: in the index, or written since by another
        process sharing the directory (one stat per miss; a walk stops at its first)."""
        self._settle()
        if digest in self._index:
            return True
        if digest in self._pending:
            return False
        try:
            size = self._path(digest).stat().st_size
        except OSError:
            return False
        self._index[digest] = size
        self._num_bytes += size
        return True

    def save(self, digest: bytes, page_id: int) -> None:
        """Keep page `page_id` (whose KV is complete) as `digest`, unless it is kept already. The page
        is copied now: its slot may be reused as soon as the prefix cache evicts it."""
        self._settle()
        if digest in self._index:
            self._index.move_to_end(digest)
            return
        if digest in self._pending:
            return
        self._pending.add(digest)
        payload = self.pool.tensor[page_id].contiguous().view(torch.uint8).cpu().numpy().tobytes()
        path = self._path(digest)
        if self._background is None:
            self._write(path, digest, payload)
        else:
            self._background(lambda: self._write(path, digest, payload))

    def load(self, digest: bytes, page_id: int) -> bool:
        """Copy the page named `digest` into pool page `page_id`. False, the file deleted, when it is
        missing, truncated, corrupted or not the page it claims to be."""
        return load_read(self, digest, self.read(digest), page_id)

    def read(self, digest: bytes) -> PageRead:
        """The bytes of the page named `digest`, checked (a damaged file is deleted). Touches no state of
        the tier, so it may run off the engine thread; `took` then accounts for it on the engine thread."""
        path = self._path(digest)
        try:
            data = path.read_bytes()
        except OSError:
            return PageRead(None)
        problem = _check(data, digest, self.pool.layout.page_bytes)
        if problem is not None:
            path.unlink(missing_ok=True)
            return PageRead(None, problem)
        return PageRead(data[_HEADER.size :])

    def took(self, digest: bytes, read: PageRead) -> bytes | None:
        """On the engine thread, after `read`: the page's bytes, or None (a damaged page is forgotten and
        counted). Does not count a load: the caller does, once the bytes are in the pool."""
        if read.problem:
            logger.warning("KV disk tier: dropped %s (%s); its tokens are computed again", digest.hex(), read.problem)
            self._forget(digest)
            self.num_dropped += 1
        elif read.payload is not None and digest in self._index:
            self._index.move_to_end(digest)
        return read.payload

    def flush(self) -> None:
        """Wait until every page handed to `save` is on disk (or failed)."""
        while self._pending:
            self._settle()
            if self._pending:
                time.sleep(0.001)

    @property
    def num_pages(self) -> int:
        """Pages on disk now."""
        self._settle()
        return len(self._index)

    def _settle(self) -> None:
        """Take the writes finished since the last call into the index, deleting the least recently used
        pages beyond the capacity."""
        while self._written:
            digest, size = self._written.popleft()
            self._pending.discard(digest)
            if not size:
                continue
            self._index[digest] = size
            self._num_bytes += size
            self.num_saved += 1
        while self._num_bytes > self.capacity_bytes and len(self._index) > 1:
            old, old_size = self._index.popitem(last=False)
            self._num_bytes -= old_size
            self._path(old).unlink(missing_ok=True)

    def _forget(self, digest: bytes) -> None:
        size = self._index.pop(digest, None)
        if size is not None:
            self._num_bytes -= size

    def _write(self, path: Path, digest: bytes, payload: bytes) -> None:
        """Write one page file (on the `background` thread): to a temporary name, then renamed, so no
        reader sees a partial file. Reports the outcome through `_written`; touches nothing else."""
        header = _HEADER.pack(_MAGIC, _VERSION, 0, digest, len(payload), zlib.crc32(payload))
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        size = 0
        try:
            path.parent.mkdir(exist_ok=True)
            with open(temporary, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(temporary, path)
            size = len(header) + len(payload)
        except OSError as exc:
            self.num_write_failures += 1
            if self.num_write_failures in (1, 10, 100) or self.num_write_failures % 1000 == 0:
                logger.warning("KV disk tier: %d pages could not be written (%s)", self.num_write_failures, exc)
            temporary.unlink(missing_ok=True)
        self._written.append((digest, size))


def kv_identity(weights_identity: str, layout: KVLayout) -> bytes:
    """Names KV computed with the weights `weights_identity` into pages of `layout`."""
    shape = f"{layout.num_layers}x{layout.page_size}x{layout.num_kv_heads}x{layout.head_dim}"
    text = f"{weights_identity}/{shape}/{layout.dtype}"
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES).digest()


def root_digest(identity: bytes, namespace: str) -> bytes:
    """The digest every page chain of `namespace` (a LoRA adapter's cache id; "" the base model) starts
    from, under `identity` (`kv_identity`)."""
    return hashlib.blake2b(identity + namespace.encode(), digest_size=DIGEST_BYTES).digest()


def _check(data: bytes, digest: bytes, page_bytes: int) -> str | None:
    """What is wrong with a page file's bytes `data` (None: nothing)."""
    if not data:
        return "missing"
    if len(data) < _HEADER.size:
        return "truncated header"
    magic, version, _, named, length, crc = _HEADER.unpack_from(data)
    if magic != _MAGIC or version != _VERSION:
        return "not a KV page file"
    if named != digest:
        return "holds another page"
    if length != page_bytes or len(data) - _HEADER.size != length:
        return f"truncated: {len(data) - _HEADER.size} of {page_bytes} bytes"
    if zlib.crc32(memoryview(data)[_HEADER.size :]) != crc:
        return "checksum mismatch"
    return None


class SlowTier(Protocol):
    """A tier whose reads may run off the engine thread (`DiskTier`, engine/kv_store_tier.py's `StoreTier`)."""

    pool: KVPool
    num_loaded: int

    def took(self, digest: bytes, read: PageRead) -> bytes | None: ...


def load_read(tier: SlowTier, digest: bytes, read: PageRead, page_id: int) -> bool:
    """On the engine thread: account for `tier`'s `read` of `digest` and, if it found the page, copy it into
    pool page `page_id` and count the load."""
    payload = tier.took(digest, read)
    if payload is None:
        return False
    copy_payload(payload, tier.pool, page_id)
    tier.num_loaded += 1
    return True


def copy_payload(payload: bytes, pool: KVPool, page_id: int) -> None:
    """Copy a page's bytes (as a slow tier keeps them) into pool page `page_id`."""
    page = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    pool.tensor[page_id].view(torch.uint8).view(-1).copy_(page)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
