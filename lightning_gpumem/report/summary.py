"""One run's numbers, taken from its logged ``gpumem/`` scalars, and the table that shows them."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from lightning_gpumem import keys
from lightning_gpumem._core.summary import RunMemory, advice
from lightning_gpumem._core.units import GIB, format_gib
from lightning_gpumem.report._text import printable
from lightning_gpumem.report.runs import Run, in_range


@dataclass(frozen=True)
class RunSummary:
    """What a run's logs say about its memory; sizes in GiB, ``None`` where the key was not logged.

    Attributes:
        name: the run's directory relative to the log directory.
        steps: first and last step with a ``gpumem/`` value.
        stage_peaks: per stage (``train``, ``val``, ...): the highest logged peak allocated and peak reserved
            (over ranks, where the ``_max`` keys were logged; likewise the other peaks).
        batch_peak_mean: mean of the per-batch peaks (``train_peak_allocated_gib``, rank zero's) over the
            logged batches.
        batch_peak_max: the largest of them.
        logged_batches: how many training batches were logged.
        nvml_process_peak: the highest NVML reading for the process (what ``nvidia-smi`` lists for it).
        nvml_used_peak: the highest NVML reading for the whole device (all processes).
        nvml_total: the device's memory (MIG instance under MIG).
        non_torch_peak: the highest non-PyTorch share (CUDA context, NCCL, cuBLAS).
        host_rss_peak: the highest host resident memory.
        budget: the last ``MemoryBudget`` logged.
        headroom: ``budget`` minus the highest peak reserved over the stages; without a budget,
            ``nvml_total`` minus that peak and ``non_torch_peak``.
        batch_size: the last batch size a ``BatchSizeTuner`` logged.
        token_budget: the last ``TokenBudgetSampler`` budget a ``BatchSizeTuner`` tuned, and the epoch's
            padding fraction (%) at that budget; ``None`` where no budget was tuned.
        tuned_budget: the memory budget the ``BatchSizeTuner`` tuned for (``gpumem/batch_size_budget_gib``).
        step_peaks_over_budget: the logged training steps' peak reserved (the highest over ranks where
            logged) over ``budget``, else over ``tuned_budget``: p50, p99 and max, and how many steps;
            ``None`` without a budget or per-step peaks.
        plan: what a ``MemoryPlanner`` logged before step 1 (``gpumem/plan_*``): the predicted peak at the
            run's batch size and its band, the line's fixed part and per-sample slope, the memory outside
            PyTorch and the largest batch size of its first budget; empty without a planner.
        cache_releases: releases by ``EmptyCacheOnThreshold`` (summed over ranks where logged per rank).
        released: GiB those releases gave back.
        leak_warnings: how many times the monitor warned of a leak.
        leaks_watched: the monitor's leak detection logged a growth rate or a warning.
        leak_rate: the growth rate, MiB per step, logged at the first leak warning or the first logging step
            after it (the detector stops sampling there, so its estimate holds from then on); ``None``
            without a warning. A leak-free run's estimates are noise about zero, the highest of them the
            first, made from the first samples after the warm-up: they are not shown.
        alloc_retries: allocator retries (cumulative count, last value).
        ooms: out-of-memory errors (cumulative count, last value).
        over_ranks: cross-rank ``_max`` keys were logged (DDP/FSDP): the peaks above are the highest over
            ranks.
        advice: the fit-end summary's advice (:func:`~lightning_gpumem._core.summary.advice`) on what the
            logs say.
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
    token_budget: tuple[int, float | None] | None = None
    tuned_budget: float | None = None
    step_peaks_over_budget: tuple[float, float, float, int] | None = None
    plan: dict[str, float] = field(default_factory=dict)
    cache_releases: int | None = None
    released: float | None = None
    leak_warnings: int = 0
    leaks_watched: bool = False
    leak_rate: float | None = None
    alloc_retries: int | None = None
    ooms: int | None = None
    over_ranks: bool = False
    advice: list[str] = field(default_factory=list)

    @property
    def peak_reserved(self) -> float | None:
        """The highest peak reserved over all stages."""
        values = [reserved for _, reserved in self.stage_peaks.values() if reserved is not None]
        return max(values) if values else None


