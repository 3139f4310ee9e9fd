"""The one reader of the hardware: allocator counters, NVML and host memory, as a :class:`MemorySample`.

Everything else in the package receives samples and never reads memory from ``torch.cuda``,
``torch.accelerator``, NVML or ``psutil`` itself, so the callbacks can be tested on CPU with a fake probe and
a new backend is a matter of this module.

Why the CUDA path reads ``torch.cuda.memory_stats_as_nested_dict``: ``torch.cuda.memory_stats`` and
``torch.accelerator.memory_stats`` build the same C++ statistics and then flatten and sort ~120 keys in
Python, work the nested read skips. Other accelerators (XPU, MPS, ...) go through ``torch.accelerator`` where
the installed torch has it.

The callbacks get their probe from :func:`make_probe`, the one seam where another reader goes in (a fake in
the tests, through :func:`set_probe_factory`); what they may call is the :class:`Probe` protocol: its reads,
and two calls on the allocator, the cap (``set_memory_fraction``, CUDA only: ``MemoryBudget`` and the tuner's
and planner's trials) and ``release_cache``. Two rarer reads live here too: the census of live tensors
(:func:`tensor_census`, for leak reports) and the host memory available (:func:`host_available_bytes`, for
the tuner's in-memory copies). The allocator's history, snapshot and OOM observer (``OOMSnapshot``) and the
trials' clean start (cache and cuBLAS workspaces given back) are in ``allocator.py``; what an out-of-memory
error looks like is in ``oom.py``.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_gpumem._core.checks import require_flags
from lightning_gpumem._core.sample import MemorySample
from lightning_gpumem._hw.nvml import NvmlDevice, NvmlReading

try:
    import psutil
except ImportError:  # pragma: no cover - psutil is a declared dependency
    psutil = None


class Probe(Protocol):
    """What the callbacks read through (:class:`MemoryProbe`, or a fake in the tests)."""

    device: torch.device
    has_allocator: bool

    @property
    def device_name(self) -> str:
        """The device's name, e.g. ``NVIDIA H200``."""

    def total_bytes(self) -> int | None:
        """The device's memory in bytes (``None`` where unknown)."""

    def usable_bytes(self) -> int | None:
        """Free device memory plus what the allocator holds, in bytes."""

    def set_memory_fraction(self, fraction: float) -> float:
        """Cap the allocator at ``fraction`` of the device; returns the previous fraction."""

    def release_cache(self) -> None:
        """Give the allocator's unused cached memory back to the driver."""

    def reset_peaks(self) -> None:
        """Start a new peak window."""

    def allocated_bytes(self) -> int | None:
        """Memory held by tensors now, in bytes."""

    def reserved_bytes(self) -> int | None:
        """Memory held by the allocator now, in bytes."""

    def read_peaks(self) -> tuple[int | None, int | None]:
        """Peak allocated and reserved bytes since the last reset."""

    def read(self, *, nvml: bool = True, host: bool = True) -> MemorySample:
        """Everything the probe can see."""

    def allocator_stats(self) -> dict[str, int]:
        """The allocator's statistics, flattened."""


ProbeFactory = Callable[[torch.device, object, bool, bool], Probe]
"""``factory(device, owner, nvml, host)``: the probe the callback ``owner`` reads ``device`` through."""


def default_probe_factory(device: torch.device, owner: object, nvml: bool, host: bool) -> Probe:
    """A :class:`MemoryProbe` for ``device``."""
    return MemoryProbe(device, nvml=nvml, host=host)


_factory: ProbeFactory = default_probe_factory


def make_probe(device: torch.device, owner: object, *, nvml: bool = False, host: bool = False) -> Probe:
    """The probe ``owner`` (a callback) reads ``device`` through.

    It reads NVML and host memory only where asked to.
    """
    return _factory(device, owner, nvml, host)


def set_probe_factory(factory: ProbeFactory | None) -> ProbeFactory:
    """Make :func:`make_probe` use ``factory`` (``None``: the default); returns the factory it replaces."""
    global _factory
    previous, _factory = _factory, factory or default_probe_factory
    return previous


