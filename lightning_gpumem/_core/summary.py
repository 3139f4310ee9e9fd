"""The fit-end summary table and its advice: plain functions of the measured numbers, no Trainer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_gpumem._core.units import GIB, format_gib

NEAR_LIMIT_FRACTION = 0.90  # peak reserved above this share of the device: close to an OOM
LARGE_HEADROOM_FRACTION = 0.50  # peak reserved below this share of the device: much memory left unused
FRAGMENTATION_FRACTION = 0.20  # inactive split memory above this share of reserved: fragmented cache
FRAGMENTATION_MIN_BYTES = GIB  # ... and at least this much, so small caches do not trigger advice


@dataclass
class RunMemory:
    """What the monitor measured over a run; sizes in bytes, ``None`` where unavailable."""

    device_name: str
    total_bytes: int | None = None
    # stage: (alloc, reserved)
    stage_peaks: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)
    max_non_torch_bytes: int | None = None
    max_host_rss_bytes: int | None = None
    alloc_retries: int | None = None
    num_ooms: int | None = None
    max_inactive_split_bytes: int | None = None
    max_reserved_bytes: int | None = None  # reserved memory at the time of the largest fragmentation reading
    world_size: int = 1
    budget_bytes: int | None = None  # a MemoryBudget's budget: shares are taken of it instead of the device
    precision: str | None = None  # the Trainer's precision, e.g. "32-true", "bf16-mixed"
    ddp_bucket_view: bool | None = None  # DDP: gradient_as_bucket_view; None when not DDP
    # parameters that need gradients, in bytes (a DDP bucket copy costs as much)
    gradient_bytes: int | None = None
    # LayerMemoryProfiler: (layer, activations)
    top_layers: list[tuple[str, int]] = field(default_factory=list)
    tuned: bool = False  # a BatchSizeTuner chose the batch size
    # BatchSizeTuner: OOMs (and retries) of its trials, planned, counted apart from the run's
    planned_ooms: int = 0
    planned_retries: int = 0
    oom_recoveries: int | None = None  # AutoMicrobatch: out-of-memory errors recovered
    microbatches: int | None = None  # AutoMicrobatch: micro-batches per batch at the end

    @property
    def peak_reserved_bytes(self) -> int | None:
        """Highest reserved memory over all stages, in bytes."""
        values = [reserved for _, reserved in self.stage_peaks.values() if reserved is not None]
        return max(values) if values else None

    @property
    def headroom_bytes(self) -> int | None:
        """What is left at the highest peak reserved, in bytes; ``None`` where unknown.

        The budget less that peak (the budget caps the allocator alone), or without a budget the device less
        the peak and the non-PyTorch share.
        """
        peak = self.peak_reserved_bytes
        if peak is None:
            return None
        if self.budget_bytes:
            return self.budget_bytes - peak
        return None if not self.total_bytes else self.total_bytes - peak - (self.max_non_torch_bytes or 0)


def advice(run: RunMemory) -> list[str]:
    """One line per piece of advice, each quoting the measurement it rests on; empty without evidence."""
    lines = []
    peak = run.peak_reserved_bytes
    retries = (run.alloc_retries or 0) - run.planned_retries
    ooms = (run.num_ooms or 0) - run.planned_ooms
    if retries > 0:
        lines.append(
            f"{retries} allocator retries (cudaMalloc failed, the cache was flushed and the allocation"
            " retried; each costs a synchronisation): set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."
        )
    elif (
        run.max_inactive_split_bytes is not None
        and run.max_reserved_bytes
        and run.max_inactive_split_bytes >= FRAGMENTATION_MIN_BYTES
        and run.max_inactive_split_bytes > FRAGMENTATION_FRACTION * run.max_reserved_bytes
    ):
        lines.append(
            f"{format_gib(run.max_inactive_split_bytes)} of {format_gib(run.max_reserved_bytes)} reserved"
            " sat in split blocks that large tensors cannot reuse (fragmentation):"
            " set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."
        )
    if ooms > 0:
        lines.append(f"{ooms} out-of-memory error(s) were raised in this process (caught somewhere).")
    limit = run.budget_bytes or run.total_bytes
    of_what = "the budget" if run.budget_bytes else "the device"
    if peak is not None and limit:
        share = peak / limit
        if share > NEAR_LIMIT_FRACTION:
            fp32 = run.precision is not None and run.precision.startswith(("32", "64"))
            remedy = (
                f"at precision='{run.precision}', precision='bf16-mixed' (or '16-mixed' before Ampere)"
                " roughly halves the activations"
                if fp32
                else "consider activation checkpointing"
            )
            lines.append(
                f"peak reserved is {share:.0%} of {of_what}: one larger batch or sequence may OOM; {remedy}."
            )
        elif share < LARGE_HEADROOM_FRACTION and not run.tuned:
            lines.append(
                f"peak reserved is only {share:.0%} of {of_what}: a larger batch size would likely fit"
                " (lightning_gpumem.BatchSizeTuner finds the largest)."
            )
    if run.top_layers and peak is not None and limit and peak / limit > NEAR_LIMIT_FRACTION / 2:
        named = ", ".join(f"{name} ({format_gib(size, 2)})" for name, size in run.top_layers[:3])
        lines.append(
            f"largest activations kept for backward (LayerMemoryProfiler): {named}; these are the candidates"
            " for activation checkpointing (torch.utils.checkpoint)."
        )
    if run.ddp_bucket_view is False and run.gradient_bytes and run.gradient_bytes >= GIB // 4:
        lines.append(
            f"DDP keeps a copy of the {format_gib(run.gradient_bytes, 2)} of gradients in its buckets:"
            " DDPStrategy(gradient_as_bucket_view=True) shares them instead."
        )
    return lines


def has_measurements(run: RunMemory) -> bool:
    """Whether anything was measured: a stage peak, the non-PyTorch share or host memory."""
    stage_values = [value for pair in run.stage_peaks.values() for value in pair]
    return any(
        value is not None for value in [*stage_values, run.max_non_torch_bytes, run.max_host_rss_bytes]
    )


def format_summary(run: RunMemory, interrupted: str | None = None) -> str:
    """A short table: peak per stage, device total, headroom, non-PyTorch share, host memory and advice.

    ``interrupted``: the name of the exception that ended the fit; the table then says it covers the fit up
    to it.
    """
    ranks = f", max over {run.world_size} ranks" if run.world_size > 1 and not interrupted else ""
    ended = f"; interrupted by {interrupted}: what was measured until then, this rank" if interrupted else ""
    lines = [f"MemoryMonitor summary ({run.device_name}{ranks}{ended})"]
    if run.stage_peaks:
        lines.append(f"  {'stage':<10} {'peak allocated':>15} {'peak reserved':>15}")
        for stage, (allocated, reserved) in run.stage_peaks.items():
            lines.append(f"  {stage:<10} {format_gib(allocated, 2):>15} {format_gib(reserved, 2):>15}")
    limit = run.budget_bytes or run.total_bytes
    if limit:
        parts = [f"device total {format_gib(run.total_bytes)}"] if run.total_bytes else []
        parts += [f"budget {format_gib(run.budget_bytes)}"] if run.budget_bytes else []
        line = "  " + "; ".join(parts)
        headroom = run.headroom_bytes
        if headroom is not None:
            line += f"; headroom {format_gib(headroom)} ({headroom / limit:.0%}) at the highest peak"
        lines.append(line)
    if run.max_non_torch_bytes is not None:
        lines.append(
            f"  non-PyTorch share {format_gib(run.max_non_torch_bytes, 2)} (CUDA context, NCCL, cuBLAS)"
        )
    if run.max_host_rss_bytes is not None:
        lines.append(f"  host RSS peak {format_gib(run.max_host_rss_bytes, 2)} (sampled on logging steps)")
    if run.oom_recoveries:
        lines.append(
            f"  AutoMicrobatch recovered {run.oom_recoveries} out-of-memory error(s); batches ended as"
            f" {run.microbatches} micro-batch(es)"
        )
    lines.extend(f"  advice: {line}" for line in advice(run))
    return "\n".join(lines)


def print_summary(
    run: RunMemory, say: Callable[[str], object], interrupted: str | None = None
) -> str | None:
    """Pass :func:`format_summary` to ``say`` and return it.

    Nothing where nothing was measured: no empty table.
    """
    if not has_measurements(run):
        return None
    text = format_summary(run, interrupted)
    say(text)
    return text
