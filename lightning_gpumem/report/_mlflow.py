"""MLflow runs from a local tracking store, read without MLflow: the file store and a SQLite store.

Lightning's ``MLFlowLogger`` writes to ``file:./mlruns`` by default, MLflow's file store (MLflow 3 asks for
``MLFLOW_ALLOW_FILE_STORE=true`` to write one, or a database: ``tracking_uri="sqlite:///mlflow.db"``).

- File store: ``<store>/<experiment id>/meta.yaml`` (the experiment's ``name``) and one directory per run,
  ``<experiment id>/<run id>/``, holding ``meta.yaml`` (``run_id``, ``run_name``, ``lifecycle_stage``) and
  ``metrics/<key>``, one line per value: ``<timestamp ms> <value> <step>``. A ``/`` in a key is a directory:
  ``metrics/gpumem/train_peak_allocated_gib``.
- SQLite store (a ``*.db``, ``*.sqlite`` or ``*.sqlite3`` file): the tables ``metrics`` (``key``, ``value``,
  ``step``, ``is_nan``, ``run_uuid``), ``runs`` (``name``, ``lifecycle_stage``, ``experiment_id``) and
  ``experiments`` (``name``), opened read-only.

Runs deleted in MLflow (``lifecycle_stage: deleted``, or in a deleted experiment) are named and not
reported. A remote tracking server is not read: point LOGDIR at the store's files.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

from lightning_gpumem import keys
from lightning_gpumem.report._reading import NotRegularFile, StoreRun, Table, read_log_file
from lightning_gpumem.report._text import printable

META = "meta.yaml"
METRICS = "metrics"
OWN_FOLDERS = ("metrics", "params", "tags")  # a file-store run's folders: no other logger's files in them
SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")
SQLITE_HEADER = b"SQLite format 3\0"
META_BYTES = 1024**2  # a meta.yaml is a few hundred bytes: one larger is read up to this
_DELETED = "deleted"


def is_run_directory(directory: Path, filenames: list[str], dirnames: list[str]) -> bool:
    """Whether a directory is a file-store run's: a ``meta.yaml`` naming a run and a ``metrics`` folder."""
    return META in filenames and METRICS in dirnames and _run_id(_meta(directory / META)) is not None


def _run_id(meta: dict[str, Any]) -> str | None:
    run_id = meta.get("run_id") or meta.get("run_uuid")
    return run_id if isinstance(run_id, str) and run_id else None


def is_sqlite_name(name: str) -> bool:
    """Whether a file's name may be a SQLite tracking store's (``mlflow.db``...)."""
    return name.lower().endswith(SQLITE_SUFFIXES)


def read_run_directory(directory: Path, skipped: list[str], inputs: list[Path]) -> StoreRun | None:
    """The ``gpumem/`` metrics of one file-store run, ``None`` where ``directory`` is not one or is deleted.

    Args:
        directory: a directory that :func:`is_run_directory`.
        skipped: the report's lines of what was passed over (a metric file that cannot be read, a deleted
            run).
        inputs: the report's input files: every file read or found here is added.
    """
    meta = _meta(directory / META)
    run_id = _run_id(meta)
    if run_id is None:
        return None
    inputs.append(directory / META)
    tables: list[tuple[Path, Table, list[str]]] = [(directory / META, {}, [])]
    for file, key in _metric_files(directory / METRICS, skipped):
        inputs.append(file)
        table = _read_metric_file(file, key, skipped)
        if table is not None:
            tables.append(table)
    experiment_meta = _meta(directory.parent / META)
    if experiment_meta:
        inputs.append(directory.parent / META)
        tables.insert(0, (directory.parent / META, {}, []))
    experiment = experiment_meta.get("name")
    experiment = experiment if isinstance(experiment, str) and experiment else directory.parent.name
    run_name = meta.get("run_name")
    if not isinstance(run_name, str) or not run_name:  # older MLflow: in the run's tags only
        tag = directory / "tags" / "mlflow.runName"
        run_name = _tag(tag)
        if run_name:
            inputs.append(tag)
            tables.append((tag, {}, []))
    name = f"{experiment}/{run_name or run_id}"
    if _DELETED in (meta.get("lifecycle_stage"), experiment_meta.get("lifecycle_stage")):
        if any(table for _, table, _ in tables):
            skipped.append(_deleted(directory, name))
        return None
    return StoreRun(name=name, path=directory, tables=tables)


