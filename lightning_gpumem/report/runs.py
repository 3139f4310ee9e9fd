"""Find the runs under a log directory, read their scalars: every logger of Lightning's that writes files.

A *run* is one directory holding event files (``events.out.tfevents.*``) and/or a ``metrics.csv``, as
Lightning's ``TensorBoardLogger`` and ``CSVLogger`` write them (``<save_dir>/<name>/version_<n>/``). When
both loggers write to the same directory, the event files' values are kept and the CSV adds only the keys
they lack. ``MLFlowLogger``'s runs are read from a local tracking store (:mod:`._mlflow`: the file
store's run directories, a SQLite store's file) and ``WandbLogger``'s from each run's ``run-<id>.wandb``
(:mod:`._wandb`), neither needing its logger's package; those runs are named as their store names them
(``experiment/run``, ``project/run``).
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from lightning_gpumem import keys
from lightning_gpumem.report import _mlflow, _reading, _wandb
from lightning_gpumem.report._events import CorruptEventFile, read_scalars
from lightning_gpumem.report._reading import StoreRun, Table, read_log_file
from lightning_gpumem.report._text import printable

PREFIX = keys.PREFIX
EVENT_FILE_MARK = "tfevents"
CSV_NAME = "metrics.csv"
MAX_MAGNITUDE = 1e100  # no GiB figure or count comes near; beyond ~1.7e299 GiB the bytes overflow a float
NOTICES_PER_FILE = 5  # values left out that are named one by one; the rest of a file's are counted

Series = list[tuple[int, float]]


class ReportError(Exception):
    """A log directory that cannot be reported on: missing, or without any ``gpumem/`` metric."""


@dataclass
class Run:
    """The ``gpumem/`` scalars of one run: ``{key: [(step, value), ...]}`` sorted by step.

    Attributes:
        name: the run's directory relative to the log directory (its own name where it is the log directory);
            for an MLflow run ``<experiment>/<run name or id>``, for a W&B run ``<project>/<run name or id>``
            (followed by `` (<path>)`` where another run has the same name).
        path: the run's directory (a SQLite MLflow store's file, for its runs).
        series: every ``gpumem/`` key logged, with its ``(step, value)`` points in step order, one per step
            (the last written where a step was logged twice, as by a run resumed from a checkpoint).
        sources: the files read.
    """

    name: str
    path: Path
    series: dict[str, Series] = field(default_factory=dict)
    sources: list[Path] = field(default_factory=list)

    def values(self, key: str) -> list[float]:
        """The finite values logged under ``key`` below :data:`MAX_MAGNITUDE` (empty if never logged)."""
        return [value for _, value in self.series.get(key, []) if in_range(value)]

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
    """The runs found (with at least one ``gpumem/`` key), what was skipped and why, the log files found.

    Attributes:
        runs: the runs, in path order.
        skipped: one line per file, directory or value passed over, naming it and why.
        files_read: how many log files were read (whole or in part).
        inputs: every log file found (read or skipped): the report never writes over one.
    """

    runs: list[Run]
    skipped: list[str]
    files_read: int
    inputs: list[Path] = field(default_factory=list)


def in_range(value: float) -> bool:
    """Whether ``value`` is finite and below :data:`MAX_MAGNITUDE` (the values the report keeps)."""
    return math.isfinite(value) and abs(value) < MAX_MAGNITUDE


def load_runs(logdir: str | os.PathLike[str]) -> LoadResult:
    """Read every run under ``logdir``.

    Args:
        logdir: a directory written by Lightning's ``TensorBoardLogger``, ``CSVLogger``, ``MLFlowLogger``
            (a local store) or ``WandbLogger``, any level: the ``save_dir``, a ``name`` or ``version_<n>``
            directory, an MLflow store or one run's directory, ``wandb/`` or one run's directory.

    Returns:
        The runs with ``gpumem/`` metrics, in path order, and the files skipped (corrupt or unreadable) with
        why.

    Raises:
        ReportError: ``logdir`` does not exist or is not a directory, or no file under it holds a ``gpumem/``
            metric.
    """
    if not str(logdir).strip():
        raise ReportError(
            f"LOGDIR {str(logdir)!r}: expected a directory (a logger's save_dir or a version directory)."
        )
    root = Path(logdir)
    if not root.exists():
        raise ReportError(f"LOGDIR '{_shown(root)}' does not exist.")
    if not root.is_dir():
        raise ReportError(f"LOGDIR '{_shown(root)}' is not a directory.")
    runs: list[Run] = []
    skipped: list[str] = []
    inputs: list[Path] = []
    files_read = 0

    def not_searched(error: OSError) -> None:
        skipped.append(f"directory {_shown(error.filename)}: {error.strerror or error} (not searched)")

    owned: set[Path] = set()  # an MLflow run's own folders: its metrics are no other logger's files
    store_files: set[Path] = set()
    from_stores: list[Run] = []
    for directory, dirnames, names in sorted(os.walk(root, onerror=not_searched)):
        path = Path(directory)
        if owned and any(folder in owned for folder in (path, *path.parents)):
            continue
        found: list[StoreRun | None] = []
        if _mlflow.is_run_directory(path, names, dirnames):
            owned.update(path / folder for folder in _mlflow.OWN_FOLDERS)
            found.append(_mlflow.read_run_directory(path, skipped, inputs))
        for name in sorted(names, key=_natural):
            if _mlflow.is_sqlite_name(name):
                found.extend(_mlflow.read_sqlite_store(Path(directory, name), skipped, inputs))
            elif _wandb.is_run_log(name):
                inputs.append(Path(directory, name))
                found.append(_wandb.read_run_log(Path(directory, name), skipped))
        for store_run in found:
            if store_run is not None:
                run = _from_store(store_run, skipped)
                store_files.update(run.sources)
                if run.series:
                    runs.append(run)
                    from_stores.append(run)
        events = sorted(
            (name for name in names if EVENT_FILE_MARK in name and name.startswith("events.out")),
            key=_natural,
        )
        files = [Path(directory, name) for name in events]
        if CSV_NAME in names:
            files.append(Path(directory, CSV_NAME))
        if not files:
            continue
        name = str(path.relative_to(root)) if path != root else (root.resolve().name or str(root))
        run = Run(name=name, path=path)
        for file in files:
            inputs.append(file)
            scalars = _read_file(file, skipped)
            if scalars is None:
                continue
            files_read += 1
            run.sources.append(file)
            for key, points in scalars.items():
                # The event files' values first; a CSV beside them adds only the keys they lack.
                if key.startswith(PREFIX) and (file.name != CSV_NAME or key not in run.series):
                    run.series.setdefault(key, []).extend(points)
        _one_per_step(run)
        if run.series:
            runs.append(run)
    files_read += len(store_files)
    _tell_apart(runs, from_stores, root)
    if not runs:
        if skipped:
            raise ReportError(
                f"No readable `gpumem/` metrics under '{_shown(root)}': {len(skipped)} file(s) skipped:\n  "
                + "\n  ".join(skipped)
            )
        raise ReportError(
            f"No `gpumem/` metrics under '{_shown(root)}' ({files_read} readable log file(s)). Log with"
            " `MemoryMonitor` (and a TensorBoardLogger, CSVLogger, WandbLogger or MLFlowLogger with a local"
            " store) first; point LOGDIR at the logger's save_dir or a run's directory."
        )
    return LoadResult(runs=runs, skipped=skipped, files_read=files_read, inputs=inputs)


def _from_store(found: StoreRun, skipped: list[str]) -> Run:
    """A tracking store's run, its values checked as an event file's are."""
    run = Run(name=found.name, path=found.path)
    for file, table, bad in found.tables:
        run.sources.append(file)
        _name_left_out(file, [*bad, *_drop_out_of_range(table)], skipped)
        for key, points in table.items():
            if key.startswith(PREFIX):
                run.series.setdefault(key, []).extend(points)
    _one_per_step(run)
    return run


def _one_per_step(run: Run) -> None:
    """One value per step, the last written: a run resumed from a checkpoint logs its steps again."""
    for key, points in run.series.items():
        run.series[key] = sorted(dict(points).items())


def _tell_apart(runs: list[Run], from_stores: list[Run], root: Path) -> None:
    """A store's run whose name another run has too is followed by its path: `` (mlruns/1/<id>)``.

    The other runs are named by their directories, which differ.
    """
    counts = Counter(run.name for run in runs)
    for run in from_stores:
        if counts[run.name] > 1:
            where = run.path.relative_to(root) if run.path.is_relative_to(root) else run.path
            run.name = f"{run.name} ({where})"


def _natural(name: str) -> list[str | int]:
    """Sort key: the numbers in a name compared as numbers: a writer's ``.10`` after its ``.9``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _shown(path: object) -> str:
    """A path as the report prints it: control characters escaped."""
    return printable(str(path))


