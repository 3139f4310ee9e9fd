"""Scalars from TensorBoard event files, read without TensorFlow or TensorBoard's loaders.

An event file is a sequence of TFRecords (``uint64`` length, masked CRC-32C of the length, the serialized
``Event`` protobuf, masked CRC-32C of the data). Only the fields scalars use are decoded: ``Event.wall_time``
(1), ``Event.step`` (2), ``Event.summary`` (5) -> ``Summary.value`` (1) -> ``Value.tag`` (1) and
``Value.simple_value`` (2), or ``Value.tensor`` (8) holding one float or double (TensorBoard's newer scalar
format). Both CRCs are checked, so a damaged record is reported rather than read as wrong numbers (the
records before it are kept); a record cut short at the end of the file (a run still writing) ends the file
quietly, as in TensorBoard.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

from lightning_gpumem.report._reading import read_log_file

_CRC_TABLE: list[int] = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1  # CRC-32C (Castagnoli), reflected
    _CRC_TABLE.append(_c)

_DT_FLOAT, _DT_DOUBLE = 1, 2


class CorruptEventFile(ValueError):
    """An event file whose records fail their checksums or do not decode.

    Attributes:
        scalars: what the records before the damage held (``{tag: [(step, value), ...]}``).
    """

    def __init__(self, message: str, scalars: dict[str, list[tuple[int, float]]] | None = None) -> None:
        super().__init__(message)
        self.scalars = scalars or {}


def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    table = _CRC_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise CorruptEventFile("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes) -> list[tuple[int, int, int | float | bytes]]:
    """Decode one protobuf message into ``(field number, wire type, value)`` (bytes: length-delimited)."""
    out: list[tuple[int, int, int | float | bytes]] = []
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        value: int | float | bytes
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            if pos + 8 > len(buf):
                raise CorruptEventFile("truncated 64-bit field")
            value = struct.unpack_from("<d", buf, pos)[0]
            pos += 8
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if pos + size > len(buf):
                raise CorruptEventFile("truncated length-delimited field")
            value = buf[pos : pos + size]
            pos += size
        elif wire == 5:
            if pos + 4 > len(buf):
                raise CorruptEventFile("truncated 32-bit field")
            value = struct.unpack_from("<f", buf, pos)[0]
            pos += 4
        else:
            raise CorruptEventFile(f"unknown wire type {wire}")
        out.append((number, wire, value))
    return out


def _tensor_scalar(buf: bytes) -> float | None:
    """The single float/double of a ``TensorProto``, or ``None`` for the rest (strings, layouts, images)."""
    dtype = None
    values: list[float] = []
    for number, wire, value in _fields(buf):
        if number == 1 and wire == 0:
            dtype = value
        elif number == 4 and isinstance(value, bytes):  # tensor_content
            values.extend(_unpack_floats(value, dtype))
        elif number == 5 and isinstance(value, bytes):  # float_val, packed
            values.extend(struct.unpack(f"<{len(value) // 4}f", value))
        elif number == 5 and isinstance(value, float):  # float_val, unpacked
            values.append(value)
        elif number == 6 and isinstance(value, bytes):  # double_val, packed
            values.extend(struct.unpack(f"<{len(value) // 8}d", value))
        elif number == 6 and isinstance(value, float):
            values.append(value)
    if dtype not in (_DT_FLOAT, _DT_DOUBLE) or len(values) != 1:
        return None
    return float(values[0])


def _unpack_floats(content: bytes, dtype: object) -> tuple[float, ...]:
    if dtype == _DT_FLOAT:
        return struct.unpack(f"<{len(content) // 4}f", content)
    if dtype == _DT_DOUBLE:
        return struct.unpack(f"<{len(content) // 8}d", content)
    return ()


def _records(data: bytes, path: Path) -> Iterator[bytes]:
    pos = 0
    while pos + 12 <= len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack_from("<I", data, pos + 8)
        if _masked_crc(header) != length_crc:
            raise CorruptEventFile(f"{path}: record header at byte {pos} fails its checksum")
        start, end = pos + 12, pos + 12 + length
        if end + 4 > len(data):
            return  # cut short at the end: a run still writing
        (data_crc,) = struct.unpack_from("<I", data, end)
        if _masked_crc(data[start:end]) != data_crc:
            raise CorruptEventFile(f"{path}: record at byte {pos} fails its checksum")
        yield data[start:end]
        pos = end + 4


def _signed(value: int) -> int:
    """A varint read as unsigned, as the int64 it encodes."""
    return value - (1 << 64) if value >= 1 << 63 else value


def read_scalars(path: str | Path, data: bytes | None = None) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in one event file: ``{tag: [(step, value), ...]}`` in the order written.

    Args:
        path: the event file.
        data: its bytes, where the caller has read them; else it is read here (a regular file only, up to
            :data:`~lightning_gpumem.report._reading.MAX_FILE_BYTES`).

    Raises:
        CorruptEventFile: a record fails its checksum or does not decode; its ``scalars`` hold what the
            records before it held.
        OSError: the file cannot be read, or is not a regular file
            (:class:`~lightning_gpumem.report._reading.NotRegularFile`).
    """
    path = Path(path)
    if data is None:
        data = read_log_file(path)[0]
    scalars: dict[str, list[tuple[int, float]]] = {}
    position = 0
    try:
        for position, record in enumerate(_records(data, path)):  # noqa: B007  # used in `except`
            _add_event(record, scalars)
    except CorruptEventFile as error:
        message = (
            str(error) if str(path) in str(error) else f"{path}: event {position} does not decode ({error})"
        )
        raise CorruptEventFile(message, scalars) from None
    return scalars


def _add_event(record: bytes, scalars: dict[str, list[tuple[int, float]]]) -> None:
    step = 0
    summary: bytes | None = None
    for number, _, value in _fields(record):
        if number == 2 and isinstance(value, int):
            step = _signed(value)
        elif number == 5 and isinstance(value, bytes):
            summary = value
    if summary is None:
        return
    for number, _, entry in _fields(summary):
        if number != 1 or not isinstance(entry, bytes):
            continue
        tag, scalar = None, None
        for field_number, _, value in _fields(entry):
            if field_number == 1 and isinstance(value, bytes):
                tag = value.decode("utf-8", errors="replace")
            elif field_number == 2 and isinstance(value, float):
                scalar = value
            elif field_number == 8 and isinstance(value, bytes):
                scalar = _tensor_scalar(value)
        if tag is not None and scalar is not None:
            scalars.setdefault(tag, []).append((step, scalar))
