"""BatchSizeTuner: the largest batch size that fits a memory budget, found in few real trials before fit.

Why trials run through Lightning's own loop and are then undone: a trial must cost what training costs (precision,
strategy, closures, validation), and afterwards nothing may remain of it, neither in the weights, optimizer, RNG or
progress counters nor in the allocator. ``tuning/_loops.py`` holds that glue; ``tuning/search.py`` decides which
sizes to try from the measured peaks.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from lightning_gpumem._checks import require_flags, require_int
from lightning_gpumem._distributed import gather_values, max_min
from lightning_gpumem._logging import log_text, log_to_loggers
from lightning_gpumem._oom import expecting_oom, is_oom_error
from lightning_gpumem._units import GIB, format_gib, parse_budget
from lightning_gpumem.budget import budget_bytes
from lightning_gpumem.probe import MemoryProbe
from lightning_gpumem.tuning import _loops
from lightning_gpumem.tuning.search import SearchResult, Trial, search_batch_size

MAX_TRIALS = 25
MAX_VERIFICATIONS = 3  # sizes tried under the fit's own cap after the search, from the largest accepted down
CPU_MAX_VAL = 8192  # upper bound without a device to run out of (and no max_val, no dataset length)


class _PeerFailed(Exception):
    """Another rank ran out of memory in this trial: leave it at the same collective."""


class _TrialCallback(Callback):
    """The only callback during a trial: counts steps, runs one validation batch, agrees across ranks."""

    def __init__(self, steps: int, include_validation: bool) -> None:
        self.steps = steps
        self.include_validation = include_validation
        self.done = 0

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        _agree_or_raise(trainer)
        self.done += 1
        if self.done < self.steps and batch_idx + 1 < trainer.num_training_batches:
            return
        if self.include_validation and trainer.limit_val_batches and trainer.val_dataloaders is not None:
            _loops.run_validation(trainer)
        raise _loops.TrialStop

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
        _agree_or_raise(trainer)


def _agree_or_raise(trainer: pl.Trainer) -> None:
    # Collective: every rank calls it once per training and validation batch; a rank that ran out of memory calls
    # it once from its exception handler instead, so the counts match and nobody waits forever.
    if trainer.world_size > 1 and not trainer.strategy.reduce_boolean_decision(True, all=True):
        raise _PeerFailed


class BatchSizeTuner(Callback):
    r"""Find the largest batch size whose training and validation steps fit a memory budget, then fit with it.

    On fit start (or whenever :meth:`scale` is called, also mid-training) it runs *trials*: ``steps_per_trial`` real
    training steps (forward, backward, optimizer step) and one validation step at a batch size, each starting from the
    run's own state (the optimizer state is put back before every trial, so a trial's first step allocates what the
    fit's first step will). The search runs with the allocator capped at the budget less the headroom
    (``torch.cuda.set_per_process_memory_fraction``), so tuning on an 80 GiB card for a 24 GiB one is exact, and a size
    is accepted if it runs there, with whatever the allocator does to make room (free its cache, cuDNN algorithms with
    smaller workspaces). Peaks guide it (``tuning/search.py``): the reserved peak (an overestimate of the need) gives a
    safe jump, the allocated peak (an underestimate) an optimistic one, bisection settles the rest, within 1% for
    sizes over 100; typically 5-8 trials. The size found then runs once more under the full budget, which is the fit's
    first steps allocation for allocation; if it fails there, the next smaller accepted size is checked. Afterwards the
    weights, optimizer and LR-scheduler states, RNG states, step and epoch counters, callback states and loggers are as
    if no trial had run, and the cache is emptied. The size found is written where Lightning's ``BatchSizeFinder``
    writes it (``model.<batch_arg_name>``, ``model.hparams``, the datamodule or its hparams) and the fit continues with
    it. Under DDP every rank runs every trial; the out-of-memory flag and the peaks are agreed across ranks, so all
    ranks pick the same size and none hangs.

    **Logged metrics**

    ========================  ======  =====================================================
    Key                       Unit    Meaning
    ========================  ======  =====================================================
    ``gpumem/batch_size``     count   the batch size chosen, at the step where tuning ran
    ========================  ======  =====================================================

    The trials (batch size, outcome, peak) are also written as a text table to TensorBoard loggers and kept in
    :attr:`trials`; rank zero prints one line, e.g. ``BatchSizeTuner: batch_size=53 (peak 22.6/24.0 GiB, ...)``.

    Args:
        budget: memory the run may use: ``None`` for the budget of a :class:`~lightning_gpumem.MemoryBudget` among
            the callbacks (placed before this one) or else what is usable on the device now, bytes (``int``), a
            fraction of device memory in (0, 1] (``float``), or a string such as ``"24GiB"`` or ``"16GB"``.
        headroom: fraction of the budget kept free at the chosen size, in [0, 1): the search caps the allocator at
            ``(1 - headroom) * budget`` and accepts the sizes that run under it (without a cap, as elsewhere than
            CUDA: whose peak reserved memory stays under it). What is left covers what trials do not show: batches of
            other shapes (a smaller last batch, varying lengths) and fragmentation over a long run.
        init_val: first batch size tried.
        max_val: largest batch size tried; the result never exceeds it. ``None``: the training dataset's size.
        steps_per_trial: training steps per trial (the first step also creates optimizer state).
        include_validation: also run one validation step per trial, so the size found fits validation too.
        batch_arg_name: attribute holding the batch size, looked up like Lightning's ``BatchSizeFinder`` does.
        keep_effective_batch: scale ``Trainer.accumulate_grad_batches`` so that batch size times accumulation
            stays as configured (rounded to at least 1).

    Raises:
        ValueError: on an invalid argument, or (at fit start) a budget larger than the device.
        AttributeError: (at fit start) if nothing holds an attribute named ``batch_arg_name``.
        RuntimeError: (at fit start) if even a batch size of 1 does not fit the budget.

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
        steps_per_trial: int = 2,
        include_validation: bool = True,
        batch_arg_name: str = "batch_size",
        keep_effective_batch: bool = False,
    ) -> None:
        if budget is not None:
            parse_budget(budget, 1, "BatchSizeTuner")  # type and format now; the size against the device at fit
        if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0.0 <= headroom < 1.0:
            raise ValueError(f"`BatchSizeTuner(headroom={headroom!r})` is not valid. Expected a number in [0, 1).")
        require_int("BatchSizeTuner", "init_val", init_val, 1)
        require_int("BatchSizeTuner", "steps_per_trial", steps_per_trial, 1)
        if max_val is not None and (isinstance(max_val, bool) or not isinstance(max_val, int) or max_val < init_val):
            raise ValueError(
                f"`BatchSizeTuner(max_val={max_val!r})` is not valid. Expected None or an integer >= init_val"
                f" ({init_val})."
            )
        if not isinstance(batch_arg_name, str) or not batch_arg_name:
            raise ValueError(f"`BatchSizeTuner(batch_arg_name={batch_arg_name!r})` is not valid. Expected a name.")
        require_flags(
            "BatchSizeTuner", include_validation=include_validation, keep_effective_batch=keep_effective_batch
        )
        self.budget = budget
        self.headroom = float(headroom)
        self.init_val = init_val
        self.max_val = max_val
        self.steps_per_trial = steps_per_trial
        self.include_validation = include_validation
        self.batch_arg_name = batch_arg_name
        self.keep_effective_batch = keep_effective_batch

        self.optimal_batch_size: int | None = None
        """The batch size chosen by the last search (``None`` before one ran)."""
        self.result: SearchResult | None = None
        """The last search's trials and stop reason."""
        self.budget_bytes: int | None = None
        """The budget the last search used, in bytes (``None`` on CPU)."""

    @property
    def trials(self) -> tuple[Trial, ...]:
        """The last search's trials, in the order they ran."""
        return self.result.trials if self.result is not None else ()

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.scale(trainer, pl_module)

    def _make_probe(self, device: torch.device) -> MemoryProbe:
        """Create the probe for ``device`` (tests override this to inject a fake sample source)."""
        return MemoryProbe(device, nvml=False, host=False)

    def scale(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int | None:
        """Search now and switch the run to the size found; returns it (``None`` if skipped).

        Call it from any hook of a running fit (e.g. ``on_train_epoch_start``) to re-tune mid-training; trial steps
        count from the current step and leave no trace.
        """
        if trainer.fast_dev_run:  # type: ignore[attr-defined]
            rank_zero_warn("BatchSizeTuner: skipped because `fast_dev_run` is enabled.")
            return None
        if not _loops.has_batch_arg(trainer, self.batch_arg_name):
            raise AttributeError(
                f"`BatchSizeTuner(batch_arg_name={self.batch_arg_name!r})`: neither the LightningModule, its hparams,"
                f" the datamodule nor its hparams has an attribute `{self.batch_arg_name}`. Add it (and use it in your"
                " dataloaders), or pass the name your code uses."
            )
        probe = self._make_probe(trainer.strategy.root_device)
        rng = _loops.capture_rng()  # loading data may draw random numbers too: restore them at the very end
        original_size = _loops.get_batch_size(trainer, self.batch_arg_name)
        was_loaded = _loops.dataloaders_loaded(trainer)
        limit = self._limit_bytes(probe, trainer)
        _loops.reload_dataloaders(trainer)
        upper = self._upper_bound(trainer)

        start = time.perf_counter()
        snapshot = _loops.TrainerSnapshot(trainer)
        previous_fraction = None
        total = probe.total_bytes() if limit is not None and probe.device.type == "cuda" else None
        if total:
            # The search runs under the budget less the headroom: a size is accepted if it runs there, with whatever
            # the allocator must do to make room (free its cache, pick cuDNN algorithms with smaller workspaces).
            previous_fraction = probe.set_memory_fraction(min(1.0, limit / total))  # type: ignore[operator]
        try:
            with expecting_oom():  # trials that run out of memory are the search's plan, not failures to report
                result = search_batch_size(
                    lambda size: self._run_trial(trainer, snapshot, probe, size),
                    init_val=self.init_val,
                    upper=upper,
                    limit_bytes=limit,
                    max_trials=MAX_TRIALS,
                )
                if total and self.budget_bytes is not None and result.batch_size is not None:
                    probe.set_memory_fraction(min(1.0, self.budget_bytes / total))
                    result = self._verify(trainer, snapshot, probe, result)
        finally:
            snapshot.restore()
            if previous_fraction is not None:
                probe.set_memory_fraction(previous_fraction)
            _release(probe)
        seconds = time.perf_counter() - start
        self.result = result
        if result.batch_size is None:
            _loops.set_batch_size(trainer, self.batch_arg_name, original_size)
            self._finish_dataloaders(trainer, was_loaded, rng)
            if any(t.fits for t in result.trials):
                raise RuntimeError(
                    f"BatchSizeTuner: the sizes the search accepted under {format_gib(limit)} ran out of memory when"
                    f" run again under the full budget of {format_gib(self.budget_bytes)} (allocator fragmentation;"
                    f" trials: {[(t.batch_size, t.fits) for t in result.trials]}). Raise `headroom`."
                )
            raise RuntimeError(
                f"BatchSizeTuner: even batch_size=1 does not fit the budget of {format_gib(self.budget_bytes)}"
                f" ({len(result.trials)} trials). Lower the memory per sample (precision='bf16-mixed', activation"
                " checkpointing) or raise `budget`."
            )
        self.optimal_batch_size = result.batch_size
        _loops.set_batch_size(trainer, self.batch_arg_name, result.batch_size)
        self._finish_dataloaders(trainer, was_loaded, rng)
        if self.keep_effective_batch:
            self._keep_effective_batch(trainer, original_size, result.batch_size)
        self._report(trainer, result, seconds, upper)
        return result.batch_size

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _finish_dataloaders(trainer: pl.Trainer, was_loaded: bool, rng: dict[str, Any]) -> None:
        """Leave the dataloaders as they were: unbuilt at fit start, rebuilt at the new size mid-training."""
        if was_loaded:
            _loops.reload_dataloaders(trainer)
        else:
            _loops.unload_dataloaders(trainer)
        _loops.restore_rng(rng)

    def _limit_bytes(self, probe: MemoryProbe, trainer: pl.Trainer) -> int | None:
        total = probe.total_bytes()
        if not probe.has_allocator or total is None:
            self.budget_bytes = None
            return None
        if self.budget is None:  # a MemoryBudget's, else what this process can use now
            self.budget_bytes = budget_bytes(trainer) or probe.usable_bytes() or total
        else:
            self.budget_bytes = parse_budget(self.budget, total, "BatchSizeTuner")
            if self.budget_bytes > total:
                raise ValueError(
                    f"`BatchSizeTuner(budget={self.budget!r})` is {format_gib(self.budget_bytes)}, larger than the"
                    f" device's {format_gib(total)}. Expected at most the device's memory."
                )
        return int(self.budget_bytes * (1.0 - self.headroom))

    def _upper_bound(self, trainer: pl.Trainer) -> int:
        size = _loops.train_dataset_size(trainer)
        candidates = [v for v in (self.max_val, size) if v is not None]
        interval = trainer.val_check_interval
        if size is not None and isinstance(interval, int) and trainer.check_val_every_n_epoch is not None:
            # Lightning refuses a `val_check_interval` larger than the number of batches per epoch.
            candidates.append(max(1, size // interval))
        if not candidates:
            candidates = [CPU_MAX_VAL]
        return max(1, min(candidates))

    def _run_trial(self, trainer: pl.Trainer, snapshot: _loops.TrainerSnapshot, probe: MemoryProbe, size: int) -> Trial:
        _loops.set_batch_size(trainer, self.batch_arg_name, size)
        # Limits first: the reload fixes how many validation batches the loop will run.
        snapshot.prepare_trial(_TrialCallback(self.steps_per_trial, self.include_validation), self.include_validation)
        _loops.reload_dataloaders(trainer)
        snapshot.reset_optimizers()
        probe.release_cache()  # the peak reserved of this trial must not include the last one's cache
        probe.reset_peaks()
        start = time.perf_counter()
        fits = True
        try:
            _loops.run_trial_loop(trainer)
        except _loops.TrialStop:
            pass
        except _PeerFailed:
            fits = False
        except Exception as error:
            if not is_oom_error(error):
                raise  # the user's own error: never swallowed
            fits = False
            del error  # drop the traceback, which holds the trial's tensors
            if trainer.world_size > 1:
                trainer.strategy.reduce_boolean_decision(False, all=True)  # matches the peers' `_agree_or_raise`
        finally:
            _zero_grad(trainer)
            _loops.drop_trial_references(trainer)
        seconds = time.perf_counter() - start
        peak_allocated, peak_reserved = probe.read_peaks()
        if not fits:
            gc.collect()  # an OOM's traceback frames hold tensors in reference cycles
            probe.release_cache()  # (otherwise the next trial's start, or the end of the search, releases it)
        if trainer.world_size > 1:  # all ranks measured the same sizes: agree on the largest peaks
            gathered = gather_values(trainer, [peak_allocated, peak_reserved])
            peak_allocated, peak_reserved = (_int_or_none(max_min(gathered, i)[0]) for i in (0, 1))
        if not fits:
            peak_allocated = peak_reserved = None
        return Trial(size, fits=fits, peak_bytes=peak_reserved, seconds=seconds, allocated_bytes=peak_allocated)

    def _verify(
        self, trainer: pl.Trainer, snapshot: _loops.TrainerSnapshot, probe: MemoryProbe, result: SearchResult
    ) -> SearchResult:
        """Run the size found once more under the fit's own cap, from the fit's own starting state.

        That trial is the fit's first steps, allocation for allocation; where the allocator's layout under the
        search's tighter cap differed and the size does not run here, the next smaller accepted size is tried.
        """
        found = result.batch_size or 0
        accepted = sorted({t.batch_size for t in result.trials if t.fits and t.batch_size <= found}, reverse=True)
        checks: list[Trial] = []
        for size in accepted[:MAX_VERIFICATIONS]:
            trial = self._run_trial(trainer, snapshot, probe, size)
            checks.append(trial)
            if trial.fits:
                return SearchResult(size, result.trials + tuple(checks), result.reason)
        return SearchResult(None, result.trials + tuple(checks), result.reason)

    def _keep_effective_batch(self, trainer: pl.Trainer, original_size: int, new_size: int) -> None:
        effective = original_size * trainer.accumulate_grad_batches
        accumulate = max(1, round(effective / new_size))
        if accumulate != trainer.accumulate_grad_batches:
            rank_zero_info(
                f"BatchSizeTuner: accumulate_grad_batches {trainer.accumulate_grad_batches} -> {accumulate} to keep"
                f" the effective batch near {effective} (now {new_size} x {accumulate} = {new_size * accumulate})."
            )
        trainer.accumulate_grad_batches = accumulate

    def _report(self, trainer: pl.Trainer, result: SearchResult, seconds: float, upper: int) -> None:
        chosen = next(t for t in reversed(result.trials) if t.batch_size == result.batch_size)
        peak = (
            f"peak {chosen.peak_bytes / GIB:.1f}/{self.budget_bytes / GIB:.1f} GiB"
            if chosen.peak_bytes is not None and self.budget_bytes
            else "no memory measured"
        )
        rank_zero_info(
            f"BatchSizeTuner: batch_size={result.batch_size} ({peak}, {len(result.trials)} trials,"
            f" {result.num_ooms} OOM, {seconds:.1f} s)"
        )
        if result.reason == "upper_bound":
            rank_zero_warn(
                f"BatchSizeTuner: stopped at the upper bound {upper} (max_val or the dataset size) without running out"
                " of memory; the device could take more."
            )
        if not trainer.is_global_zero:
            return
        rows = "\n".join(
            f"| {t.batch_size} | {'ok' if t.fits else 'OOM'} | "
            f"{'-' if t.peak_bytes is None else f'{t.peak_bytes / GIB:.2f}'} | {t.seconds:.2f} |"
            for t in result.trials
        )
        table = f"| batch size | outcome | peak reserved GiB | seconds |\n|---|---|---|---|\n{rows}"
        log_to_loggers(trainer, {"gpumem/batch_size": float(result.batch_size or 0)}, step=trainer.global_step)
        log_text(trainer, "gpumem/batch_size_trials", table, step=trainer.global_step)


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)


def _zero_grad(trainer: pl.Trainer) -> None:
    for optimizer in trainer.optimizers:
        optimizer.zero_grad(set_to_none=True)


def _release(probe: MemoryProbe) -> None:
    gc.collect()
    probe.release_cache()
