"""Trials on the user's own Trainer: every private Lightning access of the tuner lives in this module.

Why the real loop: a trial must cost what training costs (precision plugin, strategy wrapper, closures,
gradient accumulation and clipping, the optimizer step, ``self.log`` in the user's steps), and only
Lightning's loop does all of that. Lightning has no public API to run a few steps at another batch size and
undo them, so, like its own ``BatchSizeFinder`` (``lightning/pytorch/tuner/batch_size_scaling.py``), this
module reaches into loop attributes. Each access carries a ``# private:`` comment, and
``tests/pl/test_lightning_internals.py`` fails loudly when an upgrade breaks one.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from copy import deepcopy
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from lightning_gpumem._hw.oom import is_oom_error
from lightning_gpumem._pl.compat import Callback
from lightning_gpumem._pl.patching import Patches, with_log_argument
from lightning_gpumem.tuning.trials.loaders import (
    dataloaders_loaded,
    dataset_length,
    join_workers,
    reload_dataloaders,
    set_sampler_epochs,
    train_source_is_module,
    unload_dataloaders,
)
from lightning_gpumem.tuning.trials.model_state import ModelState, keeps_whole_model
from lightning_gpumem.tuning.trials.saved_run import SavedRun, capture_rng, restore_rng, set_loop_flags

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
    np = None  # type: ignore[assignment]

SCALE_HOOKS = ("on_fit_start", "on_train_epoch_start")
"""The hooks ``BatchSizeTuner.scale`` may run from: before the fit loop, or before an epoch's data is
iterated."""

# Module hooks the fit runs once per fit, epoch or validation run; a trial must not run them again.
# the module's once-per-loop hooks, and the scheduler step (a trial's schedule is discarded)
_SKIPPED_HOOKS = (
    "lr_scheduler_step",
    "on_train_start",
    "on_train_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_validation_start",
    "on_validation_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
)


class TrialStop(Exception):
    """Raised from the trial callback to leave the fit loop once a trial's steps are done."""


class PeerFailed(Exception):
    """Another rank ran out of memory in this trial: leave it at the same collective."""