class MemoryProbe:
    """Reads a :class:`MemorySample` for one device.

    Args:
        device: the device to watch: a ``torch.device``, or what ``torch.device`` takes (``"cuda:0"``,
            ``"cpu"``, a device index); ``cpu`` gives host fields only. It also works under Lightning Fabric:
            ``MemoryProbe(fabric.device)``.
        nvml: read NVML (CUDA only). Off or failing, the NVML fields are ``None``.
        host: read host memory with ``psutil``.

    Raises:
        TypeError: if ``device`` is of another type, or ``nvml``/``host`` is not a ``bool``.
        ValueError: if ``device`` names no device, or a CUDA device that this torch build or machine does not
            have.

    Example:
        >>> probe = MemoryProbe(torch.device("cpu"))
        >>> probe.has_allocator, probe.read().host_rss_bytes > 0
        (False, True)
    """

    def __init__(self, device: torch.device | str | int, *, nvml: bool = True, host: bool = True) -> None:
        device = _device(device)
        require_flags("MemoryProbe", nvml=nvml, host=host)
        self.device = device
        self.has_allocator = _has_allocator_stats(device)
        self._accelerator_api = self.has_allocator and device.type != "cuda"
        self._nvml: NvmlDevice | None = None
        if nvml and device.type == "cuda":
            uuid = getattr(torch.cuda.get_device_properties(_index(device)), "uuid", None)
            self._nvml = NvmlDevice.open(str(uuid)) if uuid is not None else None
        self._process = psutil.Process() if host and psutil is not None else None
        self._stats_failed = False

    @property
    def device_name(self) -> str:
        """Human-readable device name (``"NVIDIA H200"``, ``"cpu"``)."""
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(_index(self.device))
        return self.device.type

    def total_bytes(self) -> int | None:
        """Memory of the device in bytes (the MIG instance's under MIG), ``None`` on CPU."""
        if self.device.type == "cuda":
            return int(torch.cuda.get_device_properties(_index(self.device)).total_memory)
        if self._accelerator_api:
            try:
                return int(torch.accelerator.get_memory_info(_index(self.device))[1])
            except Exception:
                return None
        return None

    def usable_bytes(self) -> int | None:
        """Device memory this process's allocator can hold: what it reserves plus what is free, in bytes."""
        if self.device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free) + int(torch.cuda.memory_reserved(self.device))

    def set_memory_fraction(self, fraction: float) -> float:
        """Cap this process's allocator at ``fraction`` of the device; returns the previous cap.

        Allocations past the cap raise ``torch.OutOfMemoryError`` as on a smaller card. CUDA only. Torch
        before 2.6 cannot report the previous cap; 1.0 (no cap) is returned then.
        """
        if self.device.type != "cuda":
            raise RuntimeError(f"A memory cap needs a CUDA device, not `{self.device}`.")
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        previous = float(getter(self.device)) if getter is not None else 1.0
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)
        return previous

    def release_cache(self) -> None:
        """Return cached, unused blocks to the driver (``empty_cache``)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        elif self._accelerator_api:
            torch.accelerator.empty_cache()

    def reset_peaks(self) -> None:
        """Start a new peak window: ``peak_*`` of later samples cover only what happens from now on."""
        if not self.has_allocator:
            return
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._accelerator_api:
            torch.accelerator.reset_peak_memory_stats(_index(self.device))

    def allocated_bytes(self) -> int | None:
        """Memory held by tensors now, in bytes (``None`` without allocator statistics)."""
        return _stat(self._stats(), "allocated_bytes.all.current")

    def reserved_bytes(self) -> int | None:
        """Memory held by the caching allocator now, in bytes (``None`` without allocator statistics)."""
        return _stat(self._stats(), "reserved_bytes.all.current")

    def read_peaks(self) -> tuple[int | None, int | None]:
        """Peak allocated and peak reserved bytes since the last reset (cheaper than :meth:`read`)."""
        stats = self._stats()
        return _stat(stats, "allocated_bytes.all.peak"), _stat(stats, "reserved_bytes.all.peak")

    def read(self, *, nvml: bool = True, host: bool = True) -> MemorySample:
        """Read everything this probe can see."""
        stats = self._stats()
        reading = self._nvml.read() if nvml and self._nvml is not None else NvmlReading()
        rss = available = None
        if host and self._process is not None:
            try:
                rss = int(self._process.memory_info().rss)
                available = int(psutil.virtual_memory().available)
            except Exception as err:  # psutil.AccessDenied in some sandboxes
                self._process = None
                rank_zero_warn(
                    f"lightning_gpumem: host memory unavailable ({err!r}); host_* metrics are off."
                )
        return MemorySample(
            allocated_bytes=_stat(stats, "allocated_bytes.all.current"),
            reserved_bytes=_stat(stats, "reserved_bytes.all.current"),
            peak_allocated_bytes=_stat(stats, "allocated_bytes.all.peak"),
            peak_reserved_bytes=_stat(stats, "reserved_bytes.all.peak"),
            alloc_retries=_stat(stats, "num_alloc_retries"),
            num_ooms=_stat(stats, "num_ooms"),
            inactive_split_bytes=_stat(stats, "inactive_split_bytes.all.current"),
            nvml_used_bytes=reading.used_bytes,
            nvml_total_bytes=reading.total_bytes,
            nvml_process_bytes=reading.process_bytes,
            gpu_util_pct=reading.gpu_util_pct,
            host_rss_bytes=rss,
            host_available_bytes=available,
        )

    def allocator_stats(self) -> dict[str, int]:
        """The allocator's statistics, flattened (``"allocated_bytes.all.peak"``: value); empty on CPU."""
        if not self.has_allocator:
            return {}
        flat: dict[str, int] = {}
        _flatten("", self._stats(), flat)
        return flat

    def _stats(self) -> Mapping[str, Any]:
        if not self.has_allocator or self._stats_failed:
            return {}
        try:
            if self.device.type == "cuda":
                return torch.cuda.memory_stats_as_nested_dict(self.device)
            return torch.accelerator.memory_stats(_index(self.device))
        except Exception as err:  # e.g. a backend whose allocator keeps no statistics
            self._stats_failed = True
            rank_zero_warn(f"lightning_gpumem: allocator statistics unavailable on {self.device} ({err!r}).")
            return {}


