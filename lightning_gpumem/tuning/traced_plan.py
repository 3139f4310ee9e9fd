"""The planner without a GPU: the user's training step traced on fake tensors, for the budgets asked.

On a CPU Trainer (or any device without an allocator to measure), the planner's probes cannot run. The step
is traced instead (``sources/lightning_step.py``: the user's ``training_step``, optimizer and precision on
fake copies at any batch size) and replayed through the model of the caching allocator
(``sources/traced.py``); the one search finds each budget's largest size on those traced trials.
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from lightning_gpumem._core.cards import card_bytes, card_device
from lightning_gpumem._core.kernels import H100, Device
from lightning_gpumem._hw.allocator import expandable_segments
from lightning_gpumem.tuning import bounds
from lightning_gpumem.tuning.search.model import Point
from lightning_gpumem.tuning.search.plan import Plan, Prediction, Terms
from lightning_gpumem.tuning.sources.lightning_step import lightning_tracer
from lightning_gpumem.tuning.sources.traced import (
    CONTEXT_BYTES,
    CannotTrace,
    TracedPlan,
    TracedSource,
    plan_by_trace,
)
from lightning_gpumem.tuning.trials import loaders
from lightning_gpumem.tuning.trials.measure import module_bytes
from lightning_gpumem.tuning.trials.saved_run import rng_kept


def plan_traced(
    trainer: pl.Trainer,
    budgets: Sequence[int | float | str] | None,
    size: int,
    upper: int,
    init_val: int,
    include_validation: bool,
) -> tuple[Plan | None, list[Prediction], float]:
    """Trace the fit's training step and plan the budgets from it.

    Returns the plan of the traced points (``None``, with a warning, where the step cannot be traced or the
    data makes no batch), the predictions (marked traced) and the seconds it took.
    """
    asked = bounds.planner_budgets(budgets, trainer, None)  # a bad budget is the user's error: it raises
    named = {card_bytes(b): device for b in budgets or () if (device := card_device(b)) is not None}
    groups: dict[Device, list[int]] = {}  # a card's kernels (cuBLAS, reductions, attention) are its own
    for budget in asked:
        groups.setdefault(named.get(budget) or H100, []).append(budget)
    plans: list[TracedPlan] = []
    with rng_kept(trainer):  # the first batches drew from the run's RNG streams
        for device, group in groups.items():
            source = traced_source(trainer, "MemoryPlanner", include_validation, device)
            if source is None:
                return None, [], 0.0
            try:
                plans.append(plan_by_trace(source, size, group, upper=upper, init_val=init_val))
            except Exception as error:  # the fit runs the real step: a real error shows there, not here
                warn_untraced(error)
                return None, [], 0.0
    by_budget = {p.budget: p for plan in plans for p in plan.predictions}
    predictions = [by_budget[budget] for budget in asked]
    traced = plans[0]  # its points make the plan's lines (the first card's kernels)
    seconds = sum(plan.seconds for plan in plans)
    points = sorted({p.size: p for t in traced.points if (p := t.point) is not None}.values(), key=_size)
    if len(points) < 2:
        rank_zero_warn("MemoryPlanner: fewer than two sizes could be traced; no plan.")
        return None, [], seconds
    parameters, gradients = module_bytes(trainer.lightning_module)
    plan = Plan(points, "settled", CONTEXT_BYTES)
    plan.terms = Terms(
        parameters=parameters,
        gradients=gradients,
        other_fixed=float(plan.lines[0].intercept) - parameters - gradients,
        per_sample=float(plan.per_sample),
        outside=CONTEXT_BYTES,
    )
    return plan, predictions, seconds


def traced_source(
    trainer: pl.Trainer,
    owner: str,
    include_validation: bool,
    device: Device | None = H100,
    steps: int = 3,
    meta_first: bool = False,
) -> TracedSource | None:
    """The fit's training (and validation) step as traced trials, from the first batch of each loader.

    ``steps`` training steps per trace and ``meta_first`` (``lightning_tracer``'s). ``None``, with a
    warning naming ``owner``, where the training dataloader makes no batch.
    """
    built = loaders.train_loaders(trainer)
    batch = loaders.first_batch(built)
    del built
    if batch is None:
        rank_zero_warn(f"{owner}: the training dataloader made no batch to trace; no plan.")
        return None
    val_batch = None
    if include_validation and trainer.limit_val_batches != 0:
        val_batch = loaders.first_batch(loaders.val_loaders(trainer))
    module = trainer.lightning_module
    trace_at = lightning_tracer(
        trainer, module, batch, val_batch=val_batch, device=device, steps=steps, meta_first=meta_first
    )
    return TracedSource(
        trace_at, expandable_segments=expandable_segments(), bucket_bytes=ddp_bucket_bytes(trainer)
    )


def warn_untraced(error: Exception) -> None:
    """One warning: the step could not be traced (``CannotTrace``'s op, or the error fake tensors met)."""
    if isinstance(error, CannotTrace):
        rank_zero_warn(
            f"MemoryPlanner: {error}, so there is no plan without a GPU. Run the planner on a GPU (its real"
            " probes need no trace), or make the step traceable (no `.item()` or data-dependent shapes)."
        )
        return
    rank_zero_warn(
        f"MemoryPlanner: the step could not be traced on fake tensors ({type(error).__name__}: {error});"
        " no plan without a GPU. Run the planner on a GPU (its real probes need no trace)."
    )


def ddp_bucket_bytes(trainer: pl.Trainer) -> int:
    """The bytes of DDP's gradient buckets: a copy of the trainable parameters' gradients.

    0 where the model is not wrapped by DDP, or is with ``gradient_as_bucket_view=True`` (the gradients are
    then views of the buckets).
    """
    model = getattr(trainer.strategy, "model", None)
    if not isinstance(model, DistributedDataParallel) or model.gradient_as_bucket_view:
        return 0
    return sum(p.numel() * p.element_size() for p in model.module.parameters() if p.requires_grad)


def _size(point: Point) -> int:
    return point.size
