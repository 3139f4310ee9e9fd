"""Real CUDA runs (`pytest -m gpu` on the GPU machine): the numbers come from the allocator and NVML."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_gpumem import MemoryMonitor, MemoryProbe
from lightning_gpumem._core.units import GIB
from tests.helpers.fakes import column, read_csv_metrics
from tests.helpers.models import SpikeModule
from tests.helpers.trainer import quiet_trainer

pytestmark = pytest.mark.gpu


def _fit(tmp_path: Path, module: LightningModule, monitor: MemoryMonitor, **kwargs) -> Trainer:
    options = dict(
        accelerator="gpu",
        devices=1,
        max_epochs=1,
        log_every_n_steps=1,
        logger=[CSVLogger(tmp_path / "csv"), TensorBoardLogger(tmp_path / "tb")],
        callbacks=[monitor],
        enable_model_summary=True,
    )
    trainer = quiet_trainer(**{**options, **kwargs})
    trainer.fit(module)
    return trainer


def test_one_gib_spike_shows_on_its_batch_only(tmp_path):
    k = 5
    monitor = MemoryMonitor()
    _fit(tmp_path, SpikeModule(spike_step=k), monitor, limit_val_batches=0)
    peaks = column(read_csv_metrics(tmp_path / "csv"), "gpumem/train_peak_allocated_gib")
    assert sorted(peaks) == list(range(10))
    assert peaks[k] - peaks[k - 1] == pytest.approx(1.0, abs=0.01)
    assert peaks[k] - peaks[k + 1] == pytest.approx(1.0, abs=0.01)
    assert peaks[k - 1] == pytest.approx(peaks[k + 1], abs=0.01)

    acc = EventAccumulator(str(next((tmp_path / "tb").rglob("events.out.tfevents.*"))))
    acc.Reload()
    tb = {e.step: e.value for e in acc.Scalars("gpumem/train_peak_allocated_gib")}
    assert tb == pytest.approx(peaks, rel=1e-6)
    assert monitor.peaks["train"][0] / GIB == pytest.approx(peaks[k], abs=1e-6)


def test_validation_peak_covers_the_loop(tmp_path):
    monitor = MemoryMonitor()
    _fit(tmp_path, SpikeModule(val_spike=2 * GIB), monitor, limit_train_batches=4, limit_val_batches=2)
    rows = read_csv_metrics(tmp_path / "csv")
    (val_peak,) = column(rows, "gpumem/val_peak_allocated_gib").values()
    train_peak = max(column(rows, "gpumem/train_peak_allocated_gib").values())
    assert val_peak >= 2.0
    assert train_peak < 1.0  # the validation spike does not leak into the training peaks
    assert monitor.peaks["val"][0] / GIB == pytest.approx(val_peak)


def test_nvml_and_device_wide_metrics_are_consistent(tmp_path):
    monitor = MemoryMonitor(verbose=True, nvml_host_interval_s=0)
    trainer = _fit(
        tmp_path,
        SpikeModule(),
        monitor,
        limit_train_batches=3,
        limit_val_batches=0,
        enable_progress_bar=True,
    )
    sample = monitor.last_sample
    total = torch.cuda.get_device_properties(0).total_memory
    free, cuda_total = torch.cuda.mem_get_info(0)
    assert sample.nvml_total_bytes == pytest.approx(total, rel=0.05)
    assert sample.nvml_used_bytes >= sample.reserved_bytes
    assert abs(sample.nvml_used_bytes - (cuda_total - free)) < GIB  # what nvidia-smi shows, as CUDA sees it
    assert 0 <= sample.gpu_util_pct <= 100
    if sample.nvml_process_bytes is not None:  # hidden when the container's PID namespace differs
        assert sample.nvml_process_bytes >= sample.reserved_bytes
        assert 0 < sample.non_torch_bytes < 4 * GIB
    rows = read_csv_metrics(tmp_path / "csv")
    assert column(rows, "gpumem/allocator/allocated_bytes.all.current")
    assert column(rows, "gpumem/nvml_used_gib")
    assert trainer.progress_bar_metrics["mem"].endswith(f"/{total / GIB:.1f} GiB")
    assert "NVIDIA" in monitor.summary_text
    assert "device total" in monitor.summary_text


def test_probe_peaks_match_torch():
    device = torch.device("cuda", 0)
    probe = MemoryProbe(device)
    probe.reset_peaks()
    x = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)
    del x
    allocated, reserved = probe.read_peaks()
    assert allocated == torch.cuda.max_memory_allocated(device)
    assert reserved == torch.cuda.max_memory_reserved(device)
    assert allocated - torch.cuda.memory_allocated(device) == 512 * 2**20
    stats = probe.allocator_stats()
    assert stats["allocated_bytes.all.peak"] == allocated
    assert stats == {k: v for k, v in torch.cuda.memory_stats(device).items() if k in stats}
