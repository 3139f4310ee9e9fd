"""What bounds a tuner's search: the budget in bytes, and the largest size (or token budget) that may be tried."""

from __future__ import annotations

import math

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_gpumem._core.batching import batch_cost
from lightning_gpumem._core.units import format_gib, parse_budget
from lightning_gpumem._hw.probe import Probe
from lightning_gpumem._pl.peers import budget_bytes
from lightning_gpumem.tuning.lengths.token_budget import TokenBudgetSampler


def budget_of(budget: int | float | str | None, probe: Probe, trainer: pl.Trainer, owner: str) -> int | None:
    """The budget in bytes (``None`` where the device has no allocator to measure or cap, with a warning where one
    was asked for): a ``MemoryBudget``'s, else what this process can use now, where ``budget`` is ``None``.

    Raises:
        ValueError: on a budget larger than the device.
    """
    total = probe.total_bytes()
    if not probe.has_allocator or total is None:
        if budget is not None:
            rank_zero_warn(
                f"{owner}: `budget={budget!r}` is not applied on `{probe.device}`: it has no memory to measure or"
                " cap; only out-of-memory errors bound the search."
            )
        return None
    if budget is None:
        return int(budget_bytes(trainer) or probe.usable_bytes() or total)
    parsed = int(parse_budget(budget, total, owner))
    if parsed > total:
        raise ValueError(
            f"`{owner}(budget={budget!r})` is {format_gib(parsed)}, larger than the device's {format_gib(total)}."
            " Expected at most the device's memory."
        )
    return parsed


def batches_needed(trainer: pl.Trainer) -> int:
    """Training batches an epoch must hold: an integer ``val_check_interval`` (Lightning refuses fewer), else 1."""
    interval = trainer.val_check_interval
    if isinstance(interval, int) and trainer.check_val_every_n_epoch is not None and trainer.enable_validation:
        return interval
    return 1


def upper_bound(trainer: pl.Trainer, max_val: int | None, length: int | None, drop_last: bool = False) -> int:
    """The largest size a search may try: ``max_val``, and the largest whose epoch of ``length`` samples (per rank)
    still has the batches the fit needs, whichever is smaller.
    """
    candidates = [] if max_val is None else [max_val]
    if length is not None:
        need = batches_needed(trainer)
        candidates.append(largest_size_with_batches(length, trainer.limit_train_batches, need, drop_last))
    return max(1, min(candidates))


def largest_size_with_batches(samples: int, limit: int | float, need: int, drop_last: bool = False) -> int:
    """The largest batch size whose epoch of ``samples`` still has ``need`` batches after ``limit_train_batches``.

    ``drop_last``: the loader drops a last batch that is not full, so an epoch has ``samples // size`` batches.

    >>> largest_size_with_batches(1000, 1.0, 1), largest_size_with_batches(1000, 1.0, 10)
    (1000, 111)
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


def token_bounds(
    trainer: pl.Trainer, tokens: TokenBudgetSampler, init_val: int, max_val: int | None
) -> tuple[int, int]:
    """The first token budget tried (the longest sample's own cost at least) and the largest that may be tried.

    The largest: the whole dataset's cost, ``max_val``, and the largest budget whose epoch still has the batches
    ``limit_train_batches`` and an integer ``val_check_interval`` need, whichever is smallest.

    Raises:
        ValueError: where ``max_val`` is below the longest sample's cost.
    """
    first = max(init_val, math.ceil(tokens.min_tokens))
    whole = math.ceil(batch_cost(tokens.lengths, cost=tokens.cost, quadratic=tokens.quadratic))
    if max_val is not None and max_val < first:
        raise ValueError(
            f"`BatchSizeTuner(max_val={max_val})` is below the cost of the longest sample alone ({first}): no"
            " budget up to it holds every sample. Raise `max_val` or leave it None."
        )
    top = max(first, whole if max_val is None else min(max_val, whole))
    need, limit = batches_needed(trainer), trainer.limit_train_batches

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
