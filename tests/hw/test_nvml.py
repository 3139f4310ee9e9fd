"""NVML on a fake `pynvml` module: the device found by its UUID (GPU or MIG); each failure a None and a warning."""

from __future__ import annotations

import os
import sys
import types
import warnings

import pytest

from lightning_gpumem._hw.nvml import NvmlDevice, uuid_candidates


def test_uuid_candidates_cover_gpu_and_mig():
    assert uuid_candidates("abc") == ["GPU-abc", "MIG-abc"]
    assert uuid_candidates("GPU-abc") == ["GPU-abc"]


class _Proc:
    def __init__(self, pid, used):
        self.pid, self.usedGpuMemory = pid, used


def _fake_pynvml(*, init_error=None, pid=None, util_error=None, known_uuid="MIG-abc"):
    mod = types.ModuleType("pynvml")

    def init():
        if init_error:
            raise init_error

    def by_uuid(uuid):
        if uuid != known_uuid:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return "handle"

    def util(handle):
        if util_error:
            raise util_error
        return types.SimpleNamespace(gpu=37)

    mod.nvmlInit = init
    mod.nvmlDeviceGetHandleByUUID = by_uuid
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=3 * 2**30, total=10 * 2**30)
    mod.nvmlDeviceGetComputeRunningProcesses = lambda h: [_Proc(1, 5), _Proc(pid or os.getpid(), 2**30)]
    mod.nvmlDeviceGetUtilizationRates = util
    return mod


def test_nvml_finds_a_mig_instance_by_uuid_and_reads_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    device = NvmlDevice.open("abc")
    assert device is not None
    assert device.uuid == "MIG-abc"
    reading = device.read()
    assert (reading.used_bytes, reading.total_bytes) == (3 * 2**30, 10 * 2**30)
    assert reading.process_bytes == 2**30
    assert reading.gpu_util_pct == 37.0


def test_nvml_missing_gives_none_and_one_warning(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    with pytest.warns(UserWarning, match="nvidia-ml-py"):
        assert NvmlDevice.open("abc") is None


def test_nvml_init_failure_gives_none_and_one_warning(monkeypatch):
    monkeypatch.setitem(
        sys.modules, "pynvml", _fake_pynvml(init_error=RuntimeError("NVML_ERROR_NO_PERMISSION"))
    )
    with pytest.warns(UserWarning, match="NVML could not start.*NO_PERMISSION"):
        assert NvmlDevice.open("abc") is None


def test_unknown_uuid_gives_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(known_uuid="GPU-other"))
    with pytest.warns(UserWarning, match="no device with UUID abc"):
        assert NvmlDevice.open("abc") is None


def test_hidden_pid_and_unsupported_util_warn_once_each(monkeypatch):
    monkeypatch.setitem(
        sys.modules, "pynvml", _fake_pynvml(pid=-1, util_error=RuntimeError("NVML_ERROR_NOT_SUPPORTED"))
    )
    device = NvmlDevice.open("abc")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            reading = device.read()
    assert reading.process_bytes is None
    assert reading.gpu_util_pct is None
    assert reading.used_bytes == 3 * 2**30  # what works still works
    messages = [str(w.message) for w in record]
    assert len(messages) == 2, messages
    assert any("not this one" in m for m in messages)
    assert any("NOT_SUPPORTED" in m for m in messages)