def summarize(run: Run) -> RunSummary:
    """Reduce a run's series to its :class:`RunSummary`.

    Its ``memory`` is the same model the fit-end summary uses.
    """
    steps = [step for points in run.series.values() for step, _ in points]
    peaks = {
        stage: (
            _highest(run, keys.PEAK_ALLOCATED.format(stage)),
            _highest(run, keys.PEAK_RESERVED.format(stage)),
        )
        for stage in keys.STAGES
    }
    peaks = {stage: pair for stage, pair in peaks.items() if pair != (None, None)}
    train_peak = keys.PEAK_ALLOCATED.format("train")
    batch_peaks = run.values(train_peak)
    budget = run.last(keys.BUDGET.format())
    nvml_total = run.last(keys.NVML_TOTAL.format())
    releases = _per_rank_total(run, keys.CACHE_RELEASES)
    batch_size = run.last(keys.BATCH_SIZE.format())
    token_budget = run.last(keys.TOKEN_BUDGET.format())
    tuned_budget = run.last(keys.TUNED_BUDGET.format())
    memory = run_memory(run, peaks)
    headroom = memory.headroom_bytes
    return RunSummary(
        name=run.name,
        steps=(min(steps), max(steps)) if steps else None,
        stage_peaks=peaks,
        batch_peak_mean=statistics.fmean(batch_peaks) if batch_peaks else None,
        batch_peak_max=_highest(run, train_peak),
        logged_batches=len(batch_peaks),
        nvml_process_peak=_highest(run, keys.NVML_PROCESS.format()),
        nvml_used_peak=run.maximum(keys.NVML_USED.format()),
        nvml_total=nvml_total,
        non_torch_peak=run.maximum(keys.NON_TORCH.format()),
        host_rss_peak=_highest(run, keys.HOST_RSS.format()),
        budget=budget,
        headroom=None if headroom is None else headroom / GIB,
        batch_size=None if batch_size is None or token_budget is not None else round(batch_size),
        token_budget=None
        if token_budget is None
        else (round(token_budget), run.last(keys.PADDING.format())),
        tuned_budget=tuned_budget,
        step_peaks_over_budget=_step_peaks_over(run, budget if budget is not None else tuned_budget),
        plan={key.name: value for key in PLAN_KEYS if (value := run.last(key.format())) is not None},
        cache_releases=None if releases is None else round(releases),
        released=_per_rank_total(run, keys.RELEASED),
        leak_warnings=len(run.values(keys.LEAK_WARNINGS.format())),
        leaks_watched=bool(run.values(keys.LEAK_RATE.format()) or run.values(keys.LEAK_WARNINGS.format())),
        leak_rate=_rate_when_flagged(run),
        alloc_retries=memory.alloc_retries,
        ooms=memory.num_ooms,
        over_ranks=any(
            found is not None and found.suffix == "_max" for found in map(keys.parse, run.series)
        ),
        advice=advice(memory),
    )


def run_memory(run: Run, peaks: dict[str, tuple[float | None, float | None]] | None = None) -> RunMemory:
    """The run as the fit-end summary models it, from its logs.

    A :class:`~lightning_gpumem._core.summary.RunMemory`.

    What the logs cannot say (precision, DDP settings, layers) is left unknown, and the advice that rests on
    it is not given.
    """
    if peaks is None:
        peaks = {
            stage: (
                _highest(run, keys.PEAK_ALLOCATED.format(stage)),
                _highest(run, keys.PEAK_RESERVED.format(stage)),
            )
            for stage in keys.STAGES
        }
        peaks = {stage: pair for stage, pair in peaks.items() if pair != (None, None)}
    ranks = [
        int(found.suffix[5:])
        for found in map(keys.parse, run.series)
        if found and found.suffix[:5] == "_rank"
    ]
    return RunMemory(
        device_name=run.name,
        total_bytes=_bytes(run.last(keys.NVML_TOTAL.format())),
        stage_peaks={stage: (_bytes(a), _bytes(r)) for stage, (a, r) in peaks.items()},
        max_non_torch_bytes=_bytes(run.maximum(keys.NON_TORCH.format())),
        max_host_rss_bytes=_bytes(_highest(run, keys.HOST_RSS.format())),
        alloc_retries=_count(run.last(keys.ALLOC_RETRIES.format())),
        num_ooms=_count(run.last(keys.OOMS.format())),
        max_inactive_split_bytes=_bytes(run.last(keys.INACTIVE_SPLIT.format())),
        max_reserved_bytes=_bytes(run.last(keys.RESERVED.format("train"))),
        world_size=max(ranks) + 1 if ranks else 1,
        budget_bytes=_bytes(run.last(keys.BUDGET.format())),
        tuned=run.last(keys.BATCH_SIZE.format()) is not None,
        planned_ooms=_count(run.last(keys.TRIAL_OOMS.format())) or 0,
        planned_retries=_count(run.last(keys.TRIAL_RETRIES.format())) or 0,
    )


def _rate_when_flagged(run: Run) -> float | None:
    """The leak rate logged at the first leak warning or next after it; ``None`` where none was flagged."""
    flagged = [step for step, value in run.series.get(keys.LEAK_WARNINGS.format(), []) if in_range(value)]
    if not flagged:
        return None
    rates = run.series.get(keys.LEAK_RATE.format(), [])
    return next((value for step, value in rates if step >= min(flagged) and in_range(value)), None)


def _step_peaks_over(run: Run, budget: float | None) -> tuple[float, float, float, int] | None:
    """p50, p99 and max of the training steps' peak reserved over ``budget`` (GiB), and the step count."""
    key = keys.PEAK_RESERVED.format("train")
    # under DDP/FSDP the highest rank's: each rank has the budget
    peaks = run.values(f"{key}_max") or run.values(key)
    if not peaks or budget is None or budget <= 0:
        return None
    ratios = sorted(peak / budget for peak in peaks)
    return _percentile(ratios, 50), _percentile(ratios, 99), ratios[-1], len(ratios)


