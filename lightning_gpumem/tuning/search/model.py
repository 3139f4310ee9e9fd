"""Memory against the batch size: the one model the search, the planner and every source of points share.

Live tensors are close to affine in the batch size ``B`` once activations dominate (weights, gradients and
the optimizer state do not grow with it): one line per stage, training and validation, and a size needs the
larger. Below that, the peak is set by what does not grow with ``B`` (the optimizer step's temporaries): a
plateau, which a line through two of its points would call flat. Reserved bytes, which a cap limits, grow
faster than live tensors (fragmentation): by ``growth``, measured between two points and kept in [1,
:data:`MAX_GROWTH`].

Lines are exact (whole bytes, :class:`~fractions.Fraction` slopes), so a limit that is exactly a size's peak
is hit exactly. Points come from a source behind one protocol (:class:`TrialSource`): real trials today; a
trace replayed through a model of the caching allocator can be another, and the search does not change.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Protocol

MAX_GROWTH = Fraction(3, 2)  # reserved grows at most this much faster than live tensors
FAR = Fraction(95, 100)  # a line's second point is at most this fraction of its first, where one exists
LARGEST_SIZE = 2**48  # a size past which a line's slope bounds nothing: unbounded
MIN_INCREMENT = 0.10  # an increment under this fraction of the peak is a plateau, not the per-sample line
FLAT = 0.005  # two points whose every peak moved less than this fraction, the reserved not at all: a plateau
PROBE_CEILING = 0.5  # a size chosen to test a line, not to be kept, needs at most this fraction of the limit

Number = int | float | Fraction


@dataclass(frozen=True)
class Point:
    """Peaks measured (or predicted) at one batch size, in bytes.

    Attributes:
        size: the batch size.
        train_bytes: peak of live tensors in the training steps (``None``: not measured).
        val_bytes: the same in the validation step (``None``: not run, or not measured apart).
        reserved_bytes: peak the caching allocator held (``None``: not measured).
    """

    size: int
    train_bytes: int | None
    val_bytes: int | None = None
    reserved_bytes: int | None = None

    @property
    def need(self) -> int | None:
        """Live tensors the size needs: the larger stage (``None``: not measured)."""
        if self.train_bytes is None:
            return self.val_bytes
        return max(self.train_bytes, self.val_bytes or 0)


@dataclass(frozen=True)
class Trial:
    """Outcome of running a few real steps at one batch size.

    Attributes:
        batch_size: the size tried.
        fits: the steps ran without an out-of-memory error.
        peak_bytes: peak memory reserved during the trial, in bytes (``None`` where not measurable); compared
            with the limit.
        seconds: wall time of the trial.
        allocated_bytes: peak memory of live tensors during the trial, in bytes (``None`` where not
            measurable).
        train_peak_bytes: peak memory of live tensors during the training steps, in bytes (``None`` where not
            measured apart).
        val_peak_bytes: peak memory of live tensors during the validation step, in bytes (``None`` where the
            trial ran no validation or it was not measured apart).
        retries: times the allocator hit the cap, gave its cache back and retried during the trial (``None``
            where not measured); 2 or more near the cap mean the cap squeezed the cache step after step, so
            the reserved peak overstates what the trial needed.
        samples: samples in the largest training batch the trial ran, on the rank that ran fewest (``None``:
            not counted); a trial that ran fewer than ``batch_size`` did not run that size.
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
        """It ran, on fewer samples than its size: the data ended first.

        No OOM said anything of the size.
        """
        return self.fits and not self.ran_its_size

    @property
    def point(self) -> Point | None:
        """What it measured, as a point of the model.

        ``None``: it did not run its size, or measured nothing.
        """
        if not self.fits or self.short:
            return None
        train = self.train_peak_bytes if self.train_peak_bytes is not None else self.allocated_bytes
        if train is None and self.peak_bytes is None:
            return None
        return Point(self.batch_size, train, self.val_peak_bytes, self.peak_bytes)


