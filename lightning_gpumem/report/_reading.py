"""Reading a log file, up to a size bound: regular files only (a FIFO blocks, ``/dev/zero`` never ends).

Also the shape in which a tracking store's reader (:mod:`~lightning_gpumem.report._mlflow`,
:mod:`~lightning_gpumem.report._wandb`) hands a run to :func:`~lightning_gpumem.report.runs.load_runs`.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
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

Table = dict[str, list[tuple[int, float]]]


class NotRegularFile(OSError):
    """A path named like a log file that is not a regular file (after following symbolic links)."""


@dataclass
class StoreRun:
    """One run read from a tracking store (MLflow, W&B), before the report's checks of its values.

    Attributes:
        name: the run as the store names it (``experiment/run``, ``project/run``).
        path: where it lives: its directory, or the store's file where one file holds many runs.
        tables: per file read, its scalars (``{key: [(step, value), ...]}`` in the order written, every
            key the store holds under ``gpumem/``) and the values left out of it, each described (``line 3:
            ...``).
    """

    name: str
    path: Path
    tables: list[tuple[Path, Table, list[str]]] = field(default_factory=list)


def read_log_file(path: Path, limit: int | None = None) -> tuple[bytes, bool]:
    """The bytes of ``path``, at most ``limit`` of them, and whether the file held more.

    Args:
        path: the file.
        limit: how many bytes to read at most; by default :data:`MAX_FILE_BYTES`.

    Raises:
        NotRegularFile: ``path`` (its target, for a symbolic link) is a FIFO, a device, a socket or a
            directory.
        OSError: it cannot be read.
    """
    _require_regular(os.stat(path).st_mode)  # before opening: opening some devices acts on them
    limit = MAX_FILE_BYTES if limit is None else limit
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
