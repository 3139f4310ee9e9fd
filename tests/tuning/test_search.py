"""The pure batch-size search on synthetic memory curves: every answer is known exactly."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from lightning_gpumem.tuning.search import (
    Move,
    Proposal,
    SearchResult,
    Trial,
    accepted,
    search_batch_size,
    search_by_plan,
    walk_down,
)

GIB = 2**30
CARD = 24 * GIB


def curve(
    fixed: float, per_sample: float, card: int = CARD, noise: float = 0.0, step: int = 0, seed: int = 0
):
    """A run_trial whose peak is `fixed + per_sample * bs` (+ noise, rounded up to `step`); OOM above `card`."""
    rng = random.Random(seed)
    calls = []

    def run(bs: int) -> Trial:
        calls.append(bs)
        peak = fixed + per_sample * bs + rng.uniform(-noise, noise)
        if step:
            peak = math.ceil(peak / step) * step
        peak = int(peak)
        return Trial(bs, fits=peak <= card, peak_bytes=peak if peak <= card else None)

    run.calls = calls  # type: ignore[attr-defined]
    return run


def true_max(run, limit: int, upper: int) -> int:
    """Brute force over a fresh copy of the curve."""
    best = 0
    for bs in range(1, upper + 1):
        t = run(bs)
        if t.fits and t.peak_bytes <= limit:
            best = bs
    return best


@pytest.mark.parametrize(
    ("fixed", "per_sample"),
    [(3.2 * GIB, 0.5 * GIB), (1 * GIB, 0.01 * GIB), (20 * GIB, 0.3 * GIB), (0.1 * GIB, 3 * GIB)],
)
def test_affine_curve_is_solved_exactly_in_few_trials(fixed, per_sample):
    limit = int(0.95 * CARD)
    run = curve(fixed, per_sample)
    result = search_batch_size(run, init_val=2, upper=100_000, limit_bytes=limit)
    assert result.batch_size == true_max(curve(fixed, per_sample), limit, 3000)
    assert len(result.trials) <= 5
    assert result.num_ooms <= 1
    assert len(set(run.calls)) == len(run.calls)  # never the same size twice


def test_result_is_always_a_size_that_was_run_and_accepted():
    limit = int(0.95 * CARD)
    for seed in range(20):
        run = curve(2 * GIB, 0.37 * GIB, noise=0.05 * GIB, seed=seed)
        result = search_batch_size(run, upper=10_000, limit_bytes=limit)
        (chosen,) = [t for t in result.trials if t.batch_size == result.batch_size]
        assert chosen.fits
        assert chosen.peak_bytes <= limit


def test_noisy_curve_lands_within_one_or_two_of_the_best():
    limit = int(0.95 * CARD)
    for seed in range(20):
        result = search_batch_size(
            curve(2 * GIB, 0.37 * GIB, noise=0.05 * GIB, seed=seed), upper=10_000, limit_bytes=limit
        )
        best = true_max(curve(2 * GIB, 0.37 * GIB, noise=0.05 * GIB, seed=seed), limit, 200)
        assert best - 2 <= result.batch_size <= best + 1  # noise: a neighbour may measure under the limit
        assert len(result.trials) <= 8


def test_step_shaped_curve_is_bracketed():
    limit = int(0.95 * CARD)
    run = curve(1 * GIB, 0.21 * GIB, step=2 * GIB)  # allocator rounding into 2 GiB steps
    result = search_batch_size(run, upper=10_000, limit_bytes=limit)
    assert result.batch_size == true_max(curve(1 * GIB, 0.21 * GIB, step=2 * GIB), limit, 300)
    assert len(result.trials) <= 10


def test_always_fail_reports_nothing_fits():
    run = curve(30 * GIB, GIB)  # weights alone exceed the card
    result = search_batch_size(run, init_val=16, upper=1000, limit_bytes=CARD)
    assert result.batch_size is None
    assert result.reason == "nothing_fits"
    assert run.calls[-1] == 1
    assert all(not t.fits for t in result.trials)


def test_never_fail_without_peaks_doubles_to_the_upper_bound():
    calls = []

    def run(bs):
        calls.append(bs)
        return Trial(bs, fits=True)  # CPU: no peak, no OOM

    result = search_batch_size(run, init_val=2, upper=100)
    assert result.batch_size == 100
    assert result.reason == "upper_bound"
    assert calls == [2, 4, 8, 16, 32, 64, 100]


def test_dataset_smaller_than_init_val_is_clamped():
    result = search_batch_size(curve(GIB, 0.01 * GIB), init_val=64, upper=10, limit_bytes=CARD)
    assert result.batch_size == 10
    assert result.reason == "upper_bound"
    assert [t.batch_size for t in result.trials] == [10]


def test_pass_fail_only_bisects_to_the_exact_boundary():
    def run(bs):
        return Trial(bs, fits=bs <= 53)

    result = search_batch_size(run, init_val=2, upper=10_000)
    assert result.batch_size == 53
    assert result.reason == "bracketed"


def test_oom_at_init_val_goes_down_guided_by_the_limit():
    run = curve(2 * GIB, 1 * GIB)
    result = search_batch_size(run, init_val=256, upper=10_000, limit_bytes=int(0.95 * CARD))
    assert result.batch_size == true_max(curve(2 * GIB, 1 * GIB), int(0.95 * CARD), 100)
    assert run.calls[0] == 256


def test_max_trials_returns_the_best_so_far():
    def run(bs):
        return Trial(bs, fits=bs <= 1000)

    result = search_batch_size(run, init_val=1, upper=10**6, max_trials=4)
    assert result.reason == "max_trials"
    assert result.batch_size == 8
    assert len(result.trials) == 4


def test_upper_must_be_positive():
    with pytest.raises(ValueError, match="upper=0"):
        search_batch_size(lambda bs: Trial(bs, True), upper=0)


def test_small_per_sample_memory_under_allocator_granularity_still_converges():
    """0.6 GiB fixed, 0.11 MiB per sample, peaks rounded to 20 MiB: flat at first, a line only at large sizes."""
    limit = int(0.95 * 2 * GIB)
    run = curve(0.6 * GIB, 0.11 * 2**20, card=2 * GIB, step=20 * 2**20)
    result = search_batch_size(run, init_val=2, upper=32768, limit_bytes=limit)
    best = true_max(curve(0.6 * GIB, 0.11 * 2**20, card=2 * GIB, step=20 * 2**20), limit, 32768)
    assert best - 200 <= result.batch_size <= best  # within one allocator step of the best
    assert len(result.trials) <= 14
    assert result.reason != "max_trials"


def test_a_line_that_underestimates_does_not_crawl_one_size_per_trial():
    """Peaks measured high at small sizes (workspaces), then flat: the line says 'stop' too early."""

    def run(bs):
        peak = int(10 * GIB + (2 * GIB if bs < 8 else 0) + bs * 0.01 * GIB)
        return Trial(bs, fits=peak <= 24 * GIB, peak_bytes=peak)

    result = search_batch_size(run, init_val=2, upper=100_000, limit_bytes=int(0.95 * 24 * GIB))
    best = true_max(run, int(0.95 * 24 * GIB), 3000)
    assert 0.99 * best <= result.batch_size <= best  # the default tolerance: within 1% of the boundary
    assert len(result.trials) <= 12


def test_quantised_peaks_near_the_limit_do_not_crawl_one_size_per_trial():
    """As measured on the H200 (2 GiB budget, 38M-parameter MLP): 786 MiB fixed, 0.092 MiB per sample, and peaks
    that move in ~14 MiB steps near the limit, so the line through the two largest points is flat or steep."""
    mib = 2**20
    limit = int(0.95 * 2 * GIB)

    def run(bs):
        peak = int(786 * mib + math.ceil(bs * 0.092 / 14) * 14 * mib)
        return Trial(bs, fits=peak <= 2 * GIB, peak_bytes=peak)

    best = true_max(run, limit, 20_000)
    result = search_batch_size(run, init_val=2, upper=32768, limit_bytes=limit)
    assert best * 0.99 <= result.batch_size <= best
    assert len(result.trials) <= 12


def test_tolerance_zero_bisects_to_the_exact_boundary_and_the_default_stops_within_one_percent():
    def run(bs):
        return Trial(bs, fits=bs <= 5003)

    exact = search_batch_size(run, init_val=2, upper=100_000, tolerance=0.0)
    assert exact.batch_size == 5003
    near = search_batch_size(run, init_val=2, upper=100_000)
    assert 5003 * 0.99 <= near.batch_size <= 5003
    assert len(near.trials) < len(exact.trials)
    small = search_batch_size(lambda bs: Trial(bs, fits=bs <= 53), init_val=2, upper=100_000)
    assert small.batch_size == 53  # under 100 the 1% is less than one sample: exact


def capped_allocator(fixed: float, per_sample: float, waste: float, cache: float, cap: int):
    """A caching allocator under a cap: live tensors `fixed + per_sample * bs`; a size needs `waste` more (partly
    used blocks, workspaces) and runs iff that fits `cap`; the cache holds up to `cache` more, reserved stops at cap."""
    calls = []

    def run(bs: int) -> Trial:
        calls.append(bs)
        live = int(fixed + per_sample * bs)
        if live + waste > cap:
            return Trial(bs, fits=False)
        return Trial(bs, fits=True, peak_bytes=int(min(live + waste + cache, cap)), allocated_bytes=live)

    run.calls = calls  # type: ignore[attr-defined]
    return run


@pytest.mark.parametrize(
    ("fixed", "per_sample", "waste", "cache"),
    [
        (3.5 * GIB, 0.42 * GIB, 1.5 * GIB, 2.5 * GIB),  # GPT-like: reserved overstates the need by 4 GiB
        (0.5 * GIB, 0.042 * GIB, 1.0 * GIB, 1.2 * GIB),  # ResNet-like: elastic cuDNN workspaces
        (1 * GIB, 0.2 * GIB, 0.0, 0.0),  # allocated == reserved == need
    ],
)
def test_two_lines_reach_the_largest_size_that_runs_under_the_cap(fixed, per_sample, waste, cache):
    cap = int(0.95 * CARD)
    run = capped_allocator(fixed, per_sample, waste, cache, cap)
    best = max(bs for bs in range(1, 2000) if run(bs).fits)
    run.calls.clear()
    result = search_batch_size(run, init_val=2, upper=100_000, limit_bytes=cap)
    assert best * 0.99 <= result.batch_size <= best
    assert len(result.trials) <= 10  # binsearch: about 2 * log2(best), 10 to 18 here
    assert result.num_ooms <= 3
    assert len(set(run.calls)) == len(run.calls)


def test_allocated_line_stops_when_one_more_sample_cannot_fit_even_without_waste():
    cap = int(0.95 * CARD)
    run = capped_allocator(1 * GIB, 0.2 * GIB, 0.0, 0.0, cap)
    result = search_batch_size(run, init_val=2, upper=100_000, limit_bytes=cap)
    assert result.reason == "predicted"
    assert result.num_ooms == 0


def test_measured_gpt_trials_end_with_one_oom():
    """Peaks measured on the H200 (GPT-235M, bf16, 24 GiB budget, search cap 22.8 GiB): 36 ran, 37 did not.

    The reserved line stops at 36, lo + 1 is tried before the optimistic allocated line (which points at 45), and
    its OOM ends the search: 4 trials, 1 OOM, where jumping to the allocated line first took 7 trials and 4 OOMs.
    """
    measured = {2: (4.854, 4.832), 9: (8.52, 7.739), 36: (22.771, 19.022)}  # reserved, allocated GiB

    def run(bs):
        if bs > 36:
            return Trial(bs, fits=False)
        reserved, allocated = measured.get(bs, (4.854 + (bs - 2) * 0.527, 4.832 + (bs - 2) * 0.417))
        return Trial(bs, fits=True, peak_bytes=int(reserved * GIB), allocated_bytes=int(allocated * GIB))

    result = search_batch_size(run, init_val=2, upper=16384, limit_bytes=int(0.95 * 24 * GIB))
    assert [t.batch_size for t in result.trials] == [2, 9, 36, 37]
    assert result.batch_size == 36
    assert result.num_ooms == 1


def test_measured_resnet_trials_jump_past_the_squeezed_reserved_line():
    """Peaks measured on the H200 (ResNet-50, bf16, 24 GiB budget, cap 22.8 GiB): 532 ran, 536 did not.

    At 450 the reserved peak (21.8 GiB) is already within 5% of the cap, where the allocator gives cache back instead
    of failing, so the reserved line crept up a few sizes per trial (16 trials). Now live tensors plus the memory
    reserved but not live at 450 point at 473; from there lo + 1 runs, the allocated line points at 537, it fails,
    and one step back ends the search. (These peaks came from a process whose trials left cuBLAS workspaces pinning
    segments; the reserved-but-not-live share is larger here than the search meets since.)
    """
    measured = {2: (0.59, 0.584), 77: (4.303, 3.696), 450: (21.805, 19.179)}  # reserved, allocated GiB

    def run(bs):
        if bs > 534:
            return Trial(bs, fits=False)
        allocated = 19.179 + (bs - 450) * 0.0415
        reserved, allocated = measured.get(bs, (min(22.79, allocated + 2.6), allocated))
        return Trial(bs, fits=True, peak_bytes=int(reserved * GIB), allocated_bytes=int(allocated * GIB))

    result = search_batch_size(run, init_val=2, upper=65536, limit_bytes=int(0.95 * 24 * GIB))
    assert 0.99 * 534 <= result.batch_size <= 534
    assert len(result.trials) <= 7
    assert result.num_ooms == 1


def test_slope_from_neighbouring_sizes_is_not_used_when_a_farther_point_exists():
    """lo and lo + 1 differ by allocator noise; the optimistic jump uses a point 5% or more below instead."""
    calls = []

    def run(bs):
        calls.append(bs)
        allocated = (
            1 * GIB + bs * 0.04 * GIB + (0.05 * GIB if bs % 2 else 0)
        )  # odd sizes measure 50 MiB more
        if allocated + 0.3 * GIB > 22 * GIB:
            return Trial(bs, fits=False)
        return Trial(
            bs, fits=True, peak_bytes=int(min(22 * GIB, allocated + 3 * GIB)), allocated_bytes=int(allocated)
        )

    result = search_batch_size(run, init_val=2, upper=65536, limit_bytes=22 * GIB)
    best = max(bs for bs in range(1, 1000) if run(bs).fits)
    assert 0.99 * best <= result.batch_size <= best
    sizes = [t.batch_size for t in result.trials]
    assert (
        sizes[2] < sizes[3] <= 1.01 * sizes[2] + 1
    )  # the edge ran (within 1% above lo): the allocated line next
    assert best < sizes[4] <= 1.03 * best  # from the neighbours' slope (negative) it would have doubled
    assert len(result.trials) <= 10


def test_flat_peaks_at_small_sizes_at_least_double():
    """Measured on the H200 (8-layer MLP, 8 GiB budget): 4.33 GiB reserved at 2, 3, 5 and 8, where the fixed memory
    (weights, AdamW state, a validation buffer) hides the per-sample part. Two equal peaks mean "unmeasurably small
    per sample", so the next size at least doubles instead of creeping by the line through the origin."""
    calls = []

    def run(bs):
        calls.append(bs)
        peak = 4.33 * GIB if bs < 64 else 4.33 * GIB + bs * 0.23 * 2**20
        return Trial(bs, fits=peak <= 7.6 * GIB, peak_bytes=int(peak) if peak <= 7.6 * GIB else None)

    result = search_batch_size(run, init_val=2, upper=65536, limit_bytes=int(7.6 * GIB))
    assert calls[:3] == [2, 3, 6]
    assert result.batch_size == true_max(run, int(7.6 * GIB), 20000)


