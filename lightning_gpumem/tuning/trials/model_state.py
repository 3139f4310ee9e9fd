"""What a trial changes in the model and its optimizers, kept before the trials and put back after them.

Why not Lightning's checkpoint dict: ``dump_checkpoint`` and ``restore`` call the user's
``on_save_checkpoint`` / ``on_load_checkpoint`` and every callback's ``state_dict`` / ``load_state_dict``,
which would be hook calls the fit without trials never makes. Trials run no user callback, so only the
module, the optimizers, the LR schedulers and the precision plugin change; those are copied to host memory
directly. Under a strategy where a rank does not hold the whole model (FSDP, DeepSpeed), or when the host
lacks room, the copy goes through a checkpoint file with Lightning's own connector instead, as Lightning's
``BatchSizeFinder`` does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from copy import deepcopy
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_gpumem._hw.host_copy import host_copies, plain
from lightning_gpumem._hw.probe import host_available_bytes


class ModelState:
    """Weights, buffers, optimizer, LR-scheduler and precision-plugin states of ``trainer``.

    Restorable exactly.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.ckpt_path: str | None = None
        self.optimizers_empty = all(not optimizer.state for optimizer in trainer.optimizers)
        module = trainer.lightning_module
        in_memory = keeps_whole_model(trainer.strategy) and _host_has_room(
            # weights + e.g. Adam's two moments
            _tensor_bytes(module.state_dict()) * 3 * _local_world_size(trainer)
        )
        self.in_memory = bool(trainer.strategy.reduce_boolean_decision(in_memory, all=True))
        # small, and every trial starts from them: kept in memory under any strategy
        self.schedulers = [
            deepcopy(config.scheduler.state_dict()) for config in trainer.lr_scheduler_configs
        ]
        # lr, momentum...: what a scheduler changes (the state dicts of sharded runs are files)
        self.param_groups = [
            [
                {key: deepcopy(value) for key, value in group.items() if key != "params"}
                for group in optimizer.param_groups
            ]
            for optimizer in trainer.optimizers
        ]
        if self.in_memory:
            self.weights = _copy_to_host(module.state_dict())
            self.optimizers = [_copy_to_host(optimizer.state_dict()) for optimizer in trainer.optimizers]
            self.precision = deepcopy(trainer.precision_plugin.state_dict())
        else:
            # the run's directory, whatever the process's is later
            root = os.path.abspath(trainer.default_root_dir)
            path = os.path.join(root, f".gpumem_tuner_{uuid.uuid4().hex}.ckpt")
            self.ckpt_path = trainer.strategy.broadcast(path)  # one file: rank zero writes, every rank reads
            self._on_sigterm = RemovedOnSigterm(self.ckpt_path)
            trainer.save_checkpoint(self.ckpt_path)

    def reset_for_trial(self) -> None:
        """Give each trial the optimizer and LR-scheduler states the run has now.

        At fit start the optimizer state is empty and the first step creates it (AdamW: two tensors per
        parameter), carving it out of whatever the allocator has cached then; a trial that inherited the
        state of the trial before would miss that, and with it the fragmentation the fit's second step meets.
        The schedulers start over too: a schedule with a step limit (``OneCycleLR(total_steps=...)``) must
        not count every trial's steps.
        """
        trainer = self.trainer
        if self.optimizers_empty:
            for optimizer in trainer.optimizers:
                optimizer.state.clear()
        elif self.in_memory:
            for optimizer, state in zip(trainer.optimizers, self.optimizers, strict=True):
                optimizer.load_state_dict(_copy_to_host(state))  # loading may keep CPU tensors: copy first
        # else: a sharded strategy mid-training: trials keep the state of the trial before (same sizes).
        for optimizer, groups in zip(trainer.optimizers, self.param_groups, strict=True):
            for group, saved in zip(optimizer.param_groups, groups, strict=True):
                group.update(deepcopy(saved))
        for config, state in zip(trainer.lr_scheduler_configs, self.schedulers, strict=True):
            config.scheduler.load_state_dict(deepcopy(state))

    def restore(self) -> None:
        """Put the states back exactly as they were."""
        trainer = self.trainer
        if self.in_memory:
            trainer.lightning_module.load_state_dict(self.weights)
            for optimizer, state in zip(trainer.optimizers, self.optimizers, strict=True):
                optimizer.load_state_dict(state)
                if self.optimizers_empty:
                    optimizer.state.clear()
            if self.precision:
                trainer.precision_plugin.load_state_dict(self.precision)
        elif self.ckpt_path is not None:
            connector = trainer._checkpoint_connector  # private: what Lightning's finder restores with
            try:
                connector.restore(self.ckpt_path)
            finally:
                # every rank has read it before rank zero deletes it
                trainer.strategy.barrier("gpumem_tuner_restored")
                trainer.strategy.remove_checkpoint(self.ckpt_path)
                self.ckpt_path = None
                self._on_sigterm.close()
        for config, state in zip(trainer.lr_scheduler_configs, self.schedulers, strict=True):
            config.scheduler.load_state_dict(deepcopy(state))


