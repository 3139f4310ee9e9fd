"""``python -m lightning_gpumem report LOGDIR [--png FILE] [--html FILE]``, also installed as ``gpumem``."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TextIO

from lightning_gpumem import __version__
from lightning_gpumem.report import ReportError, format_table, load_runs, summarize, write_html, write_png
from lightning_gpumem.report._output import HTML_MARK, PNG_MARK, check_output
from lightning_gpumem.report._text import printable
from lightning_gpumem.report.plot import left_out

SIGPIPE_STATUS = 141  # 128 + SIGPIPE, as a shell reports a program that a closed pipe stopped


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpumem", description="lightning-gpumem tools.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    report = commands.add_parser(
        "report",
        help="summarize the gpumem/ metrics of the runs under a log directory",
        description=(
            "Read the gpumem/ metrics that MemoryMonitor (and the other lightning-gpumem callbacks) logged"
            " to TensorBoard event files or CSVLogger CSVs under LOGDIR; print a summary table per run, and"
            " draw the memory timeline to a PNG (needs matplotlib) and/or a self-contained HTML page."
        ),
    )
    report.add_argument("logdir", metavar="LOGDIR", help="a logger's save_dir, name or version directory")
    report.add_argument(
        "--png", metavar="FILE", help="write the memory timeline, one panel per run, as a PNG"
    )
    report.add_argument("--html", metavar="FILE", help="write the tables and timelines as one HTML page")
    report.add_argument(
        "--force",
        action="store_true",
        help="overwrite an existing --png/--html file that gpumem report did not write, or write a link's"
        " target (never a file the report reads)",
    )
    return parser


def report(logdir: str, png: str | None = None, html: str | None = None, force: bool = False) -> int:
    """Run the ``report`` command; returns the exit status."""
    _check_outputs(png, html)  # before anything is read, printed or written
    loaded = load_runs(logdir)
    _check_existing(png, html, loaded.inputs, force)  # before anything is printed or written
    for line in loaded.skipped:
        _say(f"gpumem report: skipped {printable(line)}", sys.stderr)
    _say("\n\n".join(format_table(summarize(run)) for run in loaded.runs))
    if png is not None or html is not None:
        _say()
    output = None
    try:
        if html is not None:  # first: it needs nothing optional
            output = html
            _say(f"HTML: {printable(str(write_html(loaded.runs, logdir, html, force)))}")
        if png is not None:
            output = png
            _say(f"PNG:  {printable(str(write_png(loaded.runs, png, force)))}")
            notice = left_out(loaded.runs)
            if notice is not None:
                _say(f"gpumem report: {notice} (the tables and the HTML page hold every run)", sys.stderr)
    except OSError as error:
        raise ReportError(f"cannot write {printable(str(output))!r}: {error.strerror or error}") from None
    return 0


def _say(text: str = "", stream: TextIO | None = None) -> None:
    r"""Print ``text`` (already :func:`printable`) and a newline to ``stream`` (by default standard output).

    What the stream's encoding cannot hold (a run named with an emoji, on an ASCII terminal) is written as
    its escape (``\U0001f980``), as Python writes to standard error, rather than ending the report with
    ``UnicodeEncodeError``.
    """
    stream = sys.stdout if stream is None else stream
    encoding = getattr(stream, "encoding", None) or "utf-8"
    with contextlib.suppress(LookupError):  # an encoding Python does not know: the text as it is
        text = text.encode(encoding, "backslashreplace").decode(encoding)
    print(text, file=stream)


def _check_existing(png: str | None, html: str | None, inputs: Iterable[Path], force: bool) -> None:
    """Refuse an input of the report, or (without ``force``) a file it did not write or a symbolic link."""
    inputs = list(inputs)
    for option, value, mark in (("--html", html, HTML_MARK.encode()), ("--png", png, PNG_MARK)):
        if value is not None:
            check_output(option, value, mark, inputs, force)


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
    """Entry point of ``gpumem`` and ``python -m lightning_gpumem``.

    A closed standard output (``gpumem report LOGDIR | head``) ends it quietly with status 141, as a shell
    reports a program stopped by SIGPIPE.
    """
    args = _parser().parse_args(argv)
    try:
        try:
            status = report(args.logdir, png=args.png, html=args.html, force=args.force)
        except ReportError as error:
            # its own line breaks kept, none from a name
            lines = "\n".join(map(printable, str(error).split("\n")))
            _say(f"gpumem report: error: {lines}", sys.stderr)
            status = 1
        sys.stdout.flush()  # here, so that a closed pipe is met inside the `try`, not at exit
    except BrokenPipeError:
        # As the Python docs advise (signal, "Note on SIGPIPE"): what is still buffered goes to devnull.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return SIGPIPE_STATUS
    return status
