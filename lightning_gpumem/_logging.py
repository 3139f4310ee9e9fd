"""Lightning glue for logging: which step to log at, writing to every logger, the progress bar.

Lightning exposes no public way to ask "will this training batch be logged, and at which step?". Its own
``_LoggerConnector.should_update_logs`` and loggers use ``fit_loop.epoch_loop._batches_that_stepped``, and skip
the micro-batches that only accumulate gradients (``fit_loop._should_accumulate()``); to make our curves line up
with the user's loss curves we use the same two. That private access lives here only (``batches_that_stepped``,
``is_accumulating``), falls back to public values if Lightning renames them, and
``tests/unit/test_lightning_internals.py`` fails loudly when that happens.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

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


def is_accumulating(trainer: pl.Trainer) -> bool:
    """Whether the current training batch only accumulates gradients (no optimizer step, not logged by Lightning)."""
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
    """Where a callback writes its files: ``dirpath``, else the first logger's ``log_dir``, else the root dir."""
    if dirpath is not None:
        return Path(dirpath)
    for logger in trainer.loggers:
        directory = getattr(logger, "log_dir", None)
        if directory:
            return Path(directory)
    return Path(trainer.default_root_dir)


def log_text(trainer: pl.Trainer, key: str, text: str, step: int) -> None:
    """Send ``text`` to the loggers that take text (TensorBoard's ``add_text``); the others have no text panel."""
    for logger in trainer.loggers:
        add_text = getattr(getattr(logger, "experiment", None), "add_text", None)
        if callable(add_text):
            add_text(key, text, global_step=step)
