"""The record every reading of memory becomes: :class:`MemorySample` (pure, stdlib only).

The probe (``probe.py``) fills it from the hardware; everything above it (the monitor's peak window and
metrics, the fit-end summary, the report) reads samples only, so it loads neither torch nor Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class MemorySample:
    """One reading of device and host memory.

    Sizes are in bytes; a field is ``None`` where its source is absent.

    Attributes:
        allocated_bytes: memory held by live tensors (caching allocator).
        reserved_bytes: memory the caching allocator holds from the driver (allocated + cached).
        peak_allocated_bytes: highest ``allocated_bytes`` since the probe's last ``reset_peaks()``.
        peak_reserved_bytes: highest ``reserved_bytes`` since the last reset.
        alloc_retries: cumulative count of failed driver allocations that flushed the cache and retried.
        num_ooms: cumulative count of out-of-memory errors raised by the allocator.
        inactive_split_bytes: cached memory in split blocks that cannot serve large requests (fragmentation).
        nvml_used_bytes: device memory used by all processes, as ``nvidia-smi`` shows it.
        nvml_total_bytes: device memory (of the MIG instance, under MIG).
        nvml_process_bytes: device memory NVML attributes to this process (CUDA context included).
        gpu_util_pct: GPU utilisation in percent, NVML's last sample period.
        host_rss_bytes: resident memory of this process on the host.
        host_available_bytes: host memory available to new allocations.
    """

    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    alloc_retries: int | None = None
    num_ooms: int | None = None
    inactive_split_bytes: int | None = None
    nvml_used_bytes: int | None = None
    nvml_total_bytes: int | None = None
    nvml_process_bytes: int | None = None
    gpu_util_pct: float | None = None
    host_rss_bytes: int | None = None
    host_available_bytes: int | None = None

    @property
    def non_torch_bytes(self) -> int | None:
        """Device memory of this process outside PyTorch's allocator (CUDA context, NCCL, cuBLAS), in bytes.

        NVML's per-process use minus the allocator's reserved memory, floored at zero; ``None`` if either is
        absent.

        >>> MemorySample(reserved_bytes=6, nvml_process_bytes=10).non_torch_bytes
        4
        """
        if self.nvml_process_bytes is None or self.reserved_bytes is None:
            return None
        return max(self.nvml_process_bytes - self.reserved_bytes, 0)

    def as_dict(self) -> dict[str, float | None]:
        """All fields and ``non_torch_bytes`` as a plain dictionary."""
        out: dict[str, float | None] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["non_torch_bytes"] = self.non_torch_bytes
        return out
