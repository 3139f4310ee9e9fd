"""The search's moves: each proposes the next size from the bracket and the model, with a one-line reason.

The bracket is ``lo`` (the largest size accepted so far) and ``hi`` (the smallest rejected); the evidence is
the trials so far and the :class:`~lightning_gpumem.tuning.search.model.MemoryModel` of their points. The
*safe* prediction is a size's reserved peak grown from ``lo``'s by the need times the model's growth; the
*optimistic* one is live tensors alone. Near the cap the allocator gives cache back before it fails, so
reserved peaks there say little and the moves lean on live tensors (see ``docs/batch_size_tuner.md``, "How
the search works").
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_gpumem.tuning.search.model import PROBE_CEILING, MemoryModel, Trial

SQUEEZE = 0.05  # a reserved peak within this fraction of the limit may have been squeezed by the cap
# reserved but not live once the cap squeezed the cache: jump there, step back if need be
SQUEEZED_WASTE = 0.01
# retries in a trial that show the cap squeezing step after step, not one flush the steps live with
SQUEEZES = 2
# a predicted size that failed: the next needs this much less live memory, then twice as much
BACK_OFF_STEP = 0.06


class Move(enum.Enum):
    """The moves of the search; each value is the name the documentation uses."""

    STEP_BACK = "step_back"
    SQUEEZED = "squeezed"
    HALVE = "halve"
    NEAR_CAP = "near_cap"
    EDGE = "edge"
    OPTIMISTIC = "optimistic"
    SAFE = "safe"
    DOUBLE = "double"
    BISECT = "bisect"
    PROBE = "probe"  # the planner's probes: small sizes until memory is a line
    BACK_OFF = "back_off"  # a planned size ran out of memory: 6%, 12%, 24%... less live memory
    TRACED = "traced"  # the traced step's largest size, shifted by what the first trial measured


MODEL_MOVES = (None, Move.SAFE, Move.BACK_OFF, Move.TRACED)
"""Moves whose size a model chose (``None``: the first size accepted); ``near_cap`` jumps once from such a
size."""


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
    """``lo`` ran and was accepted, ``hi`` failed or was rejected (``None``: nothing yet).

    The sizes go up to ``upper``.
    """

    lo: int
    hi: int | None
    upper: int
    tolerance: float = 0.0  # the search's: the bracket is closed once hi - lo - 1 <= tolerance * lo
    last_move: Move | None = None  # None: no move yet
    last_accepted: bool = False
    last_size: int = 0
    edge_at: int | None = None  # the lo whose lo + 1 was tried
    lo_move: Move | None = None  # the move that found lo; None: the first size accepted, from init_val down
    refuted: bool = False  # an edge ran where a fitted safe model said it would not: no more edges
    back: int = 0  # how far the last move stepped back
    back_off: float = 0.0  # the last back-off's step, a fraction of the failed prediction's live memory
    back_off_from: int = 0  # the prediction that failed, which the back-offs step down from

    @property
    def top(self) -> int:
        """The largest size still open."""
        return self.upper if self.hi is None else self.hi - 1

    def edge(self, ev: Evidence) -> int:
        """The size just above ``lo`` that ends the search if it fails.

        The largest whose failure closes the bracket within the tolerance, where live tensors alone leave
        room past it; else ``lo + 1`` (the boundary is then exact).
        """
        far = min(self.top, self.lo + 1 + math.floor(self.tolerance * self.lo))
        room = ev.optimistic_size()
        return far if room is not None and room > far else self.lo + 1


@dataclass
class Evidence:
    """The trials so far under ``limit``, and the model of their points.

    ``limit`` is in bytes; ``None``: nothing to measure.
    """

    trials: list[Trial]
    limit: int | None
    model: MemoryModel = field(init=False)

    def __post_init__(self) -> None:
        self.model = MemoryModel([p for p in (t.point for t in self.trials) if p is not None])

    @property
    def has_model(self) -> bool:
        """Whether the points give any line (live tensors or reserved peaks)."""
        return self.model.measures_live or self.model.reserved_line is not None

    def trial(self, size: int) -> Trial:
        """The trial of ``size``."""
        return next(t for t in self.trials if t.batch_size == size)

    def safe_size(self, lo: Trial) -> int | None:
        """The largest size the safe model keeps under the limit (``None``: the model cannot say)."""
        point = lo.point
        if self.limit is None or lo.peak_bytes is None or point is None:
            return None
        model = self.model
        # reserved(b) = reserved(lo) + g * (need(b) - need(lo)); not from a plateau's two points
        if model.measures_live and point.need is not None and not model.on_plateau:
            bound = model.largest_under(self.limit, anchor=point)
            if not model.off_plateau:  # the line may be a plateau's: test it at half the limit first
                probe = model.largest_under(PROBE_CEILING * self.limit, anchor=point)
                bound = probe if probe is not None and probe > lo.batch_size else bound
            if bound is not None:
                return bound
        line = model.reserved_line
        if line is not None and line.slope > 0:
            return line.largest_under(self.limit)
        # One point, or peaks that did not move (allocator granularity at small sizes): all of the memory
        # counted as per-sample overestimates the slope and undershoots safely; where the peak did not move,
        # fixed memory dominates and the per-sample part is unmeasurably small: at least double.
        guess = math.floor(self.limit * lo.batch_size / lo.peak_bytes) if lo.peak_bytes > 0 else None
        if line is not None and guess is not None:
            guess = max(guess, 2 * lo.batch_size)
        return guess

    def optimistic_size(self, waste: int = 0) -> int | None:
        """The largest size whose live tensors plus ``waste`` bytes stay under the limit."""
        if self.limit is None or not self.model.measures_live:
            return None
        return self.model.largest_under(self.limit, live_only=True, waste=waste)

    def next_one_crosses(self, lo: Trial) -> bool:
        """One more sample than ``lo`` cannot fit, even with no waste at all: the search can stop."""
        if self.limit is None:
            return False
        if self.model.measures_live:
            return self.model.need(lo.batch_size + 1) > self.limit
        line = self.model.reserved_line
        if line is not None and line.slope > 0 and lo.peak_bytes is not None:
            return lo.peak_bytes + line.slope > self.limit
        return False

    def near_limit(self, trial: Trial) -> bool:
        """The trial's reserved peak is within :data:`SQUEEZE` of the limit.

        There the cap squeezes the cache.
        """
        if self.limit is None or trial.peak_bytes is None:
            return False
        return trial.peak_bytes >= (1.0 - SQUEEZE) * self.limit


def waste_at(trial: Trial) -> int:
    """Reserved but not live at ``trial``'s peaks.

    Near the cap, the fragmentation the allocator could not undo.
    """
    if trial.peak_bytes is None or trial.allocated_bytes is None:
        return 0
    return max(0, trial.peak_bytes - trial.allocated_bytes)


def _step_back(b: Bracket, ev: Evidence, tolerance: float) -> Proposal | None:
    # After the optimistic model or the trace failed, or the safe one ran but peaked over the limit (it was
    # close); a safe guess that ran out of memory may have been far off: bisection then. A step back that
    # failed too steps twice as far.
    if b.last_accepted:
        return None
    last = next((t for t in ev.trials if t.batch_size == b.last_size), None)
    if b.last_move is Move.STEP_BACK:
        step, reason = 2 * b.back, f"{b.last_size} was too large as well: step back twice as far"
    elif b.last_move in (Move.OPTIMISTIC, Move.NEAR_CAP, Move.SQUEEZED, Move.TRACED) or (
        b.last_move is Move.SAFE and last is not None and last.fits
    ):
        # the smallest size that closes the bracket if it runs
        step = max(1, b.last_size - math.ceil((b.last_size - 1) / (1 + tolerance)))
        reason = f"{b.last_size} was just too large: {tolerance:.0%} below it usually ends the search"
    else:
        return None
    size = b.last_size - step
    if not b.lo < size <= b.top:
        return None
    return Proposal(Move.STEP_BACK, size, reason)


def _back_off(b: Bracket, ev: Evidence) -> Proposal | None:
    # A prediction far above lo failed: the allocator needed more there than the points showed (a jump in its
    # overhead near the cap). Sizes needing 6%, 12%, 24%... less live memory than the one that failed, not a
    # bisection of the sizes between.
    if b.last_accepted or b.last_move not in (Move.SAFE, Move.BACK_OFF) or not ev.model.measures_live:
        return None
    failed = b.last_size if b.last_move is Move.SAFE else b.back_off_from
    step = BACK_OFF_STEP if b.last_move is Move.SAFE else 2 * b.back_off
    size = ev.model.backed_off(failed, step)
    if size is None or not b.lo < size <= b.top:
        return None
    b.back_off, b.back_off_from = step, failed
    reason = f"{failed} ran out of memory: {step:.0%} less live memory than it"
    return Proposal(Move.BACK_OFF, size, reason)


def _past_trace(b: Bracket, ev: Evidence) -> Proposal | None:
    # The traced size ran: the trace has nothing above it, so the edge above it is the one trial left.
    if b.last_move is not Move.TRACED or not b.last_accepted or b.lo + 1 > b.top:
        return None
    edge = b.edge(ev)
    return Proposal(Move.EDGE, edge, f"nothing above the trace: if {edge} fails the search is over")


def _edge(b: Bracket, ev: Evidence) -> Proposal | None:
    if b.refuted or b.edge_at == b.lo or b.lo + 1 > b.top:
        return None  # the safe model's "nothing above" was wrong once: no crawling one size per trial
    safe = ev.safe_size(ev.trial(b.lo))
    if safe is not None and safe > b.lo:
        return None
    if safe is None and not ev.has_model:
        return None  # no model at all: doubling and bisection decide
    edge = b.edge(ev)
    reason = f"the safe model has nothing above it: if {edge} fails the search is over"
    return Proposal(Move.EDGE, edge, reason)


def _squeezed(b: Bracket, ev: Evidence) -> Proposal | None:
    # The allocator retried again and again at the cap to run lo: near the cap it gives its cache back, so
    # the memory reserved but not live at lo overstates what a larger size needs. One retry is a flush the
    # steps then live with, and that waste does not shrink (docs/benchmarks.md has the measurements).
    lo = ev.trial(b.lo)
    if (
        (lo.retries or 0) < SQUEEZES
        or ev.limit is None
        or not ev.near_limit(lo)
        or not ev.model.measures_live
    ):
        # and a retry far under the cap (one large block that did not fit the cache) squeezed little
        return None
    largest = ev.optimistic_size()  # live tensors alone: no larger size can run
    if largest is None or largest <= b.lo + 1:
        return None
    if b.lo_move in (Move.SQUEEZED, Move.HALVE):
        half = (b.lo + min(largest, b.top) + 1) // 2
        reason = f"{b.lo} ran: halve the sizes left up to {largest}, where live tensors fill the limit"
        return Proposal(Move.HALVE, half, reason)
    if b.lo_move is not Move.EDGE and (ev.optimistic_size(waste_at(lo)) or 0) <= b.lo + 1:
        # the waste at lo leaves no room above lo + 1 (unless lo + 1 just ran): the edge decides it
        return None
    size = ev.optimistic_size(math.ceil(SQUEEZED_WASTE * ev.limit)) or 0
    if size <= b.lo + 1 or size > b.top:
        return None
    reason = f"the cap squeezed the cache at {b.lo}: live tensors plus 1% of the limit reach it at {size}"
    return Proposal(Move.SQUEEZED, size, reason)


def _near_cap(b: Bracket, ev: Evidence) -> Proposal | None:
    # Near the cap the reserved peak is squeezed (the allocator gives cache back before it fails), so
    # reserved lines say little there; what a larger size needs is its live tensors plus the fragmentation
    # seen at lo.
    lo = ev.trial(b.lo)
    if not ev.model.measures_live or not ev.near_limit(lo):
        return None
    waste = waste_at(lo)
    size = ev.optimistic_size(waste)
    if size is None or (b.hi is not None and size >= b.hi):
        return None
    if size > b.lo + 1 and b.lo_move in MODEL_MOVES:  # once: from its own result it would step by the slack
        gib = waste / 2**30
        reason = (
            f"near the cap: live tensors plus the {gib:.2f} GiB reserved but not live at {b.lo} reach the"
            " limit"
        )
        return Proposal(Move.NEAR_CAP, size, f"{reason} at {size}")
    if b.edge_at == b.lo or b.lo + 1 > b.top or b.lo_move not in (*MODEL_MOVES, Move.NEAR_CAP):
        return None  # only from a size a model chose: no crawling one size per trial
    edge = b.edge(ev)
    return Proposal(
        Move.EDGE, edge, f"near the cap, no room above {b.lo}: if {edge} fails the search is over"
    )


def _optimistic(b: Bracket, ev: Evidence) -> Proposal | None:
    if not b.refuted:  # only once an edge has shown that the safe model overstates the need
        return None
    size = ev.optimistic_size()
    if size is None or size <= b.lo or (b.hi is not None and size >= b.hi):
        return None
    reason = f"the safe model overstated the need: live tensors alone reach the limit at {size}"
    return Proposal(Move.OPTIMISTIC, size, reason)


def _safe(b: Bracket, ev: Evidence) -> Proposal | None:
    lo = ev.trial(b.lo)
    if b.refuted and ev.near_limit(lo):
        # near the cap the reserved peaks are squeezed, and an edge showed they overstate the need
        return None
    size = ev.safe_size(lo)
    if size is None or size <= b.lo:
        return None
    if b.hi is not None and size >= b.hi:
        return None  # contradicted: the model says a size that failed fits
    return Proposal(Move.SAFE, min(size, b.top), f"the safe model's largest size under the limit is {size}")


def _fallback(b: Bracket) -> Proposal:
    if b.hi is None:
        return Proposal(Move.DOUBLE, min(2 * b.lo, b.top), "no usable model: double")
    return Proposal(Move.BISECT, (b.lo + b.hi) // 2, "no usable model: bisect")


MOVES: tuple[Callable[[Bracket, Evidence], Proposal | None], ...] = (
    _past_trace,
    _back_off,
    _squeezed,
    _near_cap,
    _edge,
    _safe,
    _optimistic,
)
"""After the step back (the one move that takes the tolerance), the first of these that applies."""


def next_move(b: Bracket, ev: Evidence, tolerance: float) -> Proposal:
    """The step back if it applies, else the first of :data:`MOVES` that does.

    Else double (nothing rejected yet) or bisect. The step back is by ``tolerance`` of the last size.
    """
    found = _step_back(b, ev, tolerance)
    if found is not None:
        return found
    for move in MOVES:
        found = move(b, ev)
        if found is not None:
            return found
    return _fallback(b)
