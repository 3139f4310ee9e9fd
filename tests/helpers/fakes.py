"""A fake memory source and helpers shared by the tests: allocator logic tested on CPU with known numbers.

Importing this module sets the tests' probe factory: a callback with a ``fake`` attribute reads that `FakeProbe`,
every other one the hardware. Also here: fake callbacks reading a `FakeProbe`, a logger without text or table
calls, a synthetic allocator snapshot, and readers of the CSV metrics a fit wrote.
"""

from __future__ import annotations

import csv
import math
from fractions import Fraction
from pathlib import Path

import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import Logger

from lightning_gpumem import EmptyCacheOnThreshold, LayerMemoryProfiler, MemoryBudget, MemoryMonitor
from lightning_gpumem._core.units import GIB, MIB
from lightning_gpumem._hw.probe import MemorySample, Probe, default_probe_factory, set_probe_factory


class FakeProbe:
    """Mimics the caching allocator's counters: allocations move `allocated`, peaks follow until reset."""

    device_name = "FakeGPU"

    def __init__(
        self, base: int = GIB, total: int = 24 * GIB, retries: int = 0, inactive_split: int = 0
    ) -> None:
        self.device = torch.device("cpu")
        self.has_allocator = True
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = base
        self.total = total
        self.retries = retries
        self.inactive_split = inactive_split
        self.resets = 0
        self.reads = 0

    def total_bytes(self) -> int:
        return self.total

    def usable_bytes(self) -> int:
        return self.total

    def release_cache(self) -> None:
        self.reserved = self.allocated

    def allocate(self, n: int) -> None:
        self.allocated += n
        self.reserved = max(self.reserved, self.allocated)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, n: int) -> None:
        self.allocated -= n

    def spike(self, n: int) -> None:
        self.allocate(n)
        self.free(n)

    def reset_peaks(self) -> None:
        self.resets += 1
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def allocated_bytes(self) -> int:
        return self.allocated

    def reserved_bytes(self) -> int:
        return self.reserved

    def read_peaks(self) -> tuple[int, int]:
        return self.peak_allocated, self.peak_reserved

    def read(self, *, nvml: bool = True, host: bool = True) -> MemorySample:
        self.reads += 1
        return MemorySample(
            allocated_bytes=self.allocated,
            reserved_bytes=self.reserved,
            peak_allocated_bytes=self.peak_allocated,
            peak_reserved_bytes=self.peak_reserved,
            alloc_retries=self.retries,
            num_ooms=0,
            inactive_split_bytes=self.inactive_split,
            nvml_used_bytes=self.reserved + 500 * MIB if nvml else None,
            nvml_total_bytes=self.total if nvml else None,
            nvml_process_bytes=self.reserved + 300 * MIB if nvml else None,
            gpu_util_pct=50.0 if nvml else None,
            host_rss_bytes=2 * GIB if host else None,
            host_available_bytes=20 * GIB if host else None,
        )

    def allocator_stats(self) -> dict[str, int]:
        return {"allocated_bytes.all.current": self.allocated, "num_alloc_retries": self.retries}


def _fake_or_real(device: torch.device, owner: object, nvml: bool, host: bool) -> Probe:
    """The probe factory of the tests: a callback with a ``fake`` FakeProbe reads it, the others the hardware."""
    fake = getattr(owner, "fake", None)
    return fake if isinstance(fake, FakeProbe) else default_probe_factory(device, owner, nvml, host)  # type: ignore[return-value]


set_probe_factory(_fake_or_real)