class TrialSource(Protocol):
    """Where trials come from: ``source(size) -> Trial``, called at most once per size by the search.

    Real trials through the user's Trainer (``tuning/trials/measure.py``), a replay of measured ones (the
    tests), or, next, a trace replayed through a model of the allocator.
    """

    def __call__(self, size: int, /) -> Trial:
        """Run a trial at ``size`` and report it."""


def accepted(trial: Trial, limit_bytes: int | None) -> bool:
    """The trial ran its size without OOM and, if a limit is given, its measured peak is at most the limit.

    A trial whose batches held fewer samples than its size (the data ran out) did not run that size.
    """
    if not trial.fits or trial.short:
        return False
    return limit_bytes is None or trial.peak_bytes is None or trial.peak_bytes <= limit_bytes


# ---------------------------------------------------------------------- lines
@dataclass(frozen=True)
class Line:
    """``peak(B) = intercept + slope * B`` in bytes; ``slope`` is at least 0."""

    intercept: Number
    slope: Number

    @classmethod
    def through(cls, a: tuple[int, Number], b: tuple[int, Number]) -> Line:
        """The line through two ``(size, bytes)`` points.

        Flat where they fall: noise, no per-sample part.
        """
        (b1, p1), (b2, p2) = sorted((a, b))
        slope = max(Fraction(0), _ratio(p2 - p1, b2 - b1)) if b2 != b1 else Fraction(0)
        return cls(p2 - slope * b2, slope)

    def at(self, size: Number) -> Number:
        """The line's peak at ``size``."""
        return self.intercept + self.slope * size

    def largest_under(self, limit: Number) -> int | None:
        """The largest size whose peak is at most ``limit``.

        ``None``: a flat line under it, unbounded; 0: none.
        """
        if self.slope <= 0:
            return None if self.intercept <= limit else 0
        return max(0, math.floor((limit - self.intercept) / self.slope))


def _ratio(a: Number, b: Number) -> Number:
    return Fraction(a, b) if isinstance(a, int) and isinstance(b, int) else a / b


def fit_line(points: Sequence[tuple[int, Number]]) -> Line | None:
    """The line through the largest size and the largest one at most 95% of it (neighbours are noisy).

    ``points`` are by size, one per size; ``None`` under two.
    """
    if len(points) < 2:
        return None
    b2, p2 = points[-1]
    b1, p1 = next(((b, p) for b, p in reversed(points[:-1]) if b <= FAR * b2), points[-2])
    return Line.through((b1, p1), (b2, p2))


def along(points: Sequence[tuple[int, Number]], line: Line, size: Number) -> Number:
    """``size`` on the measured ``points`` (by size).

    Between two points, the straight line between them; beyond the largest, ``line`` (at least the largest's
    value); below the smallest, the smallest's value (the peak of a plateau holds below it).
    """
    if size >= points[-1][0]:
        return max(line.at(size), points[-1][1])
    if size <= points[0][0]:
        return points[0][1]
    for (b1, p1), (b2, p2) in itertools.pairwise(points):
        if b1 <= size <= b2:
            return p1 + (p2 - p1) * _ratio(size - b1, b2 - b1)
    return points[-1][1]  # pragma: no cover - the points cover the range


# ---------------------------------------------------------------------- points
def merged(points: Iterable[Point]) -> list[Point]:
    """The points by size, one per size: where a size ran twice, the larger of each peak.

    Raises:
        ValueError: on a point whose size is not a whole number of at least 1 or whose peaks are not whole
            numbers of bytes, at least 0.
    """
    by_size: dict[int, Point] = {}
    for p in points:
        _check_point(p)
        seen = by_size.get(p.size)
        if seen is not None:
            p = Point(
                p.size,
                _larger(p.train_bytes, seen.train_bytes),
                _larger(p.val_bytes, seen.val_bytes),
                _larger(p.reserved_bytes, seen.reserved_bytes),
            )
        by_size[p.size] = p
    return [by_size[size] for size in sorted(by_size)]


