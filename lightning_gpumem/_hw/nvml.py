"""NVML behind one small class: what ``nvidia-smi`` shows for the device this process uses.

The device is found by its UUID, never by index: CUDA device ``i`` is not NVML device ``i`` under
``CUDA_VISIBLE_DEVICES`` reordering, and a MIG instance has an NVML handle of its own (``MIG-...`` UUID)
whose memory is the instance's, not the whole card's. Every failure (library missing, driver too old, no
permission, process list hidden inside a container) turns the affected fields into ``None`` and is reported
with one warning per failing part, after which that part is not asked again; never an exception: monitoring
must not stop a training run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_warn


@dataclass(frozen=True)
class NvmlReading:
    """One NVML reading; every field is ``None`` where NVML could not provide it."""

    used_bytes: int | None = None  # device (or MIG instance) memory in use by all processes, in bytes
    total_bytes: int | None = None  # device (or MIG instance) memory, in bytes
    process_bytes: int | None = None  # memory NVML attributes to this process, in bytes
    gpu_util_pct: float | None = None  # GPU utilisation over NVML's last sample period, in percent


def uuid_candidates(torch_uuid: str) -> list[str]:
    """NVML UUID spellings for a UUID as torch prints it (``"6f8a..."``, without NVML's prefix).

    >>> uuid_candidates("1234-ab")
    ['GPU-1234-ab', 'MIG-1234-ab']
    >>> uuid_candidates("MIG-1234-ab")
    ['MIG-1234-ab']
    """
    if torch_uuid.startswith(("GPU-", "MIG-")):
        return [torch_uuid]
    return [f"GPU-{torch_uuid}", f"MIG-{torch_uuid}"]


class NvmlDevice:
    """NVML view of one device, opened by UUID.

    Use :meth:`open`, which returns ``None`` (after one warning) when NVML cannot serve the device.
    """

    def __init__(self, nvml: Any, handle: Any, uuid: str) -> None:
        self._nvml = nvml
        self._handle = handle
        self.uuid = uuid
        self._pid = os.getpid()
        self._failed: set[str] = set()  # parts that failed for good: not asked again

    @classmethod
    def open(cls, torch_uuid: str) -> NvmlDevice | None:
        """Open the NVML handle of the device whose torch UUID is ``torch_uuid``; ``None`` if impossible."""
        try:
            import pynvml
        except ImportError:
            rank_zero_warn(
                "lightning_gpumem: `pynvml` (package nvidia-ml-py) is not installed; NVML metrics are off."
            )
            return None
        try:
            pynvml.nvmlInit()
        except Exception as err:  # NVMLError_LibraryNotFound, DriverNotLoaded, NoPermission, ...
            rank_zero_warn(f"lightning_gpumem: NVML could not start ({err!r}); NVML metrics are off.")
            return None
        for uuid in uuid_candidates(torch_uuid):
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            except Exception:  # noqa: S112 - the other spelling may match
                continue
            return cls(pynvml, handle, uuid)
        rank_zero_warn(
            f"lightning_gpumem: NVML lists no device with UUID {torch_uuid}; NVML metrics are off."
        )
        return None

    def read(self) -> NvmlReading:
        """Read memory, this process's memory and utilisation; unavailable parts are ``None``."""
        used = total = process = util = None
        if "memory" not in self._failed:
            try:
                info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
                used, total = int(info.used), int(info.total)
            except Exception as err:
                self._fail("memory", f"NVML memory info failed ({err!r}); nvml_used/nvml_total are off.")
        if "process" not in self._failed:
            try:
                process = self._process_bytes()
            except Exception as err:
                self._fail("process", f"NVML process list failed ({err!r}); nvml_process/non_torch are off.")
        if "util" not in self._failed:
            try:
                util = float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
            except Exception as err:  # not supported on MIG instances
                self._fail("util", f"NVML utilisation is not available ({err!r}); gpu_util_pct is off.")
        return NvmlReading(used_bytes=used, total_bytes=total, process_bytes=process, gpu_util_pct=util)

    def _process_bytes(self) -> int | None:
        processes = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        for proc in processes:
            if proc.pid == self._pid and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
        # Inside a container NVML reports host PIDs, which do not match ours.
        self._fail(
            "process",
            f"NVML lists {len(processes)} process(es) on {self.uuid} but not this one (pid {self._pid}; a"
            " container's PID namespace hides it); nvml_process/non_torch are off.",
        )
        return None

    def _fail(self, part: str, message: str) -> None:
        self._failed.add(part)
        rank_zero_warn(f"lightning_gpumem: {message}")
