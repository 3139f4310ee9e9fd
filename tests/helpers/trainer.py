"""The quiet Trainer of the tests: on the CPU, no logger, no checkpoints, no progress bar, no model summary.

`quiet_trainer(**overrides)` is ``Trainer(**QUIET, **overrides)``: a test names what its fit needs (steps, callbacks,
a logger, a GPU) and nothing else. `quiet_trainer(root, ...)` also sets ``default_root_dir=root``; without a root the
Trainer keeps Lightning's default (the working directory), as a test that never set one had it. The `make_trainer`
fixture is `quiet_trainer` with the test's `tmp_path` as the root. `trainer_class=pytorch_lightning.Trainer` builds
the older namespace's Trainer with the same settings. `csv_epoch_trainer` is the fit the fake-allocator tests read
back: one short epoch, every step logged to a CSVLogger.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

QUIET: dict[str, Any] = {
    "accelerator": "cpu",
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def quiet_trainer(
    root: str | os.PathLike[str] | None = None,
    /,
    *,
    trainer_class: Callable[..., Any] = Trainer,
    **overrides: Any,
) -> Any:
    """``trainer_class(**QUIET, default_root_dir=root, **overrides)``: each override replaces the quiet setting.

    Lightning's own default of a setting (``logger=True``, ``enable_checkpointing=True``, ...) is passed as itself:
    Lightning reads ``True`` as it reads the ``None`` it defaults to.
    """
    options = dict(QUIET)
    if root is not None:
        options["default_root_dir"] = root
    options.update(overrides)
    return trainer_class(**options)


def csv_epoch_trainer(log_dir: str | os.PathLike[str], callbacks: list, **overrides: Any) -> Trainer:
    """`quiet_trainer` for one epoch of 20 training and 2 validation batches without a sanity check, every step
    logged to a ``CSVLogger(log_dir)`` (and no ``default_root_dir``)."""
    options = dict(
        max_epochs=1,
        limit_train_batches=20,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=CSVLogger(log_dir),
        callbacks=callbacks,
        log_every_n_steps=1,
    )
    return quiet_trainer(**{**options, **overrides})


@pytest.fixture
def make_trainer(tmp_path) -> Callable[..., Any]:
    """`quiet_trainer` rooted in the test's `tmp_path`: ``make_trainer(max_steps=2, callbacks=[...])``."""
    return functools.partial(quiet_trainer, tmp_path)
