"""``python -m lightning_gpumem report|check|plan ...``, also installed as ``gpumem``.

``gpumem report LOGDIR [--png FILE] [--html FILE] [--json [FILE|-]] [--run GLOB]``: the tables, the timeline
and the figures as JSON; ``gpumem check LOGDIR --max-peak 20GiB ...``: a memory gate (exit 0, 1 or 2);
``gpumem plan [--budget SIZE]... SCRIPT fit [ARGS]...``: a LightningCLI script's plan on a CPU (by trace).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TextIO

from lightning_gpumem import __version__, plan_command
from lightning_gpumem.report import (
    ReportError,
    Run,
    format_table,
    load_runs,
    summarize,
    write_html,
    write_png,
)
from lightning_gpumem.report import check as gate
from lightning_gpumem.report._output import HTML_MARK, PNG_MARK, check_output
from lightning_gpumem.report._text import printable
from lightning_gpumem.report.json_report import MARK as JSON_MARK
from lightning_gpumem.report.json_report import document, dumps, write_json
from lightning_gpumem.report.plot import left_out

SIGPIPE_STATUS = 141  # 128 + SIGPIPE, as a shell reports a program that a closed pipe stopped
USAGE_STATUS = 2  # as argparse exits on a bad argument
STDOUT = "-"  # `--json -`: the document on standard output
SHOWN_RUNS = 20  # runs named in the message of a `--run` that matches none


class UsageError(ReportError):
    """An argument that selects nothing (``--run`` matching no run): exit status 2, as argparse's errors."""


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
        "--json",
        metavar="FILE",
        nargs="?",
        const=STDOUT,
        help="write every run's figures as one JSON document (schema lightning-gpumem.report, version 1) to"
        " FILE; to standard output with '-' or no FILE, instead of the tables",
    )
    _run_option(report)
    report.add_argument(
        "--force",
        action="store_true",
        help="overwrite an existing --png/--html/--json file that gpumem report did not write, or write a"
        " link's target (never a file the report reads)",
    )
    check = commands.add_parser(
        "check",
        help="exit non-zero when a run breaks a memory limit or grows past its baseline",
        description=(
            "Hold each run under LOGDIR to memory limits: its peak (the highest peak allocated over the"
            " stages), its peak reserved, no leak warning, and no more growth than --max-increase over the"
            " runs of --baseline (matched by name, or one run to one run). Prints one line per check."
        ),
        epilog="exit status: 0 every check passed; 1 a limit broken; 2 nothing to read, a figure not"
        " logged, no baseline run to compare with, or a bad argument",
    )
    check.add_argument("logdir", metavar="LOGDIR", help="a logger's save_dir, name or version directory")
    check.add_argument(
        "--max-peak",
        metavar="SIZE",
        type=_converter(gate.parse_size),
        help="the highest the peak allocated may be: 20GiB, 512MiB, 20GB",
    )
    check.add_argument(
        "--max-reserved",
        metavar="SIZE",
        type=_converter(gate.parse_size),
        help="the highest the peak reserved may be",
    )
    check.add_argument("--no-leak", action="store_true", help="fail a run whose monitor flagged a leak")
    check.add_argument(
        "--baseline", metavar="LOGDIR", help="the runs to compare with (needs --max-increase)"
    )
    check.add_argument(
        "--max-increase",
        metavar="SHARE",
        type=_converter(gate.parse_fraction),
        help="how much the peak and the peak reserved may exceed the baseline's: 5%% or 0.05",
    )
    _run_option(check)
    plan = commands.add_parser(
        "plan",
        help="plan a LightningCLI script's batch size for cards you may not have, on this machine's CPU",
        description=(
            "Run SCRIPT's fit (a LightningCLI script) on a CPU Trainer with MemoryPlanner added, stop=true:"
            " the training step is traced on fake tensors and the caching allocator replayed, and the plan"
            " (the peak at the configured size, the largest size per budget) is printed; no step runs."
        ),
        epilog="exit status: the script's (0 when the plan was made); 2 on a bad argument",
    )
    plan.add_argument(
        "--budget",
        action="append",
        metavar="SIZE",
        help="a budget to plan for: 24GiB, 16GB, or a card (H100-80GB, A100-80GB, A100-40GB, RTX4090);"
        f" repeatable; default: {', '.join(plan_command.DEFAULT_BUDGETS)}",
    )
    plan.add_argument("--batch-arg-name", metavar="NAME", help="the attribute holding the batch size")
    plan.add_argument(
        "--ddp",
        action="store_true",
        help="plan one rank of a DDP run: counts DDP's gradient buckets (a copy of the gradients)",
    )
    plan.add_argument("script", metavar="SCRIPT", help="the LightningCLI script (train.py)")
    plan.add_argument(
        "args", nargs=argparse.REMAINDER, metavar="fit [ARGS]", help="its subcommand, fit, and its arguments"
    )
    return parser


