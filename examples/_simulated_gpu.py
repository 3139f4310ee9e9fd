"""A simulated GPU for the examples on a machine without one (a module they import; it does not run by itself).

On a CPU there is no allocator to measure or to run out of. `SimulatedGPU` stands in for one: its counters
(allocated, reserved, their peaks) move only when the example's model calls `allocate`, `free` or `spike`, an
allocation past `limit` raises the `torch.OutOfMemoryError` a GPU raises, and `install()` has every lightning-gpumem
callback read it (through `lightning_gpumem._hw.probe.set_probe_factory`, the seam the package's tests use too). Freed
memory stays reserved (cached) until a callback releases the cache, as with PyTorch's caching allocator. Nothing in
it is measured: each example that uses it says "simulated" in its output.
"""

from __future__ import annotations

import itertools
import traceback
from collections import deque
from typing import Any

import torch

from lightning_gpumem._hw.probe import MemorySample, set_probe_factory

MIB, GIB = 2**20, 2**30


class SimulatedGPU:
    """The allocator the callbacks read (the `lightning_gpumem._hw.probe.Probe` protocol), moved by the model."""

    device_name = "simulated GPU"
    has_allocator = True

    def __init__(self, total: int, limit: int | None = None) -> None:
        self.device = torch.device("cpu")  # where the tensors really are
        self.why = (
            "no GPU here" if not torch.cuda.is_available() else "--simulate"
        )  # for the examples' output
        self.total, self.limit = (
            total,
            limit or total,
        )  # `limit`: a cap below the card, as `MemoryBudget` sets
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = self.ooms = 0
        self.blocks: dict[
            int, tuple[int, list[dict[str, Any]]]
        ] = {}  # handle: (bytes, stack) of live allocations
        self.history: deque[dict[str, Any]] = deque(
            maxlen=10_000
        )  # allocations, frees, OOMs: the last 10,000
        self._handles = itertools.count()

    def install(self) -> SimulatedGPU:
        """Make every lightning-gpumem callback created from now on read this simulated GPU."""
        set_probe_factory(lambda device, owner, nvml, host: self)
        return self

    # ------------------------------------------------------------------ what the model calls
    def allocate(self, size: int) -> int:
        """Take ``size`` bytes and return a handle for :meth:`free`; past ``limit``, raise ``OutOfMemoryError``."""
        stack = _stack()
        if self.allocated + size > self.limit:
            self.ooms += 1
            self.history.append({"action": "oom", "size": size, "frames": stack})
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (simulated). Tried to allocate {size / MIB:,.1f} MiB with"
                f" {self.allocated / MIB:,.1f} of {self.limit / MIB:,.1f} MiB in use."
            )
        handle = next(self._handles)
        self.blocks[handle] = (size, stack)
        self.history.append({"action": "alloc", "size": size, "frames": stack})
        self.allocated += size
        self.reserved = max(self.reserved, self.allocated)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return handle

    def free(self, handle: int) -> None:
        """Give an allocation back to the cache (it stays reserved until the cache is released)."""
        size, _ = self.blocks.pop(handle)
        self.history.append({"action": "free_completed", "size": size, "frames": []})
        self.allocated -= size

    def spike(self, size: int) -> None:
        """Allocate and free ``size`` bytes: a step's activations and temporaries, gone when the step ends."""
        self.free(self.allocate(size))

    def snapshot(self) -> dict[str, Any]:
        """This allocator's state in the layout of ``torch.cuda.memory._snapshot()``: one segment, its blocks."""
        blocks = [
            {"size": size, "state": "active_allocated", "frames": stack}
            for size, stack in self.blocks.values()
        ]
        if self.reserved > self.allocated:
            blocks.append({"size": self.reserved - self.allocated, "state": "inactive", "frames": []})
        segment = {"total_size": self.reserved, "allocated_size": self.allocated, "blocks": blocks}
        return {"segments": [segment], "device_traces": [list(self.history)]}

    # ------------------------------------------------------------------ what the callbacks read
    def total_bytes(self) -> int:
        return self.total

    def usable_bytes(self) -> int:
        return self.limit

    def set_memory_fraction(self, fraction: float) -> float:
        previous, self.limit = self.limit / self.total, int(fraction * self.total)
        return previous

    def release_cache(self) -> None:
        self.reserved = self.allocated

    def reset_peaks(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def allocated_bytes(self) -> int:
        return self.allocated

    def reserved_bytes(self) -> int:
        return self.reserved

    def read_peaks(self) -> tuple[int, int]:
        return self.peak_allocated, self.peak_reserved

    def read(self, *, nvml: bool = True, host: bool = True) -> MemorySample:
        return MemorySample(
            allocated_bytes=self.allocated,
            reserved_bytes=self.reserved,
            peak_allocated_bytes=self.peak_allocated,
            peak_reserved_bytes=self.peak_reserved,
            alloc_retries=0,
            num_ooms=self.ooms,
            inactive_split_bytes=0,
        )

    def allocator_stats(self) -> dict[str, int]:
        return {"allocated_bytes.all.current": self.allocated, "num_ooms": self.ooms}


def _stack() -> list[dict[str, Any]]:
    """The Python frames of the caller, innermost first, as the CUDA allocator's history records them."""
    frames = [f for f in traceback.extract_stack() if f.filename != __file__]  # not this file's own frames
    return [{"filename": f.filename, "line": f.lineno, "name": f.name} for f in reversed(frames)]
