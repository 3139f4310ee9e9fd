"""The batch-size search as a pure function of ``run_trial(batch_size) -> Trial``: no Trainer, no CUDA.

Why it is guided by memory and not only by pass/fail: peak memory is close to affine in the batch size
(weights, gradients and optimizer state do not grow with it; activations grow linearly). Two measured peaks give
a line, the line gives the largest size under the limit. Bisection (what Lightning's ``BatchSizeFinder`` does)
needs about ``2 * log2(B)`` trials, several of them out-of-memory errors; this needs three to six.

The search is a *bracket*, ``lo`` (the largest size accepted so far) and ``hi`` (the smallest rejected), and a
*model* of memory (:class:`MemoryModel`) built from the trials. Each step takes the first move (:class:`Move`) that
applies (:func:`next_move`); each move is a small function that proposes a size with a one-line reason
(:class:`Proposal`):

- ``step_back``: the model's last size was just too large; 1% below it usually ends the search (and where that
  fails too, twice as far below, and so on).
- ``squeezed``: the allocator gave cache back to run ``lo`` (it retried at the cap at least twice, and ``lo``'s
  reserved peak is near it), so the memory reserved but not live there is not what a larger size needs: jump to
  where live tensors plus 1% of the limit reach it, and from a size found so (``halve``), halve the sizes left below
  where live tensors alone reach it.
- ``near_cap``: ``lo``'s reserved peak is near the cap, where it is squeezed: jump (once, from a size the safe model
  chose) to where live tensors plus the memory reserved but not live at ``lo`` (fragmentation) reach the limit.
- ``edge``: the safe prediction has nothing above ``lo``: try ``lo + 1``; if it fails the search is over.
- ``optimistic``: ``lo + 1`` ran although the safe model said no: jump to where live tensors alone reach the limit.
- ``safe``: the largest size the safe model predicts under the limit.
- ``bisect`` / ``double``: no usable model (no peaks, as on CPU; or a model that a failure contradicted).

The model: live tensors (allocated bytes) follow one line per stage, training and validation (a trial measures
the two apart), and the size's need is the larger of the two, so a validation buffer that dominates small sizes
does not bend the prediction. Reserved bytes (what the cap is about) are modelled as the last measured reserved
peak plus the growth of that need times a factor ``g`` in [1, 1.5] (reserved grows faster than live tensors:
fragmentation), the *safe* model; the *optimistic* model is live tensors alone. Without allocated peaks the model is
a line through the reserved peaks. Slopes are exact fractions, so a cap exactly on a size's peak is hit exactly.

A size is *accepted* when its trial ran that many samples without OOM and, if a limit is given, its measured peak is
at most the limit. The result is always a size that was actually run and accepted.

After the search, :func:`walk_down` keeps a smaller size (the tuner's headroom), or where it is not accepted the first
accepted one going down from it in steps of 1%, 2%, 4%... of it; a size a trial of the search accepted is kept without
running it again, and the search's trials count toward the walk's trial budget.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Literal

from lightning_gpumem._core.plan import Plan, ProbePoint, Verdict, probe_verdict

StopReason = Literal["bracketed", "predicted", "upper_bound", "max_trials", "nothing_fits"]

SQUEEZE = 0.05  # a reserved peak within this fraction of the limit may have been squeezed by the cap
SQUEEZED_WASTE = 0.01  # reserved but not live once the cap squeezed the cache: jump there, step back if need be
SQUEEZES = 2  # retries in a trial that show the cap squeezing step after step, not one flush the steps then live with
MAX_GROWTH = Fraction(3, 2)  # reserved grows at most this much faster than live tensors in the safe model
FAR = Fraction(95, 100)  # a line's second point is at most this fraction of its first, where one exists
WALK_STEP = 0.01  # the walk down's first step, a fraction of the size it starts from; it doubles after each failure


@dataclass(frozen=True)
class Trial:
    """Outcome of running a few real steps at one batch size.

    Attributes:
        batch_size: the size tried.
        fits: the steps ran without an out-of-memory error.
        peak_bytes: peak memory reserved during the trial, in bytes (``None`` where not measurable); compared with
            the limit.
        seconds: wall time of the trial.
        allocated_bytes: peak memory of live tensors during the trial, in bytes (``None`` where not measurable).
        train_peak_bytes: peak memory of live tensors during the training steps, in bytes (``None`` where not
            measured apart).
        val_peak_bytes: peak memory of live tensors during the validation step, in bytes (``None`` where the trial
            ran no validation or it was not measured apart).
        retries: times the allocator hit the cap, gave its cache back and retried during the trial (``None`` where
            not measured); 2 or more near the cap mean the cap squeezed the cache step after step, so the reserved
            peak overstates what the trial needed.
        samples: samples in the largest training batch the trial ran, on the rank that ran fewest (``None``: not
            counted); a trial that ran fewer than ``batch_size`` did not run that size.
    """

    batch_size: int
    fits: bool
    peak_bytes: int | None = None
    seconds: float = 0.0
    allocated_bytes: int | None = None
    train_peak_bytes: int | None = None
    val_peak_bytes: int | None = None
    retries: int | None = None
    samples: int | None = None

    @property
    def ran_its_size(self) -> bool:
        """Whether its training batches had ``batch_size`` samples (``True`` where not counted)."""
        return self.samples is None or self.samples >= self.batch_size

    @property
    def short(self) -> bool:
        """It ran, on fewer samples than its size: the data ended first (no OOM said anything of the size)."""
        return self.fits and not self.ran_its_size


def accepted(trial: Trial, limit_bytes: int | None) -> bool:
    """The trial ran its size without OOM and, if a limit is given, its measured peak is at most the limit.

    A trial whose batches held fewer samples than its size (the data ran out) did not run that size.
    """
    if not trial.fits or trial.short:
        return False
    return limit_bytes is None or trial.peak_bytes is None or trial.peak_bytes <= limit_bytes


@dataclass(frozen=True)
class SearchResult:
    """The chosen size (``None`` if even 1 does not fit), every trial in order, and why the search stopped.

    ``plan`` is the plan a prediction came from (:func:`search_by_plan`; ``None`` where none was made) and ``note``
    says why the search ran without one, where it did.
    """

    batch_size: int | None
    trials: tuple[Trial, ...]
    reason: StopReason
    plan: Plan | None = None
    note: str = ""

    @property
    def num_ooms(self) -> int:
        """Trials that ended in an out-of-memory error."""
        return sum(not t.fits for t in self.trials)


def largest_held(result: SearchResult, limit_bytes: int | None) -> int | None:
    """The largest size the budget may hold, which the headroom is a fraction of.

    One less than the smallest size above the result that failed, where the search closed in on it (``"bracketed"``:
    within its tolerance), else the result itself.

    >>> trials = (Trial(553, True), Trial(559, False), Trial(566, False))
    >>> largest_held(SearchResult(553, trials, "bracketed"), None)
    558
    >>> largest_held(SearchResult(553, trials, "max_trials"), None)  # stopped early: 554 to 558 are not known to run
    553
    """
    best = result.batch_size
    if best is None or result.reason != "bracketed":
        return best
    failed = [t.batch_size for t in result.trials if t.batch_size > best and not accepted(t, limit_bytes)]
    return min(failed) - 1 if failed else best


# ---------------------------------------------------------------------- the model
@dataclass(frozen=True)
class Line:
    """``peak(b) = p0 + slope * (b - b0)`` through measured points; ``slope`` is exact and at least 0."""

    b0: int
    p0: int
    slope: Fraction

    def at(self, batch_size: int) -> Fraction:
        """The line's peak at ``batch_size``."""
        return self.p0 + self.slope * (batch_size - self.b0)

    def largest_under(self, limit: Fraction | int) -> int | None:
        """The largest size whose peak is at most ``limit`` (``None``: unbounded, a flat line under it)."""
        if self.slope == 0:
            return None if self.p0 <= limit else 0
        return self.b0 + math.floor((limit - self.p0) / self.slope)


