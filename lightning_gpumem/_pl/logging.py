"""Lightning glue for logging: which step to log at, writing to every logger, the progress bar.

Lightning exposes no public way to ask "will this training batch be logged, and at which step?". Its own
``_LoggerConnector.should_update_logs`` and loggers use ``fit_loop.epoch_loop._batches_that_stepped``, and
skip the micro-batches that only accumulate gradients (``fit_loop._should_accumulate()``); to make our curves
line up with the user's loss curves we use the same two. That private access lives here only
(``batches_that_stepped``, ``is_accumulating``), falls back to public values if Lightning renames them, and
``tests/pl/test_lightning_internals.py`` fails loudly when that happens.
"""

from __future__ import annotations

import csv
import io
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_gpumem._core.files import unique_path, write_atomic


def batches_that_stepped(trainer: pl.Trainer) -> int:
    """Step number Lightning's loggers use for the current training batch."""
    # Private: Lightning's `_TrainingEpochLoop._batches_that_stepped` (see the module docstring).
    value = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", None)
    return int(value) if isinstance(value, int) else int(trainer.global_step)


def is_logging_step(trainer: pl.Trainer, every_n_steps: int) -> bool:
    """Whether the training batch about to run (or running) is a logging step, as Lightning decides it."""
    if every_n_steps <= 0:
        return False
    return (batches_that_stepped(trainer) + 1) % every_n_steps == 0 or trainer.should_stop


def steps_to_next_log(step: int, every_n_steps: int) -> int | None:
    """Steps from the batch logged at ``step`` (:func:`batches_that_stepped`) to the next logging step."""
    return every_n_steps - (step + 1) % every_n_steps if every_n_steps > 0 else None


def is_accumulating(trainer: pl.Trainer) -> bool:
    """Whether this training batch only accumulates gradients (no optimizer step; Lightning logs none)."""
    if trainer.accumulate_grad_batches == 1:
        return False  # what `_should_accumulate()` says then, without its few µs on every batch
    # Private: Lightning's `_FitLoop._should_accumulate()` (see the module docstring).
    should_accumulate = getattr(trainer.fit_loop, "_should_accumulate", None)
    if should_accumulate is None or not trainer.lightning_module.automatic_optimization:
        return False
    return bool(should_accumulate())


def log_to_loggers(trainer: pl.Trainer, metrics: Mapping[str, float], step: int) -> None:
    """Send ``metrics`` to every logger in ``trainer.loggers`` (loggers write on global rank zero only).

    A logger whose ``log_metrics`` raises (a tracker's network error, a full disk) is named in one warning,
    the first time; the other loggers still get the metrics and the run goes on: metrics never end it.
    """
    if not metrics:
        return
    for logger in trainer.loggers:
        try:
            logger.log_metrics(dict(metrics), step=step)
        except Exception as error:
            _warn_once(
                logger,
                f"lightning_gpumem: could not log `gpumem/*` metrics to {type(logger).__name__}"
                f" ({error!r});",
            )