# ---------------------------------------------------------------------- search v2: stage lines
MIB = 2**20
LIMIT = int(0.95 * CARD)


def staged(
    train: tuple[float, float],
    val: tuple[float, float] | None = None,
    *,
    waste: float = 0.0,
    block: int = 0,
    noise: float = 0.0,
    cap: int = LIMIT,
):
    """A trial under an allocator cap: live tensors `fixed + per_sample * bs` in training and in validation (each
    with relative `noise`, drawn per size), reserved = the larger stage + `waste`, rounded up to `block`; a size runs
    iff its reserved peak fits `cap`."""
    calls = []

    def run(bs: int) -> Trial:
        calls.append(bs)
        jitter = random.Random(bs).uniform(-noise, noise)
        t = int((train[0] + train[1] * bs) * (1 + jitter))
        v = None if val is None else int((val[0] + val[1] * bs) * (1 + jitter))
        live = max(t, v or 0)
        reserved = live + int(waste)
        if block:
            reserved = math.ceil(reserved / block) * block
        if reserved > cap:
            return Trial(bs, fits=False)
        return Trial(
            bs, True, peak_bytes=reserved, allocated_bytes=live, train_peak_bytes=t, val_peak_bytes=v
        )

    run.calls = calls  # type: ignore[attr-defined]
    return run


