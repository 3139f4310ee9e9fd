"""The report as one self-contained HTML page: each run's table and its timeline as inline SVG, no script.

Every text from outside (the log directory, run names, the table's cells) goes through :func:`markup`:
escaped for the terminal first (control characters, bidirectional overrides, undecodable bytes), then as
HTML, so any name a file system allows gives a valid UTF-8 page that shows it.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Sequence
from pathlib import Path

from lightning_gpumem._core.files import write_atomic
from lightning_gpumem.report._output import HTML_MARK, check_output
from lightning_gpumem.report._text import printable
from lightning_gpumem.report.runs import Run
from lightning_gpumem.report.summary import rows, summarize
from lightning_gpumem.report.timeline import RELEASE_COLOR, lines, release_steps, tuned

WIDTH, HEIGHT = 960, 320
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 12, 36

_STYLE = """
body { font: 14px system-ui, sans-serif; margin: 24px; color: #222; max-width: 1000px; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 32px; }
h1, h2, td { overflow-wrap: anywhere; }
table { border-collapse: collapse; margin: 8px 0 12px; }
td { padding: 3px 12px 3px 0; border-bottom: 1px solid #eee; vertical-align: top; }
td:first-child { color: #555; white-space: nowrap; }
.legend span { display: inline-block; margin-right: 16px; font-size: 12px; }
.legend i { display: inline-block; width: 18px; height: 3px; margin-right: 5px; vertical-align: middle; }
svg text { font: 11px system-ui, sans-serif; fill: #555; }
"""


def markup(text: str) -> str:
    r"""``text`` as HTML.

    Made :func:`~lightning_gpumem.report._text.printable`, then ``&``, ``<``, ``>`` and quotes escaped.

    Example:
        >>> markup("<b>run\n\udcff</b>")
        '&lt;b&gt;run\\x0a\\xff&lt;/b&gt;'
    """
    return html.escape(printable(text), quote=True)


def _ticks(low: float, high: float, count: int = 5, whole: bool = False) -> list[float]:
    """About ``count`` round tick values over ``[low, high]``; with ``whole``, whole numbers only (steps)."""
    span = high - low
    if span <= 0:
        return [low]
    raw = span / count
    magnitude = 10 ** math.floor(math.log10(raw))
    multiples = (1, 2, 5, 10) if whole and magnitude <= 1 else (1, 2, 2.5, 5, 10)  # 2.5 x 10 and up is whole
    step = next(m * magnitude for m in multiples if m * magnitude >= raw)
    if whole:
        step = max(1, round(step))
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 1)]


def _label(value: float) -> str:
    if value == int(value):
        # steps: every digit, ticks differ
        return f"{int(value):,}" if abs(value) >= 1e6 else str(int(value))
    return f"{value:g}"


def timeline_svg(run: Run) -> str:
    """The run's curves (GiB against step) as an SVG element."""
    curves = lines(run)
    releases = release_steps(run)
    steps = [s for _, points in curves for s, _ in points] + releases
    values = [v for _, points in curves for _, v in points if math.isfinite(v)]
    if not steps or not values:
        return "<p>No memory curves logged for this run.</p>"
    x0, x1 = min(steps), max(steps)
    x1 = x1 if x1 > x0 else x0 + 1
    y1 = max(values) * 1.05 or 1.0
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(step: float) -> float:
        return LEFT + (step - x0) / (x1 - x0) * plot_w

    def y(value: float) -> float:
        return TOP + plot_h - value / y1 * plot_h

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img">']
    for tick in _ticks(0.0, y1):
        parts.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#eee"/>'
        )
        parts.append(f'<text x="{LEFT - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{_label(tick)}</text>')
    for tick in _ticks(x0, x1, whole=True):
        parts.append(
            f'<text x="{x(tick):.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{_label(tick)}</text>'
        )
    parts.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 4}" text-anchor="middle">step</text>')
    parts.append(
        f'<text x="12" y="{TOP + plot_h / 2}" transform="rotate(-90 12 {TOP + plot_h / 2})">GiB</text>'
    )
    axis = f"M{LEFT},{TOP} V{TOP + plot_h} H{WIDTH - RIGHT}"
    parts.append(f'<path d="{axis}" fill="none" stroke="#999"/>')
    for step in releases:
        parts.append(
            f'<line x1="{x(step):.1f}" x2="{x(step):.1f}" y1="{TOP}" y2="{TOP + plot_h}"'
            f' stroke="{RELEASE_COLOR}" stroke-dasharray="2,3"><title>cache release at step'
            " " + str(step) + "</title></line>"
        )
    for line, points in curves:
        finite = [(s, v) for s, v in points if math.isfinite(v)]
        if not finite:
            continue
        if line.limit:  # a level logged once: across the whole panel, at its last value
            level, value = y(finite[-1][1]), finite[-1][1]
            parts.append(
                f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{level:.1f}" y2="{level:.1f}"'
                f' stroke="{line.color}" stroke-dasharray="6,4">'
                f"<title>{markup(line.label)}: {value:.2f} GiB</title></line>"
            )
            continue
        if line.points_only or len(finite) == 1:  # one point draws no line: a marker
            parts.extend(
                f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="3"'
                f' fill="{line.color}"><title>{markup(line.label)}'
                f" at step {s}: {v:.2f} GiB</title></circle>"
                for s, v in finite
            )
            continue
        if line.dashed:  # a level that holds until it changes: steps, drawn on to the last step
            corners = [finite[0]]
            for step, value in [*finite[1:], (x1, finite[-1][1])]:
                corners += [(step, corners[-1][1]), (step, value)]
            finite = corners
        coords = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in finite)
        dash = ' stroke-dasharray="6,4"' if line.dashed else ""
        parts.append(
            f'<polyline points="{coords}" fill="none" stroke="{line.color}" stroke-width="1.5"{dash}>'
            f"<title>{markup(line.label)}</title></polyline>"
        )
    parts.append("</svg>")
    legend = [
        f'<span><i style="background:{line.color}"></i>{markup(line.label)}</span>' for line, _ in curves
    ]
    if releases:
        legend.append(
            f'<span><i style="background:{RELEASE_COLOR}"></i>cache release ({len(releases)})</span>'
        )
    return "".join(parts) + f'<div class="legend">{"".join(legend)}</div>'


def render_html(runs: Sequence[Run], logdir: str) -> str:
    """The whole page for ``runs`` read from ``logdir``."""
    body = [f"<h1>Memory report: <bdi>{markup(logdir)}</bdi></h1>"]
    for run in runs:
        table = "".join(
            f"<tr><td>{markup(label)}</td><td>{markup(value)}</td></tr>"
            for label, value in rows(summarize(run))
        )
        # <bdi>: a right-to-left name stays apart
        heading = f"<bdi>{markup(run.name)}</bdi>{markup(tuned(run))}"
        body.append(f"<h2>{heading}</h2><table>{table}</table>{timeline_svg(run)}")
    return (
        f'<!doctype html>\n{HTML_MARK}\n<html lang="en"><head><meta charset="utf-8"><title>gpumem'
        " report</title>"
        f"<style>{_STYLE}</style></head><body>{''.join(body)}</body></html>\n"
    )


def write_html(runs: Sequence[Run], logdir: str, path: str | os.PathLike[str], force: bool = False) -> Path:
    """Write :func:`render_html` to ``path`` (whole or not at all) and return it.

    ``path`` is never one of the runs' sources; an existing file that the report did not write (one without
    :data:`~lightning_gpumem.report._output.HTML_MARK` near its start), or a symbolic link, is replaced only
    with ``force`` (which writes the link's target).

    Raises:
        ReportError: ``path`` is refused, as above.
        OSError: it cannot be written.
    """
    inputs = [source for run in runs for source in run.sources]
    out = check_output("--html", path, HTML_MARK.encode(), inputs, force)
    page = render_html(runs, logdir).encode("utf-8")
    write_atomic(out, lambda handle: handle.write(page))
    return Path(path)