def fit_line(points: Iterable[tuple[int, int]]) -> Line | None:
    """The line through the largest size and the largest one at most 95% of it (neighbours are noisy).

    ``None`` under two points. A falling pair (noise) gives a flat line: no measurable per-sample part.
    """
    points = sorted(points)
    if len(points) < 2:
        return None
    b2, p2 = points[-1]
    b1, p1 = next(((b, p) for b, p in reversed(points[:-1]) if b <= FAR * b2), points[-2])
    return Line(b2, p2, max(Fraction(0), Fraction(p2 - p1, b2 - b1)))


def _largest_where(lines: list[Line], limit: Fraction | int) -> int | None:
    """The largest size at which every line is at most ``limit`` (``None``: no line bounds it)."""
    bounds = [b for b in (line.largest_under(limit) for line in lines) if b is not None]
    return min(bounds) if bounds else None


@dataclass
class MemoryModel:
    """Memory as a function of the batch size, from the accepted trials (see the module docstring)."""

    trials: list[Trial]
    limit: int | None
    reserved: Line | None = field(init=False)
    need: list[Line] | None = field(init=False)  # lines of live tensors; the need is their maximum
    growth: Fraction = field(init=False)

    def __post_init__(self) -> None:
        ran = [t for t in self.trials if accepted(t, None)]
        self.reserved = fit_line((t.batch_size, t.peak_bytes) for t in ran if t.peak_bytes is not None)
        allocated = fit_line((t.batch_size, t.allocated_bytes) for t in ran if t.allocated_bytes is not None)
        stages = [
            fit_line((t.batch_size, t.train_peak_bytes) for t in ran if t.train_peak_bytes is not None),
            fit_line((t.batch_size, t.val_peak_bytes) for t in ran if t.val_peak_bytes is not None),
        ]
        # Stage lines where every stage measured at the largest accepted size has one; else the overall line.
        last = max(ran, key=lambda t: t.batch_size, default=None)
        measured = [last.train_peak_bytes, last.val_peak_bytes] if last is not None else [None, None]
        usable = [line for line, value in zip(stages, measured, strict=True) if value is not None]
        if usable and all(line is not None for line in usable):
            self.need = [line for line in usable if line is not None]
        else:
            self.need = [allocated] if allocated is not None else None
        self.growth = Fraction(1)
        if self.reserved is not None and allocated is not None and allocated.slope > 0:
            self.growth = min(MAX_GROWTH, max(Fraction(1), self.reserved.slope / allocated.slope))

    def need_at(self, batch_size: int) -> Fraction | None:
        """Live tensors at ``batch_size``: the larger stage (``None`` without allocated peaks)."""
        return max(line.at(batch_size) for line in self.need) if self.need else None

    def safe_size(self, lo: Trial) -> int | None:
        """The largest size the safe model keeps under the limit (``None``: the model cannot say)."""
        if self.limit is None or lo.peak_bytes is None:
            return None
        need_lo = self.need_at(lo.batch_size)
        if self.need is not None and need_lo is not None:  # reserved(b) = reserved(lo) + g * (need(b) - need(lo))
            bound = _largest_where(self.need, (self.limit - lo.peak_bytes) / self.growth + need_lo)
            if bound is not None:
                return bound
        if self.reserved is not None and self.reserved.slope > 0:
            return self.reserved.largest_under(self.limit)
        # One point, or peaks that did not move (allocator granularity at small sizes): all of the memory counted as
        # per-sample overestimates the slope and undershoots safely; where the peak did not move, fixed memory
        # dominates and the per-sample part is unmeasurably small: at least double.
        guess = math.floor(self.limit * lo.batch_size / lo.peak_bytes) if lo.peak_bytes > 0 else None
        if self.reserved is not None and guess is not None:
            guess = max(guess, 2 * lo.batch_size)
        return guess

    def optimistic_size(self, waste: int = 0) -> int | None:
        """The largest size whose live tensors plus ``waste`` bytes stay under the limit."""
        if self.limit is None or not self.need:
            return None
        return _largest_where(self.need, self.limit - waste)

    def waste_at(self, trial: Trial) -> int:
        """Reserved but not live at ``trial``'s peaks: near the cap, the fragmentation the allocator could not undo."""
        if trial.peak_bytes is None or trial.allocated_bytes is None:
            return 0
        return max(0, trial.peak_bytes - trial.allocated_bytes)

    def next_one_crosses(self, lo: Trial) -> bool:
        """One more sample than ``lo`` cannot fit, even with no waste at all: the search can stop."""
        if self.limit is None:
            return False
        need = self.need_at(lo.batch_size + 1)
        if need is not None:
            return need > self.limit
        if self.reserved is not None and self.reserved.slope > 0 and lo.peak_bytes is not None:
            return lo.peak_bytes + self.reserved.slope > self.limit
        return False


