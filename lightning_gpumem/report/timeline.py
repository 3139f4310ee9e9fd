"""What the memory timeline draws, shared by the PNG (matplotlib) and the HTML page (inline SVG)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_gpumem.report.runs import Run, Series


@dataclass(frozen=True)
class Line:
    """One curve: the key it draws, its legend label, colour and dash style."""

    key: str
    label: str
    color: str
    dashed: bool = False
    points_only: bool = False


LINES = (
    Line("gpumem/train_peak_allocated_gib", "per-batch peak allocated", "#d62728"),
    Line("gpumem/train_allocated_gib", "allocated (batch end)", "#1f77b4"),
    Line("gpumem/train_reserved_gib", "reserved (batch end)", "#2ca02c"),
    Line("gpumem/nvml_process_gib", "NVML, this process", "#9467bd"),
    Line("gpumem/budget_gib", "budget", "#000000", dashed=True),
    Line("gpumem/val_peak_allocated_gib", "validation peak allocated", "#ff7f0e", points_only=True),
)
HOST_LINE = Line("gpumem/host_rss_gib", "host RSS (no device memory logged)", "#8c564b")
RELEASE_COLOR = "#7f7f7f"


def lines(run: Run) -> list[tuple[Line, Series]]:
    """The curves this run has data for; host memory only where no device memory was logged (a CPU run)."""
    found = [(line, run.series[line.key]) for line in LINES if run.series.get(line.key)]
    if not any(line.key != "gpumem/budget_gib" for line, _ in found) and run.series.get(HOST_LINE.key):
        found.append((HOST_LINE, run.series[HOST_LINE.key]))
    return found


def release_steps(run: Run) -> list[int]:
    """Steps at which ``EmptyCacheOnThreshold``'s release count went up (on any rank)."""
    keys = [key for key in run.series if key == "gpumem/cache_releases" or key.startswith("gpumem/cache_releases_rank")]
    steps: set[int] = set()
    for key in keys:
        previous = 0.0
        for step, value in run.series[key]:
            if value > previous:
                steps.add(step)
            previous = value
    return sorted(steps)


def title(run: Run) -> str:
    """The run's name, with the tuned batch size where a ``BatchSizeTuner`` logged one."""
    batch_size = run.last("gpumem/batch_size")
    return run.name if batch_size is None else f"{run.name}  (tuned batch size {round(batch_size)})"
