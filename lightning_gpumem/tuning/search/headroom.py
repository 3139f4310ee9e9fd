"""The headroom policy, in one place.

How much of the largest size a budget holds is given up, and the walk down to a size that runs where the
one kept does not.
"""

from __future__ import annotations

import math
from dataclasses import replace

from lightning_gpumem.tuning.search.model import TrialSource, accepted
from lightning_gpumem.tuning.search.policy import SearchResult

# the tuner's search closes to within this fraction: the sizes left open above what ran stay few
TUNER_TOLERANCE = 0.01
# the walk down's first step, a fraction of the size it starts from; it doubles after each failure
WALK_STEP = 0.01


def largest_held(result: SearchResult, limit_bytes: int | None) -> int | None:
    """The largest size the budget may hold, which the headroom is a fraction of.

    One less than the smallest size above the result that failed, where the search closed in on it
    (``"bracketed"``: within its tolerance), else the result itself.

    >>> from lightning_gpumem.tuning.search.model import Trial
    >>> trials = (Trial(553, True), Trial(559, False), Trial(566, False))
    >>> largest_held(SearchResult(553, trials, "bracketed"), None)
    558
    >>> # stopped early: 554 to 558 are not known to run
    >>> largest_held(SearchResult(553, trials, "max_trials"), None)
    553
    """
    best = result.batch_size
    if best is None or result.reason != "bracketed":
        return best
    failed = [t.batch_size for t in result.trials if t.batch_size > best and not accepted(t, limit_bytes)]
    return min(failed) - 1 if failed else best


def headroom_size(largest: int, headroom: float) -> int:
    """The size kept when ``largest`` is the largest that runs in the budget.

    The smallest at least ``(1 - headroom) * largest``, so at most ``headroom`` of it is given up, and under
    ``1 / headroom`` nothing.

    >>> headroom_size(40, 0.05), headroom_size(40, 0.02), headroom_size(558, 0.05)
    (38, 40, 531)
    """
    kept = math.ceil(round((1.0 - headroom) * largest, 9))  # 0.95 * 40 is 38, not 38.000000000000004
    return max(1, min(largest, kept))


def size_to_keep(largest: int, headroom: float, upper: int) -> int:
    """:func:`headroom_size` of ``largest``, or all of it where it is ``upper``: memory did not bound it.

    >>> size_to_keep(40, 0.05, upper=4096), size_to_keep(64, 0.05, upper=64)
    (38, 64)
    """
    return largest if largest >= upper else headroom_size(largest, headroom)


def leave_headroom(
    run_trial: TrialSource,
    result: SearchResult,
    headroom: float,
    limit_bytes: int | None,
    max_trials: int,
    lower: int = 1,
) -> SearchResult:
    """Give up ``headroom`` of the largest size the budget holds, and run the size kept.

    The largest size the budget holds is :func:`largest_held`'s. Nothing is given up where memory did not
    bound the search (it stopped at ``upper``), nor where the search kept the traced size (``"traced"``: the
    headroom is already given up below the traced largest size, and that size ran). The size kept is at
    most the search's result and at least ``lower`` (the search's smallest size); :func:`walk_down` runs it
    where no trial of the search did (and, where it does not run, the sizes below it down to ``lower``) under
    the search's trial budget.
    """
    largest = result.batch_size
    if largest is None or result.reason in ("upper_bound", "traced"):
        return result
    lower = min(lower, largest)
    size = max(lower, min(largest, headroom_size(largest_held(result, limit_bytes) or largest, headroom)))
    return walk_down(
        run_trial, result, start=size, limit_bytes=limit_bytes, max_trials=max_trials, lower=lower
    )


def walk_down(
    run_trial: TrialSource,
    result: SearchResult,
    *,
    start: int,
    limit_bytes: int | None = None,
    max_trials: int = 25,
    lower: int = 1,
) -> SearchResult:
    """Keep ``start`` where it is accepted, else the largest accepted size below it, down to ``lower``.

    ``start`` is at most the search's result. With ``start`` the result, that is the result, with no trial.
    Else, from ``size = start`` and ``step`` 1% of ``start`` (rounded up), in turn: where a trial of the
    search accepted a size from ``size`` up to, not including, the last size the walk tried (``start``
    included, the first time), the largest such size is kept without running again; else ``size`` runs, and
    is kept if accepted; else ``size`` goes ``step`` lower (not below ``lower``) and ``step`` doubles: 1%,
    2%, 4%... of ``start``.

    Args:
        run_trial: runs a trial at a batch size and reports it, as in :func:`search_batch_size`; called at
            most once per size, never for a size the result's trials accepted.
        result: the search's result; the walk's trials are added to its trials.
        start: the size to keep where it is accepted, in ``[lower, result.batch_size]``.
        limit_bytes: peaks above this are rejected like OOMs, as in the search.
        max_trials: the trials of the search and of the walk together: once there are this many and no size
            is kept, the walk stops at the largest size below that a trial accepted.
        lower: the smallest size the walk may run (a token budget's: the longest sample's cost).

    Returns:
        The size kept, every trial in order (the search's, then the walk's) and the search's stop reason.
        ``batch_size`` is ``None`` where none is kept: the result's is ``None``, the walk reached ``lower``
        and it was rejected, or ``max_trials`` trials ran first and none of them accepted a size below the
        walk's.

    Raises:
        ValueError: if ``start`` is not in ``[lower, result.batch_size]``.

    Example:
        >>> from lightning_gpumem.tuning.search.model import Trial
        >>> trials = (Trial(2, True), Trial(100, True), Trial(101, False))
        >>> searched = SearchResult(100, trials, "bracketed")
        >>> # 95 fails, then 94 and 92
        >>> kept = walk_down(lambda bs: Trial(bs, fits=bs <= 93), searched, start=95)
        >>> kept.batch_size, [t.batch_size for t in kept.trials[3:]]
        (92, [95, 94, 92])
    """
    best = result.batch_size
    if best is None:
        return result
    if not 1 <= lower <= start <= best:
        raise ValueError(f"`start={start}` must be in [{lower}, {best}]: `lower` up to the search's result.")
    if start == best:
        return result
    trials = [*result.trials]
    size, step, failed = start, math.ceil(WALK_STEP * start), start + 1
    while True:
        ran = [t.batch_size for t in trials if accepted(t, limit_bytes) and size <= t.batch_size < failed]
        if ran:  # a trial ran one of these (the first time: ``start``)
            return replace(result, batch_size=max(ran), trials=tuple(trials))
        if len(trials) >= max_trials:  # no trial left: the largest size below that a trial accepted, if any
            below = [t.batch_size for t in trials if accepted(t, limit_bytes) and t.batch_size < size]
            return replace(result, batch_size=max(below) if below else None, trials=tuple(trials))
        trial = run_trial(size)
        trials.append(trial)
        if accepted(trial, limit_bytes):
            return replace(result, batch_size=size, trials=tuple(trials))
        if size == lower:
            return replace(result, batch_size=None, trials=tuple(trials))
        failed, size, step = size, max(lower, size - step), 2 * step