# ---------------------------------------------------------------------- the moves
class Move(enum.Enum):
    """The moves of the search (see the module docstring); each value is the name the documentation uses."""

    STEP_BACK = "step_back"
    SQUEEZED = "squeezed"
    HALVE = "halve"
    NEAR_CAP = "near_cap"
    EDGE = "edge"
    OPTIMISTIC = "optimistic"
    SAFE = "safe"
    DOUBLE = "double"
    BISECT = "bisect"
    PROBE = "probe"  # the plan's probes: small sizes until the line settles
    PREDICTED = "predicted"  # the plan's largest size under the limit, validated by a trial
    BACK_OFF = "back_off"  # the prediction ran out of memory: 6%, 12%, 24%... less live memory


MODEL_MOVES = (None, Move.SAFE, Move.PREDICTED, Move.BACK_OFF)
"""Moves whose size a model chose (``None``: the first size accepted); ``near_cap`` jumps once from such a size."""


@dataclass(frozen=True)
class Proposal:
    """The size a move tries next, and why (``str``: ``"<move> <size>: <reason>"``)."""

    move: Move
    size: int
    reason: str

    def __str__(self) -> str:
        return f"{self.move.value} {self.size}: {self.reason}"


@dataclass
class Bracket:
    """``lo`` ran and was accepted, ``hi`` failed or was rejected (``None``: nothing yet); sizes up to ``upper``."""

    lo: int
    hi: int | None
    upper: int
    last_move: Move | None = None  # None: no move yet
    last_accepted: bool = False
    last_size: int = 0
    edge_at: int | None = None  # the lo whose lo + 1 was tried
    lo_move: Move | None = None  # the move that found lo; None: the first size accepted, from init_val down
    refuted: bool = False  # an edge ran where a fitted safe model said it would not: no more edges
    back: int = 0  # how far the last move stepped back

    @property
    def top(self) -> int:
        """The largest size still open."""
        return self.upper if self.hi is None else self.hi - 1