def _larger(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def _check_point(p: Point) -> None:
    def whole(value: object, least: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= least

    values = [v for v in (p.train_bytes, p.val_bytes, p.reserved_bytes) if v is not None]
    if not whole(p.size, 1) or not all(whole(v, 0) for v in values):
        raise ValueError(
            f"`probes` holds {p!r}: expected a batch size of at least 1 and peaks in whole bytes, at least"
            " 0."
        )


def stage_points(points: Sequence[Point]) -> list[list[tuple[int, int]]]:
    """Each stage's ``(size, bytes)`` points, by size.

    Training, and validation where the largest point has it. Where only the largest point measured
    validation, one stage: the need (the larger) of each point.
    """
    live = [p for p in points if p.need is not None]
    if not live:
        return []
    train = [(p.size, p.train_bytes) for p in live if p.train_bytes is not None]
    val = [(p.size, p.val_bytes) for p in live if p.val_bytes is not None]
    if live[-1].val_bytes is None:
        return [train] if train else []
    if len(val) >= 2 and len(train) >= 2 and live[-1].train_bytes is not None:
        return [train, val]
    return [[(p.size, p.need) for p in live if p.need is not None]]


# ---------------------------------------------------------------------- the model
@dataclass
class MemoryModel:
    """Memory as a function of the batch size, from measured points (see the module docstring).

    Attributes:
        probes: the points, by size, one per size (:func:`merged`).
        lines: one line of live tensors per stage (training, then validation where measured); empty where no
            point measured live tensors.
        reserved_line: the line through the reserved peaks (``None``: fewer than two measured).
        growth: reserved bytes per byte of live tensors, in [1, :data:`MAX_GROWTH`].
    """

    probes: list[Point]
    lines: list[Line] = field(init=False)
    reserved_line: Line | None = field(init=False)
    growth: Fraction = field(init=False)

    def __post_init__(self) -> None:
        self.probes = merged(self.probes)
        self._stages = stage_points(self.probes)
        self.lines = [line for line in map(fit_line, self._stages) if line is not None]
        if len(self.lines) < len(self._stages):
            self.lines, self._stages = [], []
        reserved = [(p.size, p.reserved_bytes) for p in self.probes if p.reserved_bytes is not None]
        self.reserved_line = fit_line(reserved)
        both = [(p.size, p.reserved_bytes, p.need) for p in self.probes]
        pairs = [(b, r, n) for b, r, n in both if r is not None and n is not None]
        self.growth = Fraction(1)
        if len(pairs) >= 2:
            b2, r2, n2 = pairs[-1]
            _b1, r1, n1 = next((q for q in reversed(pairs[:-1]) if q[0] <= FAR * b2), pairs[-2])
            if n2 > n1:
                self.growth = min(MAX_GROWTH, max(Fraction(1), Fraction(r2 - r1, n2 - n1)))

    @property
    def last(self) -> Point:
        """The largest point."""
        return self.probes[-1]

    @property
    def measures_live(self) -> bool:
        """Whether the points give a line of live tensors (else only reserved peaks, or nothing)."""
        return bool(self.lines)

    @property
    def off_plateau(self) -> bool:
        """Whether every stage's line starts above a plateau.

        The increment into its lower point is at least :data:`MIN_INCREMENT` of that point's peak (or no
        point lies below it). A line through a plateau's last point is too flat: a prediction from it would
        overshoot.
        """
        for points in self._stages:
            b2 = points[-1][0]
            lower = next(
                (i for i in range(len(points) - 2, -1, -1) if points[i][0] <= FAR * b2), len(points) - 2
            )
            if lower >= 1:
                (_, p0), (_, p1) = points[lower - 1], points[lower]
                if p1 - p0 < MIN_INCREMENT * p1:
                    return False
        return True

    @property
    def on_plateau(self) -> bool:
        """Whether the two largest points lie on a plateau.

        The same reserved peak, and live tensors of every stage less than :data:`FLAT` apart: the optimizer
        step's temporaries hold the peak there, and the slope between the points is noise, not the
        per-sample memory.
        """
        if len(self.probes) < 2:
            return False
        low, high = self.probes[-2:]
        if low.reserved_bytes is None or low.reserved_bytes != high.reserved_bytes:
            return False
        pairs = [(low.train_bytes, high.train_bytes), (low.val_bytes, high.val_bytes)]
        moved = [abs(b - a) >= FLAT * max(a, b) for a, b in pairs if a is not None and b is not None]
        return bool(moved) and not any(moved)

    @property
    def per_sample(self) -> Number:
        """Bytes per sample of the stage that needs most at large sizes (0 without lines)."""
        return max((line.slope for line in self.lines), default=0)

    def need(self, size: Number) -> Number:
        """Live tensors at ``size`` (the larger stage).

        Between points the straight line between them, beyond the largest its stage line, below the smallest
        the smallest's measurement.

        Raises:
            ValueError: if no point measured live tensors.
        """
        if not self.lines:
            raise ValueError("no point measured live tensors: the model has no need to give")
        return max(along(points, line, size) for points, line in zip(self._stages, self.lines, strict=True))

    def reserved(self, size: Number, anchor: Point | None = None) -> Number:
        """Predicted reserved peak at ``size``, from ``anchor`` (default: the largest point) upwards.

        The anchor's reserved peak plus the growth of the need times :attr:`growth`; below the largest point,
        where every point measured it, the straight line between the reserved peaks around ``size``.
        """
        anchor = anchor or self.last
        if (
            anchor is self.last
            and size < anchor.size
            and all(p.reserved_bytes is not None for p in self.probes)
        ):
            points = [(p.size, p.reserved_bytes or 0) for p in self.probes]
            return along(points, fit_line(points) or Line(0, 0), size)
        need = anchor.need
        if need is None or not self.lines:  # reserved peaks alone
            line = self.reserved_line or Line(anchor.reserved_bytes or 0, 0)
            return (anchor.reserved_bytes or 0) + line.slope * (size - anchor.size)
        base = anchor.reserved_bytes if anchor.reserved_bytes is not None else need
        return base + self.growth * (self.need(size) - need)

    def band(self, size: Number) -> float:
        """Half-width of the band at ``size``, in bytes.

        The last slopes' disagreement carried out, plus 1%.
        """
        spread = 0.0
        for points in self._stages:
            if len(points) >= 3:
                before, last = slopes(points)
                spread = max(spread, float(abs(last - before)) * max(0.0, float(size) - points[-1][0]))
        return spread + BAND_FLOOR * float(self.reserved(size))

    def backed_off(self, size: int, step: float) -> int | None:
        """The largest size needing ``step`` (a fraction) less live memory than ``size``.

        Where ``size`` ran out of memory, the next to try (``None``: memory does not bound it).
        """
        return self.largest_under(self.need(size) * (1 - step), live_only=True)

    def largest_under(
        self, limit: Number, *, live_only: bool = False, anchor: Point | None = None, waste: Number = 0
    ) -> int | None:
        """The largest size whose predicted reserved peak is at most ``limit``.

        With ``live_only``, the predicted peak is live tensors plus ``waste``.

        ``None``: no stage grows with the batch size and it fits, so memory does not bound the size; 0: not
        even 1.
        """
        if live_only:

            def peak(size: int) -> Number:
                return self.need(size) + waste

            grows = self.per_sample > 0
        else:

            def peak(size: int) -> Number:
                return self.reserved(size, anchor)

            grows = self.per_sample > 0 or (self.reserved_line is not None and self.reserved_line.slope > 0)
        if peak(1) > limit:
            return 0
        if not grows:
            return None
        lo, hi = 1, 2
        while peak(hi) <= limit:  # the peak never falls as the size grows: double, then bisect
            if hi >= LARGEST_SIZE:  # a slope too small to bound any batch a dataset could hold
                return None
            lo, hi = hi, 2 * hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if peak(mid) <= limit else (lo, mid)
        return lo


BAND_FLOOR = 0.01  # the band is at least this fraction of the predicted peak


def slopes(values: Sequence[tuple[int, int]]) -> tuple[Fraction, Fraction]:
    """The slopes of the last three points' two segments, exact."""
    (b1, p1), (b2, p2), (b3, p3) = values[-3:]
    return Fraction(p2 - p1, b2 - b1), Fraction(p3 - p2, b3 - b2)