class CudaFakeProbe(FakeProbe):
    """A fake CUDA allocator with a per-process cap (only the device's type is read)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.device = torch.device("cuda")
        self.fraction = 1.0
        self.releases = 0

    def set_memory_fraction(self, fraction: float) -> float:
        previous, self.fraction = self.fraction, fraction
        return previous

    def release_cache(self) -> None:
        self.releases += 1
        super().release_cache()


class FakeMonitor(MemoryMonitor):
    """MemoryMonitor reading a FakeProbe instead of the hardware."""

    def __init__(self, probe: FakeProbe, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.fake = probe


class FakeRelease(EmptyCacheOnThreshold):
    """EmptyCacheOnThreshold reading (and releasing) a FakeProbe."""

    def __init__(self, probe: FakeProbe, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.fake = probe


class FakeBudget(MemoryBudget):
    """MemoryBudget capping a FakeProbe (a `CudaFakeProbe`: MemoryBudget caps CUDA devices only)."""

    def __init__(self, probe: FakeProbe, budget) -> None:
        super().__init__(budget)
        self.fake = probe


class FakeProfiler(LayerMemoryProfiler):
    """LayerMemoryProfiler reading a FakeProbe."""

    def __init__(self, fake: FakeProbe, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fake = fake


class SpikeModel(BoringModel):
    """BoringModel whose steps make the fake allocator spike: `train_spikes[global_step]` bytes, etc."""

    def __init__(
        self,
        probe: FakeProbe,
        train_spikes: dict[int, int] | None = None,
        val_spike: int = 0,
        by_batch_idx: bool = False,
    ) -> None:
        super().__init__()
        self.fake = probe
        self.train_spikes = train_spikes or {}
        self.val_spike = val_spike
        self.by_batch_idx = by_batch_idx  # key `train_spikes` by batch_idx instead of global_step

    def training_step(self, batch, batch_idx):
        self.fake.spike(self.train_spikes.get(batch_idx if self.by_batch_idx else self.global_step, 0))
        out = super().training_step(batch, batch_idx)
        self.log("loss", out["loss"])
        return out

    def validation_step(self, batch, batch_idx):
        self.fake.spike(self.val_spike)
        return super().validation_step(batch, batch_idx)

    def test_step(self, batch, batch_idx):
        self.fake.spike(self.val_spike)
        return super().test_step(batch, batch_idx)


class PlainLogger(Logger):
    """A logger with no text or table call (as a custom one may be)."""

    def __init__(self, save_dir: str | None = None, name: str | None = "plain", **attributes) -> None:
        super().__init__()
        self._save_dir, self._name = save_dir, name
        for name, value in attributes.items():
            setattr(self, name, value)

    @property
    def name(self):
        return self._name

    @property
    def version(self):
        return 0

    @property
    def save_dir(self):
        return self._save_dir

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def frame(filename: str, line: int, name: str) -> dict:
    """One frame of a block's stack in a `torch.cuda.memory._snapshot()`."""
    return {"filename": filename, "line": line, "name": name}


USER = frame("/home/me/model.py", 42, "forward")
NOISE = frame("/site-packages/torch/nn/modules/module.py", 1750, "_call_impl")
SNAPSHOT = {  # a synthetic `torch.cuda.memory._snapshot()`: two segments, a history that ends in an OOM
    "segments": [
        {
            "total_size": 64 * MIB,
            "allocated_size": 48 * MIB,
            "blocks": [
                {"size": 32 * MIB, "state": "active_allocated", "frames": [NOISE, USER]},
                {"size": 16 * MIB, "state": "inactive", "frames": []},
                {
                    "size": 16 * MIB,
                    "state": "active_allocated",
                    "frames": [frame("/home/me/data.py", 7, "load")],
                },
            ],
        },
        {
            "total_size": 20 * MIB,
            "allocated_size": 2 * MIB,
            "blocks": [{"size": 2 * MIB, "state": "active_allocated", "frames": []}],
        },
    ],
    "device_traces": [
        [
            {"action": "alloc", "size": 32 * MIB, "frames": [USER]},
            {"action": "oom", "size": 3 * 1024 * MIB, "frames": [frame("??", 0, "malloc"), NOISE, USER]},
        ]
    ],
}


def kept(largest: int, headroom: float = 0.05) -> int:
    """The size `BatchSizeTuner` keeps when `largest` is the largest that runs: the least >= (1 - headroom) * largest.

    Exact arithmetic (the decimal headroom as a fraction), so that 0.95 * 40 is 38.
    """
    return max(1, math.ceil((1 - Fraction(str(headroom))) * largest))


def read_csv_metrics(log_dir: str | Path) -> list[dict[str, str]]:
    """Rows of the newest CSVLogger metrics.csv under log_dir."""
    paths = sorted(Path(log_dir).rglob("metrics.csv"))
    assert paths, f"no metrics.csv under {log_dir}"
    with open(paths[-1]) as f:
        return list(csv.DictReader(f))


def column(rows: list[dict[str, str]], key: str) -> dict[int, float]:
    """`{step: value}` for the rows where `key` has a value."""
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key) not in (None, "")}


def close_process_group() -> None:
    """End a DDP script: destroy the default process group before the interpreter exits.

    Left to interpreter shutdown, gloo's worker threads can be destroyed while still joinable, which aborts the
    process ("terminate called without an active exception", exit -6) after all the work is done.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