class TrialSession:
    """Runs trials on the user's Trainer and, on leaving, puts everything back: the fit cannot tell they ran.

    Life cycle: ``with TrialSession(trainer, name) as session:`` saves the run's state; each
    ``session.prepare(size)`` then ``session.run()`` is one trial (``run`` returns whether it fitted and lets
    any other error through); ``session.choose(size)`` picks the size the fit continues with. Leaving the
    block, normally or by an exception (the user's error, Ctrl-C), restores:

    - weights, buffers, optimizer, LR-scheduler and precision-plugin states, loop progress, ``should_stop``;
    - train/eval mode and ``requires_grad`` of every module and parameter (an OOM between
      ``toggle_optimizer`` and ``untoggle_optimizer``, or in validation, leaves them changed);
    - the RNG states of Python, NumPy, torch, CUDA and of every ``torch.Generator`` the dataloaders hold;
    - the logged, callback and progress-bar metrics, the loops' result collections and every torchmetrics
      state, so no trial value reaches a logger, ``ModelCheckpoint``, ``EarlyStopping`` or an epoch
      aggregate;
    - loggers, callbacks, limits and the pending checkpoint of ``fit(ckpt_path=...)``;
    - the batch size and ``accumulate_grad_batches``: the chosen ones, or the original ones if none was
      chosen.

    During trials only the trial callback runs (no user callback, no logger), the module's once-per-loop
    hooks (``on_train_start``, ``on_train_epoch_start``, ``on_validation_epoch_end``, ...) are skipped and so
    is ``lr_scheduler_step`` (a schedule sized for the initial batch size may be shorter than the trials),
    ``self.log`` does not synchronise across ranks, and DDP skips its gradient all-reduce, so a rank that
    runs out of memory leaves its peers at the same collective. Dataloader workers of a trial are shut down
    when it ends. After the fit's size is set, what the fit derived from the batch size is derived again: at
    fit start the dataloaders are rebuilt and ``configure_optimizers`` runs again
    (``estimated_stepping_batches``, schedulers built from it).
    """

    def __init__(self, trainer: pl.Trainer, batch_arg_name: str, owner: object | None = None) -> None:
        self.trainer = trainer
        self.owner = owner  # the callback running the trials: a restore of the fit's state is not news to it
        self.batch_arg_name = batch_arg_name
        self.original = (get_batch_size(trainer, batch_arg_name), trainer.accumulate_grad_batches)
        self.chosen: tuple[int, int] | None = None
        self.validates = trainer.enable_validation
        self.callback: _TrialCallback | None = None
        self._saved: SavedRun | None = None
        self._state: ModelState | None = None
        # the module's hooks and `log`, put back exactly after
        self._patches = Patches(collapse_leftovers=False)
        self._stopping: list[Any] = []  # dataloader iterators whose workers were told to exit
        self.shapes: set[tuple[tuple[int, ...], ...]] = set()
        """The shapes of the training batches' tensors (less the first dimension) that trials saw."""

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> TrialSession:
        trainer = self.trainer
        module = trainer.lightning_module
        self._saved = SavedRun.capture(trainer)
        self._state = ModelState(trainer)
        self._patch_module(module)
        return self

    def __exit__(self, *exc: object) -> None:
        trainer = self.trainer
        saved = self._require_saved()
        try:
            self._unpatch_module()
            unload_dataloaders(trainer)
            join_workers(self._stopping)  # no trial's worker outlives the session
            saved.restore(trainer, self._state, self.owner)
        finally:
            self._state = None  # the host copy of the weights: not kept past the trials
            size, accumulation = self.chosen if self.chosen is not None and exc[0] is None else self.original
            apply_batch_size(
                trainer,
                self.batch_arg_name,
                size,
                accumulation,
                rebuild_optimizers=self.chosen is not None and self.chosen != self.original,
                rng=saved.rng,
                was_loaded=saved.loaded,
            )

    def _require_saved(self) -> SavedRun:
        if self._saved is None:
            raise RuntimeError("TrialSession: trials run only inside `with TrialSession(...)`.")
        return self._saved

    def choose(self, size: int, accumulation: int) -> None:
        """The size (and accumulation) the fit continues with once the session is left."""
        self.chosen = (size, accumulation)

    # ------------------------------------------------------------------ trials
    def prepare(
        self,
        size: int,
        accumulation: int,
        steps: int,
        validate: bool,
        after_training: Callable[[], None] | None = None,
    ) -> None:
        """Point the loop at one trial of ``steps`` optimizer steps at ``size`` (and one validation batch).

        ``after_training`` runs once the training steps are done, before the validation batch if there is
        one.
        """
        trainer = self.trainer
        set_batch_size(trainer, self.batch_arg_name, size)
        trainer.accumulate_grad_batches = accumulation
        validate = validate and self.validates
        self.callback = _TrialCallback(steps * accumulation, validate, after_training)
        saved = self._require_saved()
        trainer.loggers = [DummyLogger()] if saved.loggers else []
        trainer.callbacks = [self.callback]  # type: ignore[attr-defined]
        trainer.limit_train_batches = 1.0
        trainer.limit_val_batches = 1 if validate else 0
        trainer.should_stop = False
        fit_loop = trainer.fit_loop
        fit_loop.load_state_dict(deepcopy(saved.loop_state))
        # the trial stops itself; user limits are absolute (Lightning #21903)
        fit_loop.epoch_loop.max_steps = -1
        fresh = {loop: dict.fromkeys(names, False) for loop, names in saved.loop_flags.items()}
        set_loop_flags(fresh)  # run as a fresh run
        # an epoch shorter than the trial's steps: the trial goes on into the next epochs, as the fit would
        # (its second step is the first with the optimizer's state)
        fit_loop.max_epochs = max(fit_loop.max_epochs or 0, trainer.current_epoch + steps * accumulation + 1)
        for module, training in saved.modes.items():
            module.training = training  # a validation OOM in the trial before left them in eval mode
        for param, flag in saved.requires_grad.items():
            # an OOM between toggle_optimizer and untoggle_optimizer left them off
            param.requires_grad_(flag)
        # private: what untoggle_optimizer restores from
        trainer.lightning_module._param_requires_grad_state = {}
        reload_dataloaders(trainer, validate)
        if self._state is not None:
            self._state.reset_for_trial()

    def run(self) -> bool:
        """Run the prepared trial: ``True`` if it fitted, ``False`` on an OOM (on any rank).

        Other errors propagate.
        """
        trainer = self.trainer
        fits = True
        try:
            with _no_gradient_sync(trainer):
                trainer.fit_loop.run()
        except TrialStop:
            pass
        except PeerFailed:
            fits = False
        except Exception as error:
            if not is_oom_error(error):
                raise  # the user's own error: never swallowed
            fits = False
            # the frames' locals hold the trial's tensors, in a cycle
            traceback.clear_frames(error.__traceback__)
            del error
            if trainer.world_size > 1:
                # matches the peers' `agree_or_raise`
                trainer.strategy.reduce_boolean_decision(False, all=True)
        finally:
            if self.callback is not None:
                self.shapes.update(self.callback.shapes)
            for optimizer in trainer.optimizers:
                optimizer.zero_grad(set_to_none=True)
            _drop_trial_references(trainer)
            unload_dataloaders(trainer, self._stopping)
        return fits

    @property
    def validated(self) -> bool:
        """Whether the last trial reached its validation batch."""
        return self.callback is not None and self.callback.validated

    @property
    def batches_seen(self) -> list[int]:
        """Samples in each training batch of the last trial (what ran, not what was asked for)."""
        return self.callback.batch_sizes if self.callback is not None else []

    @property
    def epoch_ended(self) -> bool:
        """Whether the last trial drew the last batch of an epoch (its data ran out within the trial)."""
        return self.callback is not None and self.callback.epoch_ended

    @property
    def dataset_samples(self) -> int | None:
        """Samples in the last trial's training dataset (``None``: no length)."""
        return self.callback.dataset_samples if self.callback is not None else None

    # ------------------------------------------------------------------ module patches
    def _patch_module(self, module: pl.LightningModule) -> None:
        def skip(*args: Any, **kwargs: Any) -> None:
            return None

        for name in _SKIPPED_HOOKS:
            self._patches.install(module, name, skip)
        bound_log = module.log

        def log(*args: Any, **kwargs: Any) -> None:
            # A trial's logged values are discarded; synchronising them would pair a peer's logging
            # all-reduce with the OOM agreement of a rank that ran out of memory.
            args, kwargs = with_log_argument(bound_log, args, kwargs, "sync_dist", False)
            bound_log(*args, **kwargs)

        self._patches.install(module, "log", log)

    def _unpatch_module(self) -> None:
        self._patches.undo()