def _run_option(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--run",
        metavar="GLOB",
        action="append",
        help="only the runs whose name (as the report shows it) matches GLOB, as fnmatch matches it;"
        " repeatable",
    )


def _converter(parse: Callable[[str], float]) -> Callable[[str], float]:
    """``parse`` as an argparse ``type``: its ``ValueError`` becomes argparse's error, naming the option."""

    def convert(text: str) -> float:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return convert


def report(
    logdir: str,
    png: str | None = None,
    html: str | None = None,
    force: bool = False,
    json_out: str | None = None,
    runs: Sequence[str] | None = None,
) -> int:
    """Run the ``report`` command; returns the exit status.

    ``json_out``: a file for the JSON document, or ``"-"`` for standard output (then standard output holds
    the document only: the tables are left out and the notices go to standard error). ``runs``: globs that
    select the runs by name.

    Raises:
        ReportError: LOGDIR cannot be reported on, or an output is refused or cannot be written.
        UsageError: a glob of ``runs`` matches no run.
    """
    to_stdout = json_out == STDOUT
    json_file = None if to_stdout else json_out
    outputs = {"--png": png, "--html": html, "--json": json_file}
    _check_outputs(outputs)  # before anything is read, printed or written
    loaded = load_runs(logdir)
    selected = select_runs(loaded.runs, runs)
    _check_existing(outputs, loaded.inputs, force)  # before anything is printed or written
    for line in loaded.skipped:
        _say(f"gpumem report: skipped {printable(line)}", sys.stderr)
    notices = sys.stderr if to_stdout else sys.stdout
    if to_stdout:
        sys.stdout.write(dumps(document(selected, logdir, loaded.skipped)))  # ASCII: any terminal takes it
    else:
        _say("\n\n".join(format_table(summarize(run)) for run in selected))
        if any(value is not None for value in outputs.values()):
            _say()
    output = None
    try:
        if json_file is not None:
            output = json_file
            path = write_json(selected, logdir, json_file, force, loaded.skipped)
            _say(f"JSON: {printable(str(path))}", notices)
        if html is not None:  # before the PNG: it needs nothing optional
            output = html
            _say(f"HTML: {printable(str(write_html(selected, logdir, html, force)))}", notices)
        if png is not None:
            output = png
            _say(f"PNG:  {printable(str(write_png(selected, png, force)))}", notices)
            notice = left_out(selected)
            if notice is not None:
                _say(f"gpumem report: {notice} (the tables and the HTML page hold every run)", sys.stderr)
    except OSError as error:
        raise ReportError(f"cannot write {printable(str(output))!r}: {error.strerror or error}") from None
    return 0


def check(
    logdir: str, limits: gate.Limits, baseline: str | None = None, runs: Sequence[str] | None = None
) -> int:
    """Run the ``check`` command: one line per check on standard output; returns the exit status.

    0: every check passed; 1: a limit is broken; 2: a check could not be made (a figure not logged, no
    baseline run to compare with).

    Raises:
        ReportError: LOGDIR or ``baseline`` cannot be read (exit status 2).
        UsageError: no limit is given, ``baseline`` without ``limits.max_increase`` or the reverse, or a glob
            of ``runs`` matches no run.
    """
    if limits == gate.Limits() and baseline is None:
        raise UsageError(
            "nothing to check: expected --max-peak SIZE, --max-reserved SIZE, --no-leak, or --baseline"
            " LOGDIR with --max-increase SHARE."
        )
    if (baseline is None) != (limits.max_increase is None):
        given, needed = (
            ("--baseline", "--max-increase") if baseline is not None else ("--max-increase", "--baseline")
        )
        raise UsageError(f"{given} needs {needed}: expected both, as --baseline LOGDIR --max-increase 5%.")
    loaded = load_runs(logdir)
    selected = select_runs(loaded.runs, runs)
    skipped = list(loaded.skipped)
    summaries = []
    if baseline is not None:
        try:
            base = load_runs(baseline)
        except ReportError as error:
            raise ReportError(f"--baseline: {error}") from None
        skipped += base.skipped
        summaries = [summarize(run) for run in base.runs]
    for line in skipped:
        _say(f"gpumem check: skipped {printable(line)}", sys.stderr)
    outcomes = gate.check_runs([summarize(run) for run in selected], limits, summaries)
    for outcome in outcomes:
        _say(outcome.line())
    status = gate.exit_status(outcomes)
    if status != gate.EXIT_OK:
        verdicts = [outcome.verdict for outcome in outcomes]
        _say(
            f"gpumem check: {verdicts.count(gate.BROKEN)} of {len(outcomes)} checks broken,"
            f" {verdicts.count(gate.UNCHECKED)} not checked",
            sys.stderr,
        )
    return status


