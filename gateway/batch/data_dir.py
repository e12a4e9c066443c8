"""The batch store's on-disk side, apart from SQLite: the data directory's lock and the files' contents.

Layout: `<data_dir>/files/<file id>` (contents), `<data_dir>/lock` (held with flock by the one
gateway using the directory, which writes its pid there). Contents are written to `<id>.part`,
fsynced and renamed (and the directory fsynced) before the caller commits the row naming them; contents
no row names are removed by `remove_orphans`, which the store calls when it opens.

Synchronous, like `BatchStore`, which owns one and calls it from its own thread.
"""

from __future__ import annotations

import fcntl
import functools
import os
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from gateway.batch.records import DataDirInUseError

_CHUNK_BYTES = 1 << 20


class DataDir:
    """Creates `<path>/files` and takes the directory's lock (`DataDirInUseError` if another process
    holds it); `close` releases it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files_dir = path / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock(path / "lock")

    def close(self) -> None:
        os.close(self._lock_fd)

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def write_stream(self, file_id: str, source: BinaryIO) -> int:
        """Copy `source` to the file's contents, a chunk at a time; the number of bytes written."""
        return self.write_contents(file_id, iter(functools.partial(source.read, _CHUNK_BYTES), b""))

    def write_contents(self, file_id: str, chunks: Iterable[bytes]) -> int:
        """Write the file's contents durably (fsynced and renamed into place); the number of bytes written."""
        final, partial = self.file_path(file_id), self.files_dir / f"{file_id}.part"
        num_bytes = 0
        with open(partial, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                num_bytes += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, final)
        _fsync_dir(self.files_dir)
        return num_bytes

    def remove_orphans(self, known: set[str]) -> None:
        """Remove every entry of `files/` (leftover `.part` files included) not named in `known`."""
        for path in self.files_dir.iterdir():
            if path.name not in known:
                path.unlink()


def _lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DataDirInUseError(
            f"data directory {path.parent} is in use by another gateway (pid {holder}); "
            "give each gateway its own --data-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