def _percentile(ordered: list[float], q: float) -> float:
    """The ``q``-th percentile of sorted values, linear between the closest ranks (numpy's default)."""
    position = (len(ordered) - 1) * q / 100
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def _bytes(gib: float | None) -> int | None:
    return None if gib is None else round(gib * GIB)


def _count(value: float | None) -> int | None:
    return None if value is None else round(value)


def _highest(run: Run, key: str) -> float | None:
    """The largest value of ``key`` and, under DDP/FSDP, of its cross-rank maximum ``key_max``."""
    values = [v for v in (run.maximum(key), run.maximum(f"{key}_max")) if v is not None]
    return max(values) if values else None


def _per_rank_total(run: Run, key: keys.Key) -> float | None:
    """The last value of a cumulative key, or the sum of its ``_rank<r>`` last values under DDP."""
    value = run.last(key.format())
    if value is not None:
        return value
    values = []
    for name in run.series:
        found = keys.parse(name)
        if found is not None and found.key is key and found.suffix.startswith("_rank"):
            values.append(run.last(name))
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _gib(value: float | None, digits: int = 2) -> str:
    """A value logged in GiB, formatted as the package formats bytes; ``-`` where it was not logged."""
    return "-" if value is None else format_gib(value * GIB, digits)


def _count_text(value: int | None) -> str:
    return "-" if value is None else str(value)


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
    tuned_for = f", for {_gib(summary.tuned_budget, 1)}" if summary.tuned_budget is not None else ""
    if summary.batch_size is not None:
        out.append(("tuned batch size", f"{summary.batch_size}{tuned_for}"))
    if summary.token_budget is not None:
        budget, padding = summary.token_budget
        padded = f" ({padding:.1f}% of the epoch's positions padding)" if padding is not None else ""
        out.append(("tuned token budget", f"{budget} tokens per batch{padded}{tuned_for}"))
    if summary.step_peaks_over_budget is not None:
        p50, p99, highest, steps = summary.step_peaks_over_budget
        whose = "the budget" if summary.budget is not None else "the tuner's budget"
        out.append(
            (
                "step peak reserved / budget",
                f"p50 {p50:.2f}, p99 {p99:.2f}, max {highest:.2f} over {steps} logged training steps"
                f" ({whose})",
            )
        )
    if summary.plan:
        out.append(("memory plan", _plan_text(summary.plan)))
    if summary.cache_releases is not None:
        released = f", {_gib(summary.released)} given back" if summary.released is not None else ""
        out.append(("cache releases", f"{summary.cache_releases}{released}"))
    if summary.leaks_watched:
        rate = (
            f" (growth {summary.leak_rate:.2f} MiB/step when flagged)"
            if summary.leak_rate is not None
            else ""
        )
        out.append(("leak warnings", f"{summary.leak_warnings}{rate}"))
    if summary.alloc_retries is not None or summary.ooms is not None:
        out.append(
            (
                "allocator retries / OOMs",
                f"{_count_text(summary.alloc_retries)} / {_count_text(summary.ooms)}",
            )
        )
    if summary.host_rss_peak is not None:
        out.append(("host RSS peak", _gib(summary.host_rss_peak)))
    out.extend(("advice", line) for line in summary.advice)
    return out


PLAN_KEYS = (
    keys.PLAN_PEAK,
    keys.PLAN_BAND,
    keys.PLAN_FIXED,
    keys.PLAN_PER_SAMPLE,
    keys.PLAN_OUTSIDE,
    keys.PLAN_LARGEST,
)


def _plan_text(plan: dict[str, float]) -> str:
    """``MemoryPlanner``'s logged plan in a line: the predicted peak, the line, the largest size."""
    parts = []
    if keys.PLAN_PEAK.name in plan:
        band = plan.get(keys.PLAN_BAND.name)
        parts.append(
            f"peak {plan[keys.PLAN_PEAK.name]:.2f}"
            + (f" +- {band:.2f}" if band is not None else "")
            + " GiB"
        )
    if keys.PLAN_FIXED.name in plan and keys.PLAN_PER_SAMPLE.name in plan:
        parts.append(
            f"{plan[keys.PLAN_FIXED.name]:.2f} GiB + {plan[keys.PLAN_PER_SAMPLE.name]:.1f} MiB per sample"
        )
    if keys.PLAN_OUTSIDE.name in plan:
        parts.append(f"{plan[keys.PLAN_OUTSIDE.name]:.2f} GiB outside PyTorch")
    if keys.PLAN_LARGEST.name in plan:
        parts.append(f"largest batch size {round(plan[keys.PLAN_LARGEST.name])}")
    return "; ".join(parts)


def format_table(summary: RunSummary) -> str:
    """The run's table as aligned plain text, headed by the run's name; control characters escaped."""
    table = [(printable(label), printable(value)) for label, value in rows(summary)]
    width = max((len(label) for label, _ in table), default=0)
    return "\n".join(
        [f"run {printable(summary.name)}", *(f"  {label:<{width}}  {value}" for label, value in table)]
    )
