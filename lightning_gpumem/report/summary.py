"""One run's numbers, taken from its logged ``gpumem/`` scalars, and the table that shows them."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from lightning_gpumem._units import GIB, format_gib
from lightning_gpumem.report.runs import Run

STAGES = ("train", "val", "test", "predict")


@dataclass(frozen=True)
class RunSummary:
    """What a run's logs say about its memory; sizes in GiB, ``None`` where the key was not logged.

    Attributes:
        name: the run's directory relative to the log directory.
        steps: first and last step with a ``gpumem/`` value.
        stage_peaks: per stage (``train``, ``val``, ...): the highest logged peak allocated and peak reserved (over
            ranks, where the ``_max`` keys were logged; likewise the other peaks).
        batch_peak_mean: mean of the per-batch peaks (``train_peak_allocated_gib``, rank zero's) over the logged
            batches.
        batch_peak_max: the largest of them.
        logged_batches: how many training batches were logged.
        nvml_process_peak: the highest NVML reading for the process (what ``nvidia-smi`` lists for it).
        nvml_used_peak: the highest NVML reading for the whole device (all processes).
        nvml_total: the device's memory (MIG instance under MIG).
        non_torch_peak: the highest non-PyTorch share (CUDA context, NCCL, cuBLAS).
        host_rss_peak: the highest host resident memory.
        budget: the last ``MemoryBudget`` logged.
        headroom: ``budget`` minus the highest peak reserved over the stages; without a budget, ``nvml_total`` minus
            that peak and ``non_torch_peak``.
        batch_size: the last batch size a ``BatchSizeTuner`` logged.
        cache_releases: releases by ``EmptyCacheOnThreshold`` (summed over ranks where logged per rank).
        released: GiB those releases gave back.
        leak_warnings: how many times the monitor warned of a leak.
        leak_rate_max: the highest growth rate logged, MiB per step.
        alloc_retries: allocator retries (cumulative count, last value).
        ooms: out-of-memory errors (cumulative count, last value).
        over_ranks: cross-rank ``_max`` keys were logged (DDP/FSDP): the peaks above are the highest over ranks.
    """

    name: str
    steps: tuple[int, int] | None = None
    stage_peaks: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)
    batch_peak_mean: float | None = None
    batch_peak_max: float | None = None
    logged_batches: int = 0
    nvml_process_peak: float | None = None
    nvml_used_peak: float | None = None
    nvml_total: float | None = None
    non_torch_peak: float | None = None
    host_rss_peak: float | None = None
    budget: float | None = None
    headroom: float | None = None
    batch_size: int | None = None
    cache_releases: int | None = None
    released: float | None = None
    leak_warnings: int = 0
    leak_rate_max: float | None = None
    alloc_retries: int | None = None
    ooms: int | None = None
    over_ranks: bool = False

    @property
    def peak_reserved(self) -> float | None:
        """The highest peak reserved over all stages."""
        values = [reserved for _, reserved in self.stage_peaks.values() if reserved is not None]
        return max(values) if values else None


def summarize(run: Run) -> RunSummary:
    """Reduce a run's series to its :class:`RunSummary`."""
    steps = [step for points in run.series.values() for step, _ in points]
    peaks = {
        stage: (_highest(run, f"gpumem/{stage}_peak_allocated_gib"), _highest(run, f"gpumem/{stage}_peak_reserved_gib"))
        for stage in STAGES
    }
    peaks = {stage: pair for stage, pair in peaks.items() if pair != (None, None)}
    batch_peaks = run.values("gpumem/train_peak_allocated_gib")
    budget = run.last("gpumem/budget_gib")
    nvml_total = run.last("gpumem/nvml_total_gib")
    reserved = [r for _, r in peaks.values() if r is not None]
    releases = _per_rank_total(run, "gpumem/cache_releases")
    batch_size = run.last("gpumem/batch_size")
    retries, ooms = run.last("gpumem/alloc_retries"), run.last("gpumem/ooms")
    return RunSummary(
        name=run.name,
        steps=(min(steps), max(steps)) if steps else None,
        stage_peaks=peaks,
        batch_peak_mean=statistics.fmean(batch_peaks) if batch_peaks else None,
        batch_peak_max=_highest(run, "gpumem/train_peak_allocated_gib"),
        logged_batches=len(batch_peaks),
        nvml_process_peak=_highest(run, "gpumem/nvml_process_gib"),
        nvml_used_peak=run.maximum("gpumem/nvml_used_gib"),
        nvml_total=nvml_total,
        non_torch_peak=run.maximum("gpumem/non_torch_gib"),
        host_rss_peak=_highest(run, "gpumem/host_rss_gib"),
        budget=budget,
        headroom=_headroom(
            budget, nvml_total, max(reserved) if reserved else None, run.maximum("gpumem/non_torch_gib")
        ),
        batch_size=None if batch_size is None else round(batch_size),
        cache_releases=None if releases is None else round(releases),
        released=_per_rank_total(run, "gpumem/released_gib"),
        leak_warnings=len(run.values("gpumem/leak_warnings")),
        leak_rate_max=run.maximum("gpumem/leak_mib_per_step"),
        alloc_retries=None if retries is None else round(retries),
        ooms=None if ooms is None else round(ooms),
        over_ranks=any(key.endswith("_max") for key in run.series),
    )


def _highest(run: Run, key: str) -> float | None:
    """The largest value of ``key`` and, under DDP/FSDP, of its cross-rank maximum ``key_max``."""
    values = [v for v in (run.maximum(key), run.maximum(f"{key}_max")) if v is not None]
    return max(values) if values else None


def _headroom(budget: float | None, total: float | None, peak: float | None, non_torch: float | None) -> float | None:
    """The budget less the highest peak reserved (the budget caps the allocator alone).

    Without a budget: the device less that peak and the non-PyTorch share, as in the monitor's fit-end summary.
    """
    if peak is None:
        return None
    if budget is not None:
        return budget - peak
    return None if total is None else total - peak - (non_torch or 0.0)


def _per_rank_total(run: Run, key: str) -> float | None:
    """The last value of a cumulative ``key``, or the sum of its ``key_rank<r>`` last values under DDP."""
    value = run.last(key)
    if value is not None:
        return value
    ranks = [run.last(name) for name in run.series if name.startswith(f"{key}_rank")]
    values = [v for v in ranks if v is not None]
    return sum(values) if values else None


def _gib(value: float | None, digits: int = 2) -> str:
    """A value logged in GiB, formatted as the rest of the package formats bytes."""
    return format_gib(None if value is None else value * GIB, digits)


def rows(summary: RunSummary) -> list[tuple[str, str]]:
    """The table's rows as ``(quantity, value)``; rows whose keys were never logged are left out."""
    out: list[tuple[str, str]] = []
    if summary.steps is not None:
        out.append(("steps logged", f"{summary.steps[0]}-{summary.steps[1]}"))
    if summary.over_ranks:
        out.append(("ranks", "peaks and headroom: the highest over ranks; per-batch mean: rank 0's"))
    for stage, (allocated, reserved) in summary.stage_peaks.items():
        out.append((f"{stage} peak", f"{_gib(allocated)} allocated, {_gib(reserved)} reserved"))
    if summary.batch_peak_max is not None:
        out.append(
            (
                "per-batch peak",
                f"mean {_gib(summary.batch_peak_mean)}, max {_gib(summary.batch_peak_max)}"
                f" over {summary.logged_batches} logged batches",
            )
        )
    if summary.nvml_process_peak is not None:
        share = ""
        if summary.non_torch_peak is not None and summary.nvml_process_peak > 0:
            fraction = summary.non_torch_peak / summary.nvml_process_peak
            share = f"; non-PyTorch {_gib(summary.non_torch_peak)} ({fraction:.0%})"
        out.append(("NVML process peak", f"{_gib(summary.nvml_process_peak)}{share}"))
    elif summary.non_torch_peak is not None:
        out.append(("non-PyTorch share", _gib(summary.non_torch_peak)))
    if summary.nvml_used_peak is not None:
        total = f" of {_gib(summary.nvml_total, 1)}" if summary.nvml_total is not None else ""
        out.append(("NVML device used peak", f"{_gib(summary.nvml_used_peak)}{total} (all processes)"))
    if summary.budget is not None:
        out.append(("budget", _gib(summary.budget, 1)))
    if summary.headroom is not None:
        of = summary.budget if summary.budget is not None else summary.nvml_total
        what = "budget" if summary.budget is not None else "device"
        share = f" ({summary.headroom / of:.0%} of the {what})" if of else ""
        out.append(("headroom at the highest peak", f"{_gib(summary.headroom)}{share}"))
    if summary.batch_size is not None:
        out.append(("tuned batch size", str(summary.batch_size)))
    if summary.cache_releases is not None:
        released = f", {_gib(summary.released)} given back" if summary.released is not None else ""
        out.append(("cache releases", f"{summary.cache_releases}{released}"))
    if summary.leak_warnings or summary.leak_rate_max is not None:
        rate = f" (highest rate {summary.leak_rate_max:.2f} MiB/step)" if summary.leak_rate_max is not None else ""
        out.append(("leak warnings", f"{summary.leak_warnings}{rate}"))
    if summary.alloc_retries is not None:
        out.append(("allocator retries / OOMs", f"{summary.alloc_retries} / {summary.ooms}"))
    if summary.host_rss_peak is not None:
        out.append(("host RSS peak", _gib(summary.host_rss_peak)))
    return out


def format_table(summary: RunSummary) -> str:
    """The run's table as aligned plain text, headed by the run's name."""
    table = rows(summary)
    width = max((len(label) for label, _ in table), default=0)
    return "\n".join([f"run {summary.name}", *(f"  {label:<{width}}  {value}" for label, value in table)])
