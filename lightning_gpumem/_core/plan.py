"""The plan of a fit's memory: lines through real probe steps, predictions with a band, budgets (pure, stdlib only).

Peak memory of live tensors is affine in the batch size ``B`` once activations dominate, ``peak(B) = a + s * B``;
below that the peak is set by what does not grow with ``B`` (the optimizer step's temporaries), a *plateau*. Probes
therefore grow (doubling) until the last increment is at least :data:`MIN_INCREMENT` of the peak and its per-sample
slope matches the one before within :data:`SLOPE_MATCH` (:func:`probe_verdict`). Probes that never settle before
:data:`PROBE_CEILING` of the limit are *not affine* (shapes that change from batch to batch, data-dependent padding,
routing): a prediction from them would be a guess, and the caller searches instead.

A :class:`Plan` holds the probes, one line per stage (training, validation: the need is the larger), the allocator's
growth (reserved over allocated, from the last two probes), the memory outside PyTorch, and the terms the intercept
is made of. Its band at ``B`` is the two last slopes' disagreement carried from the last probe out to ``B``, plus
:data:`BAND_FLOOR` of the peak: what the probes themselves say about how far the line can be off.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Literal

MIN_INCREMENT = 0.10  # the last probe's increment must be at least this fraction of its peak (activations dominate)
SLOPE_MATCH = 0.03  # ... and its per-sample slope within this fraction of the one before (the line is settled)
PROBE_CEILING = 0.5  # probes stay cheap: no probe is planned whose need the line puts above this fraction of the limit
CLOSEST = 1.25  # a probe is at least this much larger than the one before (closer, the slope is noise)
MAX_PROBES = 12  # doubling from 2 reaches 4096: the ceiling, not this, ends the probes of a real model
BAND_FLOOR = 0.01  # the band is at least this fraction of the predicted peak
MAX_GROWTH = 1.5  # reserved grows at most this much faster than live tensors
LARGEST_SIZE = 2**48  # a size past which a line's slope bounds nothing: the plan calls it unbounded

Verdict = Literal["settled", "more", "not_affine"]


@dataclass(frozen=True)
class ProbePoint:
    """Peaks of one probe: real training steps (and a validation step) at one batch size, in bytes.

    Attributes:
        size: the batch size.
        train_bytes: peak memory of live tensors in the training steps.
        val_bytes: the same in the validation step (``None``: not run or not measured apart).
        reserved_bytes: peak memory the caching allocator held (``None``: not measured).
    """

    size: int
    train_bytes: int
    val_bytes: int | None = None
    reserved_bytes: int | None = None

    @property
    def need(self) -> int:
        """Live tensors the size needs: the larger stage."""
        return max(self.train_bytes, self.val_bytes or 0)


@dataclass(frozen=True)
class Line:
    """``peak(B) = intercept + slope * B`` in bytes; ``slope`` is at least 0."""

    intercept: float
    slope: float

    @classmethod
    def through(cls, a: tuple[int, float], b: tuple[int, float]) -> Line:
        """The line through two ``(size, bytes)`` points (flat where they fall: noise, no per-sample part)."""
        (b1, p1), (b2, p2) = sorted((a, b))
        slope = max(0.0, (p2 - p1) / (b2 - b1)) if b2 != b1 else 0.0
        return cls(p2 - slope * b2, slope)

    def at(self, size: float) -> float:
        """The line's peak at ``size``."""
        return self.intercept + self.slope * size

    def largest_under(self, limit: float) -> int | None:
        """The largest size whose peak is at most ``limit`` (``None``: a flat line under it, unbounded; 0: none)."""
        if self.slope <= 0:
            return None if self.intercept <= limit else 0
        return max(0, math.floor((limit - self.intercept) / self.slope + 1e-9))


def _along(points: list[tuple[int, float]], line: Line, size: float) -> float:
    """``size`` on the measured ``points`` (by size).

    Between two points, the straight line between them; beyond the largest, ``line``; below the smallest, the
    smallest's value (the peak of a plateau holds below it).
    """
    if size >= points[-1][0]:
        return max(line.at(size), points[-1][1])
    if size <= points[0][0]:
        return points[0][1]
    for (b1, p1), (b2, p2) in itertools.pairwise(points):
        if b1 <= size <= b2:
            return p1 + (p2 - p1) * (size - b1) / (b2 - b1)
    return points[-1][1]  # pragma: no cover - the points cover the range


