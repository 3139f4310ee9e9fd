"""The report on the logs of a real CUDA run: its table equals what the allocator and NVML gave the monitor."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_gpumem import EmptyCacheOnThreshold, MemoryBudget, MemoryMonitor
from lightning_gpumem._core.units import GIB
from lightning_gpumem.report import load_runs, summarize
from tests.helpers.models import SpikeModule
from tests.helpers.trainer import quiet_trainer

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def test_report_of_a_cuda_run_matches_the_monitor(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=1, nvml_host_interval_s=0)
    release = EmptyCacheOnThreshold(threshold=0.5, min_steps_between=1)
    trainer = quiet_trainer(
        accelerator="cuda",
        devices=1,
        max_steps=20,
        val_check_interval=10,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=TensorBoardLogger(tmp_path, name="gpu"),
        callbacks=[MemoryBudget("4GiB"), release, monitor],
        log_every_n_steps=1,
    )
    trainer.fit(SpikeModule(spike_step=5, train_spike=GIB, val_spike=3 * GIB))
    (run,) = load_runs(tmp_path).runs
    summary = summarize(run)
    train_allocated, _ = monitor.peaks["train"]
    val_allocated, _ = monitor.peaks["val"]
    assert summary.stage_peaks["train"][0] == pytest.approx(train_allocated / GIB, rel=1e-6)
    assert summary.stage_peaks["train"][0] > 1.0  # the 1 GiB spike at step 5
    assert summary.stage_peaks["val"][0] == pytest.approx(val_allocated / GIB, rel=1e-6)
    assert summary.stage_peaks["val"][0] > 3.0
    assert summary.budget == pytest.approx(4.0)
    assert summary.cache_releases == release.releases >= 1
    assert summary.released == pytest.approx(release.released_bytes / GIB, rel=1e-6)
    assert summary.nvml_process_peak is not None
    assert summary.nvml_process_peak > max(
        run.values("gpumem/train_reserved_gib")
    )  # read at the same batch ends
    assert summary.non_torch_peak is not None
    assert 0.1 < summary.non_torch_peak < 2.0  # CUDA context and cuBLAS
    assert summary.logged_batches == 20
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_gpumem",
            "report",
            str(tmp_path),
            "--html",
            str(tmp_path / "r.html"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"budget\s+4\.0 GiB", result.stdout)
    print(result.stdout)
