"""Leak detection: the detector on synthetic histories, and the census of live tensors it names."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_gpumem._core.leaks import EARLY_SAMPLES, LeakDetector, _rise, grown_tensors
from lightning_gpumem._core.units import GIB, MIB
from lightning_gpumem._hw.probe import tensor_census


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


def test_a_leak_that_starts_after_a_long_healthy_run_is_flagged_within_about_a_hundred_steps():
    values = [GIB] * 20_000 + [GIB + MIB * s for s in range(2_000)]
    step, verdict = _first_verdict(values)
    assert verdict is not None
    assert 20_000 < step <= 20_150


@pytest.mark.parametrize(
    ("start", "rate_mib"), [(1000, 0.1), (1000, 0.5), (3000, 0.2), (5000, 1.0), (20, 4.0)]
)
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


def test_no_rate_before_the_early_phase_is_over_then_what_both_halves_support():
    """Memory settling after the warm-up (+0.5 MiB/step to step 60) gives no rate until the 32nd sample (step 72),
    then the smaller of the whole history's and its recent half's rise: 0 once the recent half is flat."""
    detector = LeakDetector(warmup_steps=10, every=2)
    rates = {}
    for step in range(200):
        detector.add(step, GIB + int(min(step, 60) * MIB / 2))
        rates[step] = detector.rate()
    assert all(rate is None for step, rate in rates.items() if step < 10 + (EARLY_SAMPLES - 1) * 2)
    assert all(rates[step] is not None for step in range(72, 200))
    whole = _rise(detector.samples)[0]
    assert whole > 0.05 * MIB  # the whole history still holds the settle...
    assert detector.rate() == 0.0  # ...which stopped: its recent half is flat
    assert max(rates[step] for step in range(72, 200)) < rates[72] + 1  # never above the first rate logged
    assert detector.verdict() is None


def test_a_leak_flagged_in_the_early_phase_has_its_rate_from_the_verdict_on():
    detector = LeakDetector(warmup_steps=10, every=2)
    rates = []
    for step in range(72):  # the early phase: the 32nd sample is taken at step 72
        verdict = detector.add(step, GIB + 4 * MIB * step)
        rates.append(detector.rate())
        if verdict is not None:
            break
    assert verdict is not None
    assert rates[-1] == verdict.bytes_per_step == pytest.approx(4 * MIB)
    assert set(rates[:-1]) == {None}


def test_the_rate_after_a_verdict_is_the_verdicts_own():
    """A leak that starts late is flagged on its recent samples; the history's average would say a fifth of it."""
    detector = LeakDetector()
    for step in range(2000):
        verdict = detector.add(step, GIB + max(0, step - 400) * 2 * MIB)
        if verdict is not None:
            break
    assert verdict is not None
    assert _rise(detector.samples)[0] < verdict.bytes_per_step / 2
    assert detector.rate() == verdict.bytes_per_step == pytest.approx(2 * MIB, rel=0.05)
