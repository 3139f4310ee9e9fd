"""Units: bytes inside the package, GiB at the edges (metrics, tables, progress bar)."""

from __future__ import annotations

import re

GIB = 1024**3  # bytes in a GiB
MIB = 1024**2  # bytes in a MiB


def to_gib(num_bytes: float | None) -> float | None:
    """Convert bytes to GiB, passing ``None`` through."""
    return None if num_bytes is None else num_bytes / GIB


def format_gib(num_bytes: float | None, digits: int = 1) -> str:
    """Format bytes as ``"12.3 GiB"``, or ``"n/a"`` for ``None``."""
    return "n/a" if num_bytes is None else f"{num_bytes / GIB:.{digits}f} GiB"


_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
MIN_BUDGET_BYTES = 2**20  # below 1 MiB no training step fits: a budget that small is a typo
MAX_BYTES = 2**64  # 16 EiB: no device has more; a size above it is a typo (and overflows float conversions)
_MIN_FRACTION = MIN_BUDGET_BYTES / MAX_BYTES  # a smaller fraction is under 1 MiB of any device
_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def check_budget(value: object, owner: str, arg: str = "budget") -> None:
    """Check a memory budget's form before the device is known (at construction); see :func:`parse_budget`.

    A fraction is checked against the device in :func:`parse_budget`; here only that it is in (0, 1] and not
    so small that it is under 1 MiB of any device (below 2**-44).

    >>> check_budget(1e-300, "X")
    Traceback (most recent call last):
    ValueError: `X(budget=1e-300)` is not valid. A fraction this small is less than 1 MiB of any device.
    """
    _budget_form(value, owner, arg)


def parse_budget(value: int | float | str, total_bytes: int | None, owner: str, arg: str = "budget") -> int:
    """Turn a memory budget into bytes.

    Args:
        value: bytes (``int``), a fraction of the device in (0, 1] (``float``), or a size string such as
            ``"24GiB"``, ``"16GB"`` or ``"512 MiB"``.
        total_bytes: the device's memory, needed for fractions.
        owner: the class taking the budget, for error messages (``"BatchSizeTuner"``).
        arg: the argument's name, for error messages.

    Raises:
        TypeError: for other types (``bool`` included).
        ValueError: for sizes under 1 MiB or over 2**64 bytes, fractions outside (0, 1] or that come to less
            than 1 MiB of the device, unknown units, or a fraction without a known device size.

    Example:
        >>> parse_budget("24GiB", None, "X"), parse_budget("16GB", None, "X")
        (25769803776, 16000000000)
        >>> parse_budget(0.5, 80 * GIB, "X") == 40 * GIB
        True
        >>> parse_budget(1e-10, 80 * GIB, "X")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: `X(budget=1e-10)` is 8 bytes of the device's 80.0 GiB. Expected at least 1 MiB ...
    """
    form = _budget_form(value, owner, arg)
    if isinstance(form, int):
        return form
    if total_bytes is None:
        raise ValueError(
            f"`{owner}({arg}={value!r})` is a fraction of device memory, but no device memory is known here."
        )
    size = int(form * total_bytes)
    if size < MIN_BUDGET_BYTES:
        raise ValueError(
            f"`{owner}({arg}={value!r})` is {size} bytes of the device's {format_gib(total_bytes)}. Expected"
            f" at least 1 MiB ({MIN_BUDGET_BYTES} bytes)."
        )
    return size


def _budget_form(value: object, owner: str, arg: str) -> int | float:
    """The budget, checked: bytes (an ``int`` or size string) or the fraction of the device (a ``float``)."""
    name = f"{owner}({arg}"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(
            f"`{name}={value!r})` is not valid. Expected bytes (int), a fraction of device memory in (0, 1]"
            " (float) or a size string such as '24GiB'."
        )
    if isinstance(value, int):
        if value < MIN_BUDGET_BYTES:
            raise ValueError(
                f"`{name}={value!r})` is not valid. An int is a number of bytes and must be at least 1 MiB"
                f" ({MIN_BUDGET_BYTES}); for the whole device pass 1.0, for a share a float in (0, 1]."
            )
        if value > MAX_BYTES:
            raise ValueError(f"`{name}={value!r})` is not valid. Expected at most 2**64 bytes (16 EiB).")
        return value
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(
                f"`{name}={value!r})` is not valid. A float is a fraction of device memory and must be in"
                " (0, 1]."
            )
        if value < _MIN_FRACTION:
            raise ValueError(
                f"`{name}={value!r})` is not valid. A fraction this small is less than 1 MiB of any device."
            )
        return value
    match = _SIZE_PATTERN.match(value)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f"`{name}={value!r})` is not valid. Expected a positive size with a unit, such as '24GiB',"
            f" '16GB' or '512MiB' (units: {', '.join(k.upper().replace('I', 'i') for k in _SIZE_UNITS)})."
        )
    size = float(match.group(1)) * _SIZE_UNITS[unit]  # inf for hundreds of digits
    if size > MAX_BYTES:
        raise ValueError(
            f"`{name}={value!r})` is not valid. Expected a size of at most 2**64 bytes (16 EiB)."
        )
    if size < MIN_BUDGET_BYTES:
        raise ValueError(f"`{name}={value!r})` is not valid. Expected a size of at least 1 MiB.")
    return int(size)
