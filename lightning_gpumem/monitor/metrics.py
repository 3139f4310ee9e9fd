"""A :class:`~lightning_gpumem._core.sample.MemorySample` as the ``gpumem/*`` metrics the monitor logs.

Keys from :mod:`lightning_gpumem.keys`; values in the keys' units.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

from lightning_gpumem import keys
from lightning_gpumem._core.sample import MemorySample
from lightning_gpumem._core.units import GIB, MIB

# The sample's fields logged per rank as `<key>_max` / `<key>_min` under DDP/FSDP, with their keys.
REDUCED = {
    "peak_allocated_bytes": keys.PEAK_ALLOCATED,
    "peak_reserved_bytes": keys.PEAK_RESERVED,
    "nvml_process_bytes": keys.NVML_PROCESS,
    "host_rss_bytes": keys.HOST_RSS,
}
# (logged name, sample field, scale): names built once, as the monitor logs them at every logging step.
_DEVICE_WIDE = tuple(
    (key.format(), field, 1 / GIB if key.unit == "GiB" else 1.0)
    for key, field in (
        (keys.INACTIVE_SPLIT, "inactive_split_bytes"),
        (keys.NVML_USED, "nvml_used_bytes"),
        (keys.NVML_TOTAL, "nvml_total_bytes"),
        (keys.NVML_PROCESS, "nvml_process_bytes"),
        (keys.NON_TORCH, "non_torch_bytes"),
        (keys.HOST_RSS, "host_rss_bytes"),
        (keys.HOST_AVAILABLE, "host_available_bytes"),
        (keys.ALLOC_RETRIES, "alloc_retries"),
        (keys.OOMS, "num_ooms"),
        (keys.GPU_UTIL, "gpu_util_pct"),
    )
)
# Per stage: the logged names of the peak allocated, peak reserved, allocated and reserved keys.
_STAGE_NAMES = {
    stage: tuple(
        key.format(stage) for key in (keys.PEAK_ALLOCATED, keys.PEAK_RESERVED, keys.ALLOCATED, keys.RESERVED)
    )
    for stage in keys.STAGES
}
_BUDGET, _LEAK_RATE = keys.BUDGET.format(), keys.LEAK_RATE.format()


def stage_metrics(stage: str, sample: MemorySample) -> dict[str, float]:
    """The stage's allocator keys: peaks over the batch (loop) and the values at its end, in GiB."""
    values = (
        sample.peak_allocated_bytes,
        sample.peak_reserved_bytes,
        sample.allocated_bytes,
        sample.reserved_bytes,
    )
    return {
        name: value / GIB
        for name, value in zip(_STAGE_NAMES[stage], values, strict=True)
        if value is not None
    }


def device_wide_metrics(sample: MemorySample) -> dict[str, float]:
    """The keys that belong to no stage: allocator counters, NVML and host memory, where read."""
    metrics = {}
    for name, field, scale in _DEVICE_WIDE:
        value = getattr(sample, field)
        if value is not None:
            metrics[name] = value * scale
    return metrics


def cross_rank_metrics(
    stage: str, spread: dict[str, tuple[float | None, float | None]], device_memory: bool
) -> dict[str, float]:
    """``<key>_max``/``<key>_min`` of the :data:`REDUCED` fields, from ``(largest, smallest)`` over ranks."""
    metrics = {}
    for field, key in REDUCED.items():
        high, low = spread.get(field, (None, None))
        if high is None or low is None or (key.staged and not device_memory):
            continue
        name = key.format(stage) if key.staged else key.format()
        metrics[f"{name}_max"], metrics[f"{name}_min"] = high / GIB, low / GIB
    return metrics


def logged_metrics(
    stage: str,
    sample: MemorySample,
    device_memory: bool,
    device_wide: bool,
    budget: int | None = None,
    leak_rate: float | None = None,
    allocator_stats: Mapping[str, int] | None = None,
) -> dict[str, float]:
    """Everything one logging point logs: the stage's keys and, with ``device_wide``, the rest.

    The rest: the device's keys, the budget, the leak rate and the allocator's statistics (``verbose``).
    """
    metrics = stage_metrics(stage, sample) if device_memory else {}
    if device_wide:
        metrics.update(device_wide_metrics(sample))
        if budget is not None:
            metrics[_BUDGET] = budget / GIB
        if leak_rate is not None:
            metrics[_LEAK_RATE] = leak_rate / MIB
        for stat, value in (allocator_stats or {}).items():
            metrics[keys.ALLOCATOR_STAT.name.format(stat=stat)] = float(value)
    return metrics


def progress_text(sample: MemorySample, total: int | None, host_rss: int | None) -> str:
    """``12.3/139.8 GiB``: the last logged peak against ``total`` (the budget or device); else host RSS."""
    if sample.peak_allocated_bytes is None:
        return f"rss {host_rss / GIB:.1f} GiB" if host_rss is not None else "n/a"
    shown = f"{sample.peak_allocated_bytes / GIB:.1f}"
    return f"{shown}/{total / GIB:.1f} GiB" if total else f"{shown} GiB"


class SlowReads:
    """When a logging step also reads NVML and host memory: at most every ``interval_s`` seconds.

    They change slowly and cost tens to hundreds of µs each, unlike the allocator's counters. Under DDP the
    ranks agree one logging step ahead (:meth:`agree`), so that every rank logs the same keys at the same
    steps.
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.last = -math.inf  # time.monotonic() of the last slow reading
        self.next = True  # under DDP: whether the next logging step reads them (agreed by the ranks)

    def now(self, distributed: bool) -> bool:
        """Whether this logging step reads them."""
        now = time.monotonic()
        slow = self.next if distributed else now - self.last >= self.interval_s
        if slow:
            self.last = now
        return slow

    def due(self) -> float:
        """This rank's vote for the next logging step (1.0: due), to gather over ranks."""
        return float(time.monotonic() - self.last >= self.interval_s)

    def agree(self, due_anywhere: bool) -> None:
        """Every rank reads them at the next logging step when any rank is due."""
        self.next = due_anywhere