def _device(value: object) -> torch.device:
    """``value`` as a ``torch.device`` that exists here, or a ``TypeError``/``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, (torch.device, str, int)):
        raise TypeError(
            f"`MemoryProbe(device={value!r})` is not valid. Expected a torch.device, a device string such as"
            " 'cuda:0' or 'cpu', or a device index."
        )
    try:
        device = value if isinstance(value, torch.device) else torch.device(value)
    except (RuntimeError, ValueError) as error:  # "gpu", -1, an index with no accelerator
        raise ValueError(f"`MemoryProbe(device={value!r})` is not valid: {error}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            )
            raise ValueError(
                f"`MemoryProbe(device={value!r})` is not valid: {why}. Expected a device that exists."
            )
        count = torch.cuda.device_count()
        if device.index is not None and not 0 <= device.index < count:
            raise ValueError(
                f"`MemoryProbe(device={value!r})` is not valid: this machine has {count} CUDA device(s)."
                f" Expected an index in 0..{count - 1}."
            )
    return device


def _index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    if device.type == "cuda":
        return torch.cuda.current_device()
    return torch.accelerator.current_device_index()


def _accelerator_memory_api() -> Any:
    accelerator = getattr(torch, "accelerator", None)
    return accelerator if accelerator is not None and hasattr(accelerator, "memory_stats") else None


def _has_allocator_stats(device: torch.device) -> bool:
    if device.type == "cpu":
        return False
    if device.type == "cuda":
        return torch.cuda.is_available()
    accelerator = _accelerator_memory_api()
    return accelerator is not None and accelerator.is_available()


def _stat(stats: Mapping[str, Any], key: str) -> int | None:
    """Read ``"a.b.c"`` from flat (``torch.accelerator``) or nested (``torch.cuda``) statistics."""
    if key in stats:
        return int(stats[key])
    node: Any = stats
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return int(node)


def _flatten(prefix: str, node: Any, out: dict[str, int]) -> None:
    if isinstance(node, Mapping):
        for key, value in node.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), value, out)
    else:
        out[prefix] = int(node)


# ----------------------------------------------------------------------------------------------- rarer reads
def tensor_census(device: torch.device) -> Counter[tuple[tuple[int, ...], str]]:
    """Bytes of live tensors on ``device`` by (shape, dtype): a ``gc`` scan, for rare use only."""
    census: Counter[tuple[tuple[int, ...], str]] = Counter()
    for obj in gc.get_objects():
        # `type() in`, not isinstance: some proxy objects raise from isinstance checks.
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device == device:
            census[(tuple(obj.shape), str(obj.dtype).replace("torch.", ""))] += (
                obj.numel() * obj.element_size()
            )
    return census


def host_available_bytes() -> int | None:
    """Host memory available to new allocations, in bytes (``None`` where ``psutil`` cannot say)."""
    try:
        return int(psutil.virtual_memory().available)
    except Exception:
        return None
