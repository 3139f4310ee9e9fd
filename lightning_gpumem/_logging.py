"""Lightning glue for logging: which step to log at, writing to every logger, the progress bar.

Lightning exposes no public way to ask "will this training batch be logged, and at which step?". Its own
``_LoggerConnector.should_update_logs`` and loggers use ``fit_loop.epoch_loop._batches_that_stepped``, and skip
the micro-batches that only accumulate gradients (``fit_loop._should_accumulate()``); to make our curves line up
with the user's loss curves we use the same two. That private access lives here only (``batches_that_stepped``,
``is_accumulating``), falls back to public values if Lightning renames them, and
``tests/unit/test_lightning_internals.py`` fails loudly when that happens.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl


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
    """Steps from the batch logged at ``step`` (:func:`batches_that_stepped`) to the next logging step after it."""
    return every_n_steps - (step + 1) % every_n_steps if every_n_steps > 0 else None


def is_accumulating(trainer: pl.Trainer) -> bool:
    """Whether the current training batch only accumulates gradients (no optimizer step, not logged by Lightning)."""
    if trainer.accumulate_grad_batches == 1:
        return False  # what `_should_accumulate()` says then, without its few µs on every batch
    # Private: Lightning's `_FitLoop._should_accumulate()` (see the module docstring).
    should_accumulate = getattr(trainer.fit_loop, "_should_accumulate", None)
    if should_accumulate is None or not trainer.lightning_module.automatic_optimization:
        return False
    return bool(should_accumulate())


def log_to_loggers(trainer: pl.Trainer, metrics: Mapping[str, float], step: int) -> None:
    """Send ``metrics`` to every logger in ``trainer.loggers`` (loggers write on global rank zero only)."""
    if not metrics:
        return
    for logger in trainer.loggers:
        logger.log_metrics(dict(metrics), step=step)


def show_in_progress_bar(trainer: pl.Trainer, key: str, text: str) -> None:
    """Show ``key=text`` in the progress bar until it is replaced.

    ``trainer.progress_bar_metrics`` returns the dictionary the progress bars read on refresh (``self.log`` cannot
    show text). Reading it converts the values logged with ``prog_bar=True`` to floats, as every progress-bar
    refresh does anyway, so it is skipped when there is no progress bar.
    """
    if trainer.progress_bar_callback is None:
        return
    trainer.progress_bar_metrics[key] = text  # type: ignore[assignment]  # the bars show str values too


def log_dir(trainer: pl.Trainer, dirpath: str | Path | None = None) -> Path:
    """Where a callback writes its files: ``dirpath``, else ``trainer.log_dir``.

    ``trainer.log_dir`` is the first logger's ``log_dir`` (TensorBoard, CSV), else its ``save_dir`` (MLflow, W&B),
    else ``default_root_dir``. Worked out here as Lightning does, without its broadcast, so rank zero alone may ask.
    """
    if dirpath is not None:
        return Path(dirpath)
    if trainer.loggers:
        first = trainer.loggers[0]
        directory = getattr(first, "log_dir", None) or getattr(first, "save_dir", None)
        if directory:
            return Path(directory)
    return Path(trainer.default_root_dir)


def log_table(
    trainer: pl.Trainer,
    key: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    step: int,
    text: str,
    files: bool = True,
) -> list[Path]:
    """Send a table to every logger, each the way it takes tables; returns the files written.

    TensorBoard gets ``text`` (Markdown) in its text tab, W&B a table (``log_table``), MLflow a Markdown artifact
    (``log_text``); every other logger (``CSVLogger``, custom ones) a CSV file ``gpumem_<name>.csv`` in its
    ``log_dir`` (or ``save_dir``, else ``trainer.log_dir``), one file per directory, unless ``files`` is off (the
    caller writes its own). Call it on global rank zero.
    """
    name = key.split("/", 1)[-1]
    written: list[Path] = []
    for logger in trainer.loggers:
        experiment = getattr(logger, "experiment", None)
        add_text = getattr(experiment, "add_text", None)  # TensorBoard (and tensorboardX)
        wandb_table = getattr(logger, "log_table", None)  # W&B
        mlflow_text, run_id = getattr(experiment, "log_text", None), getattr(logger, "run_id", None)  # MLflow
        if callable(add_text):
            add_text(key, text, global_step=step)
        elif callable(wandb_table):
            wandb_table(key=key, columns=list(columns), data=[list(row) for row in rows], step=step)
        elif callable(mlflow_text) and run_id:
            mlflow_text(run_id, text, f"gpumem_{name}.md")
        elif files:
            directory = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
            path = (Path(directory) if directory else log_dir(trainer)) / f"gpumem_{name}.csv"
            if path not in written:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(_csv(columns, rows), encoding="utf-8")
                written.append(path)
    return written


def _csv(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(columns)
    writer.writerows(rows)
    return buffer.getvalue()