class _TrialCallback(Callback):
    """The only callback during a trial: counts batches, runs one validation batch, agrees across ranks."""

    def __init__(
        self, batches: int, validate: bool, after_training: Callable[[], None] | None = None
    ) -> None:
        self.batches = batches
        self.validate = validate
        self.after_training = after_training  # e.g. read the training steps' peaks, then reset them
        self.batch_sizes: list[int] = []
        # each batch's tensor shapes, less the first dimension
        self.shapes: list[tuple[tuple[int, ...], ...]] = []
        self.dataset_samples: int | None = None  # samples in the trial's training dataset
        self.validated = False
        self.epoch_ended = False  # the trial drew the last batch of an epoch (the data ran out)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.batch_sizes:
            self.dataset_samples = dataset_length(trainer.train_dataloader)
        self.batch_sizes.append(_batch_size(batch))
        self.shapes.append(_shapes(batch))

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
    ) -> None:
        agree_or_raise(trainer)
        if batch_idx + 1 >= trainer.num_training_batches:
            self.epoch_ended = True
        if len(self.batch_sizes) < self.batches:  # across the epoch's end where it is shorter
            return
        if self.validate:
            self.validated = True
            _run_validation(trainer, self.after_training)
        elif self.after_training is not None:
            self.after_training()
        raise TrialStop

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epoch_ended = True  # an iterable dataset (or a sampler without a length) ran out

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        agree_or_raise(trainer)


def agree_or_raise(trainer: pl.Trainer) -> None:
    """Collective: every rank calls it once per trial batch.

    A rank that ran out of memory calls it once from its handler.
    """
    if trainer.world_size > 1 and not trainer.strategy.reduce_boolean_decision(True, all=True):
        raise PeerFailed


def _batch_size(batch: Any) -> int:
    from lightning.pytorch.utilities.data import extract_batch_size

    try:
        return int(extract_batch_size(batch))
    except Exception:  # a batch without tensors: nothing to count
        return -1


def _shapes(batch: Any) -> tuple[tuple[int, ...], ...]:
    """The shapes of ``batch``'s tensors, less their first (batch) dimension."""
    shapes: list[tuple[int, ...]] = []
    apply_to_collection(batch, torch.Tensor, lambda tensor: shapes.append(tuple(tensor.shape[1:])))
    return tuple(shapes)


# ---------------------------------------------------------------------- batch size
def has_batch_arg(trainer: pl.Trainer, name: str) -> bool:
    """Whether the model, its hparams, the datamodule or its hparams has ``name``.

    This is Lightning's own lookup.
    """
    return bool(lightning_hasattr(trainer.lightning_module, name))


def batch_arg_in_hparams(trainer: pl.Trainer, name: str) -> bool:
    """Whether the module's or the datamodule's ``hparams`` hold ``name``.

    The ``hparams`` are what Lightning logs as hyperparameters.
    """
    module, datamodule = trainer.lightning_module, getattr(trainer, "datamodule", None)
    return any(name in getattr(owner, "hparams", {}) for owner in (module, datamodule) if owner is not None)


