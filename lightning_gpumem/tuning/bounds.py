"""What bounds a tuner's search.

The budget in bytes, and the largest size (or token budget) that may be tried.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_gpumem._core.batching import batch_cost
from lightning_gpumem._core.cards import card_bytes
from lightning_gpumem._core.units import GIB, format_gib, parse_budget
from lightning_gpumem._hw.probe import Probe
from lightning_gpumem._pl.peers import budget_bytes
from lightning_gpumem.tuning.lengths.token_budget import TokenBudgetSampler
from lightning_gpumem.tuning.trials import loaders
from lightning_gpumem.tuning.trials import session as _session


def budget_of(budget: int | float | str | None, probe: Probe, trainer: pl.Trainer, owner: str) -> int | None:
    """The budget in bytes.

    A ``MemoryBudget``'s, else what this process can use now, where ``budget`` is ``None``; ``None`` where
    the device has no allocator to measure or cap, with a warning where one was asked for.

    Raises:
        ValueError: on a budget larger than the device.
    """
    total = probe.total_bytes()
    if not probe.has_allocator or total is None:
        if budget is not None:
            rank_zero_warn(
                f"{owner}: `budget={budget!r}` is not applied on `{probe.device}`: it has no memory to"
                " measure or cap; only out-of-memory errors bound the search."
            )
        return None
    if budget is None:
        return int(budget_bytes(trainer) or probe.usable_bytes() or total)
    parsed = int(parse_budget(budget, total, owner))
    if parsed > total:
        raise ValueError(
            f"`{owner}(budget={budget!r})` is {format_gib(parsed)}, larger than the device's"
            f" {format_gib(total)}. Expected at most the device's memory."
        )
    return parsed


def batches_needed(trainer: pl.Trainer) -> int:
    """Training batches an epoch must hold: an integer ``val_check_interval``, else 1.

    Lightning refuses fewer than an integer ``val_check_interval``.
    """
    interval = trainer.val_check_interval
    if (
        isinstance(interval, int)
        and trainer.check_val_every_n_epoch is not None
        and trainer.enable_validation
    ):
        return interval
    return 1


def batches_run(length: int, limit: int | float) -> float:
    """The batches of an epoch of ``length`` that ``limit_train_batches`` lets run (Lightning's rule)."""
    return int(length * limit) if isinstance(limit, float) else min(length, limit)


def upper_bound(
    trainer: pl.Trainer, max_val: int | None, length: int | None, drop_last: bool = False
) -> int:
    """The largest size a search may try.

    ``max_val``, and the largest whose epoch of ``length`` samples (per rank) still has the batches the fit
    needs, whichever is smaller.
    """
    candidates = [] if max_val is None else [max_val]
    if length is not None:
        need = batches_needed(trainer)
        candidates.append(largest_size_with_batches(length, trainer.limit_train_batches, need, drop_last))
    return max(1, min(candidates))


def largest_size_with_batches(samples: int, limit: int | float, need: int, drop_last: bool = False) -> int:
    """The largest batch size whose epoch of ``samples`` still has ``need`` batches.

    The batches are counted after ``limit_train_batches``.

    ``drop_last``: the loader drops a last batch that is not full, so an epoch has ``samples // size``
    batches.

    >>> largest_size_with_batches(1000, 1.0, 1), largest_size_with_batches(1000, 1.0, 10)
    (1000, 111)
    """

    def batches(size: int) -> float:
        return batches_run(samples // size if drop_last else math.ceil(samples / size), limit)

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
    """The first token budget tried and the largest that may be tried.

    The first: the longest sample's own cost at least. The largest: the whole dataset's cost, ``max_val``,
    and the largest budget whose epoch still has the batches ``limit_train_batches`` and an integer
    ``val_check_interval`` need, whichever is smallest.

    Raises:
        ValueError: where ``max_val`` is below the longest sample's cost.
    """
    first = max(init_val, math.ceil(tokens.min_tokens))
    whole = math.ceil(batch_cost(tokens.lengths, cost=tokens.cost, quadratic=tokens.quadratic))
    if max_val is not None and max_val < first:
        raise ValueError(
            f"`BatchSizeTuner(max_val={max_val})` is below the cost of the longest sample alone ({first}):"
            " no budget up to it holds every sample. Raise `max_val` or leave it None."
        )
    top = max(first, whole if max_val is None else min(max_val, whole))
    need, limit = batches_needed(trainer), trainer.limit_train_batches

    def batches(budget: int) -> float:
        return batches_run(len(tokens.plan(budget)) // tokens.num_replicas, limit)

    if batches(top) >= need or batches(first) < need:
        return first, top
    lo, hi = first, top  # batches(lo) >= need > batches(hi): fewer batches as the budget grows
    while hi - lo > max(1, lo // 1000):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if batches(mid) >= need else (lo, mid)
    return first, lo


CARDS_GIB = (16, 24, 40, 48, 80)
"""Common card sizes the planner answers for by default, besides the device (those up to its size)."""


def planner_budgets(
    budgets: Sequence[int | float | str] | None, trainer: pl.Trainer, total: int | None
) -> list[int]:
    """The planner's budgets in bytes, largest first.

    The device's (or a ``MemoryBudget``'s) and the common cards below it where ``budgets`` is ``None``;
    without a device (``total`` ``None``, the plan is traced) every common card.

    Raises:
        ValueError: on a budget that is not valid, or a fraction of the device where there is none.
    """
    if budgets is None:
        own = budget_bytes(trainer) or total
        cards = [gib * GIB for gib in CARDS_GIB if own is None or gib * GIB < own]
        return sorted({*cards, *([own] if own is not None else [])}, reverse=True)
    parsed = [card_bytes(b) or parse_budget(b, total, "MemoryPlanner", "budgets") for b in budgets]
    return sorted(dict.fromkeys(int(b) for b in parsed), reverse=True)


def token_sampler(trainer: pl.Trainer, built: Any, name: str) -> TokenBudgetSampler | None:
    """The training loader's ``TokenBudgetSampler`` where ``name`` is its ``max_tokens``, else ``None``."""
    sampler = loaders.token_sampler(built)
    if sampler is None or sampler.max_tokens != _session.get_batch_size(trainer, name):
        return None
    return sampler


def refuse_token_budget(trainer: pl.Trainer, built: Any, name: str) -> None:
    """The planner plans samples per batch: a ``TokenBudgetSampler``'s loader is refused, naming the tuner.

    Raises:
        ValueError: where the training loader batches with a ``TokenBudgetSampler``.
    """
    sampler = loaders.token_sampler(built)
    if sampler is None:
        return
    named = sampler.max_tokens == _session.get_batch_size(trainer, name)
    what = f"`{name}` is its `max_tokens`" if named else "its batches are made by tokens"
    raise ValueError(
        f"`MemoryPlanner(batch_arg_name={name!r})`: the training loader batches with a TokenBudgetSampler"
        f" and {what}, which the planner cannot plan (it plans a number of samples per batch). Use"
        f" `BatchSizeTuner(batch_arg_name={name!r})` to tune the token budget (docs/variable_length.md)."
    )


def search_bounds(
    trainer: pl.Trainer, name: str, init_val: int, max_val: int | None
) -> tuple[int, int, TokenBudgetSampler | None]:
    """The first size a search tries, the largest it may, and the token sampler whose budget it tunes.

    The sampler is ``None`` where there is none. A token budget goes from the longest sample's own cost to
    the whole dataset's (:func:`token_bounds`); a batch size up to :func:`upper_bound`.

    Raises:
        ValueError: where the training dataset has no length and ``max_val`` is ``None``.
    """
    built = loaders.train_loaders(trainer)
    tokens = token_sampler(trainer, built, name)
    if tokens is not None:
        return (*token_bounds(trainer, tokens, init_val, max_val), tokens)
    length = loaders.samples_per_rank(built, trainer.world_size)
    if length is None and max_val is None:
        raise ValueError(
            "`BatchSizeTuner(max_val=None)`: the training dataset has no length (an `IterableDataset`), so"
            " no batch size is known to exist in it. Pass `max_val`, the largest batch size the dataset can"
            " fill."
        )
    return init_val, upper_bound(trainer, max_val, length, loaders.drops_last(built)), None
