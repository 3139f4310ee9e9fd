"""What the planner says of a plan: the table on rank zero, scalars and the table to every logger."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_gpumem import keys
from lightning_gpumem._core.units import GIB, format_gib
from lightning_gpumem._hw.allocator import expandable_segments
from lightning_gpumem._pl.logging import log_table, log_to_loggers
from lightning_gpumem.tuning.lengths.longest import margin_tip
from lightning_gpumem.tuning.search.plan import Plan, Prediction, plan_table


def report_plan(
    trainer: pl.Trainer,
    plan: Plan,
    size: int,
    predictions: list[Prediction],
    name: str,
    shape_margin: float | None,
    seconds: float | None,
) -> None:
    """The plan on rank zero, its scalars and table to every logger, and what would make the size fit."""
    table = plan_table(plan, size, predictions, name)
    lines = [table]
    for p in predictions:
        if p.fits:
            continue
        lines.append(
            f"Does not fit {format_gib(p.budget)}: {name}={size} needs"
            f" {format_gib(int(p.peak + p.band))} reserved, the allocator has {format_gib(p.limit)}."
            f" {_advice(trainer, plan, p, name)}"
        )
    if plan.margin > 0:
        lines.append(
            f"The batches vary in shape (`length_fn`), so each allocator limit leaves {plan.margin:.0%}"
            " of it free for the allocator's fragmentation"
            f" (`shape_margin`){margin_tip(shape_margin)}."
        )
    shown = f" ({seconds:.1f} s)" if seconds is not None else ""
    rank_zero_info(f"MemoryPlanner{shown}:\n" + "\n".join(lines))
    if not trainer.is_global_zero:
        return
    device = predictions[0]
    scalars = {
        keys.PLAN_PEAK.format(): device.peak / GIB,
        keys.PLAN_BAND.format(): device.band / GIB,
        keys.PLAN_PER_SAMPLE.format(): float(plan.per_sample) / 2**20,
        keys.PLAN_FIXED.format(): float(plan.lines[0].intercept) / GIB,
    }
    if plan.outside is not None:
        scalars[keys.PLAN_OUTSIDE.format()] = plan.outside / GIB
    if device.largest is not None:
        scalars[keys.PLAN_LARGEST.format()] = float(device.largest)
    log_to_loggers(trainer, scalars, step=trainer.global_step)
    columns = ["budget GiB", "limit GiB", "peak GiB", "band GiB", "fits", f"largest {name}", "how"]
    rows = [
        [
            f"{p.budget / GIB:.1f}",
            f"{p.limit / GIB:.2f}",
            f"{p.peak / GIB:.2f}",
            f"{p.band / GIB:.2f}",
            "yes" if p.fits else "no",
            "unbounded" if p.largest is None else p.largest,
            p.how,
        ]
        for p in predictions
    ]
    log_table(trainer, keys.MEMORY_PLAN.format(), columns, rows, trainer.global_step, table, "MemoryPlanner")


def _advice(trainer: pl.Trainer, plan: Plan, prediction: Prediction, name: str) -> str:
    tips = []
    if prediction.largest is not None and prediction.largest >= 1:
        tips.append(f"{name}={prediction.largest} fits")
    else:
        tips.append("even the smallest batch does not fit: the fixed memory alone is over it")
    precision = str(getattr(trainer, "precision", ""))
    if precision.startswith("32") or precision.startswith("64"):
        tips.append("precision='bf16-mixed' roughly halves the activations")
    tips.append("activation checkpointing trades compute for activation memory")
    if plan.growth > 1.05 and not expandable_segments():
        tips.append(
            f"reserved memory grew {float(plan.growth):.2f}x as fast as live tensors:"
            " PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before CUDA starts: in the shell, or"
            " before the first CUDA call) may lower it"
        )
    return "To make it fit: " + "; ".join(tips) + "."
