"""What the memory timeline draws, shared by the PNG (matplotlib) and the HTML page (inline SVG)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_gpumem import keys
from lightning_gpumem.report.runs import Run, Series


@dataclass(frozen=True)
class Curve:
    """One curve: the key it draws, its legend label, colour and dash style.

    ``width``, ``marker`` and ``linestyle`` keep curves that coincide (a peak equal to what stays allocated)
    apart in the PNG: the widest underneath, translucent, the others on top with their own markers.
    ``limit``: a level logged once (the tuner's budget), drawn across the whole panel.
    """

    key: str
    label: str
    color: str
    dashed: bool = False
    points_only: bool = False
    width: float = 1.2
    marker: str = ""
    linestyle: str = "-"
    limit: bool = False


CURVES = (
    Curve(keys.PEAK_ALLOCATED.format("train"), "per-batch peak allocated", "#d62728", width=4.0),
    Curve(keys.ALLOCATED.format("train"), "allocated (batch end)", "#1f77b4", marker="s"),
    Curve(keys.RESERVED.format("train"), "reserved (batch end)", "#2ca02c", marker="^", linestyle="-."),
    Curve(keys.NVML_PROCESS.format(), "NVML, this process", "#9467bd", marker="d", linestyle=":"),
    Curve(keys.BUDGET.format(), "budget", "#000000", dashed=True),
    Curve(keys.TUNED_BUDGET.format(), "the tuner's budget", "#e377c2", dashed=True, limit=True),
    Curve(keys.PEAK_ALLOCATED.format("val"), "validation peak allocated", "#ff7f0e", points_only=True),
)
MARKS = 12  # markers per curve, evenly spaced: enough to tell curves apart, few enough to read
HOST_CURVE = Curve(keys.HOST_RSS.format(), "host RSS (no device memory logged)", "#8c564b")
RELEASE_COLOR = "#7f7f7f"


def lines(run: Run) -> list[tuple[Curve, Series]]:
    """The curves this run has data for; host memory only where no device memory was logged (a CPU run)."""
    found = [(line, run.series[line.key]) for line in CURVES if run.series.get(line.key)]
    if not any(line.key != keys.BUDGET.format() for line, _ in found) and run.series.get(HOST_CURVE.key):
        found.append((HOST_CURVE, run.series[HOST_CURVE.key]))
    return found


def release_steps(run: Run) -> list[int]:
    """Steps at which ``EmptyCacheOnThreshold``'s release count went up (on any rank)."""
    releases = keys.CACHE_RELEASES.format()
    logged = [key for key in run.series if key == releases or key.startswith(releases + "_rank")]
    steps: set[int] = set()
    for key in logged:
        previous = 0.0
        for step, value in run.series[key]:
            if value > previous:
                steps.add(step)
            previous = value
    return sorted(steps)


def title(run: Run) -> str:
    """The run's name, with the tuned batch size where a ``BatchSizeTuner`` logged one.

    Raw: escape it to show it.
    """
    return run.name + tuned(run)


def tuned(run: Run) -> str:
    """What :func:`title` adds to the run's name: ``"  (tuned batch size N)"``, or ``""`` if none."""
    batch_size = run.last(keys.BATCH_SIZE.format())
    return "" if batch_size is None else f"  (tuned batch size {round(batch_size)})"