def _step_back(b: Bracket, model: MemoryModel, tolerance: float) -> Proposal | None:
    # After the optimistic model failed, or the safe one ran but peaked over the limit (it was close); a safe guess
    # that ran out of memory may have been far off: bisection then. A step back that failed too steps twice as far.
    if b.last_accepted:
        return None
    last = next((t for t in model.trials if t.batch_size == b.last_size), None)
    if b.last_move is Move.STEP_BACK:
        step, reason = 2 * b.back, f"{b.last_size} was too large as well: step back twice as far"
    elif b.last_move in (Move.OPTIMISTIC, Move.NEAR_CAP, Move.SQUEEZED) or (
        b.last_move is Move.SAFE and last is not None and last.fits
    ):
        step, reason = (
            max(1, math.ceil(tolerance * b.last_size)),
            f"{b.last_size} was just too large: 1% below it usually ends the search",
        )
    else:
        return None
    size = b.last_size - step
    if not b.lo < size <= b.top:
        return None
    return Proposal(Move.STEP_BACK, size, reason)


def _edge(b: Bracket, model: MemoryModel) -> Proposal | None:
    lo = _lo_trial(model, b)
    if b.refuted or b.edge_at == b.lo or b.lo + 1 > b.top:
        return None  # the safe model's "nothing above" was wrong once: no crawling one size per trial
    safe = model.safe_size(lo)
    if safe is not None and safe > b.lo:
        return None
    if safe is None and model.reserved is None and model.need is None:
        return None  # no model at all: doubling and bisection decide
    return Proposal(Move.EDGE, b.lo + 1, f"the safe model has nothing above it: if {b.lo + 1} fails the search is over")


def _squeezed(b: Bracket, model: MemoryModel) -> Proposal | None:
    # The allocator retried again and again at the cap to run lo: near the cap it gives its cache back, so the memory
    # reserved but not live at lo overstates what a larger size needs (ResNet-50: 3 retries and 3.1 GiB at 477, 5 and
    # 0.46 GiB at 554, on a 24 GiB cap). One retry is a flush the steps then live with: a GPT had 1 retry and 3.0 GiB
    # reserved but not live at both 38 and 40 (tuner-24gib-gpt.json); that waste does not shrink.
    lo = _lo_trial(model, b)
    if (lo.retries or 0) < SQUEEZES or model.limit is None or not _near_limit(lo, model.limit) or model.need is None:
        return None  # and a retry far under the cap (one large block that did not fit the cache) squeezed little
    largest = model.optimistic_size()  # live tensors alone: no larger size can run
    if largest is None or largest <= b.lo + 1:
        return None
    if b.lo_move in (Move.SQUEEZED, Move.HALVE):
        half = (b.lo + min(largest, b.top) + 1) // 2
        return Proposal(
            Move.HALVE, half, f"{b.lo} ran: halve the sizes left up to {largest}, where live tensors fill the limit"
        )
    if b.lo_move is not Move.EDGE and (model.optimistic_size(model.waste_at(lo)) or 0) <= b.lo + 1:
        return None  # the waste at lo leaves no room above lo + 1 (unless lo + 1 just ran): the edge decides it
    size = model.optimistic_size(math.ceil(SQUEEZED_WASTE * model.limit)) or 0
    if size <= b.lo + 1 or size > b.top:
        return None
    return Proposal(
        Move.SQUEEZED,
        size,
        f"the cap squeezed the cache at {b.lo}: live tensors plus 1% of the limit reach it at {size}",
    )


def _near_cap(b: Bracket, model: MemoryModel) -> Proposal | None:
    # Near the cap the reserved peak is squeezed (the allocator gives cache back before it fails), so reserved lines
    # say little there; what a larger size needs is its live tensors plus the fragmentation seen at lo.
    lo = _lo_trial(model, b)
    if model.need is None or not _near_limit(lo, model.limit):
        return None
    waste = model.waste_at(lo)
    size = model.optimistic_size(waste)
    if size is None or (b.hi is not None and size >= b.hi):
        return None
    if size > b.lo + 1 and b.lo_move in MODEL_MOVES:  # once: from its own result it would step by the slack
        return Proposal(
            Move.NEAR_CAP,
            size,
            (
                f"near the cap: live tensors plus the {waste / 2**30:.2f} GiB reserved but not live at {b.lo} reach the"
                f" limit at {size}"
            ),
        )
    if b.edge_at == b.lo or b.lo + 1 > b.top or b.lo_move not in (*MODEL_MOVES, Move.NEAR_CAP):
        return None  # only from a size a model chose: no crawling one size per trial
    return Proposal(Move.EDGE, b.lo + 1, f"near the cap, no room above {b.lo + 1}: if it fails the search is over")


def _optimistic(b: Bracket, model: MemoryModel) -> Proposal | None:
    if not b.refuted:  # only once an edge has shown that the safe model overstates the need
        return None
    size = model.optimistic_size()
    if size is None or size <= b.lo or (b.hi is not None and size >= b.hi):
        return None
    return Proposal(
        Move.OPTIMISTIC, size, f"the safe model overstated the need: live tensors alone reach the limit at {size}"
    )


