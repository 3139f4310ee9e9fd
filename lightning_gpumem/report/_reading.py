"""Reading a log file, up to a size bound: regular files only (a FIFO blocks, ``/dev/zero`` never ends)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_FILE_BYTES = 2 * 1024**3  # 2 GiB: a log file larger than this is read up to it (and named)
_CHUNK = 16 * 1024**2

_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


class NotRegularFile(OSError):
    """A path named like a log file that is not a regular file (after following symbolic links)."""


def read_log_file(path: Path) -> tuple[bytes, bool]:
    """The bytes of ``path``, at most :data:`MAX_FILE_BYTES` of them, and whether the file held more.

    Raises:
        NotRegularFile: ``path`` (its target, for a symbolic link) is a FIFO, a device, a socket or a
            directory.
        OSError: it cannot be read.
    """
    _require_regular(os.stat(path).st_mode)  # before opening: opening some devices acts on them
    limit = MAX_FILE_BYTES
    # O_NONBLOCK: a FIFO swapped in after the check opens at once (and is refused below) rather than
    # blocking.
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(descriptor, "rb") as handle:
        _require_regular(os.fstat(handle.fileno()).st_mode)
        chunks, size = [], 0
        while size <= limit:  # in chunks: `read(limit)` would set aside the whole bound for a small file
            chunk = handle.read(min(_CHUNK, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    return b"".join(chunks)[:limit], size > limit


def kind_of(mode: int) -> str:
    """What a file that is not regular is, by its ``st_mode``: ``"a FIFO"``, ``"a character device"``..."""
    return _KINDS.get(stat.S_IFMT(mode), "of an unknown kind")


def _require_regular(mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise NotRegularFile(f"not a regular file ({kind_of(mode)})")
