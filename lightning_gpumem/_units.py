"""Units: bytes inside the package, GiB at the edges (metrics, tables, progress bar)."""

from __future__ import annotations

GIB = 1024**3  # bytes in a GiB
MIB = 1024**2  # bytes in a MiB


def to_gib(num_bytes: float | None) -> float | None:
    """Convert bytes to GiB, passing ``None`` through."""
    return None if num_bytes is None else num_bytes / GIB


def format_gib(num_bytes: float | None, digits: int = 1) -> str:
    """Format bytes as ``"12.3 GiB"``, or ``"n/a"`` for ``None``."""
    return "n/a" if num_bytes is None else f"{num_bytes / GIB:.{digits}f} GiB"
