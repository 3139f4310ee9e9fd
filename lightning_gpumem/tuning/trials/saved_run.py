"""What a fit had before the trials, captured once and put back exactly: :class:`SavedRun`.

The trials run the user's own fit loop, so the session saves what a trial changes (loop progress and restart
flags, limits, loggers and callbacks, module modes and ``requires_grad``, logged metrics and their result
collections, torchmetrics states, RNG streams, the pending checkpoint, the running hook's name) in one
record, and :meth:`SavedRun.restore` puts each back. Lightning has no public API for most of these: each
private access carries a ``# private:`` comment, and ``tests/pl/test_lightning_internals.py`` fails loudly
when an upgrade breaks one.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_gpumem.tuning.trials.loaders import dataloaders_loaded, loader_generators
from lightning_gpumem.tuning.trials.model_state import ModelState

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
    np = None  # type: ignore[assignment]

# private: what `metric_state` leaves out
TORCHMETRICS_COUNTERS = ("_update_count", "_computed", "_forward_cache")


@dataclass
class SavedRun:
    """The fit as it was before the trials (see the module docstring); :meth:`restore` puts it back."""

    hook: str | None
    rng: dict[str, Any]
    loaded: bool
    loaded_checkpoint: Any
    loggers: list[Any]
    callbacks: list[Any]
    limits: tuple[Any, Any]
    should_stop: bool
    max: tuple[int, int | None]
    loop_state: dict[str, Any]
    loop_flags: dict[Any, dict[str, bool]]
    val_has_run: bool
    modes: dict[torch.nn.Module, bool]
    requires_grad: dict[torch.nn.Parameter, bool]
    metrics: dict[str, Any]
    torchmetrics: list[tuple[Any, dict[str, Any]]]

    @classmethod
    def capture(cls, trainer: pl.Trainer) -> SavedRun:
        """Save the fit's state; empties its result collections for the trials.

        See :func:`_logged_metrics`.
        """
        module = trainer.lightning_module
        fit_loop = trainer.fit_loop
        # private: holds the pending checkpoint of `fit(ckpt_path=...)`
        connector = trainer._checkpoint_connector
        return cls(
            # private attribute of LightningModule, set by Lightning's hook calls
            hook=module._current_fx_name,
            rng=capture_rng(trainer),
            loaded=dataloaders_loaded(trainer),
            loaded_checkpoint=connector._loaded_checkpoint,  # private
            loggers=trainer.loggers,
            callbacks=trainer.callbacks,  # type: ignore[attr-defined]
            limits=(trainer.limit_train_batches, trainer.limit_val_batches),
            should_stop=trainer.should_stop,
            max=(fit_loop.epoch_loop.max_steps, fit_loop.max_epochs),
            loop_state=deepcopy(fit_loop.state_dict()),
            loop_flags=loop_flags(fit_loop),
            # private: ModelCheckpoint raises on a missing monitor key once validation has run
            val_has_run=getattr(fit_loop.epoch_loop.val_loop, "_has_run", False),
            modes={m: m.training for m in module.modules()},
            requires_grad={p: p.requires_grad for p in module.parameters()},
            metrics=_logged_metrics(trainer),
            torchmetrics=_torchmetrics_states(module),
        )

    def restore(
        self, trainer: pl.Trainer, model_state: ModelState | None, owner: object | None = None
    ) -> None:
        """Put the fit back as it was, ``model_state`` in between, in dependency order.

        ``model_state`` is the weights, optimizers... A model state kept in a checkpoint file is restored
        through Lightning, which hands every callback its saved state: ``owner`` (the callback that runs the
        trials) is left out of those callbacks, as the state is its own.
        """
        trainer.loggers = self.loggers
        trainer.callbacks = [c for c in self.callbacks if c is not owner]  # type: ignore[attr-defined]
        trainer.limit_train_batches, trainer.limit_val_batches = self.limits
        fit_loop = trainer.fit_loop
        fit_loop.epoch_loop.max_steps, fit_loop.max_epochs = self.max
        try:
            if model_state is not None:
                model_state.restore()
        finally:  # the owner is back among the callbacks even if the restore fails
            trainer.callbacks = self.callbacks  # type: ignore[attr-defined]
        fit_loop.load_state_dict(deepcopy(self.loop_state))
        set_loop_flags(self.loop_flags)  # `load_state_dict` marked the loops as restarting
        fit_loop.epoch_loop.val_loop._has_run = self.val_has_run  # private, see `capture`
        trainer.should_stop = self.should_stop
        for module, training in self.modes.items():
            module.training = training
        for param, flag in self.requires_grad.items():
            param.requires_grad_(flag)
        _restore_logged_metrics(trainer, self.metrics)
        _restore_torchmetrics_states(self.torchmetrics)
        trainer._checkpoint_connector._loaded_checkpoint = self.loaded_checkpoint  # private
        trainer.lightning_module._current_fx_name = self.hook  # private, see `capture`


# ---------------------------------------------------------------------- RNG
def capture_rng(trainer: pl.Trainer) -> dict[str, Any]:
    """RNG states of Python, NumPy, torch, every CUDA device and every generator the dataloaders hold."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    state["generators"] = [(g, g.get_state()) for g in loader_generators(trainer)]
    return state


