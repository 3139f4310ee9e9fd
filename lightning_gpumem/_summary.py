"""The fit-end summary table and its advice: plain functions of the measured numbers, no Trainer."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_gpumem._units import GIB, format_gib

NEAR_LIMIT_FRACTION = 0.90  # peak reserved above this share of the device: close to an OOM
LARGE_HEADROOM_FRACTION = 0.50  # peak reserved below this share of the device: much memory left unused
FRAGMENTATION_FRACTION = 0.20  # inactive split memory above this share of reserved: fragmented cache
FRAGMENTATION_MIN_BYTES = GIB  # ... and at least this much, so small caches do not trigger advice


@dataclass
class RunMemory:
    """What the monitor measured over a run; sizes in bytes, ``None`` where unavailable."""

    device_name: str
    total_bytes: int | None = None
    stage_peaks: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)  # stage: (alloc, reserved)
    max_non_torch_bytes: int | None = None
    max_host_rss_bytes: int | None = None
    alloc_retries: int | None = None
    num_ooms: int | None = None
    max_inactive_split_bytes: int | None = None
    max_reserved_bytes: int | None = None  # reserved memory at the time of the largest fragmentation reading
    world_size: int = 1

    @property
    def peak_reserved_bytes(self) -> int | None:
        """Highest reserved memory over all stages, in bytes."""
        values = [reserved for _, reserved in self.stage_peaks.values() if reserved is not None]
        return max(values) if values else None


def advice(run: RunMemory) -> list[str]:
    """One line per piece of advice, each quoting the measurement it rests on; empty without evidence."""
    lines = []
    peak = run.peak_reserved_bytes
    if run.alloc_retries:
        lines.append(
            f"{run.alloc_retries} allocator retries (cudaMalloc failed, the cache was flushed and the allocation"
            " retried; each costs a synchronisation): set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."
        )
    elif (
        run.max_inactive_split_bytes is not None
        and run.max_reserved_bytes
        and run.max_inactive_split_bytes >= FRAGMENTATION_MIN_BYTES
        and run.max_inactive_split_bytes > FRAGMENTATION_FRACTION * run.max_reserved_bytes
    ):
        lines.append(
            f"{format_gib(run.max_inactive_split_bytes)} of {format_gib(run.max_reserved_bytes)} reserved sat in"
            " split blocks that large tensors cannot reuse (fragmentation):"
            " set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."
        )
    if run.num_ooms:
        lines.append(f"{run.num_ooms} out-of-memory error(s) were raised in this process (caught somewhere).")
    if peak is not None and run.total_bytes:
        share = peak / run.total_bytes
        if share > NEAR_LIMIT_FRACTION:
            lines.append(
                f"peak reserved is {share:.0%} of the device: one larger batch or sequence may OOM; consider"
                " precision='bf16-mixed' or activation checkpointing."
            )
        elif share < LARGE_HEADROOM_FRACTION:
            lines.append(f"peak reserved is only {share:.0%} of the device: a larger batch size would likely fit.")
    return lines


def format_summary(run: RunMemory) -> str:
    """A short table: peak per stage, device total, headroom, non-PyTorch share, host memory and advice."""
    ranks = f", max over {run.world_size} ranks" if run.world_size > 1 else ""
    lines = [f"MemoryMonitor summary ({run.device_name}{ranks})"]
    if run.stage_peaks:
        lines.append(f"  {'stage':<10} {'peak allocated':>15} {'peak reserved':>15}")
        for stage, (allocated, reserved) in run.stage_peaks.items():
            lines.append(f"  {stage:<10} {format_gib(allocated, 2):>15} {format_gib(reserved, 2):>15}")
    peak = run.peak_reserved_bytes
    if run.total_bytes:
        line = f"  device total {format_gib(run.total_bytes)}"
        if peak is not None:
            headroom = run.total_bytes - peak - (run.max_non_torch_bytes or 0)
            line += f"; headroom {format_gib(headroom)} ({headroom / run.total_bytes:.0%}) at the highest peak"
        lines.append(line)
    if run.max_non_torch_bytes is not None:
        lines.append(f"  non-PyTorch share {format_gib(run.max_non_torch_bytes, 2)} (CUDA context, NCCL, cuBLAS)")
    if run.max_host_rss_bytes is not None:
        lines.append(f"  host RSS peak {format_gib(run.max_host_rss_bytes, 2)} (sampled on logging steps)")
    lines.extend(f"  advice: {line}" for line in advice(run))
    return "\n".join(lines)
