"""The probe layer on CPU: host memory, the sample record, allocator statistics, the device it takes."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_gpumem import MemoryProbe, MemorySample
from lightning_gpumem._hw.probe import _stat


def test_cpu_probe_reads_host_memory_only():
    probe = MemoryProbe(torch.device("cpu"))
    sample = probe.read()
    assert not probe.has_allocator
    assert sample.allocated_bytes is None
    assert sample.peak_allocated_bytes is None
    assert sample.nvml_used_bytes is None
    import psutil

    rss = psutil.Process().memory_info().rss
    assert abs(sample.host_rss_bytes - rss) < 256 * 1024**2
    assert 0 < sample.host_available_bytes <= psutil.virtual_memory().total
    probe.reset_peaks()  # a no-op, not an error
    assert probe.read_peaks() == (None, None)
    assert probe.allocator_stats() == {}
    assert probe.total_bytes() is None


def test_host_reading_can_be_disabled():
    sample = MemoryProbe(torch.device("cpu"), host=False).read()
    assert sample.host_rss_bytes is None
    assert sample.host_available_bytes is None


def test_sample_is_frozen_and_derives_non_torch_share():
    sample = MemorySample(reserved_bytes=10, nvml_process_bytes=25)
    assert sample.non_torch_bytes == 15
    assert MemorySample(reserved_bytes=30, nvml_process_bytes=25).non_torch_bytes == 0
    assert MemorySample(reserved_bytes=30).non_torch_bytes is None
    assert sample.as_dict()["non_torch_bytes"] == 15
    with pytest.raises(AttributeError):
        sample.reserved_bytes = 3  # type: ignore[misc]


def test_stat_reads_flat_and_nested_statistics():
    nested = {"allocated_bytes": {"all": {"current": 5, "peak": 9}}, "num_ooms": 2}
    flat = {"allocated_bytes.all.current": 5, "num_ooms": 2}
    assert _stat(nested, "allocated_bytes.all.peak") == 9
    assert _stat(flat, "allocated_bytes.all.current") == _stat(nested, "allocated_bytes.all.current") == 5
    assert _stat(nested, "num_ooms") == 2
    assert _stat(nested, "reserved_bytes.all.current") is None


def test_host_reading_failure_warns_once_and_turns_host_fields_off(monkeypatch):
    probe = MemoryProbe(torch.device("cpu"))

    def denied():
        raise PermissionError("/proc/self/statm")

    monkeypatch.setattr(probe._process, "memory_info", denied)
    with pytest.warns(UserWarning, match="host memory unavailable"):
        first = probe.read()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = probe.read()
    assert first.host_rss_bytes is None
    assert second.host_rss_bytes is None


def test_the_device_may_be_given_as_torch_device_takes_it():
    assert MemoryProbe("cpu").device == MemoryProbe(torch.device("cpu")).device == torch.device("cpu")
    with pytest.raises(
        TypeError, match=r"`MemoryProbe\(device=None\)` is not valid. Expected a torch.device"
    ):
        MemoryProbe(None)  # was: AttributeError: 'NoneType' object has no attribute 'type'
    with pytest.raises(ValueError, match=r"`MemoryProbe\(device='gpu'\)` is not valid"):
        MemoryProbe("gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
@pytest.mark.parametrize("device", [torch.device("cuda"), "cuda:0", 0])
def test_a_cuda_device_without_cuda_is_refused_by_name(device):
    with pytest.raises(ValueError, match=r"`MemoryProbe\(device=.*\)` is not valid: "):
        MemoryProbe(
            device
        )  # was: AssertionError: Torch not compiled with CUDA enabled (AttributeError for 0)


def test_a_probe_reads_memory_under_fabric():
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    probe = MemoryProbe(fabric.device)
    probe.reset_peaks()
    assert probe.read().host_rss_bytes > 0
    assert probe.read_peaks() == (None, None)  # CPU: host memory only; on a GPU the allocator's peaks too
