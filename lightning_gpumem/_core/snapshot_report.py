"""Reading an allocator snapshot (``torch.cuda.memory._snapshot()``): live blocks, the OOM, an HTML page.

Pure functions of the snapshot dictionary, so they are tested on CPU with synthetic snapshots. Why our own
HTML: PyTorch's ``_memory_viz`` pages load their viewer script from a CDN, which offline clusters cannot
reach; this page is one file with inline SVG and no script. The pickle written next to it opens in PyTorch's
full viewer (https://pytorch.org/memory_viz) when there is a network.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from typing import Any

_MIB = 2**20
# Frames in these paths are the machinery between the user's code and the allocation, not the cause:
# installed packages, the standard library (`.../lib/python3.11/...`), and the libraries themselves run from
# a checkout.
_LIBRARY = re.compile(
    r"(/(site|dist)-packages/|/lib/python\d+(\.\d+)?t?/|(^|/)(torch|lightning|pytorch_lightning"
    r"|lightning_fabric|lightning_utilities|torchmetrics|lightning_gpumem)/)"
)


@dataclass(frozen=True)
class Allocation:
    """A live block (or the allocation that failed): its size in bytes and the Python frames that made it."""

    size: int
    frames: tuple[str, ...]


def live_allocations(snapshot: dict[str, Any], top: int = 10) -> list[Allocation]:
    """The ``top`` largest blocks in use, largest first."""
    blocks = [
        Allocation(int(block["size"]), _frames(block.get("frames", ())))
        for segment in snapshot.get("segments", ())
        for block in segment.get("blocks", ())
        if block.get("state") == "active_allocated"
    ]
    return sorted(blocks, key=lambda a: a.size, reverse=True)[:top]


def failed_allocation(snapshot: dict[str, Any]) -> Allocation | None:
    """The last allocation that ran out of memory, from the recorded history (``None``: none recorded)."""
    for trace in reversed(snapshot.get("device_traces", ())):
        for event in reversed(trace):
            if event.get("action") == "oom":
                return Allocation(int(event.get("size", 0)), _frames(event.get("frames", ())))
    return None


def totals(snapshot: dict[str, Any]) -> tuple[int, int]:
    """Bytes allocated (in use) and reserved (segments) in the snapshot."""
    segments = snapshot.get("segments", ())
    return sum(int(s.get("allocated_size", 0)) for s in segments), sum(
        int(s.get("total_size", 0)) for s in segments
    )


def format_report(snapshot: dict[str, Any], top: int = 10) -> str:
    """Plain text: the failed allocation if any, then the largest live allocations, where they were made."""
    allocated, reserved = totals(snapshot)
    lines = [f"in use {allocated / _MIB:,.1f} MiB of {reserved / _MIB:,.1f} MiB reserved"]
    failed = failed_allocation(snapshot)
    if failed is not None:
        lines.append(f"failed to allocate {failed.size / _MIB:,.1f} MiB at {_where(failed)}")
    lines.append(f"largest live allocations (top {top}):")
    for allocation in live_allocations(snapshot, top):
        lines.append(f"  {allocation.size / _MIB:10,.1f} MiB  {_where(allocation)}")
    return "\n".join(lines)


def render_html(snapshot: dict[str, Any], title: str, top: int = 10) -> str:
    """A self-contained page: totals, the failed allocation, a segment map, the largest live blocks."""
    allocated, reserved = totals(snapshot)
    failed = failed_allocation(snapshot)
    rows = "".join(
        f"<tr><td>{a.size / _MIB:,.1f}</td><td><pre>{_stack_html(a)}</pre></td></tr>"
        for a in live_allocations(snapshot, top)
    )
    failed_html = (
        f"<p><b>Failed to allocate {failed.size / _MIB:,.1f} MiB</b> at:</p><pre>{_stack_html(failed)}</pre>"
        if failed is not None
        else ""
    )
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}td{vertical-align:top;padding:2px 8px}"
        "pre{margin:0;font-size:12px}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        f"<p>In use {allocated / _MIB:,.1f} MiB of {reserved / _MIB:,.1f} MiB reserved by PyTorch's"
        f" allocator, in {len(snapshot.get('segments', ()))} segments.</p>{failed_html}"
        "<h2>Segments</h2><p>One bar per segment, widths to scale within the largest; blue: in use, grey:"
        " cached and free.</p>"
        f"{_segment_map(snapshot)}"
        f"<h2>Largest live allocations</h2><table><tr><th>MiB</th><th>made at</th></tr>{rows}</table>"
        "<p>The <code>.pickle</code> next to this page opens in PyTorch's memory viewer"
        " (<code>https://pytorch.org/memory_viz</code>) for the full allocation history.</p></body></html>"
    )


def _segment_map(snapshot: dict[str, Any], width: int = 900, bar: int = 14, limit: int = 200) -> str:
    segments = sorted(snapshot.get("segments", ()), key=lambda s: -int(s.get("total_size", 0)))[:limit]
    if not segments:
        return "<p>(no segments)</p>"
    scale = width / max(int(s.get("total_size", 1)) for s in segments)
    shapes = []
    for row, segment in enumerate(segments):
        y = row * (bar + 2)
        shapes.append(
            f"<rect x='0' y='{y}' width='{int(segment['total_size']) * scale:.1f}' height='{bar}'"
            " fill='#ddd'/>"
        )
        offset = 0
        for block in segment.get("blocks", ()):
            size = int(block.get("size", 0))
            if block.get("state") == "active_allocated":
                x, w = offset * scale, max(size * scale, 0.5)
                shapes.append(f"<rect x='{x:.1f}' y='{y}' width='{w:.1f}' height='{bar}' fill='#3b7dd8'/>")
            offset += size
    height = len(segments) * (bar + 2)
    return (
        f"<svg width='{width}' height='{height}' xmlns='http://www.w3.org/2000/svg'>{''.join(shapes)}</svg>"
    )


def _stack_html(allocation: Allocation) -> str:
    return html.escape("\n".join(allocation.frames) or "(no stack recorded)")


def _frames(frames: Any) -> tuple[str, ...]:
    out = []
    for frame in frames or ():
        filename = str(frame.get("filename", "?"))
        if filename == "??":
            continue  # unsymbolised C++ frames
        out.append(f"{filename}:{frame.get('line', '?')} in {frame.get('name', '?')}")
    return tuple(out)


def _where(allocation: Allocation) -> str:
    """Where an allocation was made: the innermost Python frame of the user's code.

    Library frames (torch, Lightning, anything under ``site-packages`` or the standard library) are skipped.
    Where no frame of the user's code exists, the outermost library frame (the one nearest the caller) is
    named and marked so; with no Python frame at all, the innermost frame (C++ only: autograd's backward
    thread).
    """
    python = [frame for frame in allocation.frames if ".py:" in frame]
    for frame in python:
        if not _is_library(frame):
            return frame
    if python:
        return f"{python[-1]} (no frame of your code)"
    return allocation.frames[0] if allocation.frames else "(no stack recorded)"


def _is_library(frame: str) -> bool:
    """Whether ``frame`` (``path:line in name``) is in an installed package, PyTorch, Lightning or stdlib."""
    path = frame.rsplit(":", 1)[0].replace("\\", "/")
    return path.startswith("<") or bool(_LIBRARY.search(path))
