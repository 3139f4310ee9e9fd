"""The plan of a fit's memory: when the probes have drawn the line, predictions with a band, budgets (pure).

Probes grow until the last increment is at least :data:`MIN_INCREMENT` of the peak and its per-sample slope
matches the one before within :data:`SLOPE_MATCH` (:func:`probe_verdict`): below that the peak is set by what
does not grow with the batch size (a plateau). Probes that never settle before :data:`PROBE_CEILING` of the
limit are *not affine* (shapes that change from batch to batch, data-dependent padding, routing): a
prediction from them would be a guess, and the caller searches instead.

A :class:`Plan` is the :class:`~lightning_gpumem.tuning.search.model.MemoryModel` of the probes with the
verdict, the memory outside PyTorch and the terms the intercept is made of. Its band at ``B`` is the two last
slopes' disagreement carried from the last probe out to ``B``, plus 1% of the peak: what the probes
themselves say about how far the line can be off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lightning_gpumem.tuning.search.model import (
    MIN_INCREMENT,
    PROBE_CEILING,
    Line,
    MemoryModel,
    Point,
    merged,
    slopes,
    stage_points,
)

# ... and its per-sample slope within this fraction of the one before (the line is settled)
SLOPE_MATCH = 0.03
CLOSEST = 1.25  # a probe is at least this much larger than the one before (closer, the slope is noise)
MAX_PROBES = 12  # doubling from 2 reaches 4096: the ceiling, not this, ends the probes of a real model

Verdict = Literal["settled", "more", "not_affine"]


def settled(points: list[tuple[int, int]]) -> bool:
    """Whether the line is settled.

    The last increment is at least :data:`MIN_INCREMENT` of the peak, its slope the previous one's within 3%.
    """
    if len(points) < 3:
        return False
    before, last = slopes(points)
    (_, p2), (_, p3) = points[-2:]
    return p3 - p2 >= MIN_INCREMENT * p3 and last > 0 and abs(last - before) <= SLOPE_MATCH * last


def collinear(points: list[tuple[int, int]]) -> bool:
    """The last three points lie on one line.

    The slopes agree within 3%, or so nearly that the disagreement carried out to the last size is under 0.3%
    of its peak (a peak that barely moves).
    """
    if len(points) < 3:
        return False
    before, last = slopes(points)
    size, peak = points[-1]
    diff = abs(last - before)
    return (
        diff <= SLOPE_MATCH * max(abs(last), abs(before))
        or diff * size <= SLOPE_MATCH * MIN_INCREMENT * peak
    )


def _dominated(stages: list[list[tuple[int, int]]]) -> list[bool]:
    """Stages another stage stays above from the largest probe on.

    The other stage's line is at least as high there and at least as steep: they never set the need, so their
    own plateau does not keep the probes going.
    """
    lines = [Line.through(*points[-2:]) if len(points) >= 2 else None for points in stages]
    out = []
    for i, line in enumerate(lines):
        end = stages[i][-1][0]
        out.append(
            line is not None
            and any(
                other is not None and other.slope >= line.slope and other.at(end) >= line.at(end)
                for j, other in enumerate(lines)
                if j != i
            )
        )
    return out


def probe_verdict(probes: list[Point], limit: int | None, upper: int) -> tuple[Verdict, int | None]:
    """Whether the probes settle the line, and the next size to probe if not.

    Returns ``("settled", None)`` once every stage that can set the need (one another stage does not stay
    above up to the limit) has a last increment of at least :data:`MIN_INCREMENT` of its peak matching the
    slope before within :data:`SLOPE_MATCH`; ``("more", size)`` with the next size: double the largest, or
    less where the line through the last two probes reaches :data:`PROBE_CEILING` of ``limit`` (or ``upper``)
    sooner, as long as it is at least :data:`CLOSEST` times the largest; otherwise ``("settled", None)``
    where the last three probes lie on one line (a peak that barely moves is affine too) and
    ``("not_affine", None)`` where they do not.

    >>> probes = [Point(b, 1000 + 100 * max(b, 4)) for b in (2, 4, 8)]  # a plateau up to 4
    >>> probe_verdict(probes, 10**6, 1000)
    ('more', 16)
    >>> probe_verdict([*probes, Point(16, 1000 + 1600)], 10**6, 1000)
    ('settled', None)
    """
    if not probes:
        raise ValueError("`probes` is empty: expected at least one probe.")
    probes = merged(probes)
    stages = stage_points(probes)
    if not stages:
        raise ValueError("`probes` measured no live tensors: expected peaks of live tensors to draw a line.")
    deciding = [s for s, under in zip(stages, _dominated(stages), strict=True) if not under]
    if len(probes) >= 3 and all(settled(points) for points in deciding):
        return "settled", None
    largest = max(p.size for p in probes)
    nxt = min(2 * largest, upper)
    within = nxt >= CLOSEST * largest and len(probes) < MAX_PROBES
    if within and limit is not None and len(probes) >= 2:  # not past the ceiling: where the line reaches it
        lines = [Line.through(*points[-2:]) for points in stages if len(points) >= 2]
        bounds = [b for b in (line.largest_under(PROBE_CEILING * limit) for line in lines) if b is not None]
        nxt = min([nxt, *bounds])
        within = nxt >= CLOSEST * largest
    elif within and limit is not None:  # one probe: no slope yet; fixed memory does not grow with the size
        within = (probes[-1].need or 0) <= PROBE_CEILING * limit
    if within:
        return "more", nxt
    if len(probes) >= 3 and all(collinear(points) for points in deciding):
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
        limit: what the allocator may reserve in it: the budget less the memory outside PyTorch (and the
            plan's margin).
        largest: the largest batch size whose predicted reserved peak fits ``limit`` (``None``: unbounded).
        validated: a trial ran ``largest`` under this budget.
        peak: predicted reserved peak at the batch size asked about, and its band (``peak - band`` to
            ``peak + band``).
        band: half-width of the band, in bytes.
        fits: the batch size asked about fits (its predicted peak plus the band is at most ``limit``).
        traced: the figures come from the step traced on fake tensors and replayed through the allocator
            model, not from real probes.
    """

    budget: int
    limit: int
    largest: int | None
    validated: bool
    peak: float
    band: float
    fits: bool
    traced: bool = False

    @property
    def how(self) -> str:
        """How ``largest`` is known: ``"validated"``, ``"traced"`` or ``"predicted"``."""
        return "validated" if self.validated else "traced" if self.traced else "predicted"