def _best(run, limit: int = LIMIT, upper: int = 70_000) -> int:
    """The largest accepted size: accepted sizes are a prefix on these curves (noise aside: brute force there)."""
    if (t := run(upper)).fits and t.peak_bytes <= limit:
        return upper
    lo, hi = 1, upper
    while hi - lo > 1:
        mid = (lo + hi) // 2
        t = run(mid)
        lo, hi = (mid, hi) if t.fits and t.peak_bytes <= limit else (lo, mid)
    return lo


CLEAN = [
    pytest.param(staged((3.2 * GIB, 0.5 * GIB)), id="affine-gpt-like"),
    pytest.param(staged((1 * GIB, 0.01 * GIB)), id="affine-small-per-sample"),
    pytest.param(staged((20 * GIB, 0.3 * GIB)), id="affine-big-fixed"),
    pytest.param(staged((0.5 * GIB, 0.042 * GIB), waste=0.8 * GIB), id="affine-resnet-like-with-waste"),
    pytest.param(staged((3.5 * GIB, 0.42 * GIB), block=20 * MIB), id="quantised-20MiB-blocks"),
    pytest.param(staged((0.6 * GIB, 0.11 * MIB), block=20 * MIB), id="quantised-tiny-per-sample"),
]


@pytest.mark.parametrize("run", CLEAN)
def test_clean_curves_are_solved_in_at_most_four_trials(run):
    best = _best(run)
    run.calls.clear()
    result = search_batch_size(run, init_val=2, upper=70_000, limit_bytes=LIMIT)
    assert 0.99 * best <= result.batch_size <= best, [t.batch_size for t in result.trials]
    assert len(result.trials) <= 4, [t.batch_size for t in result.trials]
    assert len(set(run.calls)) == len(run.calls)


