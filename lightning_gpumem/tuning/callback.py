"""BatchSizeTuner: the largest batch size that fits a memory budget, found in few real trials before fit.

Why trials run through Lightning's own loop and are then undone: a trial must cost what training costs
(precision, strategy, closures, validation), and afterwards nothing may remain of it. ``trials/bench.py``
runs and measures the trials and undoes them, ``search/`` decides which sizes to try from the measured peaks,
``bounds.py`` says how far it may go and ``record.py`` says what was found.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_gpumem import keys
from lightning_gpumem._core.checks import require_trainer
from lightning_gpumem._core.units import parse_budget
from lightning_gpumem._hw.probe import make_probe
from lightning_gpumem._pl.compat import Callback, either
from lightning_gpumem.tuning.arguments import check_tuner
from lightning_gpumem.tuning.lengths.scan import LengthFn
from lightning_gpumem.tuning.record import Searched, Shapes, SizeLog, refuse_none, report, warn_shapes
from lightning_gpumem.tuning.search import SearchResult, Trial
from lightning_gpumem.tuning.trials import session as _session
from lightning_gpumem.tuning.tune import restore, tune_traced, tune_with


@keys.document
class BatchSizeTuner(Callback):
    r"""Find the largest batch size whose training and validation steps fit a budget, then fit with it.

    At fit start it runs *trials*: ``steps_per_trial`` real optimizer steps (with gradient accumulation, all
    the accumulated micro-batches and the step) and, where the fit validates, one validation batch, at a
    candidate batch size, each from the run's own starting state and from the allocator layout of a fresh
    process. Trials run with the allocator capped at the budget
    (``torch.cuda.set_per_process_memory_fraction``), so tuning on an 80 GiB card for a 24 GiB one is exact.
    The search probes ``init_val``, predicts the largest size under the budget from the measured peaks,
    validates each prediction in a trial and closes in to within 1%; the tuner then gives up at most
    ``headroom`` of the largest size the budget holds (``docs/batch_size_tuner.md``).

    A tuned fit equals a fit with the chosen size set by hand (weights, optimizer, schedulers, counters, RNG
    streams, logged metrics, checkpoints, hook calls; ``tests/tuning/test_conformance.py``);
    ``configure_optimizers`` runs once more after tuning. The size is written where Lightning's
    ``BatchSizeFinder`` writes it, saved in checkpoints and applied on ``fit(ckpt_path=...)`` without trials.
    Under DDP all ranks agree on every trial.

    **Logged metrics** (from :mod:`lightning_gpumem.keys`):

    {logged_metrics}

    The trials also go to every logger as a table (kept in :attr:`trials`); under ``LightningCLI`` the size
    is written beside ``config.yaml`` as ``gpumem_batch_size.yaml``.

    Args:
        budget: memory the run may use: ``None`` for the budget of a :class:`~lightning_gpumem.MemoryBudget`
            among the callbacks (placed before this one) or else what is usable on the device now, bytes
            (``int``), a fraction of device memory in (0, 1] (``float``), or a string such as ``"24GiB"`` or
            ``"16GB"``.
        headroom: fraction of the largest size the budget holds given up at most, in [0, 1): the size chosen
            is the smallest at least ``(1 - headroom) * largest``, and under ``1 / headroom`` nothing is
            given up. ``largest`` is one less than the smallest size that failed where the search closed in
            on it, else the largest size that ran; the size chosen never exceeds the largest size that ran.
            Nothing is given up where memory does not bound the size (the search stopped at ``max_val`` or
            the dataset size).
        init_val: first batch size tried.
        max_val: largest batch size tried; the result never exceeds it. ``None``: the samples an epoch of the
            training loader draws, per rank (and at most the size that still gives an integer
            ``val_check_interval`` its batches). On a device without memory to measure (a CPU) the tuner
            searches only where ``max_val`` is given, and otherwise keeps the run's size with one warning.
        steps_per_trial: optimizer steps per trial (the first step also creates optimizer state; a later step
            can need more than the first two).
        include_validation: also run one validation batch per trial where the fit validates.
        batch_arg_name: attribute holding the batch size, looked up like Lightning's ``BatchSizeFinder``
            does; the ``max_tokens`` of the training loader's :class:`~lightning_gpumem.TokenBudgetSampler`
            tunes that budget (trials run its heaviest batches).
        keep_effective_batch: scale ``Trainer.accumulate_grad_batches`` in every trial so that batch size
            times accumulation stays as configured (rounded, at least 1); the fit uses the accumulation of
            the size chosen.
        retune_on_resume: on ``fit(ckpt_path=...)``, tune again instead of applying the size saved in the
            checkpoint.
        method: deprecated and ignored: ``"predict"`` and ``"search"`` are both the one search now.
        length_fn: how a sample's size is measured, for data whose batches change shape: a function of the
            sample, or the key (or attribute) of a field holding the length or the sequence itself
            (``"input_ids"``); trials then draw the longest samples first (``docs/variable_length.md``).
        shape_margin: fraction of the budget the trials leave free where batches change shape (``length_fn``
            or a token budget), in [0, 1). ``None``: ``0.2``, or ``0.06`` with
            ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``; ``0`` where shapes do not change.
        start: ``"probe"``: the search starts from its first trial alone. ``"trace"``: the training (and
            validation) step is first traced on fake tensors (as :class:`MemoryPlanner` does without a GPU),
            and the second trial is the largest size its replay fits in the budget, shifted by what the
            first trial measured above the trace, less ``headroom``: where the headroom gave something up
            and that size runs, it is kept (two trials); else the search closes in from there
            (``docs/batch_size_tuner.md``, "Starting from a trace"). Not for batches whose shapes vary; a
            step that cannot be traced gives one warning and the search from its probe.

    Raises:
        ValueError: on an invalid argument, or (at fit start) a budget larger than the device, dataloaders
            passed to ``trainer.fit``, or a training dataset without a length and no ``max_val``.
        AttributeError: (at fit start) if nothing holds an attribute named ``batch_arg_name``.
        RuntimeError: (at fit start) if even a batch size of 1 does not fit the budget, or :meth:`scale` is
            called from a hook it cannot run from.

    Example::

        from lightning import Trainer
        from lightning_gpumem import BatchSizeTuner

        trainer = Trainer(callbacks=[BatchSizeTuner(budget="24GiB")])
        trainer.fit(model)  # model.batch_size (or model.hparams.batch_size) is tuned first
    """

    def __init__(
        self,
        budget: int | float | str | None = None,
        headroom: float = 0.05,
        init_val: int = 2,
        max_val: int | None = None,
        steps_per_trial: int = 3,
        include_validation: bool = True,
        batch_arg_name: str = "batch_size",
        keep_effective_batch: bool = False,
        retune_on_resume: bool = False,
        method: str | None = None,
        length_fn: LengthFn | None = None,
        shape_margin: float | None = None,
        start: Literal["probe", "trace"] = "probe",
    ) -> None:
        check_tuner(
            budget=budget,
            headroom=headroom,
            init_val=init_val,
            max_val=max_val,
            steps_per_trial=steps_per_trial,
            batch_arg_name=batch_arg_name,
            method=method,
            length_fn=length_fn,
            shape_margin=shape_margin,
            start=start,
            include_validation=include_validation,
            keep_effective_batch=keep_effective_batch,
            retune_on_resume=retune_on_resume,
        )
        self.budget = budget
        self.headroom = float(headroom)
        self.init_val = init_val
        self.max_val = max_val
        self.steps_per_trial = steps_per_trial
        self.include_validation = include_validation
        self.batch_arg_name = batch_arg_name
        self.keep_effective_batch = keep_effective_batch
        self.retune_on_resume = retune_on_resume
        self.length_fn = length_fn
        self.shape_margin = None if shape_margin is None else float(shape_margin)
        self.start = start

        self.optimal_batch_size: int | None = None
        """The batch size chosen by the last search (or restored from a checkpoint; ``None`` before
        either)."""
        self.result: SearchResult | None = None
        """The last search's trials and stop reason."""
        self.searched = Searched()
        """The last search's budget, margin and counts
        (:class:`~lightning_gpumem.tuning.record.Searched`)."""
        self._accumulation: int | None = None
        self._restored: dict[str, Any] | None = None
        self._size_log = SizeLog()

    @property
    def trials(self) -> tuple[Trial, ...]:
        """The last search's trials, in the order they ran."""
        return self.result.trials if self.result is not None else ()

    @property
    def budget_bytes(self) -> int | None:
        """The budget the last search used, in bytes (``None`` on CPU)."""
        return self.searched.budget_bytes

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_trainer("BatchSizeTuner", trainer)
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        finder = either("callbacks", "BatchSizeFinder")
        finders = [type(c).__name__ for c in callbacks if isinstance(c, finder)]
        if stage == "fit" and finders:
            raise ValueError(
                f"BatchSizeTuner and Lightning's {finders[0]} are both in the Trainer's callbacks: both tune"
                " the batch size at fit start and would undo each other's trials. Keep one of them."
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        require_trainer("BatchSizeTuner", trainer)
        restored, self._restored = self._restored, None
        if restored is not None and not self.retune_on_resume:
            self._apply_restored(trainer, restored)
            return
        self.scale(trainer, pl_module)

    def gpumem_summary_context(self) -> dict[str, Any]:
        """What this callback adds to ``MemoryMonitor``'s fit-end advice.

        Whether a batch size was tuned, and the allocator's OOM and retry counts when the trials ended
        (planned, so not the run's).
        """
        context: dict[str, Any] = dict(self.searched.planned)
        if self.optimal_batch_size is not None:
            context["tuned"] = True
        return context

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.optimal_batch_size,
            "accumulate_grad_batches": self._accumulation,
            "budget_bytes": self.budget_bytes,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("batch_size") is not None:
            self._restored = dict(state_dict)

    def scale(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int | None:
        """Search now and switch the run to the size found; returns it (``None`` if skipped).

        The tuner calls it at fit start. Call it from ``on_train_epoch_start`` (of a callback or the module)
        to re-tune mid-training: the new size applies from that epoch, trial steps count from the current
        step and leave no trace. Mid-training, ``configure_optimizers`` is not run again (the optimizer state
        is kept).
        """
        hook = _session.current_hook(trainer)
        if hook not in _session.SCALE_HOOKS:
            raise RuntimeError(
                f"`BatchSizeTuner.scale()` was called from `{hook}`. It runs only from `on_fit_start` (where"
                " the tuner calls it) or `on_train_epoch_start`, before an epoch's batches are drawn; call"
                " it from there."
            )
        skipped = "`fast_dev_run` is enabled" if trainer.fast_dev_run else None  # type: ignore[attr-defined]
        if trainer.limit_train_batches == 0:
            skipped = "`limit_train_batches=0` runs no training step"
        if skipped:
            rank_zero_warn(f"BatchSizeTuner: skipped because {skipped}.")
            return None
        _session.require_settable_batch(trainer, self.batch_arg_name, "BatchSizeTuner")
        probe = make_probe(trainer.strategy.root_device, self)
        # no allocator: a budget in bytes is planned by trace, unless `max_val` asks for real steps up to it
        budget = self.budget
        if not probe.has_allocator and isinstance(budget, (int, str)) and self.max_val is None:
            return self._scale_traced(trainer, parse_budget(budget, None, "BatchSizeTuner"))
        # a CPU smoke test: no search bounded by nothing
        if not probe.has_allocator and self.max_val is None:
            size = _session.get_batch_size(trainer, self.batch_arg_name)
            rank_zero_warn(
                f"BatchSizeTuner: `{probe.device}` has no memory allocator to measure, so only the dataset's"
                f" size would bound a search; kept `{self.batch_arg_name}={size}`. Pass `max_val` to search"
                " up to it anyway (every size tried runs real steps)."
            )
            return None
        self.searched = Searched(original=(_session.get_batch_size(trainer, self.batch_arg_name), 1))
        start = time.perf_counter()
        result, shapes, upper = tune_with(trainer, self, probe, self.searched, self._accumulation_for)
        self.result = result
        self._apply(trainer, result, shapes)
        seconds = time.perf_counter() - start
        report(trainer, self.batch_arg_name, result, self.searched, seconds, upper, self.shape_margin)
        self._record(trainer)
        return result.batch_size

    # ------------------------------------------------------------------ helpers
    def _scale_traced(self, trainer: pl.Trainer, budget: int) -> int | None:
        """No allocator to measure: the size the traced step fits in ``budget`` (no trials)."""
        size = _session.get_batch_size(trainer, self.batch_arg_name)
        self.searched = Searched(original=(size, trainer.accumulate_grad_batches))
        kept = tune_traced(trainer, budget, self, accumulation_for=self._accumulation_for)
        if kept is not None:
            self.optimal_batch_size, self._accumulation = kept, trainer.accumulate_grad_batches
            self._record(trainer)
        return kept

    def _apply(self, trainer: pl.Trainer, result: SearchResult, shapes: list[Shapes]) -> None:
        """Keep the size found (the session applied it), or say why there is none."""
        tokens = self.searched.tokens is not None
        self.optimal_batch_size = refuse_none(result, self.budget_bytes, self.batch_arg_name, tokens)
        self._accumulation = trainer.accumulate_grad_batches
        size, accumulation = self.searched.original
        if self.keep_effective_batch and self._accumulation != accumulation:
            rank_zero_info(
                f"BatchSizeTuner: accumulate_grad_batches {accumulation} -> {self._accumulation} to keep the"
                f" effective batch near {size * accumulation} (now {result.batch_size} x"
                f" {self._accumulation} = {self.optimal_batch_size * self._accumulation})."
            )
        if self.searched.tokens is None and self.length_fn is None:
            warn_shapes(shapes)

    def _accumulation_for(self, size: int) -> int:
        original_size, original_accumulation = self.searched.original
        if not self.keep_effective_batch:
            return original_accumulation
        return max(1, round(original_size * original_accumulation / size))

    def _apply_restored(self, trainer: pl.Trainer, state: dict[str, Any]) -> None:
        size, accumulation, self.searched = restore(
            trainer, state, self.batch_arg_name, self.keep_effective_batch
        )
        self.optimal_batch_size, self._accumulation = size, accumulation
        self._record(trainer)

    def _record(self, trainer: pl.Trainer) -> None:
        if self.optimal_batch_size is not None:
            accumulation = self._accumulation if self.keep_effective_batch else None
            self._size_log.record(
                trainer, self.batch_arg_name, self.optimal_batch_size, accumulation, self.searched
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after Lightning's own `log_hyperparams` (the initial hparams) and, on resume, at the restored step
        self._size_log.log(trainer)
