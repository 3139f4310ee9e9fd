"""A real CPU training run with TensorBoard and CSV loggers; the scalars are read back from the files."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_gpumem import MemoryMonitor
from tests.helpers.fakes import column, read_csv_metrics
from tests.helpers.trainer import quiet_trainer


def _scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    (event_file,) = Path(log_dir).rglob("events.out.tfevents.*")
    acc = EventAccumulator(str(event_file))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_cpu_run_logs_host_memory_to_tensorboard_and_csv(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=5, nvml_host_interval_s=0)
    trainer = quiet_trainer(
        max_epochs=2,
        limit_train_batches=10,
        limit_val_batches=2,
        logger=[TensorBoardLogger(tmp_path / "tb"), CSVLogger(tmp_path / "csv")],
        callbacks=[monitor],
        enable_progress_bar=True,
        enable_model_summary=True,
    )
    trainer.fit(BoringModel())

    scalars = _scalars(tmp_path / "tb")
    rss = scalars["gpumem/host_rss_gib"]
    assert sorted(rss) == [4, 9, 14, 19]
    now = psutil.Process().memory_info().rss / 2**30
    assert all(0.05 < v < now * 1.5 for v in rss.values())
    assert all(v > 0 for v in scalars["gpumem/host_available_gib"].values())
    assert not [tag for tag in scalars if "peak" in tag or "nvml" in tag]  # no accelerator: host memory only

    csv_rss = column(read_csv_metrics(tmp_path / "csv"), "gpumem/host_rss_gib")
    assert csv_rss == pytest.approx(rss, rel=1e-6)  # the same numbers reach every logger
    assert monitor.last_sample is not None
    assert monitor.last_sample.host_rss_bytes > 0
    assert "host RSS peak" in monitor.summary_text
    assert trainer.progress_bar_metrics["mem"].startswith("rss ")


def test_cpu_run_without_logger_or_psutil_reads_never_fails(tmp_path):
    monitor = MemoryMonitor(host=False, nvml=False)
    with pytest.warns(UserWarning, match="no logger"):
        quiet_trainer(max_steps=3, callbacks=[monitor], enable_model_summary=True).fit(BoringModel())
    assert monitor.peaks == {}
