"""``python -m lightning_gpumem report LOGDIR [--png FILE] [--html FILE]``, also installed as ``gpumem``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_gpumem import __version__
from lightning_gpumem.report import ReportError, format_table, load_runs, summarize, write_html, write_png


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpumem", description="lightning-gpumem tools.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    report = commands.add_parser(
        "report",
        help="summarize the gpumem/ metrics of the runs under a log directory",
        description=(
            "Read the gpumem/ metrics that MemoryMonitor (and the other lightning-gpumem callbacks) logged to"
            " TensorBoard event files or CSVLogger CSVs under LOGDIR; print a summary table per run, and draw"
            " the memory timeline to a PNG (needs matplotlib) and/or a self-contained HTML page."
        ),
    )
    report.add_argument("logdir", metavar="LOGDIR", help="a logger's save_dir, name or version directory")
    report.add_argument("--png", metavar="FILE", help="write the memory timeline, one panel per run, as a PNG")
    report.add_argument("--html", metavar="FILE", help="write the tables and timelines as one HTML page")
    return parser


def report(logdir: str, png: str | None = None, html: str | None = None) -> int:
    """Run the ``report`` command; returns the exit status."""
    _check_outputs(png, html)  # before anything is read, printed or written
    loaded = load_runs(logdir)
    for line in loaded.skipped:
        print(f"gpumem report: skipped {line}", file=sys.stderr)
    print("\n\n".join(format_table(summarize(run)) for run in loaded.runs))
    if png is not None or html is not None:
        print()
    try:
        if html is not None:  # first: it needs nothing optional
            print(f"HTML: {write_html(loaded.runs, logdir, html)}")
        if png is not None:
            print(f"PNG:  {write_png(loaded.runs, png)}")
    except OSError as error:
        raise ReportError(f"cannot write {error.filename or 'the output'}: {error.strerror or error}") from None
    return 0


def _check_outputs(png: str | None, html: str | None) -> None:
    """Refuse output paths that cannot be written, naming the option, before any work is done."""
    for option, value in (("--png", png), ("--html", html)):
        if value is None:
            continue
        if not value.strip():
            raise ReportError(f"{option} {value!r}: expected a file name.")
        path = Path(value)
        if path.is_dir():
            raise ReportError(f"{option} {value!r}: is a directory; expected a file name.")
        blocking = next((parent for parent in path.parents if parent.exists() and not parent.is_dir()), None)
        if blocking is not None:
            raise ReportError(f"{option} {value!r}: {str(blocking)!r} is a file, not a directory.")
    if png is not None and Path(png).suffix.lower() != ".png":
        raise ReportError(f"--png {png!r}: expected a file name ending in .png.")
    if png is not None and html is not None and Path(png).resolve() == Path(html).resolve():
        raise ReportError(f"--png and --html are the same file ({png!r}); expected two different files.")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gpumem`` and ``python -m lightning_gpumem``."""
    args = _parser().parse_args(argv)
    try:
        return report(args.logdir, png=args.png, html=args.html)
    except ReportError as error:
        print(f"gpumem report: error: {error}", file=sys.stderr)
        return 1
