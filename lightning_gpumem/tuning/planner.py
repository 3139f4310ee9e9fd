"""MemoryPlanner: "will it fit?" answered before step 1, from a few real training steps at small batch sizes.

Why real steps where a GPU is present: what decides a fit is the allocator (its blocks, its fragmentation),
the optimizer step's temporaries and the kernels' workspaces, which a real step shows exactly; small batch
sizes cost milliseconds. Without one, the step is traced on fake tensors instead (``traced_plan.py``). The
probes run on the trial bench the tuner uses (``trials/bench.py``: nothing left behind) and the plan is the
pure :class:`~lightning_gpumem.tuning.search.plan.Plan` of the one memory model.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import replace

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_gpumem import keys
from lightning_gpumem._core.checks import require_trainer
from lightning_gpumem._hw.probe import Probe, make_probe
from lightning_gpumem._pl.compat import Callback
from lightning_gpumem._pl.peers import budget_bytes
from lightning_gpumem.tuning import bounds
from lightning_gpumem.tuning.arguments import check_planner
from lightning_gpumem.tuning.lengths.longest import LongestFirst, margin_for
from lightning_gpumem.tuning.lengths.scan import LengthFn
from lightning_gpumem.tuning.plan_report import report_plan
from lightning_gpumem.tuning.search.model import Point, accepted
from lightning_gpumem.tuning.search.plan import Plan, Prediction
from lightning_gpumem.tuning.search.probes import back_off_sizes, probe_until_line
from lightning_gpumem.tuning.traced_plan import plan_traced
from lightning_gpumem.tuning.trials import loaders
from lightning_gpumem.tuning.trials import session as _session
from lightning_gpumem.tuning.trials.bench import TrialBench
from lightning_gpumem.tuning.trials.measure import BatchCheck, plan_builder

VALIDATION_TRIES = 3  # a prediction that does not run backs off at most this often under one budget


@keys.document
class MemoryPlanner(Callback):
    r"""Plan the fit's memory before step 1: the run's peak with a band, and the largest size per card.

    At fit start it runs *probes*: ``steps_per_trial`` real optimizer steps and one validation batch at small
    batch sizes (``init_val``, doubling) until peak memory of live tensors is a line in the batch size (the
    last increment at least 10% of the peak and its per-sample slope within 3% of the one before; at most
    half the device's memory). From them it predicts, for the run's batch size, the reserved peak with a
    band, and for each budget the largest batch size that fits (the budget less the memory outside PyTorch,
    which NVML measures). With ``validate=True`` the largest size of each budget runs in a trial under that
    budget (the allocator capped with ``torch.cuda.set_per_process_memory_fraction``) and is marked
    *validated*; one that runs out of memory backs off (6%, then 12% less live memory than the prediction)
    until one runs. Trials leave nothing behind: they run in ``BatchSizeTuner``'s trial session, and the fit
    then equals the fit without the planner (``tests/tuning/test_planner.py``).

    The plan is printed on rank zero, sent to every logger as a table (TensorBoard text, a W&B table, an
    MLflow artifact, else ``gpumem_memory_plan.csv``), logged as the scalars below and kept in :attr:`plan`
    and :attr:`predictions`. Where the run's batch size does not fit a budget, it says by how much and what
    would make it fit. With ``stop=True`` the fit ends after planning, before the sanity check and step 1: a
    dry run, to ask on any card whether a run fits a smaller one.

    Where the probes are not on a line (batches whose shapes vary, data-dependent padding, routing), the plan
    says so and predicts nothing. On a device without an allocator to measure (a CPU) it traces the training
    step on fake tensors instead and replays it through a model of the caching allocator: the rows are
    marked *traced* (``docs/memory_planner.md``, "Without a GPU"); a step that cannot be traced gives one
    warning naming the op (``stop=True`` still ends the fit). A ``TokenBudgetSampler``'s budget is not a
    batch size: it is refused at fit start (``BatchSizeTuner`` tunes it). For variable-length data,
    ``length_fn`` makes every probe and trial draw the longest samples first (as
    ``BatchSizeTuner(length_fn=...)`` does, see ``docs/variable_length.md``): the plan is then the plan of
    the heaviest batches the data can make, and each budget's allocator limit leaves ``shape_margin`` free
    for the fragmentation of an epoch of varying shapes.

    **Logged metrics** (from :mod:`lightning_gpumem.keys`):

    {logged_metrics}

    Args:
        budgets: the cards or budgets to answer for: sizes in bytes (``int``), strings such as ``"24GiB"``,
            cards by name (``"H100-80GB"``, ``"A100-80GB"``, ``"A100-40GB"``, ``"RTX4090"``: the memory torch
            reports for them), or fractions of the device in (0, 1]; ``None`` for the device (or a
            :class:`~lightning_gpumem.MemoryBudget`'s budget) and the common card sizes up to it (16, 24, 40,
            48, 80 GiB; on a CPU, all of them).
        validate: run each budget's largest size in a trial under that budget.
        stop: end the fit after planning (a dry run).
        init_val: the first probe's batch size.
        steps_per_trial: optimizer steps per probe (the first step also creates the optimizer state).
        include_validation: also run one validation batch per probe where the fit validates.
        batch_arg_name: attribute holding the batch size, looked up like Lightning's ``BatchSizeFinder``
            does.
        length_fn: how a training or validation sample's size is measured, for data whose batches change
            shape: a function of a sample (``dataset[i]``) returning its length, or the key (or attribute) of
            a length field. The probes then run the longest samples first, collated by the loader's own
            ``collate_fn``.
        shape_margin: with ``length_fn``, the fraction of each budget's allocator limit the plan leaves free
            for fragmentation, in [0, 1) (``None``: 0.2, or 0.06 with ``expandable_segments:True``, as the
            tuner).

    Raises:
        ValueError: on an invalid argument, or (at fit start) dataloaders passed to ``trainer.fit``.
        TypeError: on a ``length_fn`` that is neither a function nor a key.
        AttributeError: (at fit start) if nothing holds an attribute named ``batch_arg_name``.

    Example::

        from lightning import Trainer
        from lightning_gpumem import MemoryPlanner

        # On any card: would this run fit a 24 GiB one, and at which batch size? End after planning.
        trainer = Trainer(callbacks=[MemoryPlanner(budgets=["24GiB"], stop=True)])
        trainer.fit(model)
    """

    def __init__(
        self,
        budgets: Sequence[int | float | str] | None = None,
        validate: bool = True,
        stop: bool = False,
        init_val: int = 2,
        steps_per_trial: int = 3,
        include_validation: bool = True,
        batch_arg_name: str = "batch_size",
        length_fn: LengthFn | None = None,
        shape_margin: float | None = None,
    ) -> None:
        check_planner(
            budgets=budgets,
            init_val=init_val,
            steps_per_trial=steps_per_trial,
            batch_arg_name=batch_arg_name,
            length_fn=length_fn,
            shape_margin=shape_margin,
            validate=validate,
            stop=stop,
            include_validation=include_validation,
        )
        self.budgets = list(budgets) if budgets is not None else None
        self.validate = validate
        self.stop = stop
        self.init_val = init_val
        self.steps_per_trial = steps_per_trial
        self.include_validation = include_validation
        self.batch_arg_name = batch_arg_name
        self.length_fn = length_fn
        self.shape_margin = None if shape_margin is None else float(shape_margin)

        self.plan: Plan | None = None
        """The last plan (``None`` before one, or where nothing could be measured)."""
        self.predictions: list[Prediction] = []
        """One :class:`~lightning_gpumem.tuning.search.plan.Prediction` per budget, for the run's batch
        size."""
        self.seconds: float | None = None
        """Wall time of the last planning, probes and validation trials included."""
        self.probe_seconds: float | None = None
        """Wall time of the last planning's probes and plan, before any validation trial."""

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        require_trainer("MemoryPlanner", trainer)
        _session.require_settable_batch(trainer, self.batch_arg_name, "MemoryPlanner")
        built = loaders.train_loaders(trainer)  # the user's hook, called once for both
        bounds.refuse_token_budget(trainer, built, self.batch_arg_name)
        self._plan(trainer, loaders.samples_per_rank(built, trainer.world_size))
        del built
        if self.stop:  # a dry run on every device, planned or not
            trainer.num_sanity_val_steps = 0
            trainer.should_stop = True
            rank_zero_info("MemoryPlanner: `stop=True`: the fit ends after planning (a dry run).")

    def _plan(self, trainer: pl.Trainer, length: int | None) -> None:
        """Probe, plan and validate; ``length``: the samples a rank draws an epoch (``None``: not known)."""
        if trainer.fast_dev_run or trainer.limit_train_batches == 0:  # type: ignore[attr-defined]
            rank_zero_warn(
                "MemoryPlanner: skipped: the fit runs no training step to plan (fast_dev_run, limit 0)."
            )
            return
        probe = make_probe(trainer.strategy.root_device, self)
        total = probe.total_bytes()
        size = _session.get_batch_size(trainer, self.batch_arg_name)
        if not probe.has_allocator or total is None:  # no allocator to measure: trace the step
            self._plan_traced(trainer, size, length)
            return
        start = time.perf_counter()
        budgets = bounds.planner_budgets(self.budgets, trainer, total)
        upper = max(1, length) if length is not None else 2**20
        longest = LongestFirst("MemoryPlanner", self.length_fn) if self.length_fn is not None else None
        bench = TrialBench(
            trainer,
            self,
            probe,
            batch_arg_name=self.batch_arg_name,
            steps=self.steps_per_trial,
            validate=self.include_validation,
            accumulation_for=lambda _: trainer.accumulate_grad_batches,
            check_batches=BatchCheck("MemoryPlanner", self.batch_arg_name),
            drawing=longest.drawing(trainer) if longest is not None else None,
            raising=longest.raising if longest is not None else None,
        )
        with bench:
            plan, data_bound = self._probe(bench, trainer, probe, total, upper)
            upper = data_bound or upper  # the data's largest batch, where a probe found it
            self.probe_seconds = time.perf_counter() - start
            validated: dict[int, int] = {}
            if plan is not None:
                validated, measured, held = self._validate(bench, plan, budgets, upper)
                if held < upper:  # a validation trial found it
                    data_bound = upper = held
                if measured:  # the sizes that ran far out refine the line: between them it interpolates
                    sizes = {p.size for p in plan.probes}
                    extra = [p for p in measured if p.size not in sizes]
                    plan = Plan([*plan.probes, *extra], plan.verdict, plan.outside, plan.terms, plan.margin)
        self.seconds = time.perf_counter() - start
        self.plan = plan
        if plan is None:
            return
        self.predictions = []
        for budget in budgets:  # the size a trial ran replaces the prediction (a back-off may have found it)
            prediction = plan.predict(size, budget)
            beyond = prediction.largest is None or prediction.largest > upper
            bounded = length is not None or data_bound is not None
            if bounded and plan.verdict == "settled" and beyond:  # no batch holds more than an epoch draws
                prediction = replace(prediction, largest=upper)
            if budget in validated:
                prediction = replace(prediction, largest=validated[budget], validated=True)
            self.predictions.append(prediction)
        report_plan(
            trainer, plan, size, self.predictions, self.batch_arg_name, self.shape_margin, self.seconds
        )

    def _plan_traced(self, trainer: pl.Trainer, size: int, length: int | None) -> None:
        """The plan of the step traced on fake tensors, where no allocator can be measured."""
        upper = max(1, length) if length is not None else 2**20
        plan, predictions, seconds = plan_traced(
            trainer, self.budgets, size, upper, self.init_val, self.include_validation
        )
        self.plan, self.predictions, self.seconds = plan, predictions, seconds
        self.probe_seconds = seconds
        if plan is not None:
            report_plan(trainer, plan, size, predictions, self.batch_arg_name, self.shape_margin, seconds)

    # ------------------------------------------------------------------ helpers
    def _probe(
        self, bench: TrialBench, trainer: pl.Trainer, probe: Probe, total: int, upper: int
    ) -> tuple[Plan | None, int | None]:
        """Probe from ``init_val``, doubling, until the line settles; the plan (``None`` with a warning).

        Also the samples the data holds where a probe's batches found fewer than its size (an iterable
        dataset, a sampler without a length): the largest batch there is, probed too (``None``: not met).
        """
        # a MemoryBudget caps the probes
        limit = min(probe.usable_bytes() or total, budget_bytes(trainer) or total)
        probed = probe_until_line(bench.run, init_val=self.init_val, upper=upper, limit=limit)
        points, verdict, size = probed.points, probed.verdict, probed.size
        data_bound = None
        if probed.stop == "data":  # a probe's batches held fewer samples than its size: the data ends there
            # 0: no batch at all (drop_last)
            data_bound = probed.samples or (points[-1].size if points else None)
            if data_bound is not None and (not points or data_bound > points[-1].size):
                # the whole of the data in one batch: every size that can run is probed
                trial = bench.run(data_bound)
                point = trial.point
                if accepted(trial, limit) and point is not None and point.need is not None:
                    points = [*points, point]
            probed = replace(probed, stop="upper")  # the plan covers every size the data can fill
        if probed.stop in ("rejected", "unmeasured"):
            what = "ran out of memory" if probed.stop == "rejected" else "measured no peak"
            rank_zero_warn(
                f"MemoryPlanner: the probe at {self.batch_arg_name}={size} {what}; no plan. Lower"
                " `init_val`."
            )
            return None, data_bound
        if len(points) < 2:
            rank_zero_warn(
                f"MemoryPlanner: one probe ({self.batch_arg_name}={size}) left no room for another; no plan."
            )
            return None, data_bound
        # probing reached the samples an epoch draws: every size that can run lies between
        if verdict is None:
            # probes, where the plan interpolates what they measured; nothing to extrapolate
            verdict = "settled"
        assert bench.runner is not None
        plan = plan_builder(trainer, probe, bench.runner, self)(points, verdict)
        plan.margin = margin_for(self.shape_margin, self.length_fn is not None)
        if verdict == "not_affine":
            tip = "" if self.length_fn is not None else " Where samples vary in length, pass `length_fn`."
            rank_zero_warn(
                "MemoryPlanner: the probes' peaks are not on a line in the batch size (batches of varying"
                " shapes? data-dependent padding?), so the plan cannot predict larger sizes. Use"
                f" `BatchSizeTuner`, which searches where it cannot predict.{tip}"
            )
        return plan, data_bound

    def _validate(
        self, bench: TrialBench, plan: Plan, budgets: list[int], upper: int
    ) -> tuple[dict[int, int], list[Point], int]:
        """Run each budget's largest size under that budget.

        Returns the size that ran per budget, what those trials measured, and the largest batch the data can
        make (``upper``, or fewer where a trial's batches found the data ending short of its size: that size
        is not one that ran, and the data's largest batch is tried in its place).
        """
        if not self.validate or plan.verdict != "settled":
            return {}, [], upper
        ran: dict[int, int] = {}
        measured: list[Point] = []
        for budget in budgets:
            limit = plan.limit_for(budget)
            size = plan.largest_under(limit)
            if size is None or size < 1:
                continue
            size = min(size, upper)
            with bench.capped(limit):
                tries = itertools.islice(
                    itertools.chain([size], back_off_sizes(plan, size, 0)), VALIDATION_TRIES
                )
                for size in tries:  # the prediction, then 6%, 12%... less live memory than it
                    trial = bench.run(min(size, upper))
                    if trial.short:  # the data ended short of it
                        # its largest batch; where a drop_last loader made none, the largest probe (which
                        # ran)
                        upper = trial.samples or max(p.size for p in plan.probes)
                        trial = bench.run(upper)
                    if accepted(trial, limit):
                        ran[budget] = trial.batch_size
                        point = trial.point
                        measured += [point] if point is not None and trial.retries in (None, 0) else []
                        break
        return ran, measured, upper