def _safe(b: Bracket, model: MemoryModel) -> Proposal | None:
    lo = _lo_trial(model, b)
    if b.refuted and _near_limit(lo, model.limit):
        return None  # near the cap the reserved peaks are squeezed, and an edge showed they overstate the need
    size = model.safe_size(lo)
    if size is None or size <= b.lo:
        return None
    if b.hi is not None and size >= b.hi:
        return None  # contradicted: the model says a size that failed fits
    return Proposal(Move.SAFE, min(size, b.top), f"the safe model's largest size under the limit is {size}")


def _fallback(b: Bracket) -> Proposal:
    if b.hi is None:
        return Proposal(Move.DOUBLE, min(2 * b.lo, b.top), "no usable model: double")
    return Proposal(Move.BISECT, (b.lo + b.hi) // 2, "no usable model: bisect")


# After the step back (the one move that takes the tolerance), the first of these that applies.
MOVES: tuple[Callable[[Bracket, MemoryModel], Proposal | None], ...] = (
    _squeezed,
    _near_cap,
    _edge,
    _safe,
    _optimistic,
)


def _lo_trial(model: MemoryModel, b: Bracket) -> Trial:
    return next(t for t in model.trials if t.batch_size == b.lo)


def next_move(b: Bracket, model: MemoryModel, tolerance: float) -> Proposal:
    """The step back (by ``tolerance`` of the last size) if it applies, else the first of :data:`MOVES` that does.

    Else double (nothing rejected yet) or bisect.
    """
    found = _step_back(b, model, tolerance)
    if found is not None:
        return found
    for move in MOVES:
        found = move(b, model)
        if found is not None:
            return found
    return _fallback(b)


def _near_limit(trial: Trial, limit: int | None) -> bool:
    if limit is None or trial.peak_bytes is None:
        return False
    return trial.peak_bytes >= (1.0 - SQUEEZE) * limit


# ---------------------------------------------------------------------- the search
def search_batch_size(
    run_trial: Callable[[int], Trial],
    *,
    init_val: int = 2,
    upper: int,
    limit_bytes: int | None = None,
    max_trials: int = 25,
    tolerance: float = 0.01,
    on_move: Callable[[Proposal], None] | None = None,
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
            A step back steps this fraction of the size that was just too large (at least 1).
        on_move: called with each move's :class:`Proposal` (its size clamped to the open sizes) before its trial
            runs; not called for the sizes tried on the way down to the first accepted one.

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

    def run(batch_size: int) -> Trial:
        trial = run_trial(batch_size)
        trials[batch_size] = trial
        return trial

    def result(best: int | None, reason: StopReason) -> SearchResult:
        return SearchResult(best, tuple(trials.values()), reason)

    # 1. Find one accepted size, going down from init_val.
    size = max(1, min(init_val, upper))
    hi: int | None = None
    while not accepted(run(size), limit_bytes):
        hi = size
        if size == 1:
            return result(None, "nothing_fits")
        if len(trials) >= max_trials:
            return result(None, "max_trials")
        guess = MemoryModel(list(trials.values()), limit_bytes).safe_size(trials[size])  # the line through the origin
        size = guess if guess is not None and 1 <= guess < size else max(1, size // 2)

    # 2. Move up the bracket, one move per trial.
    return _close(run, trials, Bracket(lo=size, hi=hi, upper=upper), limit_bytes, max_trials, tolerance, on_move)


def _close(
    run: Callable[[int], Trial],
    trials: dict[int, Trial],
    bracket: Bracket,
    limit_bytes: int | None,
    max_trials: int,
    tolerance: float,
    on_move: Callable[[Proposal], None] | None,
) -> SearchResult:
    """Move up ``bracket`` (``lo`` accepted) one move per trial until it is closed within ``tolerance``."""

    def result(best: int | None, reason: StopReason) -> SearchResult:
        return SearchResult(best, tuple(trials.values()), reason)

    while True:
        lo = bracket.lo
        if lo >= bracket.top:
            return result(lo, "bracketed" if bracket.hi is not None else "upper_bound")
        if bracket.hi is not None and bracket.hi - lo - 1 <= tolerance * lo:
            return result(lo, "bracketed")
        if len(trials) >= max_trials:
            return result(lo, "max_trials")
        model = MemoryModel(list(trials.values()), limit_bytes)
        if bracket.hi is None and model.next_one_crosses(trials[lo]):
            return result(lo, "predicted")
        proposal = next_move(bracket, model, tolerance)
        move, size = proposal.move, min(max(proposal.size, lo + 1), bracket.top)
        if on_move is not None:
            on_move(Proposal(move, size, proposal.reason))
        if move is Move.EDGE:
            bracket.edge_at = lo
        ok = accepted(run(size), limit_bytes)
        if move is Move.EDGE and ok and (model.need is not None or model.reserved is not None):
            bracket.refuted = True
        if ok:
            bracket.lo, bracket.lo_move = size, move
        else:
            bracket.hi = size
        bracket.back = bracket.last_size - size if move is Move.STEP_BACK else 0
        bracket.last_move, bracket.last_accepted, bracket.last_size = move, ok, size


# ---------------------------------------------------------------------- predict, then validate
PLAN_TOLERANCE = 0.02  # a planned search closes its bracket to within this fraction of the size kept
BACK_OFF = 0.06  # a prediction that ran out of memory: the next size needs this much less live memory, then twice


def probe_point(trial: Trial) -> ProbePoint | None:
    """A trial as a probe of the plan (``None``: it measured no live-tensor peak, as on a CPU)."""
    train = trial.train_peak_bytes if trial.train_peak_bytes is not None else trial.allocated_bytes
    if train is None:
        return None
    return ProbePoint(trial.batch_size, train, trial.val_peak_bytes, trial.peak_bytes)


@dataclass(frozen=True)
class Probed:
    """What :func:`probe_until_line` measured.

    Attributes:
        points: the accepted probes, by size.
        verdict: the probes' verdict (``None`` where probing stopped first).
        stop: why probing stopped before a verdict: ``"rejected"`` (the last size ran out of memory or peaked over
            the limit), ``"unmeasured"`` (it measured no peak, as on a CPU), ``"upper"`` (it reached ``upper``),
            ``"data"`` (its batches held fewer samples than the size: the data ran out), or ``""``.
        size: the last size probed.
        samples: with ``"data"``, the samples the data held: no batch can be larger.
    """

    points: list[ProbePoint]
    verdict: Verdict | None
    stop: str
    size: int
    samples: int | None = None


def probe_until_line(
    run: Callable[[int], Trial],
    *,
    init_val: int,
    upper: int,
    limit: int,
    on_move: Callable[[Proposal], None] | None = None,
) -> Probed:
    """Probe from ``init_val``, doubling, while :func:`~lightning_gpumem._core.plan.probe_verdict` asks for more."""
    size = max(1, min(init_val, upper))
    points: list[ProbePoint] = []
    while True:
        if on_move is not None:
            on_move(Proposal(Move.PROBE, size, "a probe of the plan: small sizes until memory is a line"))
        trial = run(size)
        point = probe_point(trial)
        if trial.short:
            return Probed(points, None, "data", size, trial.samples)
        if not accepted(trial, limit):
            return Probed(points, None, "rejected", size)
        if point is None:
            return Probed(points, None, "unmeasured", size)
        points.append(point)
        if size >= upper:
            return Probed(points, None, "upper", size)
        verdict, nxt = probe_verdict(points, limit, upper)
        if verdict != "more" or nxt is None:
            return Probed(points, verdict, "", size)
        size = nxt


class DataEnds(Exception):
    """A trial's batches held fewer samples than its size: the data holds no larger batch than ``samples``."""

    def __init__(self, samples: int) -> None:
        super().__init__(samples)
        self.samples = samples


def until_data_ends(
    search: Callable[[Callable[[int], Trial], int], SearchResult], run_trial: Callable[[int], Trial], upper: int
) -> SearchResult:
    """``search(run, upper)``; where a trial finds the data ending short of its size, the search again up to there.

    Where the loader's samples per epoch are not known beforehand (an iterable dataset, a sampler without a length),
    a size past them runs the batch the data can make, not the size: no search may take it for that size. Each size
    runs once across the searches; the result holds every trial in the order they ran.

    >>> def run(bs):  # the data holds 100 samples; 1 GiB + 0.1 GiB a sample
    ...     return Trial(bs, fits=True, peak_bytes=2**30 + min(bs, 100) * 2**30 // 10, samples=min(bs, 100))
    >>> until_data_ends(lambda r, u: search_batch_size(r, upper=u, limit_bytes=24 * 2**30), run, 4096).batch_size
    100
    """
    ran: dict[int, Trial] = {}

    def run(size: int) -> Trial:
        if size not in ran:
            ran[size] = run_trial(size)
        trial = ran[size]
        if trial.short and trial.samples:  # 0: no batch at all (drop_last), a rejection like any other
            raise DataEnds(trial.samples)
        return trial

    note = ""
    while True:
        try:
            result = search(run, upper)
            break
        except DataEnds as ended:
            upper = min(upper - 1, ended.samples)  # every pass lowers it: the loop ends
            note = f"the data makes batches of {ended.samples} samples at most: searched up to that"
    return replace(result, trials=tuple(ran.values()), note=note or result.note)


def back_off_sizes(plan: Plan, size: int, floor: int) -> Iterator[int]:
    """After ``size`` ran out of memory: the sizes needing 6%, 12%, 24%... less live memory than it, above ``floor``."""
    need, step = plan.need(size), BACK_OFF
    while True:
        smaller = plan.largest_under(need * (1 - step), live_only=True)
        if smaller is None or smaller <= floor:
            return
        yield smaller
        step *= 2


def search_by_plan(
    run_trial: Callable[[int], Trial],
    *,
    init_val: int = 2,
    upper: int,
    limit_bytes: int | None = None,
    max_trials: int = 25,
    tolerance: float = PLAN_TOLERANCE,
    on_move: Callable[[Proposal], None] | None = None,
    make_plan: Callable[[list[ProbePoint], Verdict], Plan] | None = None,
) -> SearchResult:
    """Probe small sizes until memory is a line, predict the largest size under the limit, validate it, close in.

    1. **Probe**: ``init_val``, then double, while :func:`~lightning_gpumem._core.plan.probe_verdict` asks for more
       (probes stay under half the limit, so they are cheap).
    2. **Predict**: the plan's largest size whose reserved peak fits ``limit_bytes`` (live tensors on the line,
       reserved growing as it grew between the last two probes).
    3. **Validate**: a trial runs it. Where it runs out of memory, sizes needing 6%, 12%, 24%... less live memory
       than it run, until one is accepted.
    4. **Close**: until the sizes between the largest accepted and the smallest rejected (or, where none was
       rejected, the size where live tensors alone fill the limit) are at most ``tolerance`` of the former: while
       nothing ran out of memory, the size the line gives from the largest accepted size's own reserved peak
       (``near_cap``), where that is more than half the tolerance above it; else (a reserved peak squeezed against
       the cap says little), and after an OOM, bisection.

    Where the probes are not affine (:func:`~lightning_gpumem._core.plan.probe_verdict`), the search's moves
    (:func:`next_move`) go on from the largest probe, to within 1%; where they measured nothing (a CPU), or a probe
    was already rejected (a budget below the plateau), the search is :func:`search_batch_size`, reusing the
    probes' trials. ``note`` says why. The result is always a size a trial accepted.

    Args:
        run_trial: runs a trial at a batch size and reports it; called at most once per size.
        init_val: the first probe.
        upper: largest size that may be tried.
        limit_bytes: peaks above this are rejected like OOMs; ``None`` (no memory to measure) searches.
        max_trials: all trials together.
        tolerance: the bracket's closing width, a fraction of the size kept.
        on_move: called with each move's :class:`Proposal` before its trial runs.
        make_plan: builds the :class:`~lightning_gpumem._core.plan.Plan` from the probes and the verdict (the
            caller adds the terms and the memory outside PyTorch); default: ``Plan(probes, verdict)``.

    Returns:
        The size kept, every trial in order, why it stopped, and the plan (``None`` where the search ran).

    Example:
        >>> def run(bs):  # 2 GiB of optimizer temporaries up to 8 samples, then 1 GiB + 0.125 GiB per sample
        ...     live = max(2 * 2**30, 2**30 + bs * 2**27)
        ...     return Trial(bs, fits=live <= 24 * 2**30, peak_bytes=live, allocated_bytes=live)
        >>> result = search_by_plan(run, upper=4096, limit_bytes=24 * 2**30)
        >>> result.batch_size, [t.batch_size for t in result.trials]
        (184, [2, 4, 8, 16, 32, 184])
    """
    if upper < 1:
        raise ValueError(f"`upper={upper}` must be at least 1.")
    trials: dict[int, Trial] = {}

    def run(batch_size: int) -> Trial:
        if batch_size not in trials:
            trials[batch_size] = run_trial(batch_size)
        return trials[batch_size]

    def searched(note: str) -> SearchResult:
        probed = dict(trials)
        result = search_batch_size(
            run,
            init_val=init_val,
            upper=upper,
            limit_bytes=limit_bytes,
            max_trials=max_trials,
            on_move=on_move,
        )  # today's search, to within its own 1%
        ordered = [*probed.values(), *(t for t in result.trials if t.batch_size not in probed)]
        return replace(result, trials=tuple(ordered), note=note)

    if limit_bytes is None:
        return searched("no memory to measure: searched")
    probed = probe_until_line(run, init_val=init_val, upper=upper, limit=limit_bytes, on_move=on_move)
    points, verdict, size = probed.points, probed.verdict, probed.size
    if probed.stop == "rejected":
        return searched(f"the probe at {size} did not fit the budget: searched below it")
    if probed.stop == "unmeasured":
        return searched("the probes measured no peaks: searched")
    if probed.stop == "upper":
        return SearchResult(size, tuple(trials.values()), "upper_bound")
    if len(points) < 2 or verdict is None:
        return searched(f"{size} already needs half the budget: no room for probes, searched")
    plan = make_plan(points, verdict) if make_plan is not None else Plan(points, verdict)
    lo = max(p.size for p in points)
    if verdict == "not_affine":  # the search's moves from the largest probe, to within the search's 1%
        bracket = Bracket(lo=lo, hi=None, upper=upper, lo_move=Move.PROBE)
        result = _close(run, trials, bracket, limit_bytes, max_trials, 0.01, on_move)
        return replace(result, plan=plan, note="the probes are not on a line (sizes of batches vary?): searched")
    return replace(
        _validate_and_close(run, trials, plan, lo, upper, limit_bytes, max_trials, tolerance, on_move), plan=plan
    )


def _validate_and_close(
    run: Callable[[int], Trial],
    trials: dict[int, Trial],
    plan: Plan,
    lo: int,
    upper: int,
    limit: int,
    max_trials: int,
    tolerance: float,
    on_move: Callable[[Proposal], None] | None,
) -> SearchResult:
    """Validate the plan's prediction above the probes (backing off on OOM), then close in (see search_by_plan)."""

    def trial(move: Move, size: int, reason: str) -> bool:
        if on_move is not None:
            on_move(Proposal(move, size, reason))
        return accepted(run(size), limit)

    def result(reason: StopReason) -> SearchResult:
        return SearchResult(lo, tuple(trials.values()), reason)

    line_top = plan.largest_under(limit, live_only=True)  # live tensors alone fill the limit there
    top = upper if line_top is None else min(upper, max(line_top, lo))
    hi: int | None = None
    predicted = plan.largest_under(limit)
    if predicted is None or predicted > lo:
        size = upper if predicted is None else min(predicted, upper)
        if trial(Move.PREDICTED, size, "the plan's largest size under the budget"):
            lo = size
        else:
            hi = size
            for smaller in back_off_sizes(plan, size, lo):  # 6%, 12%, 24%... less live memory than the prediction
                if len(trials) >= max_trials:
                    break
                if trial(Move.BACK_OFF, smaller, f"{hi} ran out of memory: less live memory than it"):
                    lo = smaller
                    break
                hi = smaller
    while True:
        bound = min(top + 1, hi) if hi is not None else top + 1  # sizes from ``bound`` on are not expected to fit
        if lo >= upper:
            return result("upper_bound")
        if bound - lo - 1 <= tolerance * lo:
            return result("bracketed" if hi is not None else "predicted")
        if len(trials) >= max_trials:
            return result("max_trials")
        kept = trials[lo]
        # from lo's own reserved peak: what the sizes above need more, grown as reserved grew between the probes (only
        # before any size ran out of memory: after one, the allocator did what the probes did not show: bisect)
        guess = None
        if kept.peak_bytes is not None and hi is None:
            room = (limit - kept.peak_bytes) / plan.growth + plan.need(lo)
            guess = plan.largest_under(room, live_only=True)
        if guess is not None and lo + tolerance * lo / 2 < guess < bound:  # else a crawl: bisect
            size, move, reason = (
                guess,
                Move.NEAR_CAP,
                f"from {lo}'s reserved peak, the line reaches the limit at {guess}",
            )
        else:
            size, move, reason = (lo + bound) // 2, Move.BISECT, f"between {lo}, which ran, and {bound}"
        if size <= lo:
            return result("bracketed")
        if trial(move, size, reason):
            lo = size
        else:
            hi = size


# ---------------------------------------------------------------------- the walk down
def walk_down(
    run_trial: Callable[[int], Trial],
    result: SearchResult,
    *,
    start: int,
    limit_bytes: int | None = None,
    max_trials: int = 25,
) -> SearchResult:
    """Keep ``start`` (at most the search's result) where it is accepted, else the largest accepted size below it.

    With ``start`` the result, that is the result, with no trial. Else, from ``size = start`` and ``step`` 1% of
    ``start`` (rounded up), in turn: where a trial of the search accepted a size from ``size`` up to, not including,
    the last size the walk tried (``start`` included, the first time), the largest such size is kept without running
    again; else ``size`` runs, and is kept if accepted; else ``size`` goes ``step`` lower (not below 1) and ``step``
    doubles: 1%, 2%, 4%... of ``start``.

    Args:
        run_trial: runs a trial at a batch size and reports it, as in :func:`search_batch_size`; called at most once
            per size, never for a size the result's trials accepted.
        result: the search's result; the walk's trials are added to its trials.
        start: the size to keep where it is accepted, in ``[1, result.batch_size]``.
        limit_bytes: peaks above this are rejected like OOMs, as in the search.
        max_trials: the trials of the search and of the walk together: once there are this many and no size is
            kept, the walk stops at the largest size below that a trial accepted.

    Returns:
        The size kept, every trial in order (the search's, then the walk's) and the search's stop reason.
        ``batch_size`` is ``None`` where none is kept: the result's is ``None``, the walk reached 1 and it was
        rejected, or ``max_trials`` trials ran first and none of them accepted a size below the walk's.

    Raises:
        ValueError: if ``start`` is not in ``[1, result.batch_size]``.

    Example:
        >>> trials = (Trial(2, True), Trial(100, True), Trial(101, False))
        >>> searched = SearchResult(100, trials, "bracketed")
        >>> kept = walk_down(lambda bs: Trial(bs, fits=bs <= 93), searched, start=95)  # 95 fails, then 94 and 92
        >>> kept.batch_size, [t.batch_size for t in kept.trials[3:]]
        (92, [95, 94, 92])
    """
    best = result.batch_size
    if best is None:
        return result
    if not 1 <= start <= best:
        raise ValueError(f"`start={start}` must be in [1, {best}], the search's result.")
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
        if size == 1:
            return replace(result, batch_size=None, trials=tuple(trials))
        failed, size, step = size, max(1, size - step), 2 * step