@dataclass
class Plan(MemoryModel):
    """The model of the probes and what it predicts per budget (see the module docstring).

    Attributes:
        probes: the probes the lines come from, by size.
        verdict: ``"settled"`` (the line holds), ``"not_affine"`` (a search is needed).
        outside: memory outside PyTorch's allocator, in bytes (``None``: not measured).
        terms: the parts of the memory (:class:`Terms`).
        margin: the fraction of each budget's allocator limit left free (for the fragmentation of batches
            whose shapes vary), in [0, 1).
    """

    verdict: Verdict = "settled"
    outside: int | None = None
    terms: Terms = field(default_factory=Terms)
    margin: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.probes) < 2:
            raise ValueError(
                f"`probes` has {len(self.probes)} batch size(s): expected at least 2 to draw a line."
            )
        if not self.lines:
            raise ValueError(
                "`probes` measured no live tensors: expected peaks of live tensors to draw a line."
            )

    def limit_for(self, budget: int) -> int:
        """What the allocator may reserve on a card of ``budget`` bytes.

        The budget less the memory outside PyTorch, less :attr:`margin` of that.
        """
        return max(0, int((budget - (self.outside or 0)) * (1.0 - self.margin)))

    def predict(self, size: int, budget: int) -> Prediction:
        """The plan for ``budget``: the largest size that fits, and whether ``size`` does (with its band)."""
        limit = self.limit_for(budget)
        largest = self.largest_under(limit) if self.verdict == "settled" else None
        peak, band = float(self.reserved(size)), self.band(size)
        return Prediction(
            budget=budget,
            limit=limit,
            largest=largest,
            validated=False,
            peak=peak,
            band=band,
            fits=peak + band <= limit,
        )


def plan_table(plan: Plan, size: int, predictions: list[Prediction], name: str = "batch_size") -> str:
    """The plan as a Markdown table: the terms, then one row per budget (GiB)."""
    gib = 2**30

    def show(value: float | None) -> str:
        return "-" if value is None else f"{value / gib:.2f}"

    t = plan.terms
    lines = [
        f"Memory plan ({len(plan.probes)} probes at {', '.join(str(p.size) for p in plan.probes)};"
        f" peak(B) = {float(plan.lines[0].intercept) / gib:.2f} GiB + {float(plan.per_sample) / 2**20:.1f}"
        f" MiB x B; reserved grows {float(plan.growth):.2f}x live tensors)",
        "",
        "| term | GiB |",
        "| --- | --- |",
        f"| parameters | {show(t.parameters)} |",
        f"| gradients | {show(t.gradients)} |",
        f"| optimizer state | {show(t.optimizer_state)} |",
        f"| other fixed (workspaces, step temporaries) | {show(t.other_fixed)} |",
        f"| activations per sample | {show(t.per_sample)} |",
        f"| outside PyTorch (CUDA context, kernels) | {show(t.outside)} |",
        f"| allocator overhead at {name}={size} | {show(float(plan.reserved(size) - plan.need(size)))} |",
        "",
        f"| budget GiB | allocator limit GiB | peak at {name}={size} GiB | fits | largest {name} | |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for p in predictions:
        largest = (
            str(p.largest) if p.largest is not None else "unbounded" if plan.verdict == "settled" else "-"
        )
        lines.append(
            f"| {p.budget / gib:.1f} | {p.limit / gib:.2f} | {p.peak / gib:.2f} +- {p.band / gib:.2f}"
            f" | {'yes' if p.fits else 'no'} | {largest} | {p.how} |"
        )
    return "\n".join(lines)
