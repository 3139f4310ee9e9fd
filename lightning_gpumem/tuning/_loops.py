"""Running tuning trials through Lightning's own fit loop: every private Trainer access of the tuner is here.

Why the real loop: a trial must cost what training costs (precision plugin, strategy wrapper, closures, gradient
clipping, ``self.log`` in the user's steps), and only Lightning's loop does all of that. Lightning exposes no public
API to run a few steps at another batch size and undo them, so, like its own ``BatchSizeFinder``
(``lightning/pytorch/tuner/batch_size_scaling.py``), this module reaches into loop attributes. Each access carries a
``# private:`` comment, and ``tests/unit/test_lightning_internals.py`` fails loudly when an upgrade breaks one.
"""

from __future__ import annotations

import contextlib
import os
import random
import uuid
from collections.abc import Iterator
from copy import deepcopy
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
    np = None  # type: ignore[assignment]


class TrialStop(Exception):
    """Raised from the trial callback to leave the fit loop once a trial's steps are done."""


def capture_rng() -> dict[str, Any]:
    """RNG states of Python, NumPy, torch and every CUDA device."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Undo every random draw made since :func:`capture_rng`."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def has_batch_arg(trainer: pl.Trainer, name: str) -> bool:
    """Whether the model, its hparams, the datamodule or its hparams has ``name`` (Lightning's own lookup)."""
    return bool(lightning_hasattr(trainer.lightning_module, name))


def get_batch_size(trainer: pl.Trainer, name: str) -> int:
    """The current batch size, read where Lightning's finder reads it."""
    value = lightning_getattr(trainer.lightning_module, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"The batch size attribute `{name}` holds {value!r}; expected an integer.")
    return value


def set_batch_size(trainer: pl.Trainer, name: str, value: int) -> None:
    """Write the batch size everywhere Lightning's finder writes it."""
    lightning_setattr(trainer.lightning_module, name, value)


def train_dataset_size(trainer: pl.Trainer) -> int | None:
    """Samples in the training dataset (the first loader's), or ``None`` if it has no length."""
    loaders = trainer.train_dataloader
    if loaders is None:
        return None
    first = loaders if isinstance(loaders, torch.utils.data.DataLoader) else _first_loader(loaders)
    dataset = getattr(first, "dataset", None)
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return None


def _first_loader(loaders: Any) -> Any:
    if isinstance(loaders, dict):
        return next(iter(loaders.values()), None)
    if isinstance(loaders, (list, tuple)):
        return loaders[0] if loaders else None
    return loaders


def dataloaders_loaded(trainer: pl.Trainer) -> bool:
    """Whether the fit loop has built its training dataloader yet (not before the loop starts running)."""
    return trainer.fit_loop._combined_loader is not None  # private attribute of the fit loop


def unload_dataloaders(trainer: pl.Trainer) -> None:
    """Drop the dataloaders so the fit loop builds them itself when it starts, as it would have without tuning.

    Building them draws random numbers (the first iterator's base seed), so building them here instead would shift
    the run's random stream.
    """
    trainer.fit_loop._combined_loader = None  # private, see `reload_dataloaders`
    trainer.fit_loop.epoch_loop.val_loop._combined_loader = None  # private


def reload_dataloaders(trainer: pl.Trainer) -> None:
    """Rebuild the train and val dataloaders so they use the batch size just written."""
    fit_loop = trainer.fit_loop
    fit_loop._combined_loader = None  # private: force a reload (Lightning's `_reset_dataloaders` does the same)
    fit_loop.setup_data()
    val_loop = fit_loop.epoch_loop.val_loop  # private attribute of the epoch loop
    val_loop._combined_loader = None  # private: force a reload
    val_loop.setup_data()


class TrainerSnapshot:
    """Everything a trial changes, saved before the search and put back after it, in ``finally``.

    Weights, optimizer, LR-scheduler, precision-plugin, loop progress and callback states go through Lightning's own
    checkpoint dict (``dump_checkpoint``), restored with the connector Lightning's own finder uses. Where each rank
    holds its whole model (single device, DDP) and the host has room, the dict is kept in host memory; otherwise
    (sharded strategies, little host memory) it goes through a checkpoint file, as Lightning's finder does. The rest
    (RNG, loggers, callbacks, limits) is kept in memory.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.ckpt_path: str | None = None
        self.checkpoint: dict[str, Any] | None = None
        connector = trainer._checkpoint_connector  # private: what `Trainer.save_checkpoint` and the finder use
        in_memory = _keeps_whole_model(trainer.strategy)
        checkpoint = connector.dump_checkpoint(weights_only=False) if in_memory else None
        if checkpoint is not None:
            in_memory = _host_has_room(_tensor_bytes(checkpoint) * _local_world_size(trainer))
        if trainer.strategy.reduce_boolean_decision(in_memory, all=True) and checkpoint is not None:
            self.checkpoint = _copy_to_host(checkpoint)
        else:
            del checkpoint
            path = os.path.join(trainer.default_root_dir, f".gpumem_tuner_{uuid.uuid4().hex}.ckpt")
            self.ckpt_path = trainer.strategy.broadcast(path)  # one file: rank zero writes, every rank reads
            trainer.save_checkpoint(self.ckpt_path)
        self.rng = capture_rng()
        self.loggers = trainer.loggers
        self.callbacks = trainer.callbacks  # type: ignore[attr-defined]
        self.limit_train_batches = trainer.limit_train_batches
        self.limit_val_batches = trainer.limit_val_batches
        self.should_stop = trainer.should_stop
        self.max_steps = trainer.fit_loop.epoch_loop.max_steps
        self.max_epochs = trainer.fit_loop.max_epochs
        self.loop_state = deepcopy(trainer.fit_loop.state_dict())
        self.loop_flags = _loop_flags(trainer.fit_loop)
        self.training_modes = {module: module.training for module in trainer.lightning_module.modules()}
        self.optimizers_empty = all(not optimizer.state for optimizer in trainer.optimizers)

    def reset_optimizers(self) -> None:
        """Give each trial the optimizer state the run has now, so its first step allocates what the fit's will.

        At fit start the state is empty and the first step creates it (AdamW: two tensors per parameter), carving it
        out of whatever the allocator has cached then; a trial that inherited the state of the trial before would
        miss that, and with it the fragmentation the fit's second step meets.
        """
        if self.optimizers_empty:
            for optimizer in self.trainer.optimizers:
                optimizer.state.clear()
        elif self.checkpoint is not None:
            states = _copy_to_host(self.checkpoint["optimizer_states"])  # loading may keep CPU tensors: copy first
            for optimizer, state in zip(self.trainer.optimizers, states, strict=True):
                optimizer.load_state_dict(state)
        # else: a sharded strategy mid-training: trials keep the state of the trial before (same sizes).

    def prepare_trial(self, callback: pl.Callback, include_validation: bool) -> None:
        """Point the loop at one trial: only ``callback`` runs, nothing is logged, no step or epoch limit hits."""
        trainer = self.trainer
        trainer.loggers = [DummyLogger()] if self.loggers else []
        trainer.callbacks = [callback]  # type: ignore[attr-defined]
        trainer.limit_train_batches = 1.0
        trainer.limit_val_batches = 1 if include_validation else 0
        trainer.should_stop = False
        fit_loop = trainer.fit_loop
        fit_loop.load_state_dict(deepcopy(self.loop_state))
        fit_loop.epoch_loop.max_steps = -1  # the trial stops itself; user limits are absolute (Lightning #21903)
        _set_loop_flags({loop: (False, False, False) for loop in self.loop_flags})  # run as a fresh run
        fit_loop.max_epochs = max(fit_loop.max_epochs or 0, trainer.current_epoch + 2)

    def restore(self) -> None:
        """Put the Trainer back exactly as it was."""
        trainer = self.trainer
        trainer.loggers = self.loggers
        trainer.callbacks = self.callbacks  # type: ignore[attr-defined]
        trainer.limit_train_batches = self.limit_train_batches
        trainer.limit_val_batches = self.limit_val_batches
        trainer.fit_loop.epoch_loop.max_steps = self.max_steps
        trainer.fit_loop.max_epochs = self.max_epochs
        connector = trainer._checkpoint_connector  # private: what Lightning's finder restores with
        if self.checkpoint is not None:
            # `restore(path)` without its file read: the same steps on the dict kept in host memory.
            connector._loaded_checkpoint = self.checkpoint  # private
            try:
                connector.restore_datamodule()
                connector.restore_model()
                connector.restore_callbacks()
                connector.restore_training_state()
            finally:
                connector._loaded_checkpoint = {}  # private
                self.checkpoint = None
        elif self.ckpt_path is not None:
            try:
                connector.restore(self.ckpt_path)
            finally:
                trainer.strategy.barrier("gpumem_tuner_restored")  # every rank has read it before rank zero deletes it
                trainer.strategy.remove_checkpoint(self.ckpt_path)
        trainer.fit_loop.load_state_dict(deepcopy(self.loop_state))
        _set_loop_flags(self.loop_flags)  # `load_state_dict` marked the loops as restarting from a checkpoint
        trainer.should_stop = self.should_stop
        for module, training in self.training_modes.items():
            module.training = training  # a trial's validation left them in eval mode
        restore_rng(self.rng)


def _keeps_whole_model(strategy: Any) -> bool:
    """Whether each rank's ``state_dict`` is the whole model (so a host copy per rank restores it exactly)."""
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    return type(strategy) in (SingleDeviceStrategy, DDPStrategy)


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _local_world_size(trainer: pl.Trainer) -> int:
    return max(1, int(getattr(trainer, "num_devices", 1) or 1))


def _host_has_room(nbytes: int) -> bool:
    """Whether ``nbytes`` take at most half of the host memory available now (unknown: assume not)."""
    try:
        import psutil

        return nbytes <= psutil.virtual_memory().available // 2
    except Exception:
        return False


def _copy_to_host(obj: Any) -> Any:
    """A deep copy with every tensor copied to host memory (containers rebuilt, other leaves deep-copied)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        items = [(k, _copy_to_host(v)) for k, v in obj.items()]
        try:
            return type(obj)(items)  # OrderedDict, AttributeDict, ...
        except Exception:
            return dict(items)
    if isinstance(obj, list):
        return [_copy_to_host(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_copy_to_host(v) for v in obj)
    return deepcopy(obj)


def _loop_flags(loop: Any) -> dict[Any, tuple[bool, bool, bool]]:
    """The restart flags of ``loop`` and every loop inside it (private attributes of Lightning's `_Loop`)."""
    flags = {loop: (loop._restarting, loop._loaded_from_state_dict, loop._resuming_from_checkpoint)}
    for child in vars(loop).values():
        if isinstance(child, pl.loops.loop._Loop):
            flags.update(_loop_flags(child))
    return flags


def _set_loop_flags(flags: dict[Any, tuple[bool, bool, bool]]) -> None:
    # Set the attributes directly: `_FitLoop.restarting`'s setter forces True for step-based runs (`max_steps`).
    for loop, (restarting, loaded, resuming) in flags.items():
        loop._restarting, loop._loaded_from_state_dict, loop._resuming_from_checkpoint = restarting, loaded, resuming


def drop_trial_references(trainer: pl.Trainer) -> None:
    """Forget the batch a trial left in the loops' result collections (an OOM skips the batch-end cleanup)."""
    for loop in (trainer.fit_loop.epoch_loop, trainer.fit_loop.epoch_loop.val_loop):
        results = getattr(loop, "_results", None)  # private: `_ResultCollection` of the loop
        if results is not None:
            results.batch = None
            results.batch_size = None


def run_trial_loop(trainer: pl.Trainer) -> None:
    """Run the fit loop until the trial callback raises :class:`TrialStop`."""
    with _no_gradient_sync(trainer):
        trainer.fit_loop.run()


def run_validation(trainer: pl.Trainer) -> None:
    """Run the fit's validation loop now (one batch, as the trial set ``limit_val_batches``)."""
    # What Lightning's loop does before validating: free the gradients (`on_validation_model_zero_grad`).
    trainer.lightning_module.on_validation_model_zero_grad()
    trainer.validating = True
    try:
        trainer.fit_loop.epoch_loop.val_loop.run()  # private attribute of the epoch loop
    finally:
        trainer.training = True


@contextlib.contextmanager
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
