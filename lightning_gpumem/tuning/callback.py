"""BatchSizeTuner: the largest batch size that fits a memory budget, found in few real trials before fit.

Why trials run through Lightning's own loop and are then undone: a trial must cost what training costs (precision,
strategy, closures, validation), and afterwards nothing may remain of it, neither in the weights, optimizer, RNG or
progress counters nor in the allocator. ``tuning/trials.py`` (``TrialSession``) runs the trials and undoes them,
``tuning/measure.py`` measures each, and ``tuning/search.py`` decides which sizes to try from the measured peaks: by
default it probes small sizes, predicts the largest size from the line they draw and validates it
(``search_by_plan``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_gpumem import keys
from lightning_gpumem._core.batching import batch_cost
from lightning_gpumem._core.checks import (
    require_flags,
    require_fraction,
    require_int,
    require_length_fn,
    require_trainer,
)
from lightning_gpumem._core.files import unique_path, write_atomic
from lightning_gpumem._core.units import GIB, check_budget, format_gib, parse_budget
from lightning_gpumem._hw.allocator import release_to
from lightning_gpumem._hw.oom import expecting_oom
from lightning_gpumem._hw.probe import Probe, make_probe
from lightning_gpumem._pl.compat import Callback, either
from lightning_gpumem._pl.logging import log_table, log_to_loggers, run_dir
from lightning_gpumem._pl.peers import budget_bytes
from lightning_gpumem.tuning import loaders
from lightning_gpumem.tuning import trials as _session
from lightning_gpumem.tuning.lengths import LengthFn
from lightning_gpumem.tuning.longest import (
    LongestFirst,
    margin_for,
    margin_tip,
)
from lightning_gpumem.tuning.measure import LEFTOVER_BYTES, BatchCheck, TrialRunner, plan_builder
from lightning_gpumem.tuning.search import (
    SearchResult,
    Trial,
    largest_held,
    search_batch_size,
    search_by_plan,
    until_data_ends,
    walk_down,
)
from lightning_gpumem.tuning.token_budget import TokenBudgetSampler, heaviest_batches_first
from lightning_gpumem.tuning.trials import TrialSession

MAX_TRIALS = 25
METHODS = ("predict", "search")


@keys.document
class BatchSizeTuner(Callback):
    r"""Find the largest batch size whose training and validation steps fit a memory budget, then fit with it.

    At fit start it runs *trials*: ``steps_per_trial`` real optimizer steps (with gradient accumulation, all the
    accumulated micro-batches and the step) and, where the fit validates, one validation batch, at a candidate batch
    size, each from the run's own starting state. Trials run with the allocator capped at the budget
    (``torch.cuda.set_per_process_memory_fraction``), so tuning on an 80 GiB card for a 24 GiB one is exact, and
    measured peaks guide the search (``tuning/search.py``) to the largest size that runs. The tuner then gives up
    at most ``headroom`` of the largest size the budget holds and runs the size kept if no trial has. Every trial,
    and the fit after them, starts from the allocator layout of a fresh process (no cached block, no cuBLAS
    workspace), so the trial of the size kept is the fit's first steps, block for block.

    **What is guaranteed.** A tuned fit equals a fit with the chosen size set by hand: same weights, optimizer,
    LR-scheduler and precision states, step and epoch counters, RNG streams (also the dataloaders' own
    ``torch.Generator``), logged metrics, checkpoints kept and hook calls. No trial value reaches a logger,
    ``ModelCheckpoint``, ``EarlyStopping`` or an epoch aggregate; user callbacks, the module's once-per-loop hooks
    (``on_train_start``, ``on_train_epoch_start``, ...) and ``lr_scheduler_step`` do not run during trials. What the fit
    derived from the batch size is derived again: ``configure_optimizers`` runs once more after tuning, so
    ``estimated_stepping_batches`` and the schedulers built from it use the size chosen.
    ``tests/tuning/test_conformance.py`` checks this across Lightning set-ups. The size found is written
    where Lightning's ``BatchSizeFinder`` writes it (``model.<batch_arg_name>``, ``model.hparams``, the datamodule or
    its hparams). An error or Ctrl-C in a trial puts the original size back. Under DDP every rank runs every trial and
    the OOM verdicts and peaks are agreed, so all ranks pick the same size; ``self.log(..., sync_dist=True)`` does not
    synchronise during trials.

    **Resume.** The size chosen is saved in checkpoints (``state_dict``). On ``fit(ckpt_path=...)`` it is applied
    without trials and Lightning restores the training state untouched; ``retune_on_resume=True`` tunes again (the
    restored state is kept all the same).

    **What is refused** (``ValueError`` at fit start): dataloaders passed straight to ``trainer.fit`` (the batch size
    cannot be applied to a built loader), and a training dataset without a length (an ``IterableDataset``) unless
    ``max_val`` bounds the search. :meth:`scale` runs only from ``on_fit_start`` (where the tuner calls it) or
    ``on_train_epoch_start``.

    **Logged metrics** (from :mod:`lightning_gpumem.keys`):

    {logged_metrics}

    The trials (batch size, outcome, peaks, seconds) also go to every logger as a table (TensorBoard text, a W&B
    table, an MLflow artifact; for the others ``gpumem_batch_size_trials.csv`` in their directory) and are kept in
    :attr:`trials`; rank zero prints one line, e.g. ``BatchSizeTuner: batch_size=53 (peak 22.6/24.0 GiB, ...)``.
    The size the run trains at, tuned or restored on resume, is logged as ``gpumem/batch_size`` and, where the
    module's or datamodule's hparams hold ``batch_arg_name``, as that hyperparameter (TensorBoard's HPARAMS,
    ``hparams.yaml``). Under ``LightningCLI`` it is also written to the run's directory as
    ``gpumem_batch_size.yaml`` (beside the saved ``config.yaml``, which keeps the initial size, where the first logger
    is a TensorBoard or CSV one: Lightning saves the config in ``trainer.log_dir``, an MLflow or W&B logger's root).

    Args:
        budget: memory the run may use: ``None`` for the budget of a :class:`~lightning_gpumem.MemoryBudget` among
            the callbacks (placed before this one) or else what is usable on the device now, bytes (``int``), a
            fraction of device memory in (0, 1] (``float``), or a string such as ``"24GiB"`` or ``"16GB"``.
        headroom: fraction of the largest size the budget holds given up at most as a safety margin, in [0, 1):
            the size chosen is the smallest at least ``(1 - headroom) * largest`` (40 runs and 41 does not: 38 at
            0.05, 40 at 0.02; under ``1 / headroom`` nothing is given up, as the largest size ran in a trial that
            starts from the fit's own layout). ``largest`` is one less than the smallest size that failed where the
            search closed in on it (within 1% of the largest size that ran; 553 runs and 559 does not: 531 at 0.05),
            else the largest size that ran; the size chosen never exceeds the largest size that ran. Activation
            memory grows with the batch size, so about that fraction of it stays free for what trials do not show:
            batches of other shapes (a smaller last batch, varying lengths) and fragmentation over a long run.
            Nothing is given up where memory does not bound the size (the search stopped at ``max_val`` or the
            dataset size).
        init_val: first batch size tried.
        max_val: largest batch size tried; the result never exceeds it. ``None``: the samples an epoch of the
            training loader draws, per rank (and at most the size that still gives an integer ``val_check_interval``
            its batches). On a device without memory to measure (a CPU) the tuner searches only where ``max_val`` is
            given, and otherwise keeps the run's size with one warning.
        steps_per_trial: optimizer steps per trial (the first step also creates optimizer state). Three by
            default: a GPT under a 12 GiB cap ran two steps at a size and ran out of memory in the third.
        include_validation: also run one validation batch per trial where the fit validates, so the size found
            fits validation too.
        batch_arg_name: attribute holding the batch size, looked up like Lightning's ``BatchSizeFinder`` does.
        keep_effective_batch: search over the micro-batch with ``Trainer.accumulate_grad_batches`` scaled in every
            trial so that batch size times accumulation stays as configured (rounded, at least 1); the fit uses the
            accumulation of the size chosen.
        retune_on_resume: on ``fit(ckpt_path=...)``, tune again instead of applying the size saved in the
            checkpoint.
        method: ``"predict"``: probe small sizes (from ``init_val``, doubling) until peak memory is a line in the
            batch size, predict the largest size under the budget, validate it in a trial, and close in to within 2%
            (:func:`~lightning_gpumem.tuning.search.search_by_plan`; where the probes are not on a line or measure
            nothing, as on a CPU given ``max_val``, it searches and says why in :attr:`result`'s ``note``).
            ``"search"``: the bracket search from ``init_val`` alone, to within 1%.
        length_fn: how a training or validation sample's size is measured, for data whose batches change shape
            (text, speech): a function of the sample, or the key (or attribute) of a field holding the length or
            the sequence itself (``"input_ids"``). The datasets' lengths are scanned once (at most 30 s; past that,
            the samples scanned so far, and a warning says so) and every trial draws the longest samples first,
            collated by the loader's own ``collate_fn``, so the size found fits the longest batch the data can
            make. Without it, a warning says when the trials' batches changed shape. Not needed for a
            :class:`~lightning_gpumem.TokenBudgetSampler`, whose trials always run its heaviest batches.
        shape_margin: fraction of the budget the trials leave free where batches change shape (``length_fn`` or
            a token budget), in [0, 1): trials run with the allocator capped at ``(1 - shape_margin) * budget``
            and the fit at the whole budget. PyTorch's caching allocator fragments as shapes change: a size whose
            heaviest batch filled the budget in a trial ran out of memory 6 to 12 steps into a shuffled epoch with
            up to a quarter of the budget cached but unusable. ``None``: ``0.2`` with PyTorch's default allocator,
            ``0.06`` with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (read from the environment), which
            fragments far less; ``0`` where shapes do not change. See ``docs/variable_length.md``.

    **Token budgets.** Where ``batch_arg_name`` is the ``max_tokens`` of the training loader's
    :class:`~lightning_gpumem.TokenBudgetSampler` (``BatchSizeTuner(batch_arg_name="max_tokens")``), the tuner tunes
    that budget instead of a batch size: trials run the sampler's heaviest batches (the costliest, the one with the
    longest sample, the one with the most samples), the search starts at the longest sample's own cost, and the
    budget chosen is logged as ``gpumem/token_budget`` with the epoch's padding fraction.

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
        method: str = "predict",
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
        if not isinstance(method, str) or method not in METHODS:
            raise ValueError(f"`BatchSizeTuner(method={method!r})` is not valid. Expected one of {METHODS}.")
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
        self.method = method
        self.length_fn = length_fn
        self.shape_margin = None if shape_margin is None else float(shape_margin)

        self.optimal_batch_size: int | None = None
        """The batch size chosen by the last search (or restored from a checkpoint; ``None`` before either)."""
        self.result: SearchResult | None = None
        """The last search's trials and stop reason."""
        self.budget_bytes: int | None = None
        """The budget the last search used, in bytes (``None`` on CPU)."""
        self._planned: dict[str, int] = {}  # the allocator's OOM and retry counts when the trials ended
        self._counted: dict[str, int | None] = {}  # the same, as logged: None where no source counts them (CPU)
        self._yaml_path: Path | None = None  # the `gpumem_batch_size.yaml` this callback wrote
        self._size_due = False  # a size was chosen or restored and is not logged yet
        self._accumulation: int | None = None
        self._restored: dict[str, Any] | None = None
        self._longest: LongestFirst | None = None  # the trials' longest-first order (`length_fn`), per search
        self._tokens: TokenBudgetSampler | None = None  # the sampler whose budget the last search tuned
        self._margin = 0.0  # the fraction of the budget the last search's trials left free (shapes that vary)

    @property
    def trials(self) -> tuple[Trial, ...]:
        """The last search's trials, in the order they ran."""
        return self.result.trials if self.result is not None else ()

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_trainer("BatchSizeTuner", trainer)
        finders = [type(c).__name__ for c in trainer.callbacks if isinstance(c, either("callbacks", "BatchSizeFinder"))]  # type: ignore[attr-defined]
        if stage == "fit" and finders:
            raise ValueError(
                f"BatchSizeTuner and Lightning's {finders[0]} are both in the Trainer's callbacks: both tune the batch"
                " size at fit start and would undo each other's trials. Keep one of them."
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

        Whether a batch size was tuned, and the allocator's OOM and retry counts when the trials ended (planned, so
        not the run's).
        """
        context: dict[str, Any] = dict(self._planned)
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
                f"`BatchSizeTuner.scale()` was called from `{hook}`. It runs only from `on_fit_start` (where the tuner"
                " calls it) or `on_train_epoch_start`, before an epoch's batches are drawn; call it from there."
            )
        if trainer.fast_dev_run:  # type: ignore[attr-defined]
            rank_zero_warn("BatchSizeTuner: skipped because `fast_dev_run` is enabled.")
            return None
        if trainer.limit_train_batches == 0:
            rank_zero_warn("BatchSizeTuner: skipped because `limit_train_batches=0` runs no training step.")
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
        self._longest = LongestFirst("BatchSizeTuner", self.length_fn) if self.length_fn is not None else None
        built = loaders.train_loaders(trainer)
        self._tokens = tokens = self._token_sampler(trainer, built)
        init_val = self.init_val
        if tokens is not None:  # a token budget: from the longest sample's own cost to the whole dataset's
            init_val, upper = self._token_bounds(trainer, tokens)
        else:
            length = loaders.samples_per_rank(built, trainer.world_size)
            if length is None and self.max_val is None:
                raise ValueError(
                    "`BatchSizeTuner(max_val=None)`: the training dataset has no length (an `IterableDataset`), so"
                    " no batch size is known to exist in it. Pass `max_val`, the largest batch size the dataset can"
                    " fill."
                )
            upper = self._upper_bound(trainer, length, loaders.drops_last(built))
        del built
        baseline = probe.allocated_bytes()  # what each trial starts from, and the search ends at
        limit = self._limit_bytes(probe, trainer)  # budget
        self._margin = margin_for(self.shape_margin, tokens is not None or self.length_fn is not None) if limit else 0.0
        if limit is not None:  # trials leave the margin free for the fragmentation of shapes that vary
            limit = int(limit * (1.0 - self._margin))
        start = time.perf_counter()
        total = probe.total_bytes() if limit is not None and probe.device.type == "cuda" else None
        previous_fraction = None
        try:
            with TrialSession(trainer, self.batch_arg_name, owner=self) as session:
                self._original = session.original
                if total:  # trials run with the allocator capped at the budget, as the fit will be
                    previous_fraction = probe.set_memory_fraction(min(1.0, limit / total))  # type: ignore[operator]
                runner = TrialRunner(
                    session,
                    probe,
                    steps=self.steps_per_trial,
                    validate=self.include_validation,
                    accumulation_for=self._accumulation_for,
                    check_batches=BatchCheck("BatchSizeTuner", self.batch_arg_name) if tokens is None else None,
                    counts_samples=tokens is None,
                )
                try:
                    with expecting_oom(), self._heaviest_first(trainer, tokens):  # OOMs are the search's plan
                        make_plan = plan_builder(trainer, probe, runner, self)

                        def search(run: Callable[[int], Trial], top: int) -> SearchResult:
                            if self.method == "predict":  # probe, predict, validate, close in
                                return search_by_plan(
                                    run, init_val=init_val, upper=top, limit_bytes=limit, max_trials=MAX_TRIALS,
                                    make_plan=make_plan,
                                )  # fmt: skip
                            # search: the largest size that runs in the budget
                            return search_batch_size(
                                run, init_val=init_val, upper=top, limit_bytes=limit, max_trials=MAX_TRIALS
                            )

                        result = until_data_ends(search, self._raising(runner), upper)
                        result = self._leave_headroom(self._raising(runner), result, limit)
                finally:
                    if previous_fraction is not None:
                        probe.set_memory_fraction(previous_fraction)
                if result.batch_size is not None:  # apply (when the session is left)
                    session.choose(result.batch_size, self._accumulation_for(result.batch_size))
                shapes = sorted(session.shapes)
        finally:
            release_to(probe, baseline, LEFTOVER_BYTES)
            counters = probe.read(nvml=False, host=False)  # the trials' planned OOMs are not the run's
            self._counted = {
                keys.TRIAL_OOMS.format(): counters.num_ooms,
                keys.TRIAL_RETRIES.format(): counters.alloc_retries,
            }
            self._planned = {"planned_ooms": counters.num_ooms or 0, "planned_retries": counters.alloc_retries or 0}
        seconds = time.perf_counter() - start
        self.result = result
        if result.batch_size is None:
            if any(t.fits for t in result.trials):
                raise RuntimeError(
                    f"BatchSizeTuner: the sizes that ran in the budget of {format_gib(self.budget_bytes)} ran out of"
                    " memory when run again below the largest one (allocator fragmentation; trials:"
                    f" {[(t.batch_size, t.fits) for t in result.trials]}). Raise `headroom`."
                )
            raise RuntimeError(
                f"BatchSizeTuner: even batch_size=1 does not fit the budget of {format_gib(self.budget_bytes)}"
                f" ({len(result.trials)} trials). Lower the memory per sample (precision='bf16-mixed', activation"
                " checkpointing) or raise `budget`."
            )
        self.optimal_batch_size = result.batch_size
        self._accumulation = trainer.accumulate_grad_batches
        if self.keep_effective_batch and self._accumulation != self._original[1]:
            rank_zero_info(
                f"BatchSizeTuner: accumulate_grad_batches {self._original[1]} -> {self._accumulation} to keep the"
                f" effective batch near {self._original[0] * self._original[1]} (now {result.batch_size} x"
                f" {self._accumulation} = {result.batch_size * self._accumulation})."
            )
        if len(shapes) > 1 and tokens is None and self.length_fn is None:
            rank_zero_warn(
                f"BatchSizeTuner: the trials' training batches changed shape ({_shown(shapes[0])} and"
                f" {_shown(shapes[-1])}, less the batch dimension), so the size was tuned on the batches the trials"
                " happened to draw; a longer batch later in the fit may not fit. Pass `length_fn` (e.g."
                ' `BatchSizeTuner(length_fn="input_ids")`) so that trials run the longest samples, or batch by'
                " tokens with `TokenBudgetSampler` and tune its `max_tokens`."
            )
        self._report(trainer, result, seconds, upper)
        return result.batch_size

    # ------------------------------------------------------------------ variable-length data
    def _token_sampler(self, trainer: pl.Trainer, built: Any) -> TokenBudgetSampler | None:
        """The training loader's TokenBudgetSampler where ``batch_arg_name`` is its ``max_tokens``, else ``None``."""
        sampler = loaders.token_sampler(built)
        if sampler is None or sampler.max_tokens != _session.get_batch_size(trainer, self.batch_arg_name):
            return None
        return sampler

    def _token_bounds(self, trainer: pl.Trainer, tokens: TokenBudgetSampler) -> tuple[int, int]:
        """The first budget tried (the longest sample's own cost at least) and the largest one that may be tried.

        The largest: the whole dataset's cost, ``max_val``, and the largest budget whose epoch still has the batches
        ``limit_train_batches`` and an integer ``val_check_interval`` need, whichever is smallest.
        """
        first = max(self.init_val, math.ceil(tokens.min_tokens))
        whole = math.ceil(batch_cost(tokens.lengths, cost=tokens.cost, quadratic=tokens.quadratic))
        if self.max_val is not None and self.max_val < first:
            raise ValueError(
                f"`BatchSizeTuner(max_val={self.max_val})` is below the cost of the longest sample alone"
                f" ({first}): no budget up to it holds every sample. Raise `max_val` or leave it None."
            )
        top = max(first, whole if self.max_val is None else min(self.max_val, whole))
        need, limit = self._batches_needed(trainer), trainer.limit_train_batches

        def batches(budget: int) -> float:
            length = len(tokens.plan(budget)) // tokens.num_replicas
            return int(length * limit) if isinstance(limit, float) else min(length, limit)  # Lightning's rule

        if batches(top) >= need or batches(first) < need:
            return first, top
        lo, hi = first, top  # batches(lo) >= need > batches(hi): fewer batches as the budget grows
        while hi - lo > max(1, lo // 1000):
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if batches(mid) >= need else (lo, mid)
        return first, lo

    def _batches_needed(self, trainer: pl.Trainer) -> int:
        interval = trainer.val_check_interval
        if isinstance(interval, int) and trainer.check_val_every_n_epoch is not None and trainer.enable_validation:
            return interval  # Lightning refuses an epoch with fewer batches than `val_check_interval`
        return 1

    def _heaviest_first(self, trainer: pl.Trainer, tokens: TokenBudgetSampler | None) -> Any:
        """Within the block, trials draw the heaviest batches the data can make (where that is known)."""
        if tokens is not None:
            return heaviest_batches_first()
        if self._longest is not None:
            return self._longest.drawing(trainer)
        return nullcontext()

    def _raising(self, runner: TrialRunner) -> Callable[[int], Trial]:
        return runner if self._longest is None else self._longest.raising(runner)

    # ------------------------------------------------------------------ helpers
    def _accumulation_for(self, size: int) -> int:
        original_size, original_accumulation = self._original
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
        self.budget_bytes = None if budget is None else int(budget)
        self._tokens = self._token_sampler(trainer, loaders.train_loaders(trainer))  # a budget: its keys too
        rank_zero_info(
            f"BatchSizeTuner: {self.batch_arg_name}={size} restored from the checkpoint; no trials ran"
            " (`retune_on_resume=True` tunes again)."
        )
        self._record(trainer)

    def _limit_bytes(self, probe: Probe, trainer: pl.Trainer) -> int | None:
        total = probe.total_bytes()
        if not probe.has_allocator or total is None:
            self.budget_bytes = None
            if self.budget is not None:
                rank_zero_warn(
                    f"BatchSizeTuner: `budget={self.budget!r}` is not applied on `{probe.device}`: it has no memory"
                    " to measure or cap; only out-of-memory errors bound the search."
                )
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
        return int(self.budget_bytes)

    def _upper_bound(self, trainer: pl.Trainer, length: int | None, drop_last: bool = False) -> int:
        candidates = [] if self.max_val is None else [self.max_val]
        if length is not None:  # the samples a rank draws an epoch (`loaders.samples_per_rank`)
            need = self._batches_needed(trainer)
            candidates.append(_largest_size_with_batches(length, trainer.limit_train_batches, need, drop_last))
        return max(1, min(candidates))

    def _headroom_size(self, largest: int) -> int:
        """The size kept when ``largest`` is the largest that runs in the budget.

        The smallest size at least ``(1 - headroom) * largest``: at most ``headroom`` of it is given up, and under
        ``1 / headroom`` nothing (each trial starts from a fresh process's layout, so the largest size that ran in a
        trial runs in the fit).
        """
        kept = math.ceil(round((1.0 - self.headroom) * largest, 9))  # 0.95 * 40 is 38, not 38.000000000000004
        return max(1, min(largest, kept))

    def _leave_headroom(self, runner: Callable[[int], Trial], result: SearchResult, limit: int | None) -> SearchResult:
        """Give up ``headroom`` of the largest size the budget holds, and run the size kept once.

        That largest size is one less than the smallest size that failed where the search closed in on it (within
        1% of the largest size that ran), else the largest size that ran; the size kept is at most the latter.
        Nothing is given up where memory did not bound the search (it stopped at ``max_val`` or the dataset size).
        The size kept runs from the fit's own starting state under the fit's cap, unless a trial of the search ran
        it (every trial starts from that state); where it does not run (the allocator's layout differs from size to
        size: large single allocations near a tight cap), the sizes 1%, 2%, 4%... of it below it run until one does (or
        one that a trial of the search ran is kept): :func:`~lightning_gpumem.tuning.search.walk_down` decides, under
        the search's trial budget.
        """
        largest = result.batch_size
        if largest is None or result.reason == "upper_bound":
            return result
        size = min(largest, self._headroom_size(largest_held(result, limit) or largest))
        return walk_down(
            runner,
            result,
            start=size,
            limit_bytes=limit,
            max_trials=MAX_TRIALS,
        )

    def _report(self, trainer: pl.Trainer, result: SearchResult, seconds: float, upper: int) -> None:
        chosen = next(t for t in reversed(result.trials) if t.batch_size == result.batch_size)
        peak = (
            f"peak {chosen.peak_bytes / GIB:.1f}/{self.budget_bytes / GIB:.1f} GiB"
            if chosen.peak_bytes is not None and self.budget_bytes
            else "no memory measured"
        )
        rank_zero_info(
            f"BatchSizeTuner: {self.batch_arg_name}={result.batch_size} ({peak}, {len(result.trials)} trials,"
            f" {result.num_ooms} OOM, {seconds:.1f} s)"
        )
        if self._margin > 0:
            rank_zero_info(
                f"BatchSizeTuner: the batches vary in shape, so the trials ran under {1 - self._margin:.0%} of the"
                f" budget and left {self._margin:.0%} free for the allocator's fragmentation (`shape_margin`)"
                f"{margin_tip(self.shape_margin)}."
            )
        if result.reason == "upper_bound":
            more = (
                "the device could take more."
                if self.budget_bytes is not None
                else f"no memory could be measured on `{trainer.strategy.root_device}`, so memory did not bound it."
            )
            rank_zero_warn(
                f"BatchSizeTuner: stopped at the upper bound {upper} (max_val, the dataset size per rank or"
                f" `val_check_interval`) without running out of memory; {more}"
            )
        if not trainer.is_global_zero:
            return

        def gib(value: int | None) -> str:
            return "-" if value is None else f"{value / GIB:.2f}"

        columns = ["batch size", "outcome", "reserved GiB", "training allocated GiB", "validation allocated GiB"]
        columns.append("seconds")
        rows: list[list[object]] = [
            [t.batch_size, _outcome(t), gib(t.peak_bytes), gib(t.train_peak_bytes)] for t in result.trials
        ]
        for row, t in zip(rows, result.trials, strict=True):
            row.extend([gib(t.val_peak_bytes), f"{t.seconds:.2f}"])
        table: list[list[object]] = [list(columns), ["---"] * len(columns), *rows]
        lines = ["| " + " | ".join(str(cell) for cell in row) + " |" for row in table]
        # the report subtracts the trials' planned OOMs and retries from the run's; only what a source counted
        scalars = {name: float(count) for name, count in self._counted.items() if count is not None}
        log_to_loggers(trainer, scalars, step=trainer.global_step)
        log_table(
            trainer,
            keys.BATCH_SIZE_TRIALS.format(),
            columns,
            rows,
            trainer.global_step,
            "\n".join(lines),
            "BatchSizeTuner",
        )
        self._record(trainer)

    def _record(self, trainer: pl.Trainer) -> None:
        """Say in the run's logs which size it trains at, tuned or restored from a checkpoint (global rank zero).

        ``gpumem/batch_size`` to every logger; the size in the hyperparameters the loggers show (TensorBoard's
        HPARAMS, ``hparams.yaml``) where the module's or the datamodule's hparams hold ``batch_arg_name``, which
        Lightning logged with the size the run started with; and under LightningCLI ``gpumem_batch_size.yaml`` in
        the run's directory (where ``config.yaml``, which holds the initial size, is for TensorBoard and CSV).
        """
        if not trainer.is_global_zero or self.optimal_batch_size is None:
            return
        self._size_due = True
        if _session.current_hook(trainer) != "on_fit_start":  # mid-training: Lightning logged its hparams already
            self._log_size(trainer)
        self._write_next_to_cli_config(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after Lightning's own `log_hyperparams` (the initial hparams) and, on resume, at the restored step
        self._log_size(trainer)

    def _log_size(self, trainer: pl.Trainer) -> None:
        if not self._size_due or not trainer.is_global_zero:
            return
        self._size_due = False
        scalars = {keys.BATCH_SIZE.format(): float(self.optimal_batch_size or 0)}
        if self.budget_bytes is not None:  # what the run's per-step peaks are measured against
            scalars[keys.TUNED_BUDGET.format()] = self.budget_bytes / GIB
        tokens = self._tokens
        if tokens is not None and self.optimal_batch_size is not None:  # a token budget was tuned
            scalars[keys.TOKEN_BUDGET.format()] = float(self.optimal_batch_size)
            scalars[keys.PADDING.format()] = 100.0 * tokens.padding_fraction(self.optimal_batch_size)
        log_to_loggers(trainer, scalars, step=trainer.global_step)
        if not _session.batch_arg_in_hparams(trainer, self.batch_arg_name):
            return
        for logger in trainer.loggers:
            try:
                hparams = dict(getattr(logger, "hparams", None) or {})
                logger.log_hyperparams({**hparams, self.batch_arg_name: self.optimal_batch_size})
            except Exception as error:  # a logger that cannot take them: `gpumem/batch_size` says it all the same
                rank_zero_warn(
                    f"BatchSizeTuner: could not log `{self.batch_arg_name}` to {type(logger).__name__}'s"
                    f" hyperparameters ({error!r})."
                )

    def _write_next_to_cli_config(self, trainer: pl.Trainer) -> None:
        """Under LightningCLI, write the size chosen to the run's directory (:func:`run_dir`).

        Its own file of an earlier search in this run is replaced; a file of another run keeps its name (this one
        gets ``-v1``...). A disk that fails is named in a warning.
        """
        if not any(type(c).__name__ == "SaveConfigCallback" for c in trainer.callbacks):  # type: ignore[attr-defined]
            return
        lines = [
            "# Chosen by BatchSizeTuner at fit start; config.yaml holds the value the run started with.",
            f"{self.batch_arg_name}: {self.optimal_batch_size}",
        ]
        if self.keep_effective_batch:
            lines.append(f"accumulate_grad_batches: {self._accumulation}")
        path = run_dir(trainer) / "gpumem_batch_size.yaml"  # trainer.log_dir's run, without its broadcast
        if path != self._yaml_path:
            path = unique_path(path)
        try:
            write_atomic(path, "\n".join(lines) + "\n")
            self._yaml_path = path
        except OSError as error:
            rank_zero_warn(f"BatchSizeTuner: could not write {path} ({error!r}).")


def _outcome(trial: Trial) -> str:
    if not trial.fits:
        return "OOM"
    return f"short: {trial.samples} samples" if trial.short else "ok"


def _shown(shapes: tuple[tuple[int, ...], ...]) -> str:
    return ", ".join("x".join(map(str, shape)) or "scalar" for shape in shapes)


def _largest_size_with_batches(samples: int, limit: int | float, need: int, drop_last: bool = False) -> int:
    """The largest batch size whose epoch of ``samples`` still has ``need`` batches after ``limit_train_batches``.

    ``drop_last``: the loader drops a last batch that is not full, so an epoch has ``samples // size`` batches.
    """

    def batches(size: int) -> float:
        length = samples // size if drop_last else math.ceil(samples / size)
        return int(length * limit) if isinstance(limit, float) else min(length, limit)  # Lightning's rule

    lo, hi = 1, max(1, samples)
    if batches(hi) >= need:
        return hi
    while hi - lo > 1:  # batches(lo) >= need > batches(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if batches(mid) >= need else (lo, mid)
    return lo