def require_settable_batch(trainer: pl.Trainer, name: str, owner: str) -> None:
    """Refuse, before any trial, a fit whose batch size cannot be set.

    That is: no attribute ``name``, or built dataloaders.

    Raises:
        AttributeError: neither the module, its hparams, the datamodule nor its hparams has ``name``.
        ValueError: the dataloaders were passed straight to ``trainer.fit``.
    """
    if not has_batch_arg(trainer, name):
        raise AttributeError(
            f"`{owner}(batch_arg_name={name!r})`: neither the LightningModule, its hparams, the datamodule"
            f" nor its hparams has an attribute `{name}`. Add it (and use it in your dataloaders), or pass"
            " the name your code uses."
        )
    if not train_source_is_module(trainer):
        raise ValueError(
            f"{owner} cannot change the batch size of dataloaders passed straight to `trainer.fit(...)`:"
            " they are built already. Build them in `train_dataloader()` / `val_dataloader()` of your"
            f" LightningModule or LightningDataModule from `{name}`, or remove the {owner}."
        )


def get_batch_size(trainer: pl.Trainer, name: str) -> int:
    """The current batch size, read where Lightning's finder reads it."""
    value = lightning_getattr(trainer.lightning_module, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"The batch size attribute `{name}` holds {value!r}; expected an integer.")
    return value


def set_batch_size(trainer: pl.Trainer, name: str, value: int) -> None:
    """Write the batch size everywhere Lightning's finder writes it."""
    lightning_setattr(trainer.lightning_module, name, value)


def current_hook(trainer: pl.Trainer) -> str | None:
    """The Lightning hook running now (``None`` outside one)."""
    return trainer.lightning_module._current_fx_name  # private attribute, set by Lightning's hook calls


def apply_batch_size(
    trainer: pl.Trainer,
    name: str,
    size: int,
    accumulation: int,
    *,
    rebuild_optimizers: bool,
    rng: dict[str, Any] | None = None,
    was_loaded: bool | None = None,
) -> None:
    """Set the fit's batch size and re-derive what the fit derived from it.

    The RNG streams are left as they were. The dataloaders end as they were (built or not) but at the new
    size; at fit start ``configure_optimizers`` runs again when ``rebuild_optimizers`` (schedulers built from
    ``estimated_stepping_batches``).
    """
    rng = capture_rng(trainer) if rng is None else rng
    was_loaded = dataloaders_loaded(trainer) if was_loaded is None else was_loaded
    set_batch_size(trainer, name, size)
    trainer.accumulate_grad_batches = accumulation
    unload_dataloaders(trainer)
    if rebuild_optimizers and current_hook(trainer) == "on_fit_start":
        _rebuild_optimizers(trainer)
    if was_loaded and not dataloaders_loaded(trainer):
        reload_dataloaders(trainer, validation=False)
        epoch = trainer.fit_loop.epoch_progress.current.processed  # type: ignore[attr-defined]
        set_sampler_epochs(trainer, epoch)  # the loop set it on the loaders it built before
    restore_rng(rng)


def _rebuild_optimizers(trainer: pl.Trainer) -> None:
    """Run ``configure_optimizers`` again, as the strategy did at setup (before the batch size was known)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    strategy = trainer.strategy
    if not keeps_whole_model(strategy):
        rank_zero_warn(
            f"BatchSizeTuner: `configure_optimizers` was not run again under {type(strategy).__name__};"
            " anything it derived from the batch size (e.g. `estimated_stepping_batches`) keeps the initial"
            " size's value."
        )
        return
    strategy.setup_optimizers(trainer)
    _optimizers_to_device(strategy.optimizers, strategy.root_device)


def _drop_trial_references(trainer: pl.Trainer) -> None:
    """Forget the batch a trial left in the loops' result collections.

    An OOM skips the batch-end cleanup.
    """
    for loop in (trainer.fit_loop.epoch_loop, trainer.fit_loop.epoch_loop.val_loop):
        results = getattr(loop, "_results", None)  # private: `_ResultCollection` of the loop
        if results is not None:
            results.batch = None
            results.batch_size = None


def _run_validation(trainer: pl.Trainer, before: Callable[[], None] | None = None) -> None:
    """Run the fit's validation loop now (one batch, as the trial set ``limit_val_batches``)."""
    # What Lightning's loop does before validating: free the gradients (`on_validation_model_zero_grad`).
    trainer.lightning_module.on_validation_model_zero_grad()
    if before is not None:
        before()
    trainer.validating = True
    try:
        trainer.fit_loop.epoch_loop.val_loop.run()  # private attribute of the epoch loop
    finally:
        trainer.training = True


@contextmanager
def _no_gradient_sync(trainer: pl.Trainer) -> Iterator[None]:
    """Under DDP, skip the gradient all-reduce during trials.

    Without it, a rank that runs out of memory in its forward pass leaves the others waiting forever in the
    backward all-reduce. The memory is the same: DDP's buckets exist either way.
    """
    model = trainer.strategy.model
    no_sync = getattr(model, "no_sync", None)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and no_sync is not None:
        with no_sync():
            yield
    else:
        yield