@pytest.mark.parametrize("exact", [37, 1000, 4321])
def test_a_cap_exactly_on_a_sizes_peak_is_hit_exactly(exact):
    per_sample = 0.37 * GIB if exact < 100 else 4 * GIB / exact
    run = staged((2 * GIB, per_sample))
    limit = run(exact).peak_bytes  # the cap is that size's peak, to the byte
    result = search_batch_size(run, init_val=2, upper=70_000, limit_bytes=limit)
    assert result.batch_size == _best(run, limit) >= exact
    assert len(result.trials) <= 4


@pytest.mark.parametrize("seed", range(8))
def test_one_percent_noise_stays_within_one_percent_and_never_above(seed):
    """With noise, acceptance near the boundary is not monotone (292 rejected, 293 and 294 accepted): the size to
    reach is the end of the accepted prefix, and the result must be a size that was accepted."""
    run = staged((2 * GIB + seed * 0.3 * GIB, (0.05 + 0.02 * seed) * GIB), noise=0.01)
    accepted = {bs for bs in range(1, 2000) if (t := run(bs)).fits and t.peak_bytes <= LIMIT}
    prefix_end = next(bs for bs in range(1, 2001) if bs not in accepted) - 1
    run.calls.clear()
    result = search_batch_size(run, init_val=2, upper=70_000, limit_bytes=LIMIT)
    sizes = [(t.batch_size, t.fits) for t in result.trials]
    assert result.batch_size in accepted
    assert 0.99 * prefix_end <= result.batch_size <= max(accepted), sizes
    assert len(result.trials) <= 12, (
        sizes
    )  # noise on live tensors (real ones are exact) costs trials, not sizes
    assert result.num_ooms <= 3, sizes


@pytest.mark.parametrize(
    ("train", "val", "limit"),
    [
        # examples/memory_report.py on the H200: 1 GiB validation buffer, 2.5 GiB budget (the old search: 18 trials)
        ((0.6 * GIB, 80 * 2**10), (1.68 * GIB, 4 * 2**10), int(0.95 * 2.5 * GIB)),
        (
            (4 * GIB, 0.5 * GIB),
            (12 * GIB, 0.1 * GIB),
            LIMIT,
        ),  # validation dominates up to 20, training after
        ((2 * GIB, 0.2 * GIB), (2.5 * GIB, 0.3 * GIB), LIMIT),  # validation dominates everywhere
    ],
)
def test_a_validation_buffer_and_a_steeper_training_line_take_at_most_six_trials(train, val, limit):
    run = staged(train, val, waste=0.1 * GIB, cap=limit)
    best = _best(run, limit)
    run.calls.clear()
    result = search_batch_size(run, init_val=2, upper=70_000, limit_bytes=limit)
    sizes = [(t.batch_size, t.fits) for t in result.trials]
    assert 0.99 * best <= result.batch_size <= best, sizes
    assert len(result.trials) <= 6, sizes
    assert result.num_ooms <= 2, sizes


def _replay(measured: dict[int, tuple[int | None, ...] | None]):
    """Trials measured on the H200: size -> (reserved, allocated, train allocated, val allocated[, retries]) or None
    (OOM)."""

    def run(bs: int) -> Trial:
        if bs not in measured:
            pytest.fail(f"the search tried {bs}, which was not measured")
        peaks = measured[bs]
        if peaks is None:
            return Trial(bs, fits=False)
        reserved, allocated, train, val, *retries = peaks
        return Trial(
            bs, True, reserved, allocated_bytes=allocated, train_peak_bytes=train, val_peak_bytes=val,
            retries=retries[0] if retries else None,
        )  # fmt: skip

    return run


def test_measured_gpt_trials_from_a_fresh_layout_find_the_true_maximum_with_one_oom():
    """H200, GPT-235M, bf16, 24 GiB cap, every trial from a fresh layout (benchmarks/results/tuner-24gib.json).

    Fresh processes fit 38, 39 and 40 and run out of memory at 41 (the true maximum is 40). From 38 (reserved
    within 5% of the cap), live tensors plus the 3.0 GiB reserved but not live there point at 40; from 40 nothing
    is left above 41, whose OOM ends the search.
    """
    measured = {
        2: (5211422720, 5187911168, 5187911168, 3164066816),
        9: (9156165632, 8308955136, 8308955136, 4103679488),
        38: (24637341696, 21374038016, 21374038016, 7996349952),
        39: (24859639808, 21875433472, 21875433472, 8133955072),
        40: (25591545856, 22316797952, 22316797952, 8264809984),
        **dict.fromkeys(range(41, 48)),
    }
    result = search_batch_size(_replay(measured), init_val=2, upper=16384, limit_bytes=24 * GIB)
    assert [t.batch_size for t in result.trials] == [2, 9, 38, 40, 41]
    assert result.batch_size == 40
    assert result.num_ooms == 1


def test_one_retry_at_the_cap_is_not_a_squeeze_the_gpt_lives_with_its_waste():
    """H200, GPT-235M, 24 GiB cap (`benchmarks/tuner.py --models gpt --budget-gib 24`: its tuner's trials, with the
    allocator's retries; the run of `tuner-24gib-gpt.json` measured 38 and 40 alike). 38, 39 and 40 each had 1 retry
    and 3.0 GiB reserved but not live, and 41 ran out of memory. Read as a squeeze, that one retry would send the
    search to 46, where live tensors plus 1% of the cap reach it, and then down through 45 and 43 (4 OOMs); one retry
    is a flush the steps then live with, so the fragmentation seen at 38 stands and the search takes 40 with 1 OOM."""
    measured = {
        2: (5211422720, 5187911168, 5187911168, 3164066816, 0),
        9: (9760145408, 8308955136, 8308955136, 4103679488, 0),
        33: (22733127680, 19034898432, 19034898432, 7332572672, 0),
        38: (24637341696, 21374038016, 21374038016, 7996349952, 1),
        39: (24859639808, 21876482048, 21876482048, 8133955072, 1),
        40: (25591545856, 22317322240, 22317322240, 8264809984, 1),
        **dict.fromkeys(range(41, 48)),
    }
    moves: list[Proposal] = []
    result = search_batch_size(
        _replay(measured), init_val=2, upper=16384, limit_bytes=24 * GIB, on_move=moves.append
    )
    assert Move.SQUEEZED not in [m.move for m in moves]
    assert [t.batch_size for t in result.trials] == [2, 9, 33, 38, 40, 41]
    assert result.batch_size == 40
    assert result.num_ooms == 1