class RemovedOnSigterm:
    """While open, a SIGTERM that would end the process removes ``path`` first.

    A SIGTERM is what a scheduler's time limit or ``timeout`` sends. The handler before it is chained: where
    it is Python's own (Lightning's, the user's), it runs and decides, and the file is left for
    :meth:`ModelState.restore` (the run may go on and need it); where it is the default action, the file is
    removed and the signal delivered again to end the process as it would have. Only the main thread can set
    a handler: elsewhere nothing is set.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.previous: Any = None
        self.installed = False
        with contextlib.suppress(ValueError, OSError, AttributeError):  # not the main thread, no SIGTERM
            self.previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._handle)
            self.installed = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        previous = self.previous
        if callable(previous):
            previous(signum, frame)
            return
        if previous == signal.SIG_IGN:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        self.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # the default action: the process ends as it would have

    def close(self) -> None:
        """Put the handler before back (where this one is still set)."""
        if not self.installed:
            return
        self.installed = False
        with contextlib.suppress(ValueError, OSError, TypeError):
            if signal.getsignal(signal.SIGTERM) == self._handle:
                signal.signal(signal.SIGTERM, self.previous if self.previous is not None else signal.SIG_DFL)


def keeps_whole_model(strategy: Any) -> bool:
    """Whether each rank's ``state_dict`` is the whole model.

    If so, a host copy per rank restores it exactly.
    """
    from lightning_gpumem._pl.compat import either

    return type(strategy) in (
        *either("strategies", "SingleDeviceStrategy"),
        *either("strategies", "DDPStrategy"),
    )


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
    available = host_available_bytes()
    return available is not None and nbytes <= available // 2


def _copy_to_host(obj: Any) -> Any:
    """A deep copy with every tensor copied to host memory (containers rebuilt, other leaves deep-copied).

    The tensors are copied together (``_hw/host_copy.py``: one buffer, its pages touched in parallel), and
    a tensor met again (tied weights: a state dict names one tensor under each of its names) once.
    """
    found: dict[tuple[Any, ...], torch.Tensor] = {}
    _gather(obj, found)
    copies = dict(zip(found, host_copies(list(found.values())), strict=True))
    return _rebuilt(obj, copies)


def _gather(obj: Any, found: dict[tuple[Any, ...], torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        found.setdefault(_key(obj), obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _gather(value, found)
    elif isinstance(obj, list) or (isinstance(obj, tuple) and not hasattr(obj, "_fields")):
        for value in obj:
            _gather(value, found)


def _rebuilt(obj: Any, copies: dict[tuple[Any, ...], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return copies[_key(obj)]
    if isinstance(obj, dict):
        items = [(k, _rebuilt(v, copies)) for k, v in obj.items()]
        try:
            copy = type(obj)(items)  # OrderedDict, AttributeDict, ...
        except Exception:
            return dict(items)
        if hasattr(obj, "_metadata"):  # a module's state_dict: versions that `load_state_dict` reads
            copy._metadata = deepcopy(obj._metadata)  # type: ignore[attr-defined]
        return copy
    if isinstance(obj, list):
        return [_rebuilt(v, copies) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_rebuilt(v, copies) for v in obj)
    return deepcopy(obj)


def _key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """One copy per key: the same for tensors of the same elements, else the object's own."""
    return _view_key(tensor) or ("object", id(tensor))


def _view_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """What ``tensor`` is a view of, the same for every tensor of the same elements (``None``: not known)."""
    if not plain(tensor):
        return None
    try:
        pointer = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage to point at
        return None
    if pointer == 0:  # empty: nothing to share
        return None
    return (tensor.device, pointer, tensor.storage_offset(), tensor.shape, tensor.stride(), tensor.dtype)
