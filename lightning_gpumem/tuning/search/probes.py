"""The planner's probes: small sizes, doubling, until memory is a line; and the sizes to back off to."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from lightning_gpumem.tuning.search.model import MemoryModel, Point, TrialSource, accepted
from lightning_gpumem.tuning.search.moves import BACK_OFF_STEP, Move, Proposal
from lightning_gpumem.tuning.search.plan import Verdict, probe_verdict

ProbeStop = Literal["rejected", "unmeasured", "upper", "data", ""]


@dataclass(frozen=True)
class Probed:
    """What :func:`probe_until_line` measured.

    Attributes:
        points: the accepted probes, by size.
        verdict: the probes' verdict (``None`` where probing stopped first).
        stop: why probing stopped before a verdict: ``"rejected"`` (the last size ran out of memory or peaked
            over the limit), ``"unmeasured"`` (it measured no peak, as on a CPU), ``"upper"`` (it reached
            ``upper``), ``"data"`` (its batches held fewer samples than the size: the data ran out), or
            ``""``.
        size: the last size probed.
        samples: with ``"data"``, the samples the data held: no batch can be larger.
    """

    points: list[Point]
    verdict: Verdict | None
    stop: ProbeStop
    size: int
    samples: int | None = None


def probe_until_line(
    run: TrialSource,
    *,
    init_val: int,
    upper: int,
    limit: int,
    on_move: Callable[[Proposal], None] | None = None,
) -> Probed:
    """Probe from ``init_val``, doubling, while the probes' verdict asks for more.

    The verdict is :func:`~lightning_gpumem.tuning.search.plan.probe_verdict`'s. Each probe's need is at most
    half the limit, so probes are cheap.
    """
    size = max(1, min(init_val, upper))
    points: list[Point] = []
    while True:
        if on_move is not None:
            on_move(Proposal(Move.PROBE, size, "a probe of the plan: small sizes until memory is a line"))
        trial = run(size)
        point = trial.point
        if trial.short:
            return Probed(points, None, "data", size, trial.samples)
        if not accepted(trial, limit):
            return Probed(points, None, "rejected", size)
        if point is None or point.need is None:
            return Probed(points, None, "unmeasured", size)
        points.append(point)
        if size >= upper:
            return Probed(points, None, "upper", size)
        verdict, nxt = probe_verdict(points, limit, upper)
        if verdict != "more" or nxt is None:
            return Probed(points, verdict, "", size)
        size = nxt


def back_off_sizes(model: MemoryModel, size: int, floor: int) -> Iterator[int]:
    """After ``size`` ran out of memory: the sizes needing 6%, 12%, 24%... less live memory than it.

    Only those above ``floor``.
    """
    step = BACK_OFF_STEP
    while True:
        smaller = model.backed_off(size, step)
        if smaller is None or smaller <= floor:
            return
        yield smaller
        step *= 2