def test_two_probes_on_the_optimizer_steps_plateau_do_not_predict_from_their_slope():
    """H100, WideMLP (38M parameters, AdamW, ~0.14 MiB a sample), 2 GiB cap (the GPU test's; `on_move` traced in
    one session). 2, 5 and 12 reserve the same 788 MiB, their live peaks 15-29 KB apart: the optimizer step's
    temporaries, not activations, set the peak. A line through two of them has a slope of noise, and the safe move
    took its half-limit size, 32768, then backed off through five more OOMs (12 trials, 6 OOM in gpu-tests-h100-2pct.log). On a plateau it
    jumps through the origin instead, until a point leaves it: 31, then 11379 from the line above it."""
    measured = {
        2: (826277888, 824209408, 824209408, 521866240, 0),
        5: (826277888, 824224256, 824224256, 521991680, 0),
        12: (826277888, 824252928, 824252928, 522278400, 0),
        31: (828375040, 824330752, 824330752, 523056640, 0),
        11379: (2088763392, 1894067712, 1894067712, 988477952, 0),
        11644: (2126512128, 1920861696, 1920861696, 999582208, 0),
        11737: (2145386496, 1933445632, 1933445632, 1004159488, 0),
        **dict.fromkeys([11831, 11882, 12001]),
    }
    moves: list[Proposal] = []
    result = search_batch_size(
        _replay(measured), init_val=2, upper=32768, limit_bytes=2 * GIB, on_move=moves.append
    )
    assert [t.batch_size for t in result.trials] == [2, 5, 12, 31, 11379, 12001, 11882, 11644, 11831, 11737]
    assert result.batch_size == 11737
    assert result.num_ooms == 3
    assert [m.move for m in moves[:4]] == [Move.SAFE] * 4


def test_measured_longval_trials_find_the_true_maximum_with_one_oom():
    """H200, GPT-235M validated on 8x longer sequences, 24 GiB cap: validation sets the size; 19 runs, 20 does not.

    13's reserved peak is near the cap but mostly the training steps' cache (live tensors 16.9 GiB): lo + 1 runs,
    the safe model then points at 19, and from 19 (chosen by a model) only 20 is left, whose OOM ends the search.
    """
    measured = {
        2: (7413432320, 5246631424, 5246631424, 5087269888),
        6: (14040432640, 9382518272, 7006717952, 9382518272),
        13: (25214058496, 16899198464, 10090010624, 16899198464),
        14: (19472056320, 17973009920, 10526885888, 17973009920),
        19: (25232932864, 23344164352, 12753205248, 23344164352),
        **dict.fromkeys(range(20, 30)),
    }
    result = search_batch_size(_replay(measured), init_val=2, upper=16384, limit_bytes=24 * GIB)
    assert [t.batch_size for t in result.trials] == [2, 6, 13, 14, 19, 20]
    assert result.batch_size == 19
    assert result.num_ooms == 1


@pytest.mark.parametrize(
    ("fixed", "per_sample", "waste", "cache"),
    [
        (
            3.5 * GIB,
            0.42 * GIB,
            3.0 * GIB,
            0.0,
        ),  # GPT-like: 3 GiB of split blocks that no pressure gives back
        (3.5 * GIB, 0.42 * GIB, 3.0 * GIB, 0.3 * GIB),  # the same with a little cache on top
        (0.5 * GIB, 0.042 * GIB, 1.0 * GIB, 0.0),  # ResNet-like sizes
    ],
)
def test_fragmentation_that_pressure_does_not_undo_is_hit_exactly_with_one_oom(
    fixed, per_sample, waste, cache
):
    cap = int(0.95 * CARD)
    run = capped_allocator(fixed, per_sample, waste, cache, cap)
    best = max(bs for bs in range(1, 2000) if run(bs).fits)
    result = search_batch_size(run, init_val=2, upper=100_000, limit_bytes=cap)
    assert result.batch_size == best
    assert len(result.trials) <= 4
    assert result.num_ooms == 1  # the size above the best, which ends the search


def squeezing_allocator(per_sample: int, cache: int, floor: int, cap: int, retries: bool = True):
    """Live tensors 20.3 GiB at 477 and 42.67 MiB per sample (ResNet-50 on an H200, bf16); a size runs iff live
    tensors plus ``floor`` (what no pressure gives back) fit ``cap``; the allocator caches up to ``cache`` more, and
    where that would pass the cap it gives the cache back and retries, once in each of a trial's 3 training steps
    (``retries=False``: not measured)."""
    fixed = 20787 * MIB - per_sample * 477

    def run(bs: int) -> Trial:
        live = fixed + per_sample * bs
        if live + floor > cap:
            return Trial(bs, fits=False)
        squeezed = 3 * int(live + cache > cap) if retries else None
        return Trial(
            bs, True, min(live + cache, cap), allocated_bytes=live, train_peak_bytes=live, retries=squeezed
        )

    return run


@pytest.mark.parametrize("card_gib", [24, 12])
@pytest.mark.parametrize("cache_gib", [1.0, 2.8, 4.0])
@pytest.mark.parametrize("floor_mib", [100, 250])
def test_a_cache_the_cap_squeezes_is_jumped_past_with_one_oom(card_gib, cache_gib, floor_mib):
    """The allocator gave its cache back to run lo (it retried): the reserved-but-not-live memory at lo says nothing
    of a larger size, so the search jumps to where live tensors plus 1% of the limit reach it (ResNet-50 under a 24 GiB
    cap: 0.46 GiB reserved but not live at 554, where 477 had 3.1 GiB; benchmarks/results/tuner-24gib-resnet.json)."""
    cap = card_gib * GIB
    run = squeezing_allocator(int(42.67 * MIB), int(cache_gib * GIB), floor_mib * MIB, cap)
    best = max(bs for bs in range(1, 2000) if run(bs).fits)
    moves: list[Proposal] = []
    result = search_batch_size(run, init_val=2, upper=65536, limit_bytes=cap, on_move=moves.append)
    assert 0.99 * best <= result.batch_size <= best
    assert Move.SQUEEZED in [m.move for m in moves]
    assert len(result.trials) <= 7
    assert result.num_ooms == 1


