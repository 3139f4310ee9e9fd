"""A :class:`~lightning_gpumem.probe.MemorySample` as the ``gpumem/*`` metrics the monitor logs.

Keys from :mod:`lightning_gpumem.keys`; values in the keys' units.
"""

from __future__ import annotations

from lightning_gpumem import keys
from lightning_gpumem._units import GIB
from lightning_gpumem.probe import MemorySample

# The sample's fields logged per rank as `<key>_max` / `<key>_min` under DDP/FSDP, with their keys.
REDUCED = {
    "peak_allocated_bytes": keys.PEAK_ALLOCATED,
    "peak_reserved_bytes": keys.PEAK_RESERVED,
    "nvml_process_bytes": keys.NVML_PROCESS,
    "host_rss_bytes": keys.HOST_RSS,
}
_DEVICE_WIDE = (
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


def stage_metrics(stage: str, sample: MemorySample) -> dict[str, float]:
    """The stage's allocator keys: peaks over the batch (loop) and the values at its end, in GiB."""
    pairs = (
        (keys.PEAK_ALLOCATED, sample.peak_allocated_bytes),
        (keys.PEAK_RESERVED, sample.peak_reserved_bytes),
        (keys.ALLOCATED, sample.allocated_bytes),
        (keys.RESERVED, sample.reserved_bytes),
    )
    return {key.format(stage): value / GIB for key, value in pairs if value is not None}


def device_wide_metrics(sample: MemorySample) -> dict[str, float]:
    """The keys that belong to no stage: allocator counters, NVML and host memory, where read."""
    metrics = {}
    for key, field in _DEVICE_WIDE:
        value = getattr(sample, field)
        if value is not None:
            metrics[key.format()] = value / GIB if key.unit == "GiB" else float(value)
    return metrics


def cross_rank_metrics(
    stage: str, spread: dict[str, tuple[float | None, float | None]], device_memory: bool
) -> dict[str, float]:
    """``<key>_max`` / ``<key>_min`` for the :data:`REDUCED` fields, from their ``(largest, smallest)`` over ranks."""
    metrics = {}
    for field, key in REDUCED.items():
        high, low = spread.get(field, (None, None))
        if high is None or low is None or (key.staged and not device_memory):
            continue
        name = key.format(stage) if key.staged else key.format()
        metrics[f"{name}_max"], metrics[f"{name}_min"] = high / GIB, low / GIB
    return metrics
