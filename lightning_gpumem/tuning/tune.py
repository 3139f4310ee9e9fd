"""The tuner's trials: one search and its headroom on the trial bench, and what the allocator counted."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_gpumem import keys
from lightning_gpumem._core.units import format_gib
from lightning_gpumem._hw.probe import Probe
from lightning_gpumem.tuning import bounds
from lightning_gpumem.tuning.lengths.longest import LongestFirst, margin_for
from lightning_gpumem.tuning.lengths.scan import LengthFn
from lightning_gpumem.tuning.lengths.token_budget import heaviest_batches_first
from lightning_gpumem.tuning.record import Searched, Shapes
from lightning_gpumem.tuning.search import (
    SearchResult,
    TrialSource,
    leave_headroom,
    search_batch_size,
    until_data_ends,
)
from lightning_gpumem.tuning.search.headroom import TUNER_TOLERANCE, size_to_keep
from lightning_gpumem.tuning.traced_plan import plan_traced
from lightning_gpumem.tuning.traced_start import TracedStart
from lightning_gpumem.tuning.trials import loaders
from lightning_gpumem.tuning.trials import session as _session
from lightning_gpumem.tuning.trials.bench import TrialBench
from lightning_gpumem.tuning.trials.measure import BatchCheck

MAX_TRIALS = 25


def tune_with(
    trainer: pl.Trainer,
    tuner: Any,
    probe: Probe,
    searched: Searched,
    accumulation_for: Callable[[int], int],
) -> tuple[SearchResult, list[Shapes], int]:
    """:func:`tune` with a ``BatchSizeTuner``'s arguments: its bounds, and its budget less the shape margin.

    Returns the result, the shapes the trials saw, and the largest size the search could try.
    """
    init_val, upper, searched.tokens = bounds.search_bounds(
        trainer, tuner.batch_arg_name, tuner.init_val, tuner.max_val
    )
    limit = searched.budget_bytes = bounds.budget_of(tuner.budget, probe, trainer, "BatchSizeTuner")
    varying = searched.tokens is not None or tuner.length_fn is not None
    searched.margin = margin_for(tuner.shape_margin, varying) if limit else 0.0
    if limit is not None:  # trials leave the margin free for the fragmentation of shapes that vary
        limit = int(limit * (1.0 - searched.margin))
    result, shapes = tune(
        trainer,
        tuner,
        probe,
        searched,
        name=tuner.batch_arg_name,
        init_val=init_val,
        upper=upper,
        limit=limit,
        headroom=tuner.headroom,
        steps=tuner.steps_per_trial,
        validate=tuner.include_validation,
        accumulation_for=accumulation_for,
        length_fn=tuner.length_fn,
        start=tuner.start,
    )
    return result, shapes, upper


def tune(
    trainer: pl.Trainer,
    owner: object,
    probe: Probe,
    searched: Searched,
    *,
    name: str,
    init_val: int,
    upper: int,
    limit: int | None,
    headroom: float,
    steps: int,
    validate: bool,
    accumulation_for: Callable[[int], int],
    length_fn: LengthFn | None,
    start: str = "probe",
) -> tuple[SearchResult, list[Shapes]]:
    """Search up to ``upper`` under ``limit`` bytes, give up ``headroom``, choose the size for the fit.

    The trials run on the bench (the heaviest batches first where shapes vary: a token budget's, or the
    longest samples with ``length_fn``), with the allocator capped at ``limit``; ``searched`` gets the run's
    original size and accumulation, the longest-first order and the allocator's counts when the trials ended.
    With ``start="trace"`` the step is traced beside the first trial and the second trial is the traced
    largest size, calibrated by the first (:class:`~lightning_gpumem.tuning.traced_start.TracedStart`).
    Returns the result (every trial, the size kept) and the training batches' shapes the trials saw.
    """
    tokens = searched.tokens
    traced = None
    if start == "trace":
        varies = bool(tokens or length_fn)
        traced = _traced_start(trainer, limit, upper, init_val, validate, headroom, varies)

    with traced or contextlib.nullcontext():  # the forked traces not waited for stop, whatever happens
        # a token budget below the longest sample's cost holds no epoch; above it, any may be tried
        lower = math.ceil(tokens.min_tokens) if tokens else 1

        def search(run: TrialSource, top: int) -> SearchResult:
            return search_batch_size(
                run,
                init_val=init_val,
                upper=top,
                lower=min(lower, top),
                limit_bytes=limit,
                max_trials=MAX_TRIALS,
                tolerance=TUNER_TOLERANCE,
                guess=traced,
            )

        longest = searched.longest = LongestFirst("BatchSizeTuner", length_fn) if length_fn else None
        drawing = heaviest_batches_first() if tokens else longest.drawing(trainer) if longest else None
        check = BatchCheck("BatchSizeTuner", name) if not tokens else None
        bench = TrialBench(
            trainer,
            owner,
            probe,
            batch_arg_name=name,
            steps=steps,
            validate=validate,
            accumulation_for=accumulation_for,
            check_batches=check,
            counts_samples=tokens is None,
            drawing=drawing,
            raising=longest.raising if longest is not None else None,
        )
        try:
            with bench:
                searched.original = bench.session.original
                with bench.capped(
                    limit
                ):  # trials run with the allocator capped at the budget, as the fit will be
                    result = until_data_ends(search, bench.run, upper)
                    result = leave_headroom(bench.run, result, headroom, limit, MAX_TRIALS, lower)
                if result.batch_size is not None:  # applied when the session is left
                    bench.session.choose(result.batch_size, accumulation_for(result.batch_size))
                shapes = sorted(bench.session.shapes)
        finally:
            counters = probe.read(nvml=False, host=False)  # the trials' planned OOMs are not the run's
            searched.counted = {
                keys.TRIAL_OOMS.format(): counters.num_ooms,
                keys.TRIAL_RETRIES.format(): counters.alloc_retries,
            }
        return result, shapes


def _traced_start(
    trainer: pl.Trainer,
    limit: int | None,
    upper: int,
    init_val: int,
    validate: bool,
    headroom: float,
    varies: bool,
) -> TracedStart | None:
    """``start="trace"``'s guess, its traces started; ``None``, with one warning, where there is none.

    None where there is no budget in bytes or the batches' shapes vary: the search then starts from its
    probe alone.
    """
    if limit is None or varies:
        why = "there is no budget in bytes" if limit is None else "the batches' shapes vary"
        rank_zero_warn(f"BatchSizeTuner(start='trace'): {why}; the search starts from its probe alone.")
        return None
    return TracedStart(trainer, limit, upper=upper, init_val=init_val, validate=validate, headroom=headroom)


def restore(
    trainer: pl.Trainer, state: dict[str, Any], name: str, keep_effective: bool
) -> tuple[int, int, Searched]:
    """Apply the size a checkpoint saved (and its accumulation, where ``keep_effective``) without trials.

    Returns the size, the accumulation and the search's record (its budget, and the token sampler whose keys
    the size is logged under, where the size is a token budget).
    """
    size = int(state["batch_size"])
    accumulation = state.get("accumulate_grad_batches") if keep_effective else None
    accumulation = int(accumulation or trainer.accumulate_grad_batches)
    current = (_session.get_batch_size(trainer, name), trainer.accumulate_grad_batches)
    rebuild = current != (size, accumulation)
    _session.apply_batch_size(trainer, name, size, accumulation, rebuild_optimizers=rebuild)
    budget = state.get("budget_bytes")  # None in checkpoints of versions before it was saved
    searched = Searched(budget_bytes=None if budget is None else int(budget))
    searched.tokens = bounds.token_sampler(trainer, loaders.train_loaders(trainer), name)
    rank_zero_info(
        f"BatchSizeTuner: {name}={size} restored from the checkpoint; no trials ran (`retune_on_resume=True`"
        " tunes again)."
    )
    return size, accumulation, searched


def tune_traced(
    trainer: pl.Trainer, budget: int, tuner: Any, *, accumulation_for: Callable[[int], int]
) -> int | None:
    """Without an allocator to measure: the size the traced step fits in ``budget``, less the headroom.

    ``tuner`` is the ``BatchSizeTuner`` (its ``batch_arg_name``, ``init_val``, ``max_val``, ``headroom`` and
    ``include_validation``). The size is applied to the fit with one info line; ``None`` (with the planner's
    warning) where the step cannot be traced, and with a warning where no size fits or the size is a token
    budget.
    """
    name = tuner.batch_arg_name
    size = _session.get_batch_size(trainer, name)
    init_val, upper, tokens = bounds.search_bounds(trainer, name, tuner.init_val, tuner.max_val)
    if tokens is not None:
        rank_zero_warn("BatchSizeTuner: a token budget is not traced; kept as it is (tune it on a GPU).")
        return None
    validate = tuner.include_validation
    _, predictions, seconds = plan_traced(trainer, [budget], size, upper, init_val, validate)
    if not predictions:
        return None
    largest = predictions[0].largest
    if largest is None or largest < 1:
        rank_zero_warn(
            f"BatchSizeTuner: the traced step does not fit {format_gib(budget)} at any {name}; kept"
            f" {name}={size}."
        )
        return None
    kept = size_to_keep(largest, tuner.headroom, upper)
    _session.apply_batch_size(trainer, name, kept, accumulation_for(kept), rebuild_optimizers=True)
    rank_zero_info(
        f"BatchSizeTuner: {trainer.strategy.root_device} has no memory allocator to measure: {name}={kept},"
        f" traced for {format_gib(budget)} (the traced step fits up to {largest}; not run on a GPU;"
        f" {seconds:.1f} s)."
    )
    return kept