def test_a_step_back_that_fails_steps_back_twice_as_far():
    cap = 24 * GIB
    run = squeezing_allocator(int(42.67 * MIB), int(2.8 * GIB), 600 * MIB, cap)  # 2.4% left over at the cap
    best = max(bs for bs in range(1, 2000) if run(bs).fits)
    moves: list[Proposal] = []
    result = search_batch_size(run, init_val=2, upper=65536, limit_bytes=cap, on_move=moves.append)
    squeezed = next(m.size for m in moves if m.move is Move.SQUEEZED)
    first, second = (m.size for m in moves if m.move is Move.STEP_BACK)
    assert squeezed - first == 6  # 1% of 560
    assert first - second == 12  # then twice that
    assert 0.99 * best <= result.batch_size <= best
    assert result.num_ooms == 2


def test_a_near_cap_jump_is_not_repeated_from_its_own_result():
    """Reserved squeezed to 10 MiB under the cap: the waste at lo then points a fixed 10 samples up, trial after
    trial (the review's reproduction: 25 trials stepping by 10, stopping at 86% of the maximum)."""
    limit = 22 * GIB

    def run(
        bs,
    ):  # live 1 GiB + 1 MiB per sample; runs with 1 GiB more; reserved squeezed to 10 MiB under the cap
        live = GIB + bs * MIB
        if live + GIB > limit:
            return Trial(bs, fits=False)
        return Trial(bs, True, peak_bytes=min(live + 4 * GIB, limit - 10 * MIB), allocated_bytes=live)

    best = (limit - 2 * GIB) // MIB
    result = search_batch_size(run, init_val=2, upper=100_000, limit_bytes=limit)
    assert 0.99 * best <= result.batch_size <= best
    assert result.reason == "bracketed"
    assert len(result.trials) <= 15


def test_the_benchmark_trials_replay_exactly():
    """Each tuner search in benchmarks/results/ replays, from its measured peaks, to the very sizes it tried: a
    change to the search that would change those figures fails here (and needs the GPU benchmark run again).

    The searches of the removed ``method="predict"`` (finders named ``predict``) and of a previous version of the
    package (``previous-*``) ran another policy: they are not replayed."""
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    replayed = 0
    for path in sorted(results.glob("tuner-*gib*.json")):
        data = json.loads(path.read_text())
        for workload in data["workloads"].values():
            for name, finder in workload["finders"].items():
                keys = ("peak_bytes", "allocated_bytes", "train_peak_bytes", "val_peak_bytes", "retries")
                measured = {
                    t["batch_size"]: tuple(t.get(k) for k in keys) if t["fits"] else None
                    for t in finder.get("tuner_trials") or []
                }
                if not measured or name.startswith(("predict", "previous")):
                    continue
                search = list(
                    measured
                )  # the sizes in the order tried; the headroom's own trial, if any, is last
                budget = data["settings"]["budget_bytes"]
                result = search_batch_size(_replay(measured), init_val=2, upper=16384, limit_bytes=budget)
                assert [t.batch_size for t in result.trials] == search[: len(result.trials)], path.name
                assert len(result.trials) >= len(search) - 1, path.name
                replayed += 1
    assert replayed >= 12


def test_each_move_is_named_in_the_docs_by_its_value_and_printed_with_its_reason():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "batch_size_tuner.md").read_text()
    assert [move for move in Move if f"`{move.value}`" not in docs] == []
    moves: list[Proposal] = []
    search_batch_size(lambda bs: Trial(bs, fits=bs <= 53), init_val=2, upper=100, on_move=moves.append)
    assert str(moves[0]) == "double 4: no usable model: double"
    assert [m.move for m in moves] == [Move.DOUBLE] * 5 + [Move.BISECT] * 5


# ---------------------------------------------------------------------- the walk down
OK = (20 * GIB, 18 * GIB, 18 * GIB, None)  # accepted under 24 GiB
OVER = (25 * GIB, 22 * GIB, 22 * GIB, None)  # ran, but peaked over 24 GiB: rejected


def _searched(measured: dict[int, tuple[int | None, ...] | None], sizes: list[int], reason="bracketed"):
    """A search's result from its trials (sizes in the order tried, replayed from `measured`)."""
    run = _replay(measured)
    trials = tuple(run(bs) for bs in sizes)
    best = max((t.batch_size for t in trials if t.fits and t.peak_bytes <= 24 * GIB), default=None)
    return SearchResult(best, trials, reason)


def _walked(result: SearchResult, searched: SearchResult) -> list[tuple[int, bool]]:
    assert (
        result.trials[: len(searched.trials)] == searched.trials
    )  # the search's trials come first, unchanged
    assert result.reason == searched.reason
    return [(t.batch_size, t.fits) for t in result.trials[len(searched.trials) :]]


@pytest.mark.parametrize(
    ("start", "walk"),
    [
        (68, [(68, None), (67, None), (65, OVER), (61, OK)]),  # steps 1, 2, then 4
        (531, [(531, None), (525, None), (513, None), (489, OK)]),  # 1% of 531 is 6: 6, 12, then 24
    ],
)
def test_below_a_kept_size_that_fails_the_walk_doubles_its_step(start, walk):
    searched = _searched({2: OK, 600: OK, 601: None}, [2, 600, 601])
    result = walk_down(_replay(dict(walk)), searched, start=start, limit_bytes=24 * GIB)
    assert _walked(result, searched) == [(size, peaks is not None) for size, peaks in walk]
    assert result.batch_size == walk[-1][0]


def test_a_size_the_search_ran_is_kept_without_running_it_again():
    searched = _searched({62: OK, 63: OK, 75: OK, 76: None}, [62, 63, 75, 76])
    result = walk_down(_replay({68: None, 67: None, 65: None}), searched, start=68, limit_bytes=24 * GIB)
    assert _walked(result, searched) == [(68, False), (67, False), (65, False)]  # 61 is next: 62 and 63 ran
    assert result.batch_size == 63