@contextlib.contextmanager
def rng_kept(trainer: pl.Trainer) -> Iterator[None]:
    """The RNG states as they were before the block (a trace's first batches drew from them)."""
    state = capture_rng(trainer)
    try:
        yield
    finally:
        restore_rng(state)


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the RNG states :func:`capture_rng` saved."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    for generator, generator_state in state["generators"]:
        generator.set_state(generator_state)


# ---------------------------------------------------------------------- metrics
def _result_collections(trainer: pl.Trainer) -> list[dict[str, Any]]:
    """The training and validation loops' `_ResultCollection`s (private): dicts of key -> logged metric."""
    loops = (trainer.fit_loop.epoch_loop, trainer.fit_loop.epoch_loop.val_loop)
    return [results for loop in loops if (results := getattr(loop, "_results", None)) is not None]


def _logged_metrics(trainer: pl.Trainer) -> dict[str, Any]:
    """Save the metrics the fit logged so far and empty the result collections for the trials.

    A result collection remembers the arguments a key was first logged with; trials log without
    ``sync_dist``, so a key the fit logged with it, or a trial key the fit then logs with it, would make
    Lightning raise.
    """
    connector = trainer._logger_connector  # private: the dicts behind `trainer.callback_metrics` and friends
    collections = _result_collections(trainer)
    saved = {
        "dicts": (
            dict(connector._callback_metrics),
            dict(connector._logged_metrics),
            dict(connector._progress_bar_metrics),
        ),
        "results": [(results, dict(results)) for results in collections],
    }
    for results in collections:
        results.clear()
    return saved


def _restore_logged_metrics(trainer: pl.Trainer, saved: dict[str, Any]) -> None:
    connector = trainer._logger_connector  # private, see `_logged_metrics`
    connector._callback_metrics, connector._logged_metrics, connector._progress_bar_metrics = (
        dict(d) for d in saved["dicts"]
    )
    for results, entries in saved["results"]:
        results.clear()  # no trial key, value or epoch aggregate reaches the fit
        results.update(entries)


def _torchmetrics_states(module: torch.nn.Module) -> list[tuple[Any, dict[str, Any]]]:
    """The accumulated state of every torchmetrics ``Metric`` in ``module``.

    Duck-typed: ``metric_state``, public.
    """
    states = []
    for child in module.modules():
        state = getattr(child, "metric_state", None)
        if isinstance(state, dict) and hasattr(child, "reset"):
            extra = {name: getattr(child, name) for name in TORCHMETRICS_COUNTERS if hasattr(child, name)}
            states.append((child, deepcopy({**state, **extra})))
    return states


def _restore_torchmetrics_states(states: list[tuple[Any, dict[str, Any]]]) -> None:
    for metric, state in states:
        for name, value in state.items():
            setattr(metric, name, value)


# ---------------------------------------------------------------------- loops
# the last two: Lightning 2.5+
LOOP_FLAGS = ("_restarting", "_loaded_from_state_dict", "_resuming_from_checkpoint")


def loop_flags(loop: Any) -> dict[Any, dict[str, bool]]:
    """The restart flags of ``loop`` and every loop inside it (private attributes of Lightning's `_Loop`)."""
    flags = {loop: {name: getattr(loop, name) for name in LOOP_FLAGS if hasattr(loop, name)}}
    for child in vars(loop).values():
        if isinstance(child, pl.loops.loop._Loop):
            flags.update(loop_flags(child))
    return flags


def set_loop_flags(flags: dict[Any, dict[str, bool]]) -> None:
    """Set the loops' restart flags directly.

    ``_FitLoop.restarting``'s setter forces True for ``max_steps`` runs.
    """
    for loop, values in flags.items():
        for name, value in values.items():
            setattr(loop, name, value)
