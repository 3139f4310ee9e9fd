"""The allocator, changed rather than read: its cache and cuBLAS workspaces given back, its history recorded.

The probe (``probe.py``) reads the allocator; this module is the one place that changes it. It uses torch's
private allocator functions (``torch.cuda.memory._record_memory_history``, ``_snapshot``, ``torch._C``'s OOM
observer and cuBLAS workspace release), each guarded by ``tests/pl/test_lightning_internals.py``.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import Any

import torch

from lightning_gpumem._core.kernels import H100, Device, device_for
from lightning_gpumem._hw.probe import Probe


def expandable_segments() -> bool:
    """Whether the CUDA allocator was configured with ``expandable_segments:True`` (by the environment)."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        settings = os.environ.get(name, "").replace(" ", "")
        if "expandable_segments:True" in settings.split(","):
            return True
    return False


def kernel_device(device: torch.device | None = None) -> Device:
    """The card whose kernels a trace models: the CUDA ``device``'s (the current one), else the H100."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return H100
    props = torch.cuda.get_device_properties(device)
    return device_for(props.major, props.multi_processor_count, props.max_threads_per_multi_processor)


def start_history(max_entries: int) -> None:
    """Make the CUDA allocator record its history (allocations' Python stacks) for :func:`take_snapshot`."""
    # Python stacks only: C++ stacks would need symbolising (slow), and frees need no stack.
    torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=max_entries)


def stop_history() -> None:
    """Stop recording the allocator's history."""
    torch.cuda.memory._record_memory_history(enabled=None)


def take_snapshot() -> dict[str, Any]:
    """The allocator's snapshot: segments, blocks and the recorded history (what PyTorch's viewer reads)."""
    return torch.cuda.memory._snapshot()


def attach_oom_observer(observer: Callable[[int, int, int, int], None]) -> bool:
    """Have the CUDA allocator call ``observer(device, alloc, device_total, device_free)`` on raising an OOM.

    Returns whether this torch can (an observer stays attached for the life of the process).
    """
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None:
        return False
    attach(observer)
    return True


def release_to(probe: Probe, baseline: int | None, leftover_bytes: int, blind: bool = True) -> int | None:
    """Return the cache to the driver; collect garbage only where more than ``baseline`` is still allocated.

    A trial that ran out of memory can leave its tensors in reference cycles. The young generations are
    collected first (the cycles are new); the full collection runs only if that did not free them. A leftover
    of at most ``leftover_bytes`` (a few logged scalars) is left to Python's own collector: it cannot move a
    trial's peak. Where allocated bytes are not measurable (CPU), it collects fully if ``blind``, else not at
    all.

    Returns:
        What is still allocated after a full collection (``None`` when none ran or bytes are not measurable):
        the floor that further collections cannot go below.
    """
    start_clean(probe)
    for generation in (1, 2):
        allocated = probe.allocated_bytes()
        if allocated is None and not blind:
            return None
        if allocated is not None and baseline is not None and allocated <= baseline + leftover_bytes:
            return None
        gc.collect(generation)
        probe.release_cache()
    return probe.allocated_bytes()


def start_clean(probe: Probe) -> None:
    """Give every cached block back to the driver, the cuBLAS workspaces included.

    Then what runs next starts from the allocator layout of a fresh process, so a trial at a size predicts
    the fit at that size block for block. cuBLAS keeps one workspace (32 MiB on Hopper) per stream and
    thread, made by the first matrix product there and never freed. Made during a trial (the backward pass
    runs on its own thread, when large blocks are free), it sits inside a large segment, which
    ``empty_cache`` can then no longer release, and the next trial and the fit start from another layout: a
    size whose trial ran can then run out of memory in the fit.
    """
    if probe.device.type == "cuda":
        # private; what torch's own tests call
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
    probe.release_cache()