def test_a_start_the_search_ran_is_kept_with_no_trial():
    searched = _searched({68: OK, 75: OK, 76: None}, [68, 75, 76])
    result = walk_down(_replay({}), searched, start=68, limit_bytes=24 * GIB)
    assert _walked(result, searched) == []
    assert result.batch_size == 68


def test_a_start_that_is_the_result_is_the_result():
    searched = _searched({2: OK, 75: OK, 76: None}, [2, 75, 76])
    assert walk_down(_replay({}), searched, start=75, limit_bytes=24 * GIB) == searched
    nothing = _searched({1: None}, [1], "nothing_fits")
    assert walk_down(_replay({}), nothing, start=1) == nothing


def test_the_trial_budget_ends_the_walk_at_the_largest_size_below_that_ran():
    sizes = [2, *range(90, 110), 600, 601]  # 23 trials: two are left to the walk
    searched = _searched({**dict.fromkeys(sizes, OK), 601: None}, sizes)
    result = walk_down(
        _replay({570: None, 564: None}), searched, start=570, limit_bytes=24 * GIB, max_trials=25
    )
    assert _walked(result, searched) == [(570, False), (564, False)]  # 552 would be next
    assert result.batch_size == 109  # no trial left: the largest size below that a trial accepted
    assert len(result.trials) == 25


def test_the_trial_budget_ends_the_walk_with_nothing_kept_where_nothing_below_ran():
    sizes = [*range(580, 601), 601]  # 22 trials, none below the walk's sizes
    searched = _searched({**dict.fromkeys(sizes, OK), 601: None}, sizes)
    walk = {570: None, 564: None, 552: None}
    result = walk_down(_replay(walk), searched, start=570, limit_bytes=24 * GIB, max_trials=25)
    assert _walked(result, searched) == [(570, False), (564, False), (552, False)]
    assert result.batch_size is None


def test_a_search_that_used_every_trial_still_keeps_a_size_it_ran_at_or_below_the_start():
    sizes = [2, *range(60, 82), 82, 83]  # 25 trials: none left for the walk
    searched = _searched({**dict.fromkeys(sizes, OK), 83: None}, sizes)
    result = walk_down(_replay({}), searched, start=75, limit_bytes=24 * GIB, max_trials=25)
    assert _walked(result, searched) == []
    assert result.batch_size == 75  # the search ran 75: kept, not "ran out of memory when run again"


def test_where_nothing_down_to_one_runs_the_walk_keeps_nothing():
    searched = _searched({11: OK, 12: None}, [11, 12])  # from init_val 11: no smaller size ran
    walk = {10: None, 9: None, 7: None, 3: None, 1: None}  # steps 1, 2, 4, then 8 (not below 1)
    result = walk_down(_replay(walk), searched, start=10, limit_bytes=24 * GIB)
    assert _walked(result, searched) == [(10, False), (9, False), (7, False), (3, False), (1, False)]
    assert result.batch_size is None


def test_the_walk_never_goes_below_lower():
    searched = _searched({11: OK, 12: None}, [11, 12])
    walk = {10: None, 9: None, 8: None}  # steps 1, 2 (to 7: below 8, so 8)
    result = walk_down(_replay(walk), searched, start=10, limit_bytes=24 * GIB, lower=8)
    assert _walked(result, searched) == [(10, False), (9, False), (8, False)]
    assert result.batch_size is None


def test_the_search_never_tries_a_size_below_lower():
    run = curve(fixed=20 * GIB, per_sample=GIB)  # 4 samples fit the card
    result = search_batch_size(run, init_val=64, upper=1000, lower=10)
    assert result.batch_size is None
    assert result.reason == "nothing_fits"
    assert min(t.batch_size for t in result.trials) == 10
    assert (
        search_batch_size(curve(fixed=0, per_sample=GIB), init_val=64, upper=1000, lower=10).batch_size == 24
    )


@pytest.mark.parametrize("lower", [0, 1001])
def test_lower_is_checked(lower):
    with pytest.raises(ValueError, match=f"lower={lower}"):
        search_batch_size(curve(fixed=0, per_sample=GIB), upper=1000, lower=lower)


@pytest.mark.parametrize("start", [0, 76])
def test_the_walk_starts_from_a_size_up_to_the_result(start):
    searched = _searched({2: OK, 75: OK, 76: None}, [2, 75, 76])
    with pytest.raises(ValueError, match=f"start={start}"):
        walk_down(_replay({}), searched, start=start)


# ---------------------------------------------------------------------- predict, then validate
def _machine(live, cap, reserved=None, val=None):
    """A device where a size needs `live(b)` bytes of tensors (`val(b)` in validation) and reserves `reserved(b)`."""
    reserved = reserved or (lambda b: max(live(b), val(b) if val else 0))
    truth = max((b for b in range(1, 20000) if reserved(b) <= cap), default=None)

    def run(bs):
        fits = reserved(bs) <= cap
        return Trial(
            bs,
            fits,
            peak_bytes=int(reserved(bs)) if fits else None,
            allocated_bytes=int(max(live(bs), val(bs) if val else 0)) if fits else None,
            train_peak_bytes=int(live(bs)) if fits else None,
            val_peak_bytes=int(val(bs)) if fits and val else None,
        )

    return run, truth


def _planned(live, cap=24 * GIB, **kwargs):
    run, truth = _machine(live, cap, **kwargs)
    result = search_by_plan(run, upper=20000, limit_bytes=cap)
    return result, truth


def _near_limit(result, cap):
    """Trials that ran out of memory or needed more than 80% of the cap: the costly ones."""
    return [t for t in result.trials if (t.allocated_bytes or cap) > 0.8 * cap]


def test_an_affine_curve_is_predicted_validated_and_closed_within_two_percent():
    result, truth = _planned(lambda b: 2 * GIB + b * 100 * MIB)
    assert result.note == ""
    assert 0.98 * truth <= result.batch_size <= truth
    assert result.num_ooms <= 1
    assert len(_near_limit(result, 24 * GIB)) <= 3
    assert len(result.trials) <= 4
    assert result.trials[0].batch_size == 2  # init_val, the first probe


