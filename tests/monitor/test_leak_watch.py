"""MemoryMonitor's leak warning with a fake allocator: once, with its rate, and never on a healthy run."""

from __future__ import annotations

import warnings

import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_gpumem import MemoryMonitor
from lightning_gpumem._core.units import GIB, MIB
from tests.helpers.fakes import FakeMonitor, FakeProbe, SpikeModel, column, read_csv_metrics
from tests.helpers.trainer import quiet_trainer


class LeakyModel(SpikeModel):
    """Keeps 4 MiB more of the fake allocator after every step (a list of losses with their graphs)."""

    def __init__(self, probe: FakeProbe, leak: int) -> None:
        super().__init__(probe)
        self.leak = leak

    def training_step(self, batch, batch_idx):
        self.fake.allocate(self.leak)
        return super().training_step(batch, batch_idx)


def _fit(tmp_path, monitor, model, steps):
    quiet_trainer(
        max_steps=steps, limit_val_batches=0, logger=CSVLogger(tmp_path), callbacks=[monitor], log_every_n_steps=10
    ).fit(model)


def test_monitor_warns_once_about_a_leak_and_logs_its_rate(tmp_path):
    probe = FakeProbe(base=GIB, total=24 * GIB)
    monitor = FakeMonitor(probe)
    with pytest.warns(UserWarning, match=r"allocated memory keeps growing, 4.00 MiB per step") as record:
        _fit(tmp_path, monitor, LeakyModel(probe, 4 * MIB), steps=60)
    messages = [str(w.message) for w in record if "keeps growing" in str(w.message)]
    assert len(messages) == 1
    assert "budget runs out near step" in messages[0]
    assert monitor.leak is not None
    assert monitor.leak.last_step <= 50
    rates = column(read_csv_metrics(tmp_path), "gpumem/leak_mib_per_step")
    assert rates[59] == pytest.approx(4.0, rel=0.05)


def test_monitor_stays_quiet_on_a_healthy_run(tmp_path):
    probe = FakeProbe(base=GIB, total=24 * GIB)
    monitor = FakeMonitor(probe)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers).*")
        _fit(tmp_path, monitor, SpikeModel(probe, train_spikes={s: (s % 7) * 50 * MIB for s in range(300)}), 300)
    assert monitor.leak is None


def test_leak_detection_can_be_switched_off(tmp_path):
    probe = FakeProbe(base=GIB, total=24 * GIB)
    monitor = FakeMonitor(probe, detect_leaks=False)
    _fit(tmp_path, monitor, LeakyModel(probe, 4 * MIB), steps=60)
    assert monitor.leak is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"leak_threshold_mib": 0}, r"leak_threshold_mib=0"),
        ({"leak_warmup_steps": -1}, r"leak_warmup_steps=-1"),
        ({"detect_leaks": "yes"}, r"detect_leaks='yes'"),
    ],
)
def test_leak_arguments_are_validated(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=r"MemoryMonitor\(" + match):
        MemoryMonitor(**kwargs)
