"""AutoMicrobatch: a training step that runs out of memory is re-run as micro-batches, not a crash."""

from __future__ import annotations

import contextlib
import gc
import inspect
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_gpumem import keys
from lightning_gpumem._core.checks import is_int_at_least, require_int, require_trainer
from lightning_gpumem._hw.oom import NotOutOfMemoryError, is_oom_error, oom_expected
from lightning_gpumem._hw.probe import Probe, make_probe
from lightning_gpumem._pl import logging as _logging
from lightning_gpumem._pl.compat import Callback, either
from lightning_gpumem._pl.distributed import all_reduce_max, side_group
from lightning_gpumem._pl.patching import Patches, log_arguments, log_parameters
from lightning_gpumem._pl.peers import budget_bytes, tell_oom_recovered, tell_peak_reset
from lightning_gpumem.microbatch.split import (
    LogCall,
    MicrobatchPolicy,
    UpdateWatch,
    batch_length,
    combine_logs,
    split_batch,
)

AGREE_TIMEOUT_S = 600.0  # a rank still not at the agreement after this is stuck elsewhere: fail, do not hang


@keys.document
class AutoMicrobatch(Callback):
    r"""Survive an out-of-memory error in a training step: re-run it as micro-batches, then grow back.

    When a training step (its forward, its backward or the optimizer step) runs out of memory, the same batch
    is run again as ``k`` micro-batches (``k`` = 2, 4, ...: the batch split along its first dimension,
    tensors in nested lists, tuples, dicts and dataclasses alike), their gradients accumulated, and one
    optimizer step taken: for a loss that is a mean over the batch the step equals the unsplit one, and
    ``global_step``, the LR schedule and what ``self.log`` records in ``training_step`` are those of one
    unsplit step (values combined, weighted by micro-batch size). After ``grow_after`` optimizer steps
    without an OOM, one step tries half as many micro-batches; when that fails too the split doubles back and
    the wait doubles. A try that the last split step's measured peak says cannot fit the budget is skipped as
    if it had failed. The split only ever changes after an OOM or a try.

    Under DDP every rank's backward stays local and the ranks agree after it (one small all-reduce): an OOM
    on one rank re-runs the step on all, with the same split; the callback then averages the gradients itself
    (bucketed all-reduces, which do not overlap the backward as DDP's do). Values logged with
    ``sync_dist=True`` are reduced once the step has run on every rank.

    Limits: a ``sum`` loss must be divided by the batch size to stay exact, and BatchNorm sees micro-batches
    (its statistics differ); a random op (dropout) draws different numbers for a split batch; a re-run step
    runs ``training_step`` again, with its side effects (a ``torchmetrics`` update counts the batch twice).
    An OOM inside ``optimizer.step`` is recovered when the optimizer had not changed its parameters or state
    yet (PyTorch's optimizers create their state, the usual cause, before they update); one in the middle of
    an update propagates with a note, as a re-run would apply part of it twice (seen through the version
    counters of a few parameters and their state, noted in ``on_before_optimizer_step``). Under DDP it is not
    recovered at all. With ``accumulate_grad_batches``, an OOM in a later batch of a window re-runs the
    window's earlier batches too (their gradients went with the failed attempt's); the window's batches are
    kept until it ends. Manual optimization and strategies other than DDP (FSDP, DeepSpeed) are not
    supported: the callback says so once and an OOM propagates as without it. The OOMs of
    :class:`~lightning_gpumem.BatchSizeTuner`'s trials are left to the tuner.

    **Logged metrics** (on Lightning's logging steps; the table comes from :mod:`lightning_gpumem.keys`):

    {logged_metrics}

    Args:
        grow_after: optimizer steps after an OOM before one step tries half as many micro-batches (doubled
            after each try that runs out of memory).
        max_microbatches: the most micro-batches to split a batch into (``None``: as many as the batch has
            samples); an OOM at that split propagates.

    Raises:
        ValueError: if ``grow_after`` is not an integer >= 1 or ``max_microbatches`` not ``None`` or an
            integer >= 2.

    Example::

        from lightning import Trainer
        from lightning_gpumem import AutoMicrobatch
        trainer = Trainer(callbacks=[AutoMicrobatch()])
    """

    def __init__(self, grow_after: int = 16, max_microbatches: int | None = None) -> None:
        require_int("AutoMicrobatch", "grow_after", grow_after, 1)
        if max_microbatches is not None and not is_int_at_least(max_microbatches, 2):
            raise ValueError(
                f"`AutoMicrobatch(max_microbatches={max_microbatches!r})` is not valid. Expected None or an"
                " integer >= 2."
            )
        self.grow_after = grow_after
        self.max_microbatches = max_microbatches
        self.policy = MicrobatchPolicy(grow_after)
        self._trainer: pl.Trainer | None = None
        self._patches = Patches()  # what the patches replaced, to put back
        self._probe: Probe | None = None
        self._attempt = Attempt()  # what the current attempt at the step did so far
        self._buffering = False  # inside the user's `training_step`: its `self.log` calls are buffered
        self._size = 0  # samples in the micro-batch running now (the weight of what it logs)
        self._distributed = False
        self._window: list[tuple[Any, int]] = []  # the accumulation window's batches that ran so far
        # the last split step's memory: base, new gradients, activations, split
        self._measure: dict[str, int] = {}
        self._in_run = False  # inside the loop's `run`: `training_step` calls are the step's
        self._group: object | None = None  # under DDP: the ranks' agreement group
        self._batch_idx = 0
        self._warned: set[str] = set()
        self._updates = UpdateWatch()  # whether a failed optimizer step had begun its update

    @property
    def microbatches(self) -> int:
        """How many micro-batches a batch runs as now (1: unsplit)."""
        return self.policy.k

    @property
    def oom_recoveries(self) -> int:
        """Out-of-memory errors recovered so far."""
        return self.policy.oom_recoveries

    @override
    def state_dict(self) -> dict[str, Any]:
        policy = self.policy
        return {
            "k": policy.k,
            "wait": policy.wait,
            "since": policy.since,
            "oom_recoveries": policy.oom_recoveries,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume with the split, the wait and the count the checkpoint's run had.

        A try in flight is not resumed.
        """
        for name in ("k", "wait", "since", "oom_recoveries"):
            if name in state_dict:
                setattr(self.policy, name, int(state_dict[name]))

    def gpumem_summary_context(self) -> dict[str, Any]:
        """What this adds to the fit-end advice: the OOMs it recovered, the micro-batches it uses."""
        return {"oom_recoveries": self.policy.oom_recoveries, "microbatches": self.policy.k}

    # ------------------------------------------------------------------ install
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        require_trainer("AutoMicrobatch", trainer)
        reason = None
        if not pl_module.automatic_optimization:
            reason = "manual optimization (`automatic_optimization = False`) is not supported"
        elif "dataloader_iter" in inspect.signature(pl_module.training_step).parameters:
            reason = (
                "`training_step(self, dataloader_iter)` is not supported (the batch is not known to split)"
            )
        elif trainer.world_size > 1 and not isinstance(
            trainer.strategy, either("strategies", "DDPStrategy")
        ):
            reason = f"{type(trainer.strategy).__name__} is not supported yet (DDP is)"
        if reason is not None:
            self._warn_once(
                reason, f"AutoMicrobatch: {reason}; out-of-memory errors propagate as without it."
            )
            return
        self._trainer = trainer
        self._distributed = trainer.world_size > 1
        # the ranks agree on a group of their own: a rank stuck elsewhere fails it, not hangs it
        if self._distributed:
            self._group = side_group(AGREE_TIMEOUT_S)
        self._probe = make_probe(trainer.strategy.root_device, self)
        loop = trainer.fit_loop.epoch_loop.automatic_optimization

        patch = self._patches.install
        # The wrapper shows the original's signature: Lightning reads it to decide what to pass (`batch_idx`
        # or not).
        patch(pl_module, "training_step", self._training_step, keep_signature=True)
        patch(pl_module, "log", self._log)
        patch(pl_module, "backward", self._backward_hook)
        patch(loop, "run", self._run)
        patch(loop, "_on_before_zero_grad", self._skip_if_zeroed("_on_before_zero_grad"))
        patch(loop, "_optimizer_zero_grad", self._skip_if_zeroed("_optimizer_zero_grad"))

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_trainer("AutoMicrobatch", trainer)
        if stage == "fit":  # a new fit starts unsplit (a checkpoint's state is loaded after this hook)
            self.policy = MicrobatchPolicy(self.grow_after)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._unpatch()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._unpatch()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._unpatch()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._trainer is None or not trainer.is_global_zero or not trainer.loggers:
            return
        every_n = trainer.log_every_n_steps  # type: ignore[attr-defined]
        if _logging.is_logging_step(trainer, every_n) and not _logging.is_accumulating(trainer):
            metrics = {keys.MICROBATCHES.format(): float(self.policy.k)}
            metrics[keys.OOM_RECOVERIES.format()] = float(self.oom_recoveries)
            _logging.log_to_loggers(trainer, metrics, step=_logging.batches_that_stepped(trainer))

    def _unpatch(self) -> None:
        self._patches.undo()
        self._updates.clear()
        self._trainer = self._probe = None
        self._window, self._attempt, self._measure = [], Attempt(), {}

    def _original(self, owner: object, name: str) -> Any:
        return self._patches.original(owner, name)

    # ------------------------------------------------------------------ the step
    def _run(self, optimizer: torch.optim.Optimizer, batch_idx: int, kwargs: Any) -> Any:
        """Lightning's automatic-optimization step, re-run on an OOM.

        The step: training step, backward, optimizer step.
        """
        trainer = self._require_trainer()
        loop = trainer.fit_loop.epoch_loop.automatic_optimization
        step = trainer.global_step
        self.policy.next_k(step, self._cannot_fit)
        measuring = self.policy.k > 1 and self._start_measuring(trainer)
        progress = _counters(loop)  # the step's counters, put back after a failed attempt
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self._window = []  # a new accumulation window
        self._batch_idx = batch_idx
        while True:
            self._attempt = Attempt()
            self._in_run = True
            self._updates.start()
            try:
                with self._local_backward(trainer):
                    result = self._original(loop, "run")(optimizer, batch_idx, kwargs)
                break
            except _Retry:
                self._clean_up(trainer)  # another rank ran out of memory: all ranks run the step again
            except Exception as error:
                if not is_oom_error(error) or oom_expected():
                    raise
                self._recover(trainer, error, kwargs.get("batch"), batch_idx)
            finally:
                self._in_run = False
            _restore_counters(progress)
            self._replay_window(trainer, optimizer)
        self._flush_logs(trainer.lightning_module)
        if measuring:
            self._stop_measuring()
        if _logging.is_accumulating(trainer):
            # rebuilt if a later batch of the window fails
            self._window.append((kwargs.get("batch"), batch_idx))
        if self.policy.after_success(step):
            rank_zero_warn(
                f"AutoMicrobatch: step {step} ran as {self.policy.k} micro-batch(es); batches run so from"
                " now on."
            )
        return result

    def _recover(self, trainer: pl.Trainer, error: Exception, batch: Any, batch_idx: int) -> None:
        """Undo what the failed attempt did and choose the split to re-run it with.

        Raises where there is none.
        """
        step, failed_k, after_backward = trainer.global_step, self.policy.k, self._attempt.after_backward
        traceback.clear_frames(error.__traceback__)  # the frames hold the attempt's activations
        self._attempt.calls = []
        if self._distributed and self._attempt.agreed:
            raise NotOutOfMemoryError(
                f"AutoMicrobatch: out of memory at step {step} after the ranks had agreed on the step (in"
                " the optimizer step or after it): under DDP the other ranks have moved on, so it cannot be"
                " re-run (see the error above)."
            ) from error
        if after_backward and self._updates.changed():  # a re-run would apply part of the update twice
            _add_note(
                error,
                f"AutoMicrobatch: not recovered: out of memory at step {step} in the middle of the"
                " optimizer's update (parameters or optimizer state already changed), which a re-run would"
                " apply twice.",
            )
            raise error
        # (an OOM while the optimizer created its state leaves it half made)
        self._updates.forget_new_state()
        length = batch_length(batch) or 1
        try:
            split_batch(batch, 2)
        except ValueError as reason:  # nothing can be split: the OOM propagates, with why
            _add_note(error, f"AutoMicrobatch: not recovered: {reason}.")
            raise error from None
        limit = min(length, self.max_microbatches or length)
        k = self.policy.after_oom(step, limit)
        if self._distributed:  # every rank is at its agreement point of this attempt: tell them
            agreed = self._agree(trainer, failed=True, give_up=k is None)
            if not agreed["give_up"]:
                k = int(agreed["k"])
                self.policy.adopt(k, int(agreed["wait"]), step, count=False)
        if k is None:
            _add_note(
                error,
                f"AutoMicrobatch: out of memory at step {step} even with the batch of {length} split into"
                f" {failed_k} micro-batch(es){' (max_microbatches)' if limit < length else ''}; nothing"
                " smaller to try.",
            )
            raise error
        self._clean_up(trainer)
        tell_oom_recovered(trainer)  # e.g. OOMSnapshot marks the snapshot it wrote for this OOM
        where = (
            "after the backward (in the optimizer step)" if after_backward else "in the forward or backward"
        )
        rank_zero_warn(
            f"AutoMicrobatch: out of memory {where} at step {step} with the batch of {length} as {failed_k}"
            f" micro-batch(es); re-running it as {k} micro-batches of about {-(-length // k)}."
        )

    def _start_measuring(self, trainer: pl.Trainer) -> bool:
        """Reset the peak counters for this split step (callbacks that keep a peak window fold it first)."""
        probe = self._probe
        if probe is None or not probe.has_allocator:
            return False
        tell_peak_reset(trainer)
        probe.reset_peaks()
        params = list(trainer.lightning_module.parameters())
        existing = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        needed = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        self._measure = {"base": probe.allocated_bytes() or 0, "grads": max(0, needed - existing)}
        return True

    def _stop_measuring(self) -> None:
        """The split step's micro-batches' activations.

        Its peak above its start, less the gradients it created.
        """
        peak = self._probe.read_peaks()[0] if self._probe is not None and self._measure else None
        if peak is not None:
            self._measure["activations"] = max(0, peak - self._measure["base"] - self._measure["grads"])
            self._measure["split"] = self.policy.k

    def _cannot_fit(self, k: int) -> bool:
        """Whether the last split step's measured peak says ``k`` micro-batches would not fit the budget."""
        measured, trainer = self._measure, self._trainer
        if trainer is None or self._probe is None or "activations" not in measured:
            return False
        limit = budget_bytes(trainer) or self._probe.total_bytes()
        if not limit:
            return False
        # micro-batches that many times larger hold that many times the activations
        scale = measured["split"] / k
        return measured["base"] + measured["grads"] + scale * measured["activations"] > limit

    def _clean_up(self, trainer: pl.Trainer) -> None:
        """Undo a failed attempt: its gradients, its ``GradScaler`` stage, its logs; give its memory back."""
        self._attempt.calls = []
        for optimizer in trainer.optimizers:
            optimizer.zero_grad(set_to_none=True)
        _reset_scaler(trainer)
        gc.collect()
        if self._probe is not None:
            self._probe.release_cache()

    def _replay_window(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> None:
        """Rebuild the accumulation window's earlier batches' gradients (cleared with the failed attempt's).

        Their ``training_step`` runs again at the new split, its logs dropped (they were logged when it first
        ran).
        """
        if not self._window:
            return
        module = trainer.lightning_module
        original = self._original(module, "training_step")
        with self._local_backward(trainer), trainer.precision_plugin.train_step_context():
            for batch, batch_idx in self._window:
                chunks = split_batch(batch, self.policy.k)
                length = sum(size for _, size in chunks)
                self._buffering = True
                try:
                    for chunk, size in chunks:
                        self._size = size
                        output = original(chunk, batch_idx)
                        loss = output.get("loss") if isinstance(output, Mapping) else output
                        if isinstance(loss, torch.Tensor):  # (a batch `training_step` skips adds nothing)
                            weight = size / length / trainer.accumulate_grad_batches
                            self._micro_backward(trainer, loss * weight, optimizer)
                finally:
                    self._buffering, self._attempt.calls = False, []

    @contextlib.contextmanager
    def _local_backward(self, trainer: pl.Trainer) -> Iterator[None]:
        """Under DDP, the step's backwards stay local.

        The gradients are reduced once every rank is through them.
        """
        if not self._distributed:
            yield
            return
        with trainer.strategy.block_backward_sync():  # type: ignore[attr-defined]
            yield

    def _agree(self, trainer: pl.Trainer, failed: bool, give_up: bool) -> dict[str, float]:
        """Every rank's word on this attempt (collective).

        Whether any ran out of memory, and the split and wait to use.
        """
        values = [float(failed), float(self.policy.k), float(self.policy.wait), float(give_up)]
        start = time.monotonic()
        try:
            reduced = all_reduce_max(values, self._group)
        except RuntimeError as error:
            raise NotOutOfMemoryError(
                _agreement_failed(trainer.global_step, time.monotonic() - start, error)
            ) from error
        self._attempt.agreed = True
        return dict(zip(("failed", "k", "wait", "give_up"), reduced, strict=True))

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._in_run:  # the update starts now: what it changes, a re-run could not undo
            self._updates.note(optimizer)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._distributed or self._trainer is None:
            return
        agreed = self._agree(trainer, failed=False, give_up=False)
        if agreed["give_up"]:
            raise NotOutOfMemoryError(
                f"AutoMicrobatch: another rank ran out of memory at step {trainer.global_step} with nothing"
                " smaller to try; the run stops on every rank."
            )
        if agreed["failed"]:
            self.policy.adopt(int(agreed["k"]), int(agreed["wait"]), trainer.global_step, count=True)
            rank_zero_warn(
                f"AutoMicrobatch: out of memory on another rank at step {trainer.global_step}; every rank is"
                f" re-running it as {self.policy.k} micro-batches."
            )
            raise _Retry
        if not _logging.is_accumulating(trainer):
            _all_reduce_gradients(trainer)

    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self._require_trainer()
        module = trainer.lightning_module
        original = self._original(module, "training_step")
        # called from elsewhere (a `validation_step` that calls `self.training_step`): as is
        if not self._in_run:
            return original(*args, **kwargs)
        batch, rest = (args[0], args[1:]) if args else (kwargs.pop("batch"), ())
        k = self.policy.k
        self._buffering = True
        try:
            if k == 1:
                self._size = batch_length(batch) or 1
                return original(batch, *rest, **kwargs)
            return self._split_step(trainer, original, batch, rest, kwargs, k)
        finally:
            self._buffering = False

    def _split_step(
        self, trainer: pl.Trainer, original: Any, batch: Any, rest: Any, kwargs: Any, k: int
    ) -> Any:
        """Run ``batch`` as ``k`` micro-batches.

        The backward of all but the last runs here; the last is returned to Lightning.
        """
        chunks = split_batch(batch, k)
        length = sum(size for _, size in chunks)
        optimizer = trainer.optimizers[0]
        loop = trainer.fit_loop.epoch_loop.automatic_optimization
        batch_idx = self._batch_idx
        carried: torch.Tensor | None = None
        for index, (chunk, size) in enumerate(chunks):
            self._size = size
            output = original(chunk, *rest, **kwargs)
            loss = output.get("loss") if isinstance(output, Mapping) else output
            # `training_step` skips the batch: undo its micro-batches' part
            if not isinstance(loss, torch.Tensor):
                if index > 0:
                    for opt in trainer.optimizers:
                        opt.zero_grad(set_to_none=True)
                    self._replay_window(trainer, optimizer)
                return output
            weighted = loss * (size / length)
            if index == len(chunks) - 1:
                final = weighted if carried is None else weighted + carried
                return {**output, "loss": final} if isinstance(output, Mapping) else final
            if index == 0 and batch_idx % trainer.accumulate_grad_batches == 0:
                # Lightning zeroes the gradients after `training_step` returns: do it now, before these
                # backwards.
                self._original(loop, "_on_before_zero_grad")(optimizer)
                self._original(loop, "_optimizer_zero_grad")(batch_idx, optimizer)
                self._attempt.zeroed = True
            self._micro_backward(trainer, weighted / trainer.accumulate_grad_batches, optimizer)
            carried = weighted.detach() if carried is None else carried + weighted.detach()
        return None  # pragma: no cover - the loop returns at the last micro-batch

    def _micro_backward(
        self, trainer: pl.Trainer, loss: torch.Tensor, optimizer: torch.optim.Optimizer
    ) -> None:
        """One micro-batch's backward, as Lightning's without its hooks.

        As Lightning's: the loss scaled, the module's ``backward`` called.
        """
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        tensor = scaler.scale(loss) if scaler is not None else loss
        trainer.precision_plugin.backward(tensor, trainer.lightning_module, optimizer)

    def _backward_hook(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        module = self._require_trainer().lightning_module
        self._original(module, "backward")(loss, *args, **kwargs)
        self._attempt.after_backward = True

    def _skip_if_zeroed(self, name: str) -> Any:
        def zero_grad_step(*args: Any) -> None:
            if self._attempt.zeroed:
                return  # done before the micro-batches' backwards
            loop = self._require_trainer().fit_loop.epoch_loop.automatic_optimization
            self._original(loop, name)(*args)

        return zero_grad_step

    # ------------------------------------------------------------------ logging
    def _log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        module = self._require_trainer().lightning_module
        if not self._buffering:
            return self._original(module, "log")(name, value, *args, **kwargs)
        if args:
            try:
                kwargs = log_arguments(self._original(module, "log"), (name, value, *args), kwargs)
                kwargs.pop("name", None), kwargs.pop("value", None)
            except TypeError:  # more positional arguments than Lightning's `log` has: as they were given
                kwargs = {**dict(zip(list(log_parameters())[2:], args, strict=False)), **kwargs}
        # the value now, not after the optimizer step (a parameter, a view)
        if isinstance(value, torch.Tensor):
            value = value.clone() if kwargs.get("enable_graph") else value.detach().clone()
        self._attempt.calls.append(LogCall(name, value, kwargs, self._size))
        return None

    def _flush_logs(self, module: pl.LightningModule) -> None:
        """Log what the step's ``training_step`` logged, as one unsplit step would have."""
        calls, self._attempt.calls = self._attempt.calls, []
        if not calls:
            return
        log = self._original(module, "log")
        previous = module._current_fx_name  # private: the hook `self.log` files values under
        module._current_fx_name = "training_step"
        try:
            if self.policy.k == 1:
                for call in calls:
                    log(call.name, call.value, **call.kwargs)
            else:
                for name, value, kwargs in combine_logs(calls):
                    log(name, value, **kwargs)
        finally:
            module._current_fx_name = previous

    # ------------------------------------------------------------------ helpers
    def _require_trainer(self) -> pl.Trainer:
        if self._trainer is None:
            raise RuntimeError(
                "AutoMicrobatch was used outside `Trainer.fit`; add it to `Trainer(callbacks=[...])`."
            )
        return self._trainer

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)


def _reset_scaler(trainer: pl.Trainer) -> None:
    """Forget a failed attempt's ``unscale_`` (AMP's ``GradScaler`` refuses another before ``update``)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    states = getattr(scaler, "_per_optimizer_states", None)  # private: GradScaler's per-optimizer stage
    if isinstance(states, dict):
        states.clear()


@dataclass
class Attempt:
    """What one attempt at a step did so far.

    Each attempt (the first, a re-run after an OOM) starts a fresh one.
    """

    # the `self.log` calls of its `training_step`s, buffered
    calls: list[LogCall] = field(default_factory=list)
    # the gradients were zeroed before the micro-batches' backwards (Lightning must not again)
    zeroed: bool = False
    after_backward: bool = False  # its backward has run: an OOM now is in the optimizer step
    agreed: bool = False  # under DDP: the ranks agreed on it (after its backward)


class _Retry(Exception):
    """Another rank ran out of memory in this step: every rank runs it again."""


def _all_reduce_gradients(trainer: pl.Trainer, bucket_bytes: int = 25 * 2**20) -> None:
    """Average the gradients over ranks, as DDP's backward would have (the step's backwards ran without it).

    A parameter without a gradient on every rank keeps none (DDP leaves globally unused parameters alone);
    one that has a gradient on some rank gets the average, counting zero for the others.
    """
    params = [p for p in trainer.lightning_module.parameters() if p.requires_grad]
    device = trainer.strategy.root_device
    present = torch.tensor([float(p.grad is not None) for p in params], dtype=torch.float64, device=device)
    present = trainer.strategy.reduce(present, reduce_op="max")
    used = [p for p, flag in zip(params, present.tolist(), strict=True) if flag]
    for p in used:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in used:
        grad = p.grad
        if grad is not None:
            by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for grad in [*grads, None]:
            if grad is not None:
                bucket.append(grad)
                size += grad.numel() * grad.element_size()
            if bucket and (grad is None or size >= bucket_bytes):
                flat = trainer.strategy.reduce(torch.cat([g.reshape(-1) for g in bucket]), reduce_op="mean")
                offset = 0
                for g in bucket:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
                bucket, size = [], 0


def _add_note(error: BaseException, note: str) -> None:
    """Add ``note`` to the error the user will see (Python 3.11+; earlier, the error goes on without it)."""
    if hasattr(error, "add_note"):
        error.add_note(note)


def _counters(loop: Any) -> list[tuple[Any, dict[str, int]]]:
    """The optimizer-step and zero-grad counters of the loop (private: ``optim_progress``), as plain copies.

    A few integers, copied on every batch: not the whole ``optim_progress.state_dict()``.
    """
    optimizer = loop.optim_progress.optimizer
    trackers = (
        optimizer.step.total,
        optimizer.step.current,
        optimizer.zero_grad.total,
        optimizer.zero_grad.current,
    )
    return [(tracker, dict(vars(tracker))) for tracker in trackers]


def _agreement_failed(step: int, waited_s: float, error: BaseException) -> str:
    """Why the ranks' agreement failed after ``waited_s``.

    A timeout (a rank stuck elsewhere), or a rank gone.
    """
    if waited_s >= 0.9 * AGREE_TIMEOUT_S:
        return (
            f"AutoMicrobatch: the ranks did not all reach the agreement on step {step} within"
            f" {AGREE_TIMEOUT_S:.0f} s (a rank waits in another collective, such as an `all_gather` inside"
            " `training_step`, which AutoMicrobatch cannot re-run on one rank alone); the run stops."
        )
    return (
        f"AutoMicrobatch: another rank left the agreement on step {step} after {waited_s:.0f} s ({error}):"
        " it has most likely stopped with an error of its own (see that rank's output above); the run stops."
    )


def _restore_counters(saved: list[tuple[Any, dict[str, int]]]) -> None:
    for tracker, values in saved:
        vars(tracker).update(values)