def test_a_plateau_then_a_line_is_predicted_from_above_the_plateau():
    # the optimizer step's temporaries (6 GiB) set the peak up to 80 samples: a line through 2 and 4 would say
    # nothing bounds the size; the probes grow past the plateau first
    result, truth = _planned(lambda b: max(6 * GIB, 2 * GIB + b * 50 * MIB))
    assert 0.98 * truth <= result.batch_size <= truth
    assert result.num_ooms == 0
    assert len(result.trials) <= 6


def test_allocator_overhead_near_the_cap_backs_off_and_still_closes_in():
    # reserved jumps 12% above live tensors past 20 GiB of them (large blocks that no longer fit the cache's holes)
    live = lambda b: 2 * GIB + b * 80 * MIB  # noqa: E731
    reserved = lambda b: live(b) * (1.12 if live(b) > 20 * GIB else 1.0)  # noqa: E731
    result, truth = _planned(live, reserved=reserved)
    assert result.num_ooms >= 1  # the prediction (from probes that saw no overhead) ran out of memory
    assert 0.98 * truth <= result.batch_size <= truth
    assert len(_near_limit(result, 24 * GIB)) <= 5


def test_peaks_off_a_line_still_end_at_an_accepted_size_never_above_the_truth():
    noise = lambda b: 1 + 0.5 * (b.bit_length() % 2)  # noqa: E731  # padding that varies with the size
    live = lambda b: 2 * GIB + b * 100 * MIB * noise(b)  # noqa: E731
    run, truth = _machine(live, 24 * GIB)
    result = search_by_plan(run, upper=20000, limit_bytes=24 * GIB)
    assert 0.98 * truth <= result.batch_size <= truth
    assert accepted(next(t for t in result.trials if t.batch_size == result.batch_size), 24 * GIB)
    assert len({t.batch_size for t in result.trials}) == len(result.trials)  # no size ran twice
    assert len(result.trials) <= 8


def test_a_budget_below_the_plateau_searches_below_the_first_probe():
    run, truth = _machine(lambda b: max(6 * GIB, b * GIB), 5 * GIB)
    result = search_by_plan(run, upper=100, limit_bytes=5 * GIB)
    assert truth is None
    assert result.batch_size is None
    assert result.reason == "nothing_fits"
    run, truth = _machine(
        lambda b: 2 * GIB + b * GIB, 5 * GIB
    )  # 2 runs, 4 does not: no room for a second probe
    result = search_by_plan(run, upper=100, limit_bytes=5 * GIB)
    assert result.batch_size == truth == 3


def test_without_a_limit_or_peaks_the_planned_search_is_the_search():
    run = lambda bs: Trial(bs, fits=bs <= 53)  # noqa: E731  # a CPU: nothing measured
    assert search_batch_size(run, upper=100).batch_size == 53  # within 1%: exact below 100
    assert search_by_plan(run, upper=100).batch_size in (52, 53)  # within 2%
    assert search_by_plan(run, upper=100, limit_bytes=GIB).batch_size in (
        52,
        53,
    )  # no peaks: double, then bisect
    assert search_by_plan(run, upper=4, limit_bytes=GIB).batch_size == 4


@pytest.mark.parametrize("seed", range(40))
def test_planned_search_on_random_curves_never_exceeds_the_truth_and_lands_within_three_percent(seed):
    import random

    rng = random.Random(seed)
    cap = rng.choice([12, 24, 48]) * GIB
    fixed, per = rng.uniform(0.5, 8) * GIB, rng.uniform(2, 400) * MIB
    plateau = rng.choice([0, rng.uniform(1, 4) * GIB])
    jump, at = rng.choice([1.0, 1.03, 1.08, 1.13]), rng.uniform(0.6, 0.95)
    val_per = rng.choice([None, per * rng.uniform(0.3, 2.5)])
    live = lambda b: max(fixed + plateau, fixed + per * b)  # noqa: E731
    val = (lambda b: fixed * 0.5 + val_per * b) if val_per else None
    need = lambda b: max(live(b), val(b) if val else 0)  # noqa: E731
    reserved = lambda b: need(b) * (jump if need(b) > at * cap else 1.0)  # noqa: E731
    run, truth = _machine(live, cap, reserved=reserved, val=val)
    if truth is None:
        return
    result = search_by_plan(run, upper=20000, limit_bytes=cap)
    kept = next(t for t in reversed(result.trials) if t.batch_size == result.batch_size)
    assert accepted(kept, cap)  # a size a trial ran under the budget
    assert result.batch_size <= truth
    assert result.batch_size >= 0.97 * truth or truth - result.batch_size <= 1, (result, truth)
    if not result.note:  # predicted (a fallback is today's search, which the tests above cover)
        assert len(_near_limit(result, cap)) <= 6, [t.batch_size for t in result.trials]


def test_the_previous_searchs_trials_on_five_models_are_the_one_searchs():
    """benchmarks/results/tuner-42*-h100.json: the previous version's `method="search"` on five models (H100, 24 GiB,
    headroom 0.02), in two sessions (tuner-42a/b/c, tuner-42-all). Replayed from their measured peaks, the one search (closing to 1%, then the headroom's own
    size) tries the very same sizes: its cost on these models is that search's."""
    from lightning_gpumem.tuning.search import leave_headroom

    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    replayed = 0
    for path in sorted(results.glob("tuner-42*-h100.json")):
        data = json.loads(path.read_text())
        budget = data["settings"]["budget_bytes"]
        for workload in data["workloads"].values():
            finder = workload["finders"]["previous-search"]
            keys = ("peak_bytes", "allocated_bytes", "train_peak_bytes", "val_peak_bytes", "retries")
            measured = {
                t["batch_size"]: tuple(t.get(k) for k in keys) if t["fits"] else None
                for t in finder["tuner_trials"]
            }
            run = _replay(measured)
            result = search_batch_size(run, init_val=2, upper=16384, limit_bytes=budget)
            kept = leave_headroom(run, result, 0.02, budget, 25)
            assert [t.batch_size for t in kept.trials] == list(measured), path.name
            assert kept.batch_size == finder["batch_size"]
            replayed += 1
    assert replayed == 10