def select_runs(runs: Sequence[Run], patterns: Sequence[str] | None) -> list[Run]:
    """The runs whose name matches one of ``patterns`` (``fnmatch``, case-sensitive; ``*`` matches ``/``).

    All of them without patterns.

    Raises:
        UsageError: a pattern matches no run (it names the pattern and the runs there are).
    """
    if not patterns:
        return list(runs)
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(run.name, pattern) for run in runs):
            names = ", ".join(repr(run.name) for run in runs[:SHOWN_RUNS])
            more = f" and {len(runs) - SHOWN_RUNS} more" if len(runs) > SHOWN_RUNS else ""
            raise UsageError(
                f"--run {pattern!r}: no run matches; expected one of the runs' names: {names}{more}."
            )
    return [run for run in runs if any(fnmatch.fnmatchcase(run.name, pattern) for pattern in patterns)]


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


MARKS = {"--html": HTML_MARK.encode(), "--png": PNG_MARK, "--json": JSON_MARK}


def _check_existing(outputs: dict[str, str | None], inputs: Iterable[Path], force: bool) -> None:
    """Refuse an input of the report, or (without ``force``) a file it did not write or a symbolic link."""
    inputs = list(inputs)
    for option, value in outputs.items():
        if value is not None:
            check_output(option, value, MARKS[option], inputs, force)


def _check_outputs(outputs: dict[str, str | None]) -> None:
    """Refuse output paths that cannot be written, naming the option, before any work is done."""
    given = {option: value for option, value in outputs.items() if value is not None}
    for option, value in given.items():
        if not value.strip():
            raise ReportError(f"{option} {value!r}: expected a file name.")
        path = Path(value)
        if path.is_dir():
            raise ReportError(f"{option} {value!r}: is a directory; expected a file name.")
        blocking = next((parent for parent in path.parents if parent.exists() and not parent.is_dir()), None)
        if blocking is not None:
            raise ReportError(f"{option} {value!r}: {str(blocking)!r} is a file, not a directory.")
    png = given.get("--png")
    if png is not None and Path(png).suffix.lower() != ".png":
        raise ReportError(f"--png {png!r}: expected a file name ending in .png.")
    seen: dict[Path, str] = {}
    for option, value in given.items():
        other = seen.setdefault(Path(value).resolve(), option)
        if other != option:
            raise ReportError(
                f"{other} and {option} are the same file ({value!r}); expected two different files."
            )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gpumem`` and ``python -m lightning_gpumem``.

    ``report`` exits with status 1 on an error, 2 where ``--run`` matches no run; ``check`` with 0, 1 or 2
    (:func:`check`), 2 on any error. A closed standard output (``gpumem report LOGDIR | head``) ends either
    quietly with status 141, as a shell reports a program stopped by SIGPIPE.
    """
    args = _parser().parse_args(argv)
    try:
        try:
            if args.command == "plan":
                try:
                    argv = plan_command.plan_argv(
                        args.script, args.args, args.budget, args.batch_arg_name, ddp=args.ddp
                    )
                except plan_command.PlanUsageError as error:
                    raise UsageError(str(error)) from None
                _say("gpumem plan: " + " ".join(argv[1:]), sys.stderr)
                sys.stderr.flush()
                return plan_command.run_plan(argv)
            if args.command == "check":
                limits = gate.Limits(args.max_peak, args.max_reserved, args.no_leak, args.max_increase)
                status = check(args.logdir, limits, args.baseline, args.run)
            else:
                status = report(
                    args.logdir,
                    png=args.png,
                    html=args.html,
                    force=args.force,
                    json_out=args.json,
                    runs=args.run,
                )
        except ReportError as error:
            # its own line breaks kept, none from a name
            lines = "\n".join(map(printable, str(error).split("\n")))
            _say(f"gpumem {args.command}: error: {lines}", sys.stderr)
            status = USAGE_STATUS if isinstance(error, UsageError) or args.command == "check" else 1
        sys.stdout.flush()  # here, so that a closed pipe is met inside the `try`, not at exit
    except BrokenPipeError:
        # As the Python docs advise (signal, "Note on SIGPIPE"): what is still buffered goes to devnull.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return SIGPIPE_STATUS
    return status