def _read_file(file: Path, skipped: list[str]) -> dict[str, Series] | None:
    """The scalars of one event file or ``metrics.csv``, ``None`` where it cannot be read.

    What it passes over goes to ``skipped``: the file itself, the part past the size bound or a damaged
    record, and values that are not finite numbers or are out of range.
    """
    try:
        data, cut = read_log_file(file)
    except OSError as error:  # its reason only: `str(error)` would name the file again, as a `repr`
        skipped.append(f"{_shown(file)}: {printable(error.strerror or str(error))}")
        return None
    if cut:
        what = "row" if file.name == CSV_NAME else "record"
        skipped.append(
            f"{_shown(file)}: larger than {_reading.MAX_FILE_BYTES} bytes; read up to there (the {what} cut"
            " there left out)"
        )
    bad: list[str] = []
    if file.name == CSV_NAME:
        try:
            table = _read_csv(data[: data.rfind(b"\n") + 1] if cut else data, bad)
        except (ValueError, csv.Error) as error:
            skipped.append(f"{_shown(file)}: {printable(str(error))}")
            return None
    else:
        try:
            table = read_scalars(file, data)
        except CorruptEventFile as error:
            table = error.scalars
            kept = sum(map(len, table.values()))
            skipped.append(
                f"{printable(str(error))}; the rest of the file is skipped ({kept} scalars before it are"
                " kept)"
            )
        bad.extend(_drop_out_of_range(table))
    _name_left_out(file, bad, skipped)
    return table