def _slopes(values: list[tuple[int, float]]) -> tuple[float, float]:
    (b1, p1), (b2, p2), (b3, p3) = values[-3:]
    return (p2 - p1) / (b2 - b1), (p3 - p2) / (b3 - b2)


def merged(probes: list[ProbePoint]) -> list[ProbePoint]:
    """The probes by size, one per size: where a size ran twice (two budgets validated it), the larger of each peak.

    Raises:
        ValueError: on a probe whose size is not a whole number of at least 1 or whose peaks are not whole numbers of
            bytes, at least 0.
    """
    by_size: dict[int, ProbePoint] = {}
    for p in probes:
        _check_point(p)
        seen = by_size.get(p.size)
        if seen is not None:
            p = ProbePoint(
                p.size,
                max(p.train_bytes, seen.train_bytes),
                _larger(p.val_bytes, seen.val_bytes),
                _larger(p.reserved_bytes, seen.reserved_bytes),
            )
        by_size[p.size] = p
    return [by_size[size] for size in sorted(by_size)]


def _larger(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def _check_point(p: ProbePoint) -> None:
    def whole(value: object, least: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= least

    values = (p.train_bytes, *(v for v in (p.val_bytes, p.reserved_bytes) if v is not None))
    if not whole(p.size, 1) or not all(whole(v, 0) for v in values):
        raise ValueError(
            f"`probes` holds {p!r}: expected a batch size of at least 1 and peaks in whole bytes, at least 0."
        )


def _stage_points(probes: list[ProbePoint]) -> list[list[tuple[int, float]]]:
    """Each stage's ``(size, bytes)`` points of ``probes``, which :func:`merged` has made one per size, by size."""
    stages = [[(p.size, float(p.train_bytes)) for p in probes]]
    if probes and all(p.val_bytes is not None for p in probes):
        stages.append([(p.size, float(p.val_bytes or 0)) for p in probes])
    return stages


def settled(points: list[tuple[int, float]]) -> bool:
    """The last increment is at least :data:`MIN_INCREMENT` of the peak, its slope the previous one's within 3%."""
    if len(points) < 3:
        return False
    before, last = _slopes(points)
    (_, p2), (_, p3) = points[-2:]
    return p3 - p2 >= MIN_INCREMENT * p3 and last > 0 and abs(last - before) <= SLOPE_MATCH * last


def collinear(points: list[tuple[int, float]]) -> bool:
    """The last three points lie on one line.

    The slopes agree within 3%, or so nearly that the disagreement carried out to the last size is under 0.3% of its
    peak (a peak that barely moves).
    """
    if len(points) < 3:
        return False
    before, last = _slopes(points)
    size, peak = points[-1]
    diff = abs(last - before)
    return diff <= SLOPE_MATCH * max(abs(last), abs(before)) or diff * size <= SLOPE_MATCH * MIN_INCREMENT * peak


def probe_verdict(probes: list[ProbePoint], limit: int | None, upper: int) -> tuple[Verdict, int | None]:
    """Whether the probes settle the line, and the next size to probe if not.

    Returns ``("settled", None)`` once every stage's last increment is at least :data:`MIN_INCREMENT` of its peak and
    matches the slope before within :data:`SLOPE_MATCH`; ``("more", size)`` with the next size: double the largest,
    or less where the line through the last two probes reaches :data:`PROBE_CEILING` of ``limit`` (or ``upper``)
    sooner, as long as it is at least :data:`CLOSEST` times the largest; otherwise ``("settled", None)`` where the
    last three probes lie on one line (a peak that barely moves is affine too) and ``("not_affine", None)`` where
    they do not.

    >>> probes = [ProbePoint(b, 1000 + 100 * max(b, 4)) for b in (2, 4, 8)]  # a plateau up to 4
    >>> probe_verdict(probes, 10**6, 1000)
    ('more', 16)
    >>> probe_verdict([*probes, ProbePoint(16, 1000 + 1600)], 10**6, 1000)
    ('settled', None)
    """
    if not probes:
        raise ValueError("`probes` is empty: expected at least one probe.")
    probes = merged(probes)
    stages = _stage_points(probes)
    if len(probes) >= 3 and all(settled(points) for points in stages):
        return "settled", None
    largest = max(p.size for p in probes)
    nxt = min(2 * largest, upper)
    within = nxt >= CLOSEST * largest and len(probes) < MAX_PROBES
    if within and limit is not None and len(probes) >= 2:  # not past the ceiling: the size where the line reaches it
        lines = [Line.through(*points[-2:]) for points in stages]
        bounds = [b for b in (line.largest_under(PROBE_CEILING * limit) for line in lines) if b is not None]
        nxt = min([nxt, *bounds])
        within = nxt >= CLOSEST * largest
    elif within and limit is not None:  # one probe: no slope yet; fixed memory does not grow with the size
        within = probes[-1].need <= PROBE_CEILING * limit
    if within:
        return "more", nxt
    if len(probes) >= 3 and all(collinear(points) for points in stages):
        return "settled", None
    return "not_affine", None


# ---------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Terms:
    """What the memory at a batch size is made of, in bytes (``None``: not measured).

    Attributes:
        parameters: the module's parameters and buffers.
        gradients: gradients of the trainable parameters.
        optimizer_state: the optimizers' state after a step (e.g. AdamW's two moments).
        other_fixed: the rest of the intercept: workspaces, the optimizer step's temporaries, what the line's
            intercept holds beyond the above (can be negative where the plateau bends the line).
        per_sample: activations and the rest that grows with the batch size, per sample.
        outside: device memory of the process outside PyTorch's allocator (CUDA context, kernels).
    """

    parameters: int | None = None
    gradients: int | None = None
    optimizer_state: int | None = None
    other_fixed: float | None = None
    per_sample: float | None = None
    outside: int | None = None


@dataclass(frozen=True)
class Prediction:
    """The plan for one budget.

    Attributes:
        budget: the card or budget, in bytes.
        limit: what the allocator may reserve in it: the budget less the memory outside PyTorch (and the plan's
            margin).
        largest: the largest batch size whose predicted reserved peak fits ``limit`` (``None``: unbounded).
        validated: a trial ran ``largest`` under this budget.
        peak: predicted reserved peak at the batch size asked about, and its band (``peak - band`` to ``peak + band``).
        band: half-width of the band, in bytes.
        fits: the batch size asked about fits (its predicted peak plus the band is at most ``limit``).
    """

    budget: int
    limit: int
    largest: int | None
    validated: bool
    peak: float
    band: float
    fits: bool


@dataclass
class Plan:
    """Lines through the probes and what they predict (see the module docstring).

    Attributes:
        probes: the probes the lines come from, by size.
        verdict: ``"settled"`` (the line holds), ``"not_affine"`` (a search is needed).
        lines: one line of live tensors per stage (training, then validation where measured).
        growth: reserved bytes per byte of live tensors, from the last two probes, in [1, :data:`MAX_GROWTH`].
        outside: memory outside PyTorch's allocator, in bytes (``None``: not measured).
        terms: the parts of the memory (:class:`Terms`).
        margin: the fraction of each budget's allocator limit left free (for the fragmentation of batches whose
            shapes vary), in [0, 1).
    """

    probes: list[ProbePoint]
    verdict: Verdict
    outside: int | None = None
    terms: Terms = field(default_factory=Terms)
    margin: float = 0.0
    lines: list[Line] = field(init=False)
    growth: float = field(init=False)

    def __post_init__(self) -> None:
        self.probes = merged(self.probes)
        if len(self.probes) < 2:
            raise ValueError(f"`probes` has {len(self.probes)} batch size(s): expected at least 2 to draw a line.")
        self.lines = [Line.through(*points[-2:]) for points in _stage_points(self.probes)]
        self.growth = 1.0
        first, last = self.probes[-2:]
        if first.reserved_bytes is not None and last.reserved_bytes is not None and last.need > first.need:
            ratio = (last.reserved_bytes - first.reserved_bytes) / (last.need - first.need)
            self.growth = min(MAX_GROWTH, max(1.0, ratio))

    @property
    def last(self) -> ProbePoint:
        """The largest probe."""
        return self.probes[-1]

    @property
    def per_sample(self) -> float:
        """Bytes per sample of the stage that needs most at large sizes."""
        return max(line.slope for line in self.lines)

    def need(self, size: float) -> float:
        """Live tensors at ``size`` (the larger stage).

        Between two probes the straight line between them, beyond the largest the last two probes' line, below the
        smallest the smallest's measurement.
        """
        stages = zip(_stage_points(self.probes), self.lines, strict=True)
        return max(_along(points, line, size) for points, line in stages)

    def reserved(self, size: float) -> float:
        """Predicted reserved peak at ``size``.

        Between probes that measured it, the straight line between them; beyond the largest, its reserved peak plus
        the growth of the need times ``growth``.
        """
        last = self.last
        if size < last.size and all(p.reserved_bytes is not None for p in self.probes):
            points = [(p.size, float(p.reserved_bytes or 0)) for p in self.probes]
            return _along(points, Line.through(*points[-2:]), size)
        base = last.reserved_bytes if last.reserved_bytes is not None else last.need
        return base + self.growth * (self.need(size) - last.need)

    def band(self, size: float) -> float:
        """Half-width of the band at ``size``, in bytes: the slopes' disagreement carried out, plus 1% of the peak."""
        spread = 0.0
        for points in _stage_points(self.probes):
            if len(points) >= 3:
                before, last = _slopes(points)
                spread = max(spread, abs(last - before) * max(0.0, size - points[-1][0]))
        return spread + BAND_FLOOR * self.reserved(size)

    def largest_under(self, limit: float, *, live_only: bool = False) -> int | None:
        """The largest size whose predicted reserved peak (or, ``live_only``, live tensors) is at most ``limit``.

        ``None``: no stage grows with the batch size and it fits, so memory does not bound the size; 0: not even 1.
        """
        peak = self.need if live_only else self.reserved
        if peak(1) > limit:
            return 0
        if self.per_sample <= 0:
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

    def limit_for(self, budget: int) -> int:
        """What the allocator may reserve on a card of ``budget`` bytes: the budget less the memory outside PyTorch.

        Less :attr:`margin` of that.
        """
        return max(0, int((budget - (self.outside or 0)) * (1.0 - self.margin)))

    def predict(self, size: int, budget: int) -> Prediction:
        """The plan for ``budget``: the largest size that fits, and whether ``size`` does (with its band)."""
        limit = self.limit_for(budget)
        largest = self.largest_under(limit) if self.verdict == "settled" else None
        peak, band = self.reserved(size), self.band(size)
        return Prediction(
            budget=budget,
            limit=limit,
            largest=largest,
            validated=False,
            peak=peak,
            band=band,
            fits=peak + band <= limit,
        )


def format_table(plan: Plan, size: int, predictions: list[Prediction], name: str = "batch_size") -> str:
    """The plan as a Markdown table: the terms, then one row per budget (GiB)."""
    gib = 2**30

    def show(value: float | None) -> str:
        return "-" if value is None else f"{value / gib:.2f}"

    t = plan.terms
    lines = [
        f"Memory plan ({len(plan.probes)} probes at {', '.join(str(p.size) for p in plan.probes)};"
        f" peak(B) = {plan.lines[0].intercept / gib:.2f} GiB + {plan.per_sample / 2**20:.1f} MiB x B;"
        f" reserved grows {plan.growth:.2f}x live tensors)",
        "",
        "| term | GiB |",
        "| --- | --- |",
        f"| parameters | {show(t.parameters)} |",
        f"| gradients | {show(t.gradients)} |",
        f"| optimizer state | {show(t.optimizer_state)} |",
        f"| other fixed (workspaces, step temporaries) | {show(t.other_fixed)} |",
        f"| activations per sample | {show(t.per_sample)} |",
        f"| outside PyTorch (CUDA context, kernels) | {show(t.outside)} |",
        f"| allocator overhead at {name}={size} | {show(plan.reserved(size) - plan.need(size))} |",
        "",
        f"| budget GiB | allocator limit GiB | peak at {name}={size} GiB | fits | largest {name} | |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for p in predictions:
        largest = str(p.largest) if p.largest is not None else "unbounded" if plan.verdict == "settled" else "-"
        lines.append(
            f"| {p.budget / gib:.1f} | {p.limit / gib:.2f} | {p.peak / gib:.2f} +- {p.band / gib:.2f}"
            f" | {'yes' if p.fits else 'no'} | {largest} | {'validated' if p.validated else 'predicted'} |"
        )
    return "\n".join(lines)
