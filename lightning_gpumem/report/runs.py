"""Find the runs under a log directory and read their scalars (TensorBoard event files and ``CSVLogger`` CSVs).

A *run* is one directory holding event files (``events.out.tfevents.*``) and/or a ``metrics.csv``, as Lightning's
``TensorBoardLogger`` and ``CSVLogger`` write them (``<save_dir>/<name>/version_<n>/``). When both loggers write to
the same directory, the event files' values are kept and the CSV adds only the keys they lack.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from lightning_gpumem.report._events import CorruptEventFile, read_scalars

PREFIX = "gpumem/"
EVENT_FILE_MARK = "tfevents"
CSV_NAME = "metrics.csv"

Series = list[tuple[int, float]]


class ReportError(Exception):
    """A log directory that cannot be reported on: missing, or without any ``gpumem/`` metric."""


@dataclass
class Run:
    """The ``gpumem/`` scalars of one run: ``{key: [(step, value), ...]}`` sorted by step.

    Attributes:
        name: the run's directory relative to the log directory (its own name where it is the log directory).
        path: the run's directory.
        series: every ``gpumem/`` key logged, with its ``(step, value)`` points in step order, one per step (the
            last written where a step was logged twice, as by a run resumed from a checkpoint).
        sources: the files read.
    """

    name: str
    path: Path
    series: dict[str, Series] = field(default_factory=dict)
    sources: list[Path] = field(default_factory=list)

    def values(self, key: str) -> list[float]:
        """The finite values logged under ``key`` (empty if it was never logged)."""
        return [value for _, value in self.series.get(key, []) if math.isfinite(value)]

    def last(self, key: str) -> float | None:
        """The last finite value logged under ``key``, or ``None``."""
        values = self.values(key)
        return values[-1] if values else None

    def maximum(self, key: str) -> float | None:
        """The largest finite value logged under ``key``, or ``None``."""
        values = self.values(key)
        return max(values) if values else None


@dataclass
class LoadResult:
    """The runs found (those with at least one ``gpumem/`` key) and the files skipped, with why."""

    runs: list[Run]
    skipped: list[str]
    files_read: int


def load_runs(logdir: str | os.PathLike[str]) -> LoadResult:
    """Read every run under ``logdir``.

    Args:
        logdir: a directory written by Lightning's ``TensorBoardLogger`` and/or ``CSVLogger`` (any level: the
            ``save_dir``, a ``name`` directory or one ``version_<n>``).

    Returns:
        The runs with ``gpumem/`` metrics, in path order, and the files skipped (corrupt or unreadable) with why.

    Raises:
        ReportError: ``logdir`` does not exist or is not a directory, or no file under it holds a ``gpumem/`` metric.
    """
    if not str(logdir).strip():
        raise ReportError(f"LOGDIR {str(logdir)!r}: expected a directory (a logger's save_dir or a version directory).")
    root = Path(logdir)
    if not root.exists():
        raise ReportError(f"LOGDIR '{root}' does not exist.")
    if not root.is_dir():
        raise ReportError(f"LOGDIR '{root}' is not a directory.")
    runs: list[Run] = []
    skipped: list[str] = []
    files_read = 0
    for directory, _, names in sorted(os.walk(root)):
        events = sorted(name for name in names if EVENT_FILE_MARK in name and name.startswith("events.out"))
        has_csv = CSV_NAME in names
        if not events and not has_csv:
            continue
        path = Path(directory)
        name = str(path.relative_to(root)) if path != root else (root.resolve().name or str(root))
        run = Run(name=name, path=path)
        for name in events:
            file = path / name
            try:
                scalars = read_scalars(file)
            except CorruptEventFile as error:
                scalars = error.scalars
                kept = sum(map(len, scalars.values()))
                skipped.append(f"{error}; the rest of the file is skipped ({kept} scalars before it are kept)")
            except OSError as error:
                skipped.append(f"{file}: {error}")
                continue
            files_read += 1
            run.sources.append(file)
            for key, points in scalars.items():
                if key.startswith(PREFIX):
                    run.series.setdefault(key, []).extend(points)
        if has_csv:
            file = path / CSV_NAME
            bad: list[str] = []
            try:
                table = _read_csv(file, bad)
            except (OSError, ValueError, csv.Error) as error:
                skipped.append(f"{file}: {error}")
            else:
                skipped.extend(f"{file}, {what}" for what in bad[:5])
                if len(bad) > 5:
                    skipped.append(f"{file}: {len(bad) - 5} more cells that are not numbers left out")
                files_read += 1
                run.sources.append(file)
                for key, points in table.items():
                    if key.startswith(PREFIX) and key not in run.series:
                        run.series[key] = points
        for key, points in run.series.items():
            # One value per step, the last written: a run resumed from a checkpoint logs its steps again.
            run.series[key] = sorted(dict(points).items())
        if run.series:
            runs.append(run)
    if not runs:
        if skipped:
            raise ReportError(
                f"No readable `gpumem/` metrics under '{root}': {len(skipped)} file(s) skipped:\n  "
                + "\n  ".join(skipped)
            )
        raise ReportError(
            f"No `gpumem/` metrics under '{root}' ({files_read} readable log file(s)). Log with `MemoryMonitor`"
            " (and a TensorBoardLogger or CSVLogger) first; point LOGDIR at the logger's save_dir or a version"
            " directory."
        )
    return LoadResult(runs=runs, skipped=skipped, files_read=files_read)


def _read_csv(path: Path, bad: list[str] | None = None) -> dict[str, Series]:
    """``CSVLogger``'s ``metrics.csv``: one row per ``log_metrics`` call, a ``step`` column, empty cells.

    A cell that is not a finite number is left out and described in ``bad`` (the rest of the file is kept).
    """
    table: dict[str, Series] = {}
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames is None or "step" not in reader.fieldnames:
            raise ValueError("not a CSVLogger metrics file (no `step` column)")
        for row in reader:
            line = reader.line_num
            step_text = row.get("step") or ""
            if not step_text:
                continue
            try:
                step = int(float(step_text))  # OverflowError for inf, ValueError for nan and text
            except (ValueError, OverflowError):
                if bad is not None:
                    bad.append(f"line {line}: step {step_text!r} is not a finite number (row left out)")
                continue
            for key, text in row.items():
                if key is None or key == "step" or not text or not key.startswith(PREFIX):
                    continue
                try:
                    value = float(text)
                    if not math.isfinite(value):
                        raise ValueError(text)
                except ValueError:
                    if bad is not None:
                        bad.append(f"line {line}: {key} = {text!r} is not a finite number (cell left out)")
                    continue
                table.setdefault(key, []).append((step, value))
    return table
