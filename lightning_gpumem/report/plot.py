r"""The memory timeline as a PNG, drawn with matplotlib (optional: ``pip install lightning-gpumem[report]``).

A panel's title is the run's name as :func:`panel_title` draws it: control characters, undecodable bytes and
characters that no font of the title holds written as escapes (``\xff``, ``\u4e2d``), a long name cut in the
middle; the tables and the HTML page hold the whole name.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_gpumem._core.files import write_atomic
from lightning_gpumem.report._output import PNG_MARK, PNG_SOFTWARE, check_output
from lightning_gpumem.report._text import escape, printable
from lightning_gpumem.report.runs import ReportError, Run
from lightning_gpumem.report.timeline import MARKS, RELEASE_COLOR, lines, release_steps, tuned

WIDTH_IN, RUN_HEIGHT_IN, DPI = 10.0, 4.0, 100  # each run adds a 1000 x 400 pixel panel
# panels in one picture (24 x 400 px = 9600 px high); the HTML page and the tables hold every run
MAX_RUNS = 24
MAX_TITLE_CHARS = 100  # a name drawn longer is cut in the middle (its start and its version directory kept)
TITLE_SIZE = 10


def write_png(runs: Sequence[Run], path: str | os.PathLike[str], force: bool = False) -> Path:
    """Draw one panel per run (GiB against step), for the first :data:`MAX_RUNS` runs, and save it as a PNG.

    The figure is drawn without ``pyplot``, so the caller's matplotlib backend and figures are left alone.
    The file is written whole or not at all, with a ``Software`` text chunk that marks it as the report's;
    ``path`` is never one of the runs' sources, and an existing file that the report did not write, or a
    symbolic link, is replaced only with ``force`` (which writes the link's target). :func:`left_out` says
    which runs it leaves out.

    Returns:
        The path written.

    Raises:
        ReportError: matplotlib is not installed, ``path`` does not end in ``.png``, or it is refused, as
            above.
        OSError: it cannot be written.
    """
    out = Path(path)
    if out.suffix.lower() != ".png":
        raise ReportError(f"--png {printable(str(path))!r}: expected a file name ending in .png.")
    target = check_output("--png", path, PNG_MARK, [source for run in runs for source in run.sources], force)
    try:
        import matplotlib.figure  # noqa: F401  # only whether it is there: `_figure` draws with it
    except ImportError:
        raise ReportError(
            "--png needs matplotlib: pip install 'lightning-gpumem[report]' (or pip install matplotlib)."
        ) from None
    figure = _figure(runs[:MAX_RUNS])
    metadata = {"Software": PNG_SOFTWARE}
    write_atomic(target, lambda handle: figure.savefig(handle, dpi=DPI, format="png", metadata=metadata))
    return out


def left_out(runs: Sequence[Run]) -> str | None:
    """What :func:`write_png` leaves out of ``runs``, as a sentence naming them.

    ``None`` when it draws them all.
    """
    if len(runs) <= MAX_RUNS:
        return None
    names = ", ".join(f"'{printable(run.name)}'" for run in runs[MAX_RUNS:])
    return f"the PNG holds the first {MAX_RUNS} of {len(runs)} runs; left out: {names}"


def _figure(runs: Sequence[Run]) -> Any:
    """The figure: one panel per run.

    The y axis runs from 0 to 8% above the highest value, so a flat series at its maximum (host memory on a
    CPU run) is drawn inside the frame, not on its edge.
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(WIDTH_IN, RUN_HEIGHT_IN * len(runs)), dpi=DPI, layout="constrained")
    glyphs = font_glyphs()
    axes = figure.subplots(len(runs), 1, squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        highest = 0.0
        for line, points in lines(run):
            steps, values = [s for s, _ in points], [v for _, v in points]
            highest = max([highest, *(v for v in values if math.isfinite(v))])
            if line.limit:  # a level logged once: across the whole panel, at its last value
                ax.axhline(values[-1], color=line.color, label=line.label, linewidth=1.2, linestyle="--")
            elif line.points_only or len(points) == 1:  # one point draws no line: a marker
                ax.plot(steps, values, "o", color=line.color, label=line.label, markersize=4)
            else:
                wide = line.width > 1.2  # drawn underneath, translucent, so what coincides shows on it
                ax.plot(
                    steps,
                    values,
                    color=line.color,
                    label=line.label,
                    linewidth=line.width,
                    alpha=0.45 if wide else 1.0,
                    zorder=1.5 if wide else 2.0,
                    linestyle="--" if line.dashed else line.linestyle,
                    marker=line.marker or None,
                    markersize=5,
                    markevery=max(1, len(points) // MARKS),
                    drawstyle="steps-post" if line.dashed else "default",
                )
        for i, step in enumerate(release_steps(run)):
            ax.axvline(
                step,
                color=RELEASE_COLOR,
                linestyle=":",
                linewidth=1,
                label="cache release" if i == 0 else None,
            )
        ax.set_title(panel_title(run, glyphs), fontsize=TITLE_SIZE, loc="left")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
        ax.set_xlabel("step")
        ax.set_ylabel("GiB")
        ax.set_ylim(0, highest * 1.08 if highest > 0 else 1.0)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return figure


def panel_title(run: Run, glyphs: set[int] | None = None) -> str:
    r"""The run's title as its panel draws it (matplotlib text; the tuned batch size added as by ``title``).

    Each character of the name is drawn as itself where it is printable and a font of the title holds it (in
    ``glyphs``; every printable character where ``glyphs`` is ``None``), else as its escape (``\x0a``,
    ``\xff`` for an undecodable byte, ``\U0001f980``); a name longer than :data:`MAX_TITLE_CHARS` so drawn is
    cut in the middle, at a character's edge. A ``$`` is not read as mathtext.

    Example:
        >>> from lightning_gpumem.report.runs import Run
        >>> from pathlib import Path
        >>> panel_title(Run(name="a$b\n\udcff", path=Path(".")), glyphs={ord(c) for c in "ab$"})
        'a\\$b\\x0a\\xff'
    """
    pieces = [
        char if char.isprintable() and (glyphs is None or ord(char) in glyphs) else escape(char)
        for char in run.name
    ]
    if sum(map(len, pieces)) > MAX_TITLE_CHARS:
        half = (MAX_TITLE_CHARS - 1) // 2
        head, tail = _within(pieces, half), _within(pieces[::-1], half)[::-1]
        ellipsis = "\u2026" if glyphs is None or 0x2026 in glyphs else "..."
        pieces = [*head, ellipsis, *tail]
    return ("".join(pieces) + tuned(run)).replace("$", r"\$")


def _within(pieces: list[str], size: int) -> list[str]:
    """The leading ``pieces`` whose lengths add up to at most ``size``."""
    kept: list[str] = []
    for piece in pieces:
        size -= len(piece)
        if size < 0:
            break
        kept.append(piece)
    return kept


def font_glyphs(size: float = TITLE_SIZE) -> set[int]:
    """The characters (code points) held by the fonts matplotlib draws a title with: its font, the fallbacks.

    The families are ``rcParams["font.family"]``, a generic one (``sans-serif``) standing for its list
    (``rcParams["font.sans-serif"]``); a family that is not installed is passed over.
    """
    from matplotlib import rcParams
    from matplotlib.font_manager import FontProperties, findfont, get_font

    generic = {
        "serif": rcParams["font.serif"],
        "sans-serif": rcParams["font.sans-serif"],
        "cursive": rcParams["font.cursive"],
        "fantasy": rcParams["font.fantasy"],
        "monospace": rcParams["font.monospace"],
    }
    prop = FontProperties(size=size)
    paths = {findfont(prop)}
    for family in prop.get_family():
        for name in generic.get(family, [family]):
            candidate = prop.copy()
            candidate.set_family(name)
            try:
                paths.add(findfont(candidate, fallback_to_default=False))
            except ValueError:  # not installed
                continue
    glyphs: set[int] = set()
    for path in paths:
        glyphs.update(get_font(path).get_charmap())
    return glyphs
