"""The batch-size search as a pure function of ``run_trial(batch_size) -> Trial``: no Trainer, no CUDA.

Why it is guided by memory and not only by pass/fail: peak memory is close to affine in the batch size
(weights, gradients and optimizer state do not grow with it; activations grow linearly). Two measured peaks give
the line, the line gives the largest size under the limit, and one more trial above it confirms the bracket.
Bisection (what Lightning's ``BatchSizeFinder`` does) needs about ``2 * log2(B)`` trials, several of them OOMs;
this needs about four on an affine curve, and falls back to doubling and bisection where peaks are not measured
(CPU) or not affine (steps, noise).

A size is *accepted* when its trial ran without OOM and, if a limit is given, its measured peak is at most the
limit. The result is always a size that was actually run and accepted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

StopReason = Literal["bracketed", "predicted", "upper_bound", "max_trials", "nothing_fits"]
PeakKind = Literal["reserved", "allocated"]


@dataclass(frozen=True)
class Trial:
    """Outcome of running a few real steps at one batch size.

    Attributes:
        batch_size: the size tried.
        fits: the steps ran without an out-of-memory error.
        peak_bytes: peak memory reserved during the trial, in bytes (``None`` where not measurable); compared with
            the limit.
        seconds: wall time of the trial.
        allocated_bytes: peak memory of live tensors during the trial, in bytes (``None`` where not measurable);
            reported, not used by the search.
    """

    batch_size: int
    fits: bool
    peak_bytes: int | None = None
    seconds: float = 0.0
    allocated_bytes: int | None = None


@dataclass(frozen=True)
class SearchResult:
    """The chosen size (``None`` if even 1 does not fit), every trial in order, and why the search stopped."""

    batch_size: int | None
    trials: tuple[Trial, ...]
    reason: StopReason

    @property
    def num_ooms(self) -> int:
        """Trials that ended in an out-of-memory error."""
        return sum(not t.fits for t in self.trials)


def search_batch_size(
    run_trial: Callable[[int], Trial],
    *,
    init_val: int = 2,
    upper: int,
    limit_bytes: int | None = None,
    max_trials: int = 25,
    tolerance: float = 0.01,
) -> SearchResult:
    """Find the largest accepted batch size in ``[1, upper]``.

    Args:
        run_trial: runs a trial at a batch size and reports it; called at most once per size.
        init_val: first size tried (clamped to ``upper``).
        upper: largest size that may be tried (``max_val``, or the dataset size).
        limit_bytes: peaks above this are rejected like OOMs; ``None`` accepts any size that runs.
        max_trials: stop after this many trials with the best size found.
        tolerance: stop once the sizes between the largest accepted and the smallest rejected one are at most this
            fraction of the accepted one (0: always to the exact boundary). Below 100 the boundary is always exact.

    Returns:
        The largest accepted size and the trials.

    Example:
        >>> def run(bs):  # 1 GiB fixed + 0.5 GiB per sample, 24 GiB card
        ...     peak = 2**30 + bs * 2**29
        ...     return Trial(bs, fits=peak <= 24 * 2**30, peak_bytes=peak)
        >>> result = search_batch_size(run, upper=4096, limit_bytes=int(0.95 * 24 * 2**30))
        >>> result.batch_size, len(result.trials), result.num_ooms
        (43, 3, 0)
    """
    if upper < 1:
        raise ValueError(f"`upper={upper}` must be at least 1.")
    trials: dict[int, Trial] = {}

    def accepted(trial: Trial) -> bool:
        return trial.fits and (limit_bytes is None or trial.peak_bytes is None or trial.peak_bytes <= limit_bytes)

    def run(batch_size: int) -> Trial:
        trial = run_trial(batch_size)
        trials[batch_size] = trial
        return trial

    def result(best: int | None, reason: StopReason) -> SearchResult:
        return SearchResult(best, tuple(trials.values()), reason)

    # 1. Find one accepted size, going down from init_val.
    size = max(1, min(init_val, upper))
    lo: int | None = None  # largest accepted size
    hi: int | None = None  # smallest rejected size
    while lo is None:
        trial = run(size)
        if accepted(trial):
            lo = size
            break
        hi = size
        if size == 1:
            return result(None, "nothing_fits")
        if len(trials) >= max_trials:
            return result(None, "max_trials")
        guess = _predict(trials.values(), limit_bytes, below=size)
        size = guess if guess is not None and 1 <= guess < size else max(1, size // 2)

    # 2. Move up: predicted jumps where peaks allow, doubling/bisection where they do not.
    confirmed = False  # the last trial was lo + 1, tried because the line said lo was the largest, and it passed
    bisect_next = False  # the line's last guesses gained little (peaks quantised near the limit): bisect once
    step_back: int | None = None  # the line's guess was just too large: try a size `tolerance` below it
    optimistic = False  # lo + 1 ran although the reserved line had nothing more: the allocated line guides now
    while True:
        top = upper if hi is None else hi - 1
        if lo >= top:
            return result(lo, "bracketed" if hi is not None else "upper_bound")
        if hi is not None and hi - lo - 1 <= tolerance * lo:
            return result(lo, "bracketed")
        if len(trials) >= max_trials:
            return result(lo, "max_trials")
        # With allocated peaks, the stop rule uses them: reserved peaks may include cache the allocator would free.
        two_lines = _slope(trials.values(), "allocated") is not None
        kind: PeakKind = "allocated" if two_lines else "reserved"
        slope = _slope(trials.values(), kind)
        lo_peak = _peak(trials[lo], kind)
        if hi is None and limit_bytes is not None and slope and lo_peak is not None and lo_peak + slope > limit_bytes:
            return result(lo, "predicted")  # one more sample would cross the limit
        guess = _predict(trials.values(), limit_bytes, below=top + 1)
        fallback = lo * 2 if hi is None else (lo + hi) // 2
        # Near a cap the allocator gives cache back instead of failing, so reserved peaks flatten out there and the
        # safe line creeps up a few sizes per trial. Once it has nothing more to offer (or is squeezed), try lo + 1
        # first: where it fails the search is over (one OOM); where it runs, the reserved peak overstated the need
        # (cache, elastic workspaces) and the optimistic allocated line bounds what can still fit.
        squeezed = two_lines and _near_limit(trials[lo], limit_bytes)
        exhausted = guess is None or guess <= lo or squeezed
        contradicted = hi is not None and guess is not None and guess >= top > lo + 1  # hi failed, the line said fits
        if step_back is not None and lo < step_back <= top:
            mode, guess = "step_back", step_back
        elif bisect_next:
            mode, guess = "fallback", fallback
        elif two_lines and exhausted and not optimistic:
            mode, guess = "confirm", lo + 1
            optimistic = True
        elif two_lines and (exhausted or optimistic):
            optimistic_guess = _predict(trials.values(), limit_bytes, below=top + 1, kind="allocated")
            contradicted = hi is not None and optimistic_guess is not None and optimistic_guess >= top > lo + 1
            if optimistic_guess is not None and optimistic_guess > lo and not contradicted:
                mode, guess = "optimistic", optimistic_guess
            else:
                mode, guess = "fallback", fallback
        elif guess is None or (guess <= lo and confirmed) or contradicted:
            # No line yet, or the line said "lo is the largest" and lo + 1 passed anyway, or it claims all up to a
            # size that failed: it is not to be trusted here (allocator steps, noise); double or bisect instead of
            # crawling one size per trial.
            mode, guess = "fallback", fallback
        else:
            mode = "guided"
        guess = fallback if guess is None else guess  # never: every branch above sets it (for the type checker)
        confirmed = guess <= lo  # this trial checks the line's claim that lo is the largest
        size = min(max(guess, lo + 1), top)
        width = None if hi is None else hi - lo
        trial = run(size)
        ok = accepted(trial)
        if ok:
            lo = size
        else:
            hi = size
            confirmed = False
        # A guess that peaked just over the limit (or, from the optimistic line, failed) is followed by one a
        # `tolerance` under it: that usually ends the search.
        near = (mode == "guided" and not ok and trial.fits) or (mode == "optimistic" and not ok)
        step_back = size - max(1, math.ceil(tolerance * size)) if near else None
        slow = width is not None and 2 * (hi - lo) > width  # type: ignore[operator]
        bisect_next = (mode in ("guided", "optimistic") and ok and slow) or (mode == "step_back" and not ok)


SQUEEZE = 0.05  # a reserved peak within this fraction of the limit may have been squeezed by the cap


def _near_limit(trial: Trial, limit_bytes: int | None) -> bool:
    if limit_bytes is None or trial.peak_bytes is None:
        return False
    return trial.peak_bytes >= (1.0 - SQUEEZE) * limit_bytes


def _peak(trial: Trial, kind: PeakKind) -> int | None:
    return trial.peak_bytes if kind == "reserved" else trial.allocated_bytes


def _measured(trials: Iterable[Trial], kind: PeakKind = "reserved") -> list[tuple[int, int]]:
    points = [(t.batch_size, _peak(t, kind)) for t in trials if t.fits]
    return sorted((b, p) for b, p in points if p is not None)


def _slope(trials: Iterable[Trial], kind: PeakKind = "reserved") -> float | None:
    """Bytes per sample from the largest measured size and one well below it (``None``: under two points, or flat)."""
    points = _measured(trials, kind)
    if len(points) < 2:
        return None
    b2, p2 = points[-1]
    # Neighbouring sizes (lo and lo + 1) give a noisy slope: take the largest point at least 5% below the last.
    b1, p1 = next(((b, p) for b, p in reversed(points[:-1]) if b <= 0.95 * b2), points[-2])
    slope = (p2 - p1) / (b2 - b1)
    return slope if slope > 0 else None


def _predict(trials: Iterable[Trial], limit_bytes: int | None, below: int, kind: PeakKind = "reserved") -> int | None:
    """Largest size predicted to stay under the limit, or ``None`` without enough evidence.

    With two measured points that differ, the line through the two largest; otherwise (reserved peaks only) a line
    through the origin and the largest point, which overestimates the slope (the fixed part of the memory is counted
    as per-sample) and so undershoots safely.
    """
    if limit_bytes is None:
        return None
    trials = list(trials)
    points = _measured(trials, kind)
    if not points:
        return None
    slope = _slope(trials, kind)
    b2, p2 = points[-1]
    if slope is None:
        if p2 <= 0 or kind == "allocated":
            return None
        # No usable slope (one point, or peaks that did not move: allocator granularity at small sizes): all of
        # the memory counted as per-sample overestimates the slope, so this undershoots safely. Where the peak did
        # not move at all, fixed memory dominates and the per-sample part is unmeasurably small: at least double.
        guess = math.floor(limit_bytes * b2 / p2)
        if len(points) >= 2 and points[-2][1] >= p2:
            guess = max(guess, 2 * b2)
    else:
        guess = b2 + math.floor((limit_bytes - p2) / slope)
    return min(guess, below - 1) if guess >= 1 else None