def _deleted(where: Path, name: str) -> str:
    return f"{printable(str(where))}: run {printable(name)} is deleted in MLflow (not reported)"


def _meta(path: Path) -> dict[str, Any]:
    """A ``meta.yaml``'s top-level mapping; empty where it is missing, unreadable or not a mapping."""
    try:
        data, _ = read_log_file(path, META_BYTES)
        import yaml  # PyYAML: Lightning's requirement, so here too; imported only for an MLflow store
    except (OSError, ImportError):
        return {}
    try:
        # libyaml's safe loader where PyYAML has it: 8 times faster than the pure-Python one
        loaded = yaml.load(data, Loader=yaml.CSafeLoader) if yaml.__with_libyaml__ else yaml.safe_load(data)
    except (yaml.YAMLError, ValueError, RecursionError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _tag(path: Path) -> str:
    """A file-store tag's text (``tags/mlflow.runName``), empty where there is none."""
    try:
        data, _ = read_log_file(path, META_BYTES)
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace").strip()


def _metric_files(metrics: Path, skipped: list[str]) -> list[tuple[Path, str]]:
    """The files under ``metrics/gpumem/`` and their keys, in key order."""
    found = []

    def not_searched(error: OSError) -> None:
        skipped.append(
            f"directory {printable(str(error.filename))}: {printable(error.strerror or str(error))} (not"
            " searched)"
        )

    top = metrics / keys.PREFIX.rstrip("/")
    if not top.is_dir():
        return []
    for directory, _, names in os.walk(top, onerror=not_searched):
        for name in names:
            file = Path(directory, name)
            found.append((file, file.relative_to(metrics).as_posix()))
    return sorted(found, key=lambda pair: pair[1])


def _read_metric_file(file: Path, key: str, skipped: list[str]) -> tuple[Path, Table, list[str]] | None:
    """One metric file's values; a line not ``<timestamp> <value> [<step>]`` is left out and described.

    The last line, where it lacks its line break, is left out quietly: a run still writing it.
    """
    try:
        data, cut = read_log_file(file)
    except OSError as error:
        reason = str(error) if isinstance(error, NotRegularFile) else error.strerror or str(error)
        skipped.append(f"{printable(str(file))}: {printable(reason)}")
        return None
    if cut:
        skipped.append(
            f"{printable(str(file))}: larger than {len(data)} bytes; read up to there (the line cut there"
            " left out)"
        )
    points: list[tuple[int, float]] = []
    bad: list[str] = []
    for number, line in enumerate(data.split(b"\n")[:-1], start=1):
        parts = line.split()
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            value = float(parts[1])
            step = int(parts[2]) if len(parts) == 3 else 0
        except ValueError:
            text = line[:60].decode("utf-8", errors="replace")
            bad.append(f"line {number}: {text!r} is not `<timestamp> <value> <step>` (line left out)")
            continue
        if not -(2**63) <= step < 2**63:
            bad.append(f"line {number}: step {step} is out of range (beyond int64; line left out)")
            continue
        points.append((step, value))
    return file, {key: points} if points else {}, bad


def read_sqlite_store(file: Path, skipped: list[str], inputs: list[Path]) -> list[StoreRun]:
    """The runs of a SQLite tracking store with ``gpumem/`` metrics; none where ``file`` is not a store.

    A file that is not SQLite, or a SQLite database without MLflow's tables, is another program's and is
    passed over quietly; a store that cannot be read is named in ``skipped``, with why.

    Args:
        file: a ``*.db``, ``*.sqlite`` or ``*.sqlite3`` file.
        skipped: the report's lines of what was passed over.
        inputs: the report's input files: ``file`` is added where it is named like a store and is one (or
            cannot be told apart from one).
    """
    try:
        head, _ = read_log_file(file, len(SQLITE_HEADER))
    except OSError as error:
        inputs.append(file)
        reason = str(error) if isinstance(error, NotRegularFile) else error.strerror or str(error)
        skipped.append(f"{printable(str(file))}: {printable(reason)}")
        return []
    if head != SQLITE_HEADER:
        return []
    try:
        import sqlite3
    except ImportError:
        inputs.append(file)
        skipped.append(
            f"{printable(str(file))}: reading it needs Python's sqlite3 module (not in this Python)"
        )
        return []
    try:
        connection = sqlite3.connect(f"{file.absolute().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as error:
        inputs.append(file)
        skipped.append(f"{printable(str(file))}: {printable(str(error))}")
        return []
    try:
        return _read_store(connection, file, skipped, inputs)
    except sqlite3.Error as error:
        skipped.append(f"{printable(str(file))}: {printable(str(error))} (the store is skipped)")
        return []
    finally:
        connection.close()


def _read_store(connection: Any, file: Path, skipped: list[str], inputs: list[Path]) -> list[StoreRun]:
    tables = {name for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not {"metrics", "runs", "experiments"} <= tables:
        return []  # another program's database
    inputs.append(file)
    names = {
        run: (str(run_name or ""), str(experiment or experiment_id), _DELETED in (stage, experiment_stage))
        for run, run_name, stage, experiment_id, experiment, experiment_stage in connection.execute(
            "SELECT r.run_uuid, r.name, r.lifecycle_stage, r.experiment_id, e.name, e.lifecycle_stage"
            " FROM runs AS r LEFT JOIN experiments AS e ON r.experiment_id = e.experiment_id"
        )
    }
    if "tags" in tables:  # older MLflow kept a run's name in its tags only
        for run, tag in connection.execute("SELECT run_uuid, value FROM tags WHERE key = 'mlflow.runName'"):
            if run in names and not names[run][0] and tag:
                names[run] = (str(tag), *names[run][1:])
    by_run: dict[object, tuple[Table, list[str]]] = {}
    for run, key, value, step, is_nan in connection.execute(
        "SELECT run_uuid, key, value, step, is_nan FROM metrics WHERE key >= ? AND key < ? ORDER BY rowid",
        (keys.PREFIX, keys.PREFIX[:-1] + chr(ord(keys.PREFIX[-1]) + 1)),
    ):
        table, bad = by_run.setdefault(run, ({}, []))
        point = _point(key, value, step, is_nan, bad)
        if point is not None:
            table.setdefault(str(key), []).append(point)
    runs = []
    for run, (table, bad) in by_run.items():
        run_name, experiment, deleted = names.get(run, ("", "?", False))
        name = f"{experiment}/{run_name or run}"
        if deleted:
            skipped.append(_deleted(file, name))
            continue
        runs.append((name, str(run), table, bad))
    shared = Counter(name for name, *_ in runs)
    return [
        StoreRun(
            name=name if shared[name] == 1 else f"{name} (run {run})",
            path=file,
            tables=[(file, table, [f"run {run}: {what}" for what in bad])],
        )
        for name, run, table, bad in sorted(runs)
    ]


def _point(
    key: object, value: object, step: object, is_nan: object, bad: list[str]
) -> tuple[int, float] | None:
    """One ``metrics`` row as ``(step, value)``; one MLflow could not have written is noted in ``bad``."""
    if not isinstance(step, int) or not -(2**63) <= step < 2**63:
        bad.append(f"{printable(str(key))}: step {step!r} is not an int64 (value left out)")
        return None
    if is_nan:
        return step, math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        bad.append(f"{printable(str(key))} at step {step} = {value!r:.40} is not a number (value left out)")
        return None
    return step, float(value)
