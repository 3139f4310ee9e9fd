"""Batches of variable-length samples planned under a cost budget (pure, stdlib only).

A fixed batch size is tuned for the longest batch an epoch may draw, so every shorter batch wastes the memory
it could have used. Planning batches by *cost* instead (padded tokens, or tokens) keeps every batch near one
budget: many short samples or a few long ones. The plan follows fairseq's: shuffle, stable-sort by length
(samples of one length stay shuffled), pack consecutive samples greedily while the batch's cost stays within
the budget, then shuffle the batches. Sorting first keeps the padding small; shuffling the batches keeps the
order random from step to step.

The plan is a pure function of the lengths, the arguments, the seed and the epoch, so every DDP rank computes
the same global list of batches and takes its own share (``batches[rank::num_replicas]``) without talking to
the others.

Costs are in tokens: ``"padded"`` counts what a padded batch holds (``n * max(L)``), ``"tokens"`` the real
tokens (``sum(L)``, for packed or nested batches). ``quadratic`` adds a term in ``L**2`` per sample for
attention whose memory grows with the square of the length (eager attention; flash and memory-efficient
attention are linear).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal

from lightning_gpumem._core.checks import (
    is_collection,
    is_finite_number,
    require_flags,
    require_int,
    require_int_or_none,
    shown,
)

Cost = Literal["padded", "tokens"]
COSTS: tuple[Cost, ...] = ("padded", "tokens")
MAX_LENGTH = 2**53
"""The longest a sample may be: the largest whole number a float holds exactly (costs are floats)."""
MAX_REPLICAS = 2**20
"""The most ranks a plan is shared by (more than any cluster has): it holds at least a batch per rank."""


def batch_cost(lengths: Sequence[int], *, cost: Cost = "padded", quadratic: float = 0.0) -> float:
    """The cost of one batch whose samples have these lengths, in tokens.

    Args:
        lengths: the samples' lengths.
        cost: ``"padded"``: ``n * max(L)`` (``+ quadratic * n * max(L)**2``); ``"tokens"``: ``sum(L)``
            (``+ quadratic * sum(L**2)``).
        quadratic: weight of the term in ``L**2`` (attention whose memory grows with the square of the
            length).

    Returns:
        The cost; 0 for an empty batch; ``inf`` where ``quadratic`` makes it larger than a float holds.

    Raises:
        ValueError: a length is so long (an integer beyond a float's range) that the cost cannot be computed.

    Example:
        >>> batch_cost([3, 5, 2]), batch_cost([3, 5, 2], cost="tokens"), batch_cost([3, 5], quadratic=0.5)
        (15.0, 10.0, 35.0)
    """
    _check_cost("batch_cost", cost, quadratic)
    if not lengths:
        return 0.0
    try:
        if cost == "padded":
            longest = max(lengths)
            return float(len(lengths) * longest + quadratic * len(lengths) * longest * longest)
        return float(sum(lengths) + quadratic * sum(length * length for length in lengths))
    except OverflowError:  # an integer length beyond a float's range
        raise ValueError(
            f"`batch_cost(lengths={shown(lengths)})` is not valid: the cost is beyond a float's range."
            " Expected lengths from 0 to 2**53 (MAX_LENGTH)."
        ) from None


def plan_batches(
    lengths: Sequence[int],
    max_cost: float,
    *,
    cost: Cost = "padded",
    quadratic: float = 0.0,
    max_samples: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
    num_replicas: int = 1,
) -> list[list[int]]:
    """The global list of batches of one epoch: lists of dataset indices, each costing at most ``max_cost``.

    The indices are shuffled with ``random.Random(seed + epoch)`` (in index order without ``shuffle``),
    stable-sorted by length and packed greedily while the batch's cost stays within ``max_cost`` and it holds
    at most ``max_samples``; then the batches are shuffled with the same generator. The plan depends on
    nothing else, so every rank computes the same one. Each index appears exactly once, before the rounding
    for DDP:

    the number of batches is made a multiple of ``num_replicas``, so that every rank gets as many. With
    ``drop_last`` the last batches of the (shuffled) list are dropped: their samples are skipped this epoch
    (a different set each epoch when shuffled). Without it the first batches are repeated at the end: their
    samples are seen twice.

    Args:
        lengths: every sample's length (``int`` from 0 to :data:`MAX_LENGTH`), by dataset index.
        max_cost: the budget of one batch, in tokens (see :func:`batch_cost`).
        cost: ``"padded"`` or ``"tokens"`` (see :func:`batch_cost`).
        quadratic: weight of the term in ``L**2`` (see :func:`batch_cost`).
        max_samples: at most this many samples in a batch (``None``: no limit but the budget).
        shuffle: shuffle the samples within a length and the order of the batches.
        seed: the generator's seed (the same on every rank).
        epoch: added to the seed: each epoch has its own plan.
        drop_last: round the number of batches down to a multiple of ``num_replicas`` (else up).
        num_replicas: the number of ranks sharing the plan (at most :data:`MAX_REPLICAS`).

    Returns:
        The batches, in the order they run.

    Raises:
        ValueError: a sample alone costs more than ``max_cost`` (the message names the longest such sample),
            or more than a float holds (``quadratic`` is too large for the lengths); an argument is not
            valid.
        TypeError: ``lengths`` is not a sequence of ``int``.

    Example:
        >>> plan_batches([3, 5, 2, 8, 4], max_cost=10, shuffle=False)
        [[2, 0], [4, 1], [3]]
        >>> plan_batches([3, 5, 2, 8, 4], max_cost=10, shuffle=False, num_replicas=2)
        [[2, 0], [4, 1], [3], [2, 0]]
    """
    owner = "plan_batches"
    _check_lengths(owner, lengths)
    _check_budget(owner, max_cost, cost, quadratic)
    require_int_or_none(owner, "max_samples", max_samples, 1, "set no limit but the budget")
    require_flags(owner, shuffle=shuffle, drop_last=drop_last)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"`{owner}(seed={seed!r})` is not valid. Expected an integer.")
    require_int(owner, "epoch", epoch, 0)
    require_int(owner, "num_replicas", num_replicas, 1, MAX_REPLICAS)
    if not lengths:
        return []
    _check_longest(owner, lengths, max_cost, cost, quadratic)

    rng = random.Random(seed + epoch)  # noqa: S311 - a shuffle, not a secret
    order = list(range(len(lengths)))
    if shuffle:
        rng.shuffle(order)
    order.sort(key=lengths.__getitem__)  # stable: samples of one length keep the shuffled order
    batches = _pack(order, lengths, max_cost, cost, quadratic, max_samples)
    if shuffle:
        rng.shuffle(batches)
    return _round_for_replicas(batches, num_replicas, drop_last)


def heaviest_first(
    batches: Sequence[Sequence[int]],
    lengths: Sequence[int],
    *,
    cost: Cost = "padded",
    quadratic: float = 0.0,
) -> list[list[int]]:
    """The same batches, the heaviest first: what a memory trial should run.

    First the costliest batch, then the one holding the longest sample, then the one holding the most samples
    (each only where no batch already taken ties with it), then the rest by cost, the costliest first. Ties
    keep the given order.

    Args:
        batches: lists of dataset indices (a plan of :func:`plan_batches`).
        lengths: every sample's length, by dataset index.
        cost: see :func:`batch_cost`.
        quadratic: see :func:`batch_cost`.

    Returns:
        The batches (copies), reordered.

    Example:
        >>> lengths = [4, 4, 7, 1, 1, 5, 1]  # padded costs: [5] 5, [3, 4, 6] 3, [2] 7, [0, 1] 8
        >>> heaviest_first([[5], [3, 4, 6], [2], [0, 1]], lengths)
        [[0, 1], [2], [3, 4, 6], [5]]
    """
    _check_cost("heaviest_first", cost, quadratic)
    costs = [batch_cost([lengths[i] for i in batch], cost=cost, quadratic=quadratic) for batch in batches]
    longest = [max((lengths[i] for i in batch), default=0) for batch in batches]
    sizes = [len(batch) for batch in batches]
    by_cost = sorted(range(len(batches)), key=lambda p: -costs[p])  # stable: ties keep the given order
    order = by_cost[:1]
    for measure in (longest, sizes):  # a batch already taken that ties with the largest is enough
        top = max(measure, default=0)
        if order and max(measure[p] for p in order) < top:
            order.append(measure.index(top))
    taken = set(order)
    order += [p for p in by_cost if p not in taken]
    return [list(batches[p]) for p in order]


def padding_fraction(batches: Sequence[Sequence[int]], lengths: Sequence[int]) -> float:
    """The fraction of a padded epoch that is padding.

    Padded positions over ``n * max(L)``, both summed over the batches.

    Example:
        >>> padding_fraction([[0, 1], [2]], [1, 3, 4])  # [1, 3] padded to 2 x 3: 2 of 10 positions
        0.2
    """
    padded = real = 0
    for batch in batches:
        sizes = [lengths[i] for i in batch]
        padded += len(sizes) * max(sizes, default=0)
        real += sum(sizes)
    return (padded - real) / padded if padded else 0.0


# ---------------------------------------------------------------------- helpers
def _pack(
    order: list[int],
    lengths: Sequence[int],
    max_cost: float,
    cost: Cost,
    quadratic: float,
    max_samples: int | None,
) -> list[list[int]]:
    """Greedy packing of ``order`` (sorted by length, ascending).

    A batch closes where the next sample would not fit. The sorted order makes each new sample the batch's
    longest, so its cost is kept incrementally.
    """
    batches: list[list[int]] = []
    batch: list[int] = []
    total = 0.0  # "tokens": the running sum of the batch's per-sample costs
    for index in order:
        length = lengths[index]
        if cost == "padded":
            grown = (len(batch) + 1) * (length + quadratic * length * length)
        else:
            grown = total + length + quadratic * length * length
        full = max_samples is not None and len(batch) >= max_samples
        if batch and (grown > max_cost or full):
            batches.append(batch)
            batch, total = [], 0.0
            grown = length + quadratic * length * length
        batch.append(index)
        total = grown
    if batch:
        batches.append(batch)
    return batches


def _round_for_replicas(batches: list[list[int]], num_replicas: int, drop_last: bool) -> list[list[int]]:
    """Round the number of batches to a multiple of ``num_replicas``: drop the last or repeat the first."""
    extra = len(batches) % num_replicas
    if not extra:
        return batches
    if drop_last:
        return batches[: len(batches) - extra]
    missing = num_replicas - extra
    return batches + [list(batches[i % len(batches)]) for i in range(missing)]


def _check_cost(owner: str, cost: object, quadratic: object) -> None:
    if not isinstance(cost, str) or cost not in COSTS:
        raise ValueError(f"`{owner}(cost={shown(cost)})` is not valid. Expected 'padded' or 'tokens'.")
    if not is_finite_number(quadratic) or quadratic < 0:  # type: ignore[operator]
        raise ValueError(
            f"`{owner}(quadratic={shown(quadratic)})` is not valid. Expected a finite number >= 0."
        )


def _check_budget(owner: str, max_cost: object, cost: object, quadratic: object) -> None:
    """``max_cost`` is a finite number > 0 and ``cost``, ``quadratic`` are valid."""
    bad = isinstance(max_cost, bool) or not isinstance(max_cost, (int, float))
    if bad or not 0 < max_cost < float("inf"):  # type: ignore[operator]
        raise ValueError(
            f"`{owner}(max_cost={shown(max_cost)})` is not valid. Expected a finite number of tokens > 0."
        )
    _check_cost(owner, cost, quadratic)


def _check_lengths(owner: str, lengths: object) -> None:
    """``lengths`` is a sequence of ``int`` (not ``bool``) from 0 to :data:`MAX_LENGTH`."""
    if not is_collection(lengths) or not hasattr(lengths, "__getitem__"):
        raise TypeError(
            f"`{owner}(lengths={shown(lengths)})` is not valid. Expected a sequence of non-negative"
            " integers."
        )
    for index, length in enumerate(lengths):
        if isinstance(length, bool) or not isinstance(length, int):
            raise TypeError(
                f"`{owner}(lengths=...)` is not valid: lengths[{index}] is {shown(length)}. Expected a"
                " non-negative integer (an `int`)."
            )
        if not 0 <= length <= MAX_LENGTH:
            raise ValueError(
                f"`{owner}(lengths=...)` is not valid: lengths[{index}] is {shown(length)}. Expected a"
                " non-negative integer up to 2**53 (MAX_LENGTH)."
            )


def _check_longest(
    owner: str, lengths: Sequence[int], max_cost: float, cost: Cost, quadratic: float
) -> None:
    """Raise ``ValueError`` where the longest sample alone costs more than ``max_cost``.

    The cost grows with L, so the longest sample is the costliest.
    """
    longest = max(lengths)
    alone = batch_cost([longest], cost=cost, quadratic=quadratic)
    if alone == float("inf"):
        raise ValueError(
            f"`{owner}(quadratic={quadratic!r})` is not valid: sample {list(lengths).index(longest)} of"
            f" length {longest} alone costs more than a float holds. Expected a smaller `quadratic`."
        )
    if alone > max_cost:
        index = list(lengths).index(longest)
        raise ValueError(
            f"`{owner}(max_cost={shown(max_cost)})` is not valid: sample {index} of length {longest} alone"
            f" costs {alone:g}. Expected a budget of at least the longest sample's cost ({alone:g}), or"
            " leave such samples out."
        )
