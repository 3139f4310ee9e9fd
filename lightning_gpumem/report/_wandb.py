"""W&B runs from the log a run writes beside it (``wandb/offline-run-*/run-<id>.wandb``), read without wandb.

``WandbLogger`` (``offline=True`` or not) writes every record of the run to ``run-<id>.wandb`` in its run
directory before anything is synced: the log ``wandb sync`` uploads. It is a LevelDB-style log: a 7-byte
header (``:W&B``, the magic ``0xBEE1``, version 0), then 32 KiB blocks of chunks, each a CRC-32 (of its type
byte and data), a length, a type (whole, first, middle, last) and the data; a chunk never crosses a block,
and a block's last 6 bytes or fewer are zeros. A record is a ``wandb_internal.proto`` ``Record``; only its
history rows (``Record.history`` (2): ``HistoryItem`` (1) with ``key`` (1) or ``nested_key`` (2) and
``value_json`` (16)) and the run's names (``Record.run`` (17): ``run_id`` (1), ``project`` (3),
``display_name`` (8)) are decoded. A history row's step is Lightning's ``trainer/global_step`` where the row
has it (``WandbLogger`` adds it to every row; W&B's own ``_step`` counts rows), else W&B's step.

``files/wandb-summary.json`` holds the last value of each key only, so it is not read.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

from lightning_gpumem import keys
from lightning_gpumem.report._events import CorruptEventFile, _signed
from lightning_gpumem.report._events import _fields as protobuf_fields
from lightning_gpumem.report._reading import StoreRun, Table, read_log_file
from lightning_gpumem.report._text import printable

SUFFIX = ".wandb"
HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
LIGHTNING_STEP = "trainer/global_step"
_BLOCK = 32768
_CHUNK_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_HISTORY, _RUN = 2, 17


class CorruptRunLog(ValueError):
    """A ``.wandb`` file whose chunks fail their checksums or do not fit together."""


def is_run_log(name: str) -> bool:
    """Whether a file name is a W&B run's log: ``run-<id>.wandb``."""
    return name.startswith("run-") and name.endswith(SUFFIX)


def read_run_log(file: Path, skipped: list[str]) -> StoreRun | None:
    """The ``gpumem/`` history of one ``run-<id>.wandb``, ``None`` where it cannot be read at all.

    What it passes over goes to ``skipped``, the file named: a file that is not a W&B log, the part past the
    size bound or a damaged chunk (the records before it are kept). A record cut short at the end of the file
    (a run still writing) ends it quietly.

    Args:
        file: the run's log.
        skipped: the report's lines of what was passed over.
    """
    try:
        data, cut = read_log_file(file)
    except OSError as error:
        skipped.append(f"{printable(str(file))}: {printable(error.strerror or str(error))}")
        return None
    if not data.startswith(HEADER):
        skipped.append(f"{printable(str(file))}: {_header_problem(data)}")
        return None
    if cut:
        skipped.append(
            f"{printable(str(file))}: larger than {len(data)} bytes; read up to there (the record cut there"
            " left out)"
        )
    table: Table = {}
    bad: list[str] = []
    names: dict[int, str] = {}
    count = 0
    try:
        for count, record in enumerate(_records(data), start=1):  # noqa: B007  # used after the loop
            _add_record(record, table, bad, names)
    except (CorruptRunLog, CorruptEventFile) as error:
        kept = sum(map(len, table.values()))
        skipped.append(
            f"{printable(str(file))}: {printable(str(error))} (record {count + 1}); the rest of the file is"
            f" skipped ({kept} values before it are kept)"
        )
    project, run = names.get(3, ""), names.get(8) or names.get(1, "")
    name = "/".join(part for part in (project, run) if part) or file.parent.name
    return StoreRun(name=name, path=file.parent, tables=[(file, table, bad)])


def _header_problem(data: bytes) -> str:
    if data.startswith(HEADER[:6]) and len(data) >= len(HEADER):
        return f"W&B log version {data[6]}; this report reads version {HEADER[6]} (file skipped)"
    return "not a W&B run log (no `:W&B` header; file skipped)"


def _records(data: bytes) -> Iterator[bytes]:
    """The records of a ``.wandb`` file's bytes, its chunks joined; a chunk cut short at the end ends it."""
    position = len(HEADER)
    pending: bytearray | None = None
    while True:
        left = _BLOCK - position % _BLOCK
        if left < _CHUNK_HEADER:  # a block's trailer: zeros
            position += left
            continue
        if position + _CHUNK_HEADER > len(data):
            return
        checksum, length, kind = struct.unpack_from("<IHB", data, position)
        if kind == 0 and length == 0 and checksum == 0 and not data[position:].strip(b"\0"):
            return  # zeros to the end: space set aside, never written
        if length > left - _CHUNK_HEADER:
            raise CorruptRunLog(f"chunk at byte {position} runs past its block")
        start, end = position + _CHUNK_HEADER, position + _CHUNK_HEADER + length
        if end > len(data):
            return  # cut short at the end: a run still writing
        chunk = data[start:end]
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != checksum:
            raise CorruptRunLog(f"chunk at byte {position} fails its checksum")
        if (pending is None) == (kind in (_MIDDLE, _LAST)):
            raise CorruptRunLog(f"chunk at byte {position} is out of sequence")
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = bytearray(chunk)
        elif kind in (_MIDDLE, _LAST) and pending is not None:
            pending += chunk
            if kind == _LAST:
                yield bytes(pending)
                pending = None
        else:
            raise CorruptRunLog(f"chunk at byte {position} has unknown type {kind}")
        position = end


def _add_record(record: bytes, table: Table, bad: list[str], names: dict[int, str]) -> None:
    """Add a history row's ``gpumem/`` values to ``table``; note the run's names from a run record."""
    for number, _, value in protobuf_fields(record):
        if number == _HISTORY and isinstance(value, bytes):
            _add_history(value, table, bad)
        elif number == _RUN and isinstance(value, bytes):
            for field, _, text in protobuf_fields(value):
                if field in (1, 3, 8) and isinstance(text, bytes) and text:
                    names[field] = text.decode("utf-8", errors="replace")


def _add_history(row: bytes, table: Table, bad: list[str]) -> None:
    values: dict[str, bytes] = {}
    step = 0
    for number, _, value in protobuf_fields(row):
        if number == 1 and isinstance(value, bytes):
            key, nested, text = "", [], b""
            for field, _, part in protobuf_fields(value):
                if not isinstance(part, bytes):
                    continue
                if field == 1:
                    key = part.decode("utf-8", errors="replace")
                elif field == 2:
                    nested.append(part.decode("utf-8", errors="replace"))
                elif field == 16:
                    text = part
            values[key or ".".join(nested)] = text
        elif number == 2 and isinstance(value, bytes):  # HistoryStep
            step = next((_signed(n) for f, _, n in protobuf_fields(value) if f == 1 and type(n) is int), 0)
    lightning_step = _whole(values.get(LIGHTNING_STEP, b""))
    step = lightning_step if lightning_step is not None else step
    for key, text in values.items():
        if not key.startswith(keys.PREFIX):
            continue
        try:
            value = float(text)
        except ValueError:
            bad.append(f"step {step}: {key} = {text[:40]!r} is not a number (value left out)")
            continue
        table.setdefault(key, []).append((step, value))


def _whole(text: bytes) -> int | None:
    """A JSON number that is a whole number an int64 holds, else ``None``."""
    try:
        number = float(text)
    except ValueError:
        return None
    if not math.isfinite(number) or not number.is_integer() or not -(2**63) <= number < 2**63:
        return None
    return int(number)
