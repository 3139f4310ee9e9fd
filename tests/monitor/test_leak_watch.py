"""MemoryMonitor's leak warning with a fake allocator: once, with its rate, and never on a healthy run."""

from __future__ import annotations

import random
import warnings

import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_gpumem import MemoryMonitor
from lightning_gpumem._core.leaks import EARLY_SAMPLES
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
        max_steps=steps,
        limit_val_batches=0,
        logger=CSVLogger(tmp_path),
        callbacks=[monitor],
        log_every_n_steps=10,
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
        _fit(
            tmp_path,
            monitor,
            SpikeModel(probe, train_spikes={s: (s % 7) * 50 * MIB for s in range(300)}),
            300,
        )
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


class SettlingModel(SpikeModel):
    """Allocated memory settles over the first steps (+0.5 MiB per step to step 60), then stays flat with noise."""

    def __init__(self, probe: FakeProbe, settle_steps: int = 60) -> None:
        super().__init__(probe)
        self.settle_steps = settle_steps
        self.rng = random.Random(0)
        self.held = 0  # the batch held at batch end: 0-2 MiB, varying

    def training_step(self, batch, batch_idx):
        if self.global_step < self.settle_steps:
            self.fake.allocate(MIB // 2)  # the allocator, optimizer state and caches warming up
        self.fake.free(self.held)
        self.held = self.rng.randrange(2 * MIB)
        self.fake.allocate(self.held)
        return super().training_step(batch, batch_idx)


class LateLeakModel(SpikeModel):
    """Healthy for `start` steps, then keeps `leak` bytes more of the fake allocator after every step."""

    def __init__(self, probe: FakeProbe, start: int, leak: int) -> None:
        super().__init__(probe)
        self.start, self.leak = start, leak

    def training_step(self, batch, batch_idx):
        if self.global_step >= self.start:
            self.fake.allocate(self.leak)
        return super().training_step(batch, batch_idx)


def test_no_leak_rate_is_logged_while_memory_settles_after_the_warm_up(tmp_path):
    """Issue 41: a run that does not leak logged 0.5 MiB/step over its first steps; now nothing, then the estimate.

    The estimate is what the whole history and its recent half both support, so the settle fades from it once the
    recent half is past it (the figures in docs/monitor.md).
    """
    probe = FakeProbe(base=GIB, total=24 * GIB)
    monitor = FakeMonitor(probe)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers).*")
        _fit(tmp_path, monitor, SettlingModel(probe), steps=400)
    assert monitor.leak is None
    rates = column(read_csv_metrics(tmp_path), "gpumem/leak_mib_per_step")
    early_phase_end = (
        10 + (EARLY_SAMPLES - 1) * 2
    )  # the detector's 32nd sample, after 10 warm-up steps: step 72
    assert not {step: rate for step, rate in rates.items() if step < early_phase_end}
    assert sorted(rates) == list(range(79, 400, 10))  # then at every logging step
    assert [round(rates[step], 2) for step in (79, 199, 379)] == [0.23, 0.0, 0.0]


def test_a_leak_rate_is_logged_from_its_verdict_on_when_flagged_early(tmp_path):
    probe = FakeProbe(base=GIB, total=24 * GIB)
    monitor = FakeMonitor(probe)
    with pytest.warns(UserWarning, match="keeps growing"):
        _fit(tmp_path, monitor, LeakyModel(probe, 4 * MIB), steps=100)
    assert monitor.leak is not None
    rates = column(read_csv_metrics(tmp_path), "gpumem/leak_mib_per_step")
    assert min(rates) >= monitor.leak.last_step  # nothing before the verdict, in the early phase
    assert list(rates.values()) == [pytest.approx(monitor.leak.bytes_per_step / MIB)] * len(rates)
    assert sorted(rates) == [s for s in range(9, 100, 10) if s >= monitor.leak.last_step]


def test_the_logged_rate_of_a_leak_that_starts_late_is_the_warnings(tmp_path):
    """Flagged on its recent samples at 2 MiB/step; the whole history's average (0.63) is not logged."""
    probe = FakeProbe(base=GIB, total=24 * GIB)
    monitor = FakeMonitor(probe)
    with pytest.warns(UserWarning, match=r"keeps growing, 2.00 MiB per step"):
        _fit(tmp_path, monitor, LateLeakModel(probe, start=300, leak=2 * MIB), steps=500)
    assert monitor.leak is not None
    rates = column(read_csv_metrics(tmp_path), "gpumem/leak_mib_per_step")
    after = [rate for step, rate in rates.items() if step >= monitor.leak.last_step]
    assert after
    assert after == [pytest.approx(2.0, rel=0.05)] * len(after)


def test_with_every_step_logged_no_rate_comes_before_the_history_spans_the_early_phase(tmp_path):
    # Every logging step adds a free sample, so the detector's 32nd sample came at step 41 (was: 0.46 MiB/step there)
    probe = FakeProbe(base=GIB, total=24 * GIB)
    monitor = FakeMonitor(probe)
    quiet_trainer(
        max_steps=200,
        limit_val_batches=0,
        logger=CSVLogger(tmp_path),
        callbacks=[monitor],
        log_every_n_steps=1,
    ).fit(SettlingModel(probe))
    rates = column(read_csv_metrics(tmp_path), "gpumem/leak_mib_per_step")
    assert min(rates) >= 10 + (EARLY_SAMPLES - 1) * 2  # the warm-up, then 62 steps of history
    assert max(rates.values()) < 0.5  # never more than the settle's own 0.5 MiB/step, which ended at step 60
    assert all(abs(rate) < 0.02 for step, rate in rates.items() if step >= 150)  # then noise about 0