def _drop_out_of_range(table: Table) -> list[str]:
    """Leave out of ``table`` the finite values beyond :data:`MAX_MAGNITUDE`; returns them, described."""
    bad: list[str] = []
    for key, points in table.items():
        bad.extend(
            f"{key} at step {step} = {value!r} is out of range (beyond ±{MAX_MAGNITUDE:g}; value left out)"
            for step, value in points
            if math.isfinite(value) and not in_range(value)
        )
        table[key] = [(step, value) for step, value in points if not math.isfinite(value) or in_range(value)]
    return bad


def _name_left_out(file: Path, bad: list[str], skipped: list[str]) -> None:
    """Name the first :data:`NOTICES_PER_FILE` values left out of ``file`` in ``skipped``, count the rest."""
    skipped.extend(f"{_shown(file)}, {printable(what)}" for what in bad[:NOTICES_PER_FILE])
    if len(bad) > NOTICES_PER_FILE:
        skipped.append(f"{_shown(file)}: {len(bad) - NOTICES_PER_FILE} more values left out, as above")


def _read_csv(data: bytes, bad: list[str] | None = None) -> dict[str, Series]:
    """``CSVLogger``'s ``metrics.csv`` (UTF-8).

    One row per ``log_metrics`` call, a ``step`` column, empty cells.

    A cell that is not a finite number below :data:`MAX_MAGNITUDE`, or a row whose step is not an integer
    that an int64 holds (as TensorBoard's steps), is left out and described in ``bad`` (the rest of the file
    is kept).
    """
    table: dict[str, Series] = {}
    with io.StringIO(data.decode("utf-8"), newline="") as handle:
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
            if not -(2**63) <= step < 2**63:
                if bad is not None:
                    bad.append(
                        f"line {line}: step {step_text!r} is out of range (beyond int64; row left out)"
                    )
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
                if not in_range(value):
                    if bad is not None:
                        bad.append(
                            f"line {line}: {key} = {text!r} is out of range (beyond ±{MAX_MAGNITUDE:g}; cell"
                            " left out)"
                        )
                    continue
                table.setdefault(key, []).append((step, value))
    return table