class _ByIdentity:
    """What is known of each logger, by identity, never by its ``__hash__`` or ``__eq__``.

    A custom logger's may raise, or call two loggers equal. A logger is held by a weak reference, or, where
    it takes none, by itself (an ``id`` alone could be reused by a later logger).
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Any, Any]] = {}  # id -> (weak reference or the logger, value)

    def get(self, logger: object) -> Any:
        entry = self._entries.get(id(logger))
        if entry is None:
            return None
        held, value = entry
        return value if (held() if isinstance(held, weakref.ref) else held) is logger else None

    def put(self, logger: object, value: Any) -> Any:
        key = id(logger)
        try:
            held: Any = weakref.ref(logger, lambda _: self._entries.pop(key, None))
        except TypeError:  # no weak references: held as it is
            held = logger
        self._entries[key] = (held, value)
        return value


_warned = _ByIdentity()  # loggers already named in a warning


def _warn_once(logger: object, what: str) -> None:
    if _warned.get(logger) is not None:
        return
    _warned.put(logger, True)
    rank_zero_warn(f"{what} training goes on; further failures of this logger are not reported.")


def show_in_progress_bar(trainer: pl.Trainer, key: str, text: str) -> None:
    """Show ``key=text`` in the progress bar until it is replaced.

    ``trainer.progress_bar_metrics`` returns the dictionary the progress bars read on refresh (``self.log``
    cannot show text). Reading it converts the values logged with ``prog_bar=True`` to floats, as every
    progress-bar refresh does anyway, so it is skipped when there is no progress bar.
    """
    if trainer.progress_bar_callback is None:
        return
    trainer.progress_bar_metrics[key] = text  # type: ignore[assignment]  # the bars show str values too


def run_dir(trainer: pl.Trainer, dirpath: str | Path | None = None) -> Path:
    """Where a callback writes its files: ``dirpath``, else the first logger's run directory.

    That is :func:`logger_run_dir` of ``trainer.loggers[0]``, else ``default_root_dir``: ``trainer.log_dir``
    where the first logger is a TensorBoard or CSV logger (worked out without its broadcast, so rank zero
    alone may ask), and for MLflow, W&B and others without a ``log_dir`` the directory of this run, as
    ``ModelCheckpoint`` places its ``checkpoints/``: each run's files in that run, none in a root that every
    run shares.
    """
    if dirpath is not None:
        return Path(dirpath)
    if trainer.loggers:
        return logger_run_dir(trainer, trainer.loggers[0])
    return Path(trainer.default_root_dir)


def logger_run_dir(trainer: pl.Trainer, logger: object) -> Path:
    """The directory of ``logger``'s current run: its ``log_dir``, else ``<save_dir>/<name>/<version>``.

    ``save_dir`` falls back to ``default_root_dir``, and a version that is not a string is ``version_<n>``
    (the rules of ``ModelCheckpoint``). A logger that names no run (no name or version) gives its
    ``save_dir`` itself.
    """
    try:
        directory = getattr(logger, "log_dir", None)
    except Exception:  # a custom logger's property that fails: placed as one without a `log_dir`
        directory = None
    if directory:
        return Path(directory)
    try:
        root = Path(getattr(logger, "save_dir", None) or trainer.default_root_dir)
    except Exception:
        root = Path(trainer.default_root_dir)
    try:
        name, version = getattr(logger, "name", None), getattr(logger, "version", None)
    except Exception:  # a custom logger's abstract property: no run to name
        return root
    if name is None or version is None or version == "":
        return root
    return root / str(name) / (version if isinstance(version, str) else f"version_{version}")


def log_table(
    trainer: pl.Trainer,
    key: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    step: int,
    text: str,
    owner: str = "lightning_gpumem",
    has_file: Path | None = None,
) -> list[Path]:
    """Send a table to every logger, each the way it takes tables; returns the files written.

    TensorBoard gets ``text`` (Markdown) in its text tab, W&B a table (``log_table``), MLflow a Markdown
    artifact (``log_text``); every other logger (``CSVLogger``, custom ones) a CSV file ``gpumem_<name>.csv``
    in its run directory (:func:`logger_run_dir`), one file per directory, none in ``has_file`` (the caller
    wrote its own file there). A file that logger wrote before in this process is replaced; a name another
    run took (a reused ``CSVLogger(version=...)`` directory) gets ``-v1``, ``-v2``... A logger or a disk that
    fails is named in a warning (by ``owner``) and the others still get the table: a table never ends the
    run. Call it on global rank zero.
    """
    name = key.split("/", 1)[-1]
    written: list[Path] = []
    seen: set[Path] = set()
    for logger in trainer.loggers:
        try:
            experiment = getattr(logger, "experiment", None)
            add_text = getattr(experiment, "add_text", None)  # TensorBoard (and tensorboardX)
            wandb_table = getattr(logger, "log_table", None)  # W&B
            # MLflow
            mlflow_text, run_id = getattr(experiment, "log_text", None), getattr(logger, "run_id", None)
            if callable(add_text):
                add_text(key, text, global_step=step)
            elif callable(wandb_table):
                wandb_table(key=key, columns=list(columns), data=[list(row) for row in rows], step=step)
            elif callable(mlflow_text) and run_id:
                mlflow_text(run_id, text, f"gpumem_{name}.md")
            else:
                path = logger_run_dir(trainer, logger) / f"gpumem_{name}.csv"
                if path not in seen and path.parent != has_file:
                    seen.add(path)
                    written.append(write_atomic(_own_path(logger, path), _csv(columns, rows)))
        except Exception as error:
            rank_zero_warn(
                f"{owner}: could not write the table `{key}` to {type(logger).__name__} ({error!r})."
            )
    return written


_own_files = _ByIdentity()  # logger -> {name asked for: file it wrote}


def _own_path(logger: object, path: Path) -> Path:
    """Where ``logger``'s table ``path`` goes: the file it wrote under that name before, else a free name."""
    own = _own_files.get(logger)
    if own is None:
        own = _own_files.put(logger, {})
    if path not in own or not own[path].parent.is_dir():
        own[path] = unique_path(path)
    return own[path]


def _csv(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(columns)
    writer.writerows(rows)
    return buffer.getvalue()
