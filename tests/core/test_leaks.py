"""Leak detection: the detector on synthetic histories, and MemoryMonitor's warning with a fake allocator."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

from lightning_gpumem import MemoryMonitor
from lightning_gpumem._core.leaks import LeakDetector, grown_tensors
from lightning_gpumem._core.units import GIB, MIB
from lightning_gpumem._hw.probe import tensor_census
from tests._fakes import FakeMonitor, FakeProbe, SpikeModel, column, read_csv_metrics


def _first_verdict(values, **kwargs):
    detector = LeakDetector(**kwargs)
    for step, value in enumerate(values):
        verdict = detector.add(step, int(value))
        if verdict is not None:
            return step, verdict
    return None, None


def test_a_steady_leak_is_flagged_early_with_its_rate():
    step, verdict = _first_verdict([GIB + 4 * MIB * s for s in range(50)])
    assert step is not None
    assert step <= 40
    assert verdict.bytes_per_step == pytest.approx(4 * MIB, rel=0.05)
    assert verdict.growth_bytes > 32 * MIB


@pytest.mark.parametrize("seed", range(10))
def test_varying_batch_shapes_are_not_a_leak(seed):
    rng = random.Random(seed)  # the batch held at batch end: 0 to 80 MiB, shapes vary at random
    values = [GIB + rng.uniform(0, 80 * MIB) for _ in range(300)]
    assert _first_verdict(values) == (None, None)


def test_three_hundred_noisy_runs_of_a_thousand_steps_raise_no_alarm():
    """The docs' claim: 0-80 MiB of random per-batch variation over 300 runs of 1000 steps, no alarm."""
    alarms = 0
    for seed in range(300):
        rng = random.Random(1000 + seed)
        alarms += _first_verdict([GIB + rng.uniform(0, 80 * MIB) for _ in range(1000)]) != (None, None)
    assert alarms == 0


def test_one_jump_that_stays_is_not_a_leak():
    values = [GIB] * 60 + [GIB + 500 * MIB] * 240  # e.g. a buffer allocated once at step 60
    assert _first_verdict(values) == (None, None)


def test_a_slow_leak_is_flagged_once_it_has_grown_past_the_threshold():
    step, verdict = _first_verdict([GIB + 0.2 * MIB * s for s in range(2000)])
    assert verdict is not None
    assert step > 150  # 32 MiB at 0.2 MiB per step takes that long
    assert verdict.bytes_per_step == pytest.approx(0.2 * MIB, rel=0.1)


def test_a_leak_that_starts_late_is_flagged():
    values = [GIB] * 400 + [GIB + 2 * MIB * s for s in range(400)]
    step, verdict = _first_verdict(values)
    assert verdict is not None
    assert step > 400


def test_history_is_thinned_but_spans_the_run():
    detector = LeakDetector(warmup_steps=0, every=1, max_samples=16)
    for step in range(1000):
        detector.add(step, GIB)
    assert len(detector.samples) <= 16
    assert detector.samples[0][0] == 0
    assert detector.samples[-1][0] > 900


def test_tensor_census_groups_live_tensors_by_shape_and_dtype():
    before = tensor_census(torch.device("cpu"))
    kept = [torch.zeros(7, 13) for _ in range(3)]
    after = tensor_census(torch.device("cpu"))
    assert after[((7, 13), "float32")] - before.get(((7, 13), "float32"), 0) == 3 * 7 * 13 * 4
    assert "float32[7, 13] +0.0 MiB" in grown_tensors(before, after)
    del kept


# ---------------------------------------------------------------------------------------------------- monitor
class LeakyModel(SpikeModel):
    """Keeps 4 MiB more of the fake allocator after every step (a list of losses with their graphs)."""

    def __init__(self, probe: FakeProbe, leak: int) -> None:
        super().__init__(probe)
        self.leak = leak

    def training_step(self, batch, batch_idx):
        self.fake.allocate(self.leak)
        return super().training_step(batch, batch_idx)


def _fit(tmp_path, monitor, model, steps):
    Trainer(
        accelerator="cpu",
        max_steps=steps,
        limit_val_batches=0,
        logger=CSVLogger(tmp_path),
        callbacks=[monitor],
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
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


def test_a_leak_that_starts_after_a_long_healthy_run_is_flagged_within_about_a_hundred_steps():
    values = [GIB] * 20_000 + [GIB + MIB * s for s in range(2_000)]
    step, verdict = _first_verdict(values)
    assert verdict is not None
    assert 20_000 < step <= 20_150


@pytest.mark.parametrize(("start", "rate_mib"), [(1000, 0.1), (1000, 0.5), (3000, 0.2), (5000, 1.0), (20, 4.0)])
def test_a_verdict_comes_on_a_later_sample_than_the_suspicion(start, rate_mib):
    """The census of live tensors is taken at the suspicion: a verdict on the same sample would compare it to itself."""
    detector = LeakDetector(warmup_steps=0, every=2, threshold_bytes=32 * MIB)
    verdict_step = suspected_on = None
    for step in range(start + 5000):
        allocated = GIB + int(max(0, step - start) * rate_mib * MIB)
        if not detector.wants(step):
            continue
        verdict = detector.add(step, allocated)
        if suspected_on is None and detector.suspected_at is not None:
            suspected_on = step  # the sample at which the caller takes its census
        if verdict is not None:
            verdict_step = step
            break
    assert verdict_step is not None
    assert suspected_on is not None
    assert suspected_on < verdict_step
