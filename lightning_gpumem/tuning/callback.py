"""BatchSizeTuner: the largest batch size that fits a memory budget, found in few real trials before fit.

Why trials run through Lightning's own loop and are then undone: a trial must cost what training costs (precision,
strategy, closures, validation), and afterwards nothing may remain of it. ``trials/bench.py`` runs and measures the
trials and undoes them, ``search/`` decides which sizes to try from the measured peaks, ``bounds.py`` says how far
it may go and ``record.py`` says what was found.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_deprecation, rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_gpumem import keys
from lightning_gpumem._core.checks import (
    require_flags,
    require_fraction,
    require_int,
    require_length_fn,
    require_trainer,
)
from lightning_gpumem._core.units import GIB, check_budget, format_gib
from lightning_gpumem._hw.probe import make_probe
from lightning_gpumem._pl.compat import Callback, either
from lightning_gpumem.tuning import bounds
from lightning_gpumem.tuning.lengths.longest import LongestFirst, margin_for
from lightning_gpumem.tuning.lengths.scan import LengthFn
from lightning_gpumem.tuning.lengths.token_budget import TokenBudgetSampler, heaviest_batches_first
from lightning_gpumem.tuning.record import Searched, SizeLog, report
from lightning_gpumem.tuning.search import (
    SearchResult,
    Trial,
    TrialSource,
    leave_headroom,
    search_batch_size,
    until_data_ends,
)
from lightning_gpumem.tuning.search.headroom import TUNER_TOLERANCE
from lightning_gpumem.tuning.trials import loaders
from lightning_gpumem.tuning.trials import session as _session
from lightning_gpumem.tuning.trials.bench import TrialBench
from lightning_gpumem.tuning.trials.measure import BatchCheck

MAX_TRIALS = 25
METHODS = ("predict", "search")  # the names of the former methods, both now the one search


@keys.document
class BatchSizeTuner(Callback):
    r"""Find the largest batch size whose training and validation steps fit a memory budget, then fit with it.

    At fit start it runs *trials*: ``steps_per_trial`` real optimizer steps (with gradient accumulation, all the
    accumulated micro-batches and the step) and, where the fit validates, one validation batch, at a candidate
    batch size, each from the run's own starting state and from the allocator layout of a fresh process. Trials run
    with the allocator capped at the budget (``torch.cuda.set_per_process_memory_fraction``), so tuning on an 80 GiB
    card for a 24 GiB one is exact. The search probes ``init_val``, predicts the largest size under the budget from
    the measured peaks, validates each prediction in a trial and closes in to within 1%; the tuner then gives up at
    most ``headroom`` of the largest size the budget holds (``docs/batch_size_tuner.md``).

    A tuned fit equals a fit with the chosen size set by hand (weights, optimizer, schedulers, counters, RNG
    streams, logged metrics, checkpoints, hook calls; ``tests/tuning/test_conformance.py``); ``configure_optimizers``
    runs once more after tuning. The size is written where Lightning's ``BatchSizeFinder`` writes it, saved in
    checkpoints and applied on ``fit(ckpt_path=...)`` without trials. Under DDP all ranks agree on every trial.

    **Logged metrics** (from :mod:`lightning_gpumem.keys`):

    {logged_metrics}

    The trials also go to every logger as a table (kept in :attr:`trials`); under ``LightningCLI`` the size is
    written beside ``config.yaml`` as ``gpumem_batch_size.yaml``.

    Args:
        budget: memory the run may use: ``None`` for the budget of a :class:`~lightning_gpumem.MemoryBudget` among
            the callbacks (placed before this one) or else what is usable on the device now, bytes (``int``), a
            fraction of device memory in (0, 1] (``float``), or a string such as ``"24GiB"`` or ``"16GB"``.
        headroom: fraction of the largest size the budget holds given up at most, in [0, 1): the size chosen is
            the smallest at least ``(1 - headroom) * largest``, and under ``1 / headroom`` nothing is given up.
            ``largest`` is one less than the smallest size that failed where the search closed in on it, else the
            largest size that ran; the size chosen never exceeds the largest size that ran. Nothing is given up
            where memory does not bound the size (the search stopped at ``max_val`` or the dataset size).
        init_val: first batch size tried.
        max_val: largest batch size tried; the result never exceeds it. ``None``: the samples an epoch of the
            training loader draws, per rank (and at most the size that still gives an integer
            ``val_check_interval`` its batches). On a device without memory to measure (a CPU) the tuner searches
            only where ``max_val`` is given, and otherwise keeps the run's size with one warning.
        steps_per_trial: optimizer steps per trial (the first step also creates optimizer state; a later step can
            need more than the first two).
        include_validation: also run one validation batch per trial where the fit validates.
        batch_arg_name: attribute holding the batch size, looked up like Lightning's ``BatchSizeFinder`` does; the
            ``max_tokens`` of the training loader's :class:`~lightning_gpumem.TokenBudgetSampler` tunes that
            budget (trials run its heaviest batches).
        keep_effective_batch: scale ``Trainer.accumulate_grad_batches`` in every trial so that batch size times
            accumulation stays as configured (rounded, at least 1); the fit uses the accumulation of the size chosen.
        retune_on_resume: on ``fit(ckpt_path=...)``, tune again instead of applying the size saved in the checkpoint.
        method: deprecated and ignored: ``"predict"`` and ``"search"`` are both the one search now.
        length_fn: how a sample's size is measured, for data whose batches change shape: a function of the sample,
            or the key (or attribute) of a field holding the length or the sequence itself (``"input_ids"``);
            trials then draw the longest samples first (``docs/variable_length.md``).
        shape_margin: fraction of the budget the trials leave free where batches change shape (``length_fn`` or a
            token budget), in [0, 1). ``None``: ``0.2``, or ``0.06`` with
            ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``; ``0`` where shapes do not change.

    Raises:
        ValueError: on an invalid argument, or (at fit start) a budget larger than the device, dataloaders passed
            to ``trainer.fit``, or a training dataset without a length and no ``max_val``.
        AttributeError: (at fit start) if nothing holds an attribute named ``batch_arg_name``.
        RuntimeError: (at fit start) if even a batch size of 1 does not fit the budget, or :meth:`scale` is called
            from a hook it cannot run from.

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
    ) -> None:
        if budget is not None:
            check_budget(budget, "BatchSizeTuner")  # type and format now; the size against the device at fit
        require_fraction("BatchSizeTuner", "headroom", headroom)
        require_int("BatchSizeTuner", "init_val", init_val, 1)
        require_int("BatchSizeTuner", "steps_per_trial", steps_per_trial, 1)
        if max_val is not None and (isinstance(max_val, bool) or not isinstance(max_val, int) or max_val < init_val):
            raise ValueError(
                f"`BatchSizeTuner(max_val={max_val!r})` is not valid. Expected None or an integer >= init_val"
                f" ({init_val})."
            )
        if not isinstance(batch_arg_name, str) or not batch_arg_name:
            raise ValueError(f"`BatchSizeTuner(batch_arg_name={batch_arg_name!r})` is not valid. Expected a name.")
        if method is not None:
            if not isinstance(method, str) or method not in METHODS:
                raise ValueError(f"`BatchSizeTuner(method={method!r})` is not valid. Expected None or one of {METHODS}.")
            rank_zero_deprecation("`BatchSizeTuner(method=...)` is deprecated and ignored: there is one search now.")
        require_length_fn("BatchSizeTuner", length_fn)
        require_fraction("BatchSizeTuner", "shape_margin", shape_margin, none_ok=True)
        require_flags(
            "BatchSizeTuner",
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

        self.optimal_batch_size: int | None = None
        """The batch size chosen by the last search (or restored from a checkpoint; ``None`` before either)."""
        self.result: SearchResult | None = None
        """The last search's trials and stop reason."""
        self.searched = Searched()
        """The last search's budget, margin and counts (:class:`~lightning_gpumem.tuning.record.Searched`)."""
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
        finder = either("callbacks", "BatchSizeFinder")
        finders = [type(c).__name__ for c in trainer.callbacks if isinstance(c, finder)]  # type: ignore[attr-defined]
        if stage == "fit" and finders:
            raise ValueError(
                f"BatchSizeTuner and Lightning's {finders[0]} are both in the Trainer's callbacks: both tune the"
                " batch size at fit start and would undo each other's trials. Keep one of them."
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
        """What this callback adds to ``MemoryMonitor``'s fit-end advice: whether a batch size was tuned, and the
        allocator's OOM and retry counts when the trials ended (planned, so not the run's).
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

        The tuner calls it at fit start. Call it from ``on_train_epoch_start`` (of a callback or the module) to
        re-tune mid-training: the new size applies from that epoch, trial steps count from the current step and
        leave no trace. Mid-training, ``configure_optimizers`` is not run again (the optimizer state is kept).
        """
        hook = _session.current_hook(trainer)
        if hook not in _session.SCALE_HOOKS:
            raise RuntimeError(
                f"`BatchSizeTuner.scale()` was called from `{hook}`. It runs only from `on_fit_start` (where the"
                " tuner calls it) or `on_train_epoch_start`, before an epoch's batches are drawn; call it from there."
            )
        skipped = "`fast_dev_run` is enabled" if trainer.fast_dev_run else None  # type: ignore[attr-defined]
        if trainer.limit_train_batches == 0:
            skipped = "`limit_train_batches=0` runs no training step"
        if skipped:
            rank_zero_warn(f"BatchSizeTuner: skipped because {skipped}.")
            return None
        _session.require_settable_batch(trainer, self.batch_arg_name, "BatchSizeTuner")
        probe = make_probe(trainer.strategy.root_device, self)
        if not probe.has_allocator and self.max_val is None:  # a CPU smoke test: no search bounded by nothing
            size = _session.get_batch_size(trainer, self.batch_arg_name)
            rank_zero_warn(
                f"BatchSizeTuner: `{probe.device}` has no memory allocator to measure, so only the dataset's size"
                f" would bound a search; kept `{self.batch_arg_name}={size}`. Pass `max_val` to search up to it"
                " anyway (every size tried runs real steps)."
            )
            return None
        self.searched = searched = Searched(original=(_session.get_batch_size(trainer, self.batch_arg_name), 1))
        init_val, upper = self._bounds(trainer, searched)
        limit = searched.budget_bytes = bounds.budget_of(self.budget, probe, trainer, "BatchSizeTuner")
        varying = searched.tokens is not None or self.length_fn is not None
        searched.margin = margin_for(self.shape_margin, varying) if limit else 0.0
        if limit is not None:  # trials leave the margin free for the fragmentation of shapes that vary
            limit = int(limit * (1.0 - searched.margin))
        longest = searched.longest = LongestFirst("BatchSizeTuner", self.length_fn) if self.length_fn else None
        drawing = heaviest_batches_first() if searched.tokens else longest.drawing(trainer) if longest else None
        start = time.perf_counter()
        bench = TrialBench(
            trainer,
            self,
            probe,
            batch_arg_name=self.batch_arg_name,
            steps=self.steps_per_trial,
            validate=self.include_validation,
            accumulation_for=self._accumulation_for,
            check_batches=BatchCheck("BatchSizeTuner", self.batch_arg_name) if searched.tokens is None else None,
            counts_samples=searched.tokens is None,
            drawing=drawing,
            raising=longest.raising if longest is not None else None,
        )
        try:
            with bench:
                searched.original = bench.session.original
                with bench.capped(limit):  # trials run with the allocator capped at the budget, as the fit will be

                    def search(run: TrialSource, top: int) -> SearchResult:
                        return search_batch_size(
                            run, init_val=init_val, upper=top, limit_bytes=limit, max_trials=MAX_TRIALS,
                            tolerance=TUNER_TOLERANCE,
                        )  # fmt: skip

                    result = until_data_ends(search, bench.run, upper)
                    result = leave_headroom(bench.run, result, self.headroom, limit, MAX_TRIALS)
                if result.batch_size is not None:  # applied when the session is left
                    bench.session.choose(result.batch_size, self._accumulation_for(result.batch_size))
                shapes = sorted(bench.session.shapes)
        finally:
            counters = probe.read(nvml=False, host=False)  # the trials' planned OOMs are not the run's
            searched.counted = {
                keys.TRIAL_OOMS.format(): counters.num_ooms,
                keys.TRIAL_RETRIES.format(): counters.alloc_retries,
            }
        self.result = result
        self._apply(trainer, result, shapes)
        report(trainer, self.batch_arg_name, result, searched, time.perf_counter() - start, upper, self.shape_margin)
        self._record(trainer)
        return result.batch_size

    # ------------------------------------------------------------------ helpers
    def _bounds(self, trainer: pl.Trainer, searched: Searched) -> tuple[int, int]:
        """The first size tried and the largest that may be; a token budget's sampler goes to ``searched``."""
        built = loaders.train_loaders(trainer)
        searched.tokens = self._token_sampler(trainer, built)
        if searched.tokens is not None:  # a token budget: from the longest sample's own cost to the whole dataset's
            return bounds.token_bounds(trainer, searched.tokens, self.init_val, self.max_val)
        length = loaders.samples_per_rank(built, trainer.world_size)
        if length is None and self.max_val is None:
            raise ValueError(
                "`BatchSizeTuner(max_val=None)`: the training dataset has no length (an `IterableDataset`), so no"
                " batch size is known to exist in it. Pass `max_val`, the largest batch size the dataset can fill."
            )
        return self.init_val, bounds.upper_bound(trainer, self.max_val, length, loaders.drops_last(built))

    def _apply(self, trainer: pl.Trainer, result: SearchResult, shapes: list[tuple[tuple[int, ...], ...]]) -> None:
        """Keep the size found (the session applied it), or say why there is none."""
        budget = format_gib(self.budget_bytes)
        if result.batch_size is None:
            if any(t.fits for t in result.trials):
                raise RuntimeError(
                    f"BatchSizeTuner: the sizes that ran in the budget of {budget} ran out of memory when run again"
                    " below the largest one (allocator fragmentation; trials:"
                    f" {[(t.batch_size, t.fits) for t in result.trials]}). Raise `headroom`."
                )
            raise RuntimeError(
                f"BatchSizeTuner: even batch_size=1 does not fit the budget of {budget} ({len(result.trials)}"
                " trials). Lower the memory per sample (precision='bf16-mixed', activation checkpointing) or raise"
                " `budget`."
            )
        self.optimal_batch_size = result.batch_size
        self._accumulation = trainer.accumulate_grad_batches
        size, accumulation = self.searched.original
        if self.keep_effective_batch and self._accumulation != accumulation:
            rank_zero_info(
                f"BatchSizeTuner: accumulate_grad_batches {accumulation} -> {self._accumulation} to keep the"
                f" effective batch near {size * accumulation} (now {result.batch_size} x {self._accumulation} ="
                f" {result.batch_size * self._accumulation})."
            )
        if len(shapes) > 1 and self.searched.tokens is None and self.length_fn is None:
            rank_zero_warn(
                f"BatchSizeTuner: the trials' training batches changed shape ({_shown(shapes[0])} and"
                f" {_shown(shapes[-1])}, less the batch dimension), so the size was tuned on the batches the trials"
                " happened to draw; a longer batch later in the fit may not fit. Pass `length_fn` (e.g."
                ' `BatchSizeTuner(length_fn="input_ids")`) so that trials run the longest samples, or batch by'
                " tokens with `TokenBudgetSampler` and tune its `max_tokens`."
            )

    def _token_sampler(self, trainer: pl.Trainer, built: Any) -> TokenBudgetSampler | None:
        """The training loader's TokenBudgetSampler where ``batch_arg_name`` is its ``max_tokens``, else ``None``."""
        sampler = loaders.token_sampler(built)
        if sampler is None or sampler.max_tokens != _session.get_batch_size(trainer, self.batch_arg_name):
            return None
        return sampler

    def _accumulation_for(self, size: int) -> int:
        original_size, original_accumulation = self.searched.original
        if not self.keep_effective_batch:
            return original_accumulation
        return max(1, round(original_size * original_accumulation / size))

    def _apply_restored(self, trainer: pl.Trainer, state: dict[str, Any]) -> None:
        size = int(state["batch_size"])
        accumulation = state.get("accumulate_grad_batches") if self.keep_effective_batch else None
        accumulation = int(accumulation or trainer.accumulate_grad_batches)
        current = (_session.get_batch_size(trainer, self.batch_arg_name), trainer.accumulate_grad_batches)
        _session.apply_batch_size(
            trainer, self.batch_arg_name, size, accumulation, rebuild_optimizers=current != (size, accumulation)
        )
        self.optimal_batch_size, self._accumulation = size, accumulation
        budget = state.get("budget_bytes")  # None in checkpoints of versions before it was saved
        self.searched = Searched(budget_bytes=None if budget is None else int(budget))
        self.searched.tokens = self._token_sampler(trainer, loaders.train_loaders(trainer))  # a budget: its keys
        rank_zero_info(
            f"BatchSizeTuner: {self.batch_arg_name}={size} restored from the checkpoint; no trials ran"
            " (`retune_on_resume=True` tunes again)."
        )
        self._record(trainer)

    def _record(self, trainer: pl.Trainer) -> None:
        if self.optimal_batch_size is None:
            return
        lines = [
            "# Chosen by BatchSizeTuner at fit start; config.yaml holds the value the run started with.",
            f"{self.batch_arg_name}: {self.optimal_batch_size}",
        ]
        if self.keep_effective_batch:
            lines.append(f"accumulate_grad_batches: {self._accumulation}")
        self._size_log.record(trainer, lines, self._log_size)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after Lightning's own `log_hyperparams` (the initial hparams) and, on resume, at the restored step
        self._log_size(trainer)

    def _log_size(self, trainer: pl.Trainer) -> None:
        size = self.optimal_batch_size or 0
        scalars = {keys.BATCH_SIZE.format(): float(size)}
        if self.budget_bytes is not None:  # what the run's per-step peaks are measured against
            scalars[keys.TUNED_BUDGET.format()] = self.budget_bytes / GIB
        tokens = self.searched.tokens
        if tokens is not None and self.optimal_batch_size is not None:  # a token budget was tuned
            scalars[keys.TOKEN_BUDGET.format()] = float(size)
            scalars[keys.PADDING.format()] = 100.0 * tokens.padding_fraction(size)
        self._size_log.log(trainer, self.batch_arg_name, size, scalars)


def _shown(shapes: tuple[tuple[int, ...], ...]) -> str:
    return ", ".join("x".join(map(str, shape)) or "scalar" for shape in shapes)
