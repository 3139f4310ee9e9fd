"""Trials from traces: the step traced at a size, replayed through the allocator model; the traced plan."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_gpumem._core.units import GIB, MIB
from lightning_gpumem._hw.trace import Trace, trace_training
from lightning_gpumem.tuning.search import Guess, leave_headroom, search_batch_size
from lightning_gpumem.tuning.search.headroom import headroom_size
from lightning_gpumem.tuning.search.model import Trial, accepted
from lightning_gpumem.tuning.search.moves import Move, Proposal
from lightning_gpumem.tuning.sources.allocator import replay
from lightning_gpumem.tuning.sources.traced import (
    BELOW,
    TRACE_MARGIN,
    CannotTrace,
    TracedSource,
    largest_traced,
    plan_by_trace,
    trace_margin,
    traced_guess,
)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10)
    )


def _tracer(net: nn.Module, calls: list[int] | None = None):
    def trace_at(size: int) -> Trace:
        if calls is not None:
            calls.append(size)
        return trace_training(
            net,
            lambda ps: torch.optim.AdamW(ps, lr=1e-3),
            lambda m, x: m(x).square().mean(),
            torch.zeros(size, 256),
            validate=lambda m, x: m(x),
            device=None,  # the tensors alone: the plan's logic, not the kernels' buffers
        )

    return trace_at


def test_a_traced_trial_is_its_replay_and_each_size_is_traced_once():
    calls: list[int] = []
    source = TracedSource(_tracer(_mlp(), calls))
    trial = source(64)
    again = source.under(8 * MIB)(64)  # another cap replays the same trace
    assert calls == [64]
    direct = replay(_tracer(_mlp())(64).events)
    assert trial.fits
    assert trial.peak_bytes == direct.peak_reserved
    assert trial.allocated_bytes == direct.peak_allocated
    assert trial.train_peak_bytes == max(direct.phase_peaks["train"][0], direct.phase_peaks["optimizer"][0])
    assert trial.val_peak_bytes == direct.phase_peaks["val"][0]
    assert not again.fits  # 8 MiB holds less than the parameters and AdamW's state (~20 MiB)


def test_ddp_buckets_count_before_the_step():
    net = _mlp()
    bare = TracedSource(_tracer(net))(16)
    with_buckets = TracedSource(_tracer(net), bucket_bytes=64 * MIB)(16)
    assert with_buckets.allocated_bytes == bare.allocated_bytes + 64 * MIB


def test_a_step_that_cannot_be_traced_says_why():
    class Item(nn.Module):
        def forward(self, x):
            return x * float(x.sum().item())

    def trace_at(size: int) -> Trace:
        return trace_training(
            Item(), lambda ps: torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1),
            lambda m, x: m(x).sum(), torch.zeros(size, 4, requires_grad=True),
        )  # fmt: skip

    with pytest.raises(CannotTrace, match="_local_scalar_dense"):
        TracedSource(trace_at)(4)


@pytest.mark.parametrize("budget_mib", [48, 96, 160])
def test_the_traced_plans_largest_size_is_never_above_what_the_replay_fits_and_within_one_percent(
    budget_mib,
):
    source = TracedSource(_tracer(_mlp()))
    plan = plan_by_trace(source, 32, [budget_mib * MIB], upper=1 << 16, outside=0, margin=0.0)
    (prediction,) = plan.predictions
    largest = prediction.largest
    assert largest is not None
    assert prediction.traced
    assert prediction.how == "traced"
    limit = budget_mib * MIB
    assert source.under(limit)(largest).fits
    assert source.under(limit)(largest).peak_bytes <= limit
    above = largest + max(1, largest // 100) + 1  # the search closes to within 1%
    assert not source.under(limit)(above).fits or source.under(limit)(above).peak_bytes > limit


def test_the_margin_and_the_memory_outside_pytorch_lower_the_largest_size():
    source = TracedSource(_tracer(_mlp()))
    bare = plan_by_trace(source, 32, [200 * MIB], upper=1 << 16, outside=0, margin=0.0).predictions[0]
    kept = plan_by_trace(source, 32, [200 * MIB], upper=1 << 16, outside=40 * MIB, margin=0.05).predictions[
        0
    ]
    assert kept.limit == 160 * MIB
    assert kept.largest < bare.largest
    assert kept.band == pytest.approx(0.05 * kept.peak)
    assert kept.fits == (kept.peak + kept.band <= kept.limit)


@pytest.mark.parametrize("unseen_mib", [0, 12, -6])
def test_the_traced_guess_calibrated_by_the_first_trial_is_the_real_boundary_in_three_trials(unseen_mib):
    """The "GPU" is the replay plus memory the trace does not see (or sees too much of): a fixed amount."""
    source = TracedSource(_tracer(_mlp()))
    limit = 160 * MIB

    def real(size: int) -> Trial:
        trial = source.under(limit - unseen_mib * MIB)(size)
        if not trial.fits or trial.peak_bytes is None:
            return Trial(size, fits=False, samples=size)
        return dataclasses.replace(trial, peak_bytes=trial.peak_bytes + unseen_mib * MIB)

    guess = traced_guess(source, limit, upper=1 << 16, init_val=2)
    moves: list[Proposal] = []
    found = search_batch_size(
        real, upper=1 << 16, limit_bytes=limit, tolerance=0.01, guess=guess, on_move=moves.append
    )
    largest = found.batch_size
    assert largest is not None
    assert accepted(real(largest), limit)
    assert not accepted(real(largest + 1), limit)
    assert [t.batch_size for t in found.trials][:2] == [2, largest]
    assert len(found.trials) == 3  # and the edge past it (1% above, at these sizes) fails
    assert moves[0].move is Move.TRACED


def test_a_traced_guess_past_the_boundary_steps_back():
    def real(size: int) -> Trial:  # 1 GiB fixed, 0.5 GiB a sample: 46 fit in 24 GiB
        peak = GIB + size * GIB // 2
        return Trial(size, fits=peak <= 24 * GIB, peak_bytes=peak if peak <= 24 * GIB else None)

    for guess, tried in ((47, [2, 47, 46]), (46, [2, 46]), (45, [2, 45, 46]), (50, [2, 50, 49, 47, 43, 46])):
        found = search_batch_size(real, upper=4096, limit_bytes=24 * GIB, guess=lambda _, g=guess: Guess(g))
        assert found.batch_size == 46
        assert [t.batch_size for t in found.trials] == tried
    below_first = search_batch_size(real, upper=4096, limit_bytes=24 * GIB, guess=lambda _: Guess(1))
    assert below_first.batch_size == 46  # a guess at or below the first trial is not tried


def test_a_guess_to_keep_ends_the_search_where_it_runs_and_the_headroom_is_not_given_twice():
    def real(size: int) -> Trial:  # 1 GiB fixed, 0.5 GiB a sample: 46 fit in 24 GiB
        peak = GIB + size * GIB // 2
        return Trial(size, fits=peak <= 24 * GIB, peak_bytes=peak if peak <= 24 * GIB else None)

    found = search_batch_size(real, upper=4096, limit_bytes=24 * GIB, guess=lambda _: Guess(44, kept=True))
    assert (found.batch_size, found.reason) == (44, "traced")
    assert [t.batch_size for t in found.trials] == [2, 44]
    assert leave_headroom(real, found, 0.05, 24 * GIB, 25) == found  # no trial, nothing more given up
    # not to keep: the edge above it runs, as for a plain size
    plain = search_batch_size(real, upper=4096, limit_bytes=24 * GIB, guess=lambda _: Guess(44))
    assert plain.reason != "traced"
    assert plain.batch_size == 46
    # a kept guess that fails steps back, and the search and its headroom go on as without a guess
    over = search_batch_size(real, upper=4096, limit_bytes=24 * GIB, guess=lambda _: Guess(48, kept=True))
    assert (over.batch_size, over.reason) == (46, "bracketed")
    assert [t.batch_size for t in over.trials][:3] == [2, 48, 47]
    assert leave_headroom(real, over, 0.05, 24 * GIB, 25).batch_size == 44


def test_a_guess_whose_check_settles_after_its_trial_is_kept_or_taken_back():
    def real(size: int) -> Trial:  # 1 GiB fixed, 0.5 GiB a sample: 46 fit in 24 GiB
        peak = GIB + size * GIB // 2
        return Trial(size, fits=peak <= 24 * GIB, peak_bytes=peak if peak <= 24 * GIB else None)

    order: list[str] = []

    def traced(size: int) -> Trial:
        order.append(f"trial {size}")
        return real(size)

    def guess(settled: Guess | None):
        def settle() -> Guess | None:
            order.append("settle")
            return settled

        return lambda _: Guess(44, kept=True, settle=settle)

    same = search_batch_size(traced, upper=4096, limit_bytes=24 * GIB, guess=guess(Guess(44, kept=True)))
    assert (same.batch_size, same.reason) == (44, "traced")
    assert order == ["trial 2", "trial 44", "settle"]  # the check is waited for after the guess's trial
    # the check lowers it: 44 ran, but counts as rejected; the smaller guess runs and is kept
    lower = search_batch_size(real, upper=4096, limit_bytes=24 * GIB, guess=guess(Guess(40, kept=True)))
    assert (lower.batch_size, lower.reason) == (40, "traced")
    assert [t.batch_size for t in lower.trials] == [2, 44, 40]
    # nothing fits by the check: the search goes on below the guess, from its trials alone
    none = search_batch_size(real, upper=4096, limit_bytes=24 * GIB, guess=guess(None))
    assert none.batch_size is not None
    assert none.batch_size < 44
    assert [t.batch_size for t in none.trials][:2] == [2, 44]


def test_the_check_below_started_later_gives_the_guess_of_the_check_made_at_once():
    source = TracedSource(_tracer(_mlp()))
    limit = 160 * MIB
    first = source.under(limit)(2)
    at_once = traced_guess(source, limit, upper=1 << 16, init_val=2, headroom=0.05)(first)
    started: list[tuple[list[int], float]] = []

    def later(run, sizes, seconds):
        started.append((list(sizes), seconds))
        return lambda: [run(size) for size in sizes]

    given = traced_guess(source, limit, upper=1 << 16, init_val=2, headroom=0.05, later=later)(first)
    assert given is not None
    assert given.settle is not None
    assert len(started) == 1
    assert 0 < len(started[0][0]) <= BELOW
    assert started[0][1] > 0  # a replay's seconds, measured in the search
    assert given.settle() == at_once == dataclasses.replace(given, settle=None)
    # a jagged check lowers the guess it gives after the trial
    jagged = traced_guess(_Jagged(86, {76, 77, 78}), 10**9, upper=1 << 16, init_val=2, later=later)
    lowered = jagged(Trial(2, fits=True))
    assert lowered is not None
    assert lowered.settle is not None
    assert (lowered.size, lowered.settle()) == (86, Guess(75))


def test_with_a_headroom_the_traced_guess_is_the_size_kept_and_runs_alone():
    source = TracedSource(_tracer(_mlp()))
    limit = 160 * MIB
    exact = search_batch_size(source.under(limit), upper=1 << 16, limit_bytes=limit, tolerance=0.0)
    assert exact.batch_size is not None
    assert exact.batch_size > 100
    guess = traced_guess(source, limit, upper=1 << 16, init_val=2, headroom=0.05)
    found = search_batch_size(source.under(limit), upper=1 << 16, limit_bytes=limit, guess=guess)
    assert found.reason == "traced"
    assert [t.batch_size for t in found.trials] == [2, headroom_size(exact.batch_size, 0.05)]
    small = traced_guess(source, limit, upper=1 << 16, init_val=2, headroom=0.0)(found.trials[0])
    assert small == Guess(exact.batch_size, kept=False)  # nothing given up: the edge above it still runs


def test_at_the_upper_bound_the_traced_guess_gives_nothing_up():
    source = TracedSource(_tracer(_mlp()))
    limit = 160 * MIB
    exact = search_batch_size(source.under(limit), upper=1 << 16, limit_bytes=limit, tolerance=0.0)
    assert exact.batch_size is not None
    upper = exact.batch_size // 2  # the data ends before memory does
    guess = traced_guess(source, limit, upper=upper, init_val=2, headroom=0.05)
    found = search_batch_size(source.under(limit), upper=upper, limit_bytes=limit, guess=guess)
    assert (found.batch_size, found.reason) == (upper, "upper_bound")  # as without a trace: nothing given up
    assert [t.batch_size for t in found.trials] == [2, upper]


class _Jagged:
    """Replays that fit up to ``top`` but not at ``holes`` below it (the checkpointed GPT under 24 GiB: 76-78)."""

    def __init__(self, top: int, holes: set[int]) -> None:
        self.top, self.holes, self.asked = top, holes, []

    def under(self, _limit):
        return self

    def __call__(self, size: int) -> Trial:
        self.asked.append(size)
        return Trial(size, fits=size <= self.top and size not in self.holes, peak_bytes=size, samples=size)


def test_a_size_that_fits_above_one_that_does_not_is_not_the_traced_largest():
    found = largest_traced(_Jagged(86, {76, 77, 78}), 10**9, init_val=2, upper=1 << 16, tolerance=0.0)
    assert found.batch_size == 75
    assert found.note == "the replay at 76 does not fit"


def test_where_the_replays_are_monotone_the_traced_largest_is_the_searchs():
    jagged = _Jagged(86, set())
    found = largest_traced(jagged, 10**9, init_val=2, upper=1 << 16, tolerance=0.0)
    plain = search_batch_size(
        _Jagged(86, set()), init_val=2, upper=1 << 16, limit_bytes=10**9, tolerance=0.0
    )
    assert found.batch_size == plain.batch_size == 86
    assert set(range(86 - BELOW, 86)) <= set(jagged.asked)  # the sizes under it were replayed


def test_a_hole_at_the_smallest_sizes_leaves_nothing_that_fits():
    found = largest_traced(_Jagged(10, {1}), 10**9, init_val=2, upper=1 << 16, tolerance=0.0)
    assert found.batch_size is None
    assert found.reason == "nothing_fits"


def _classifier_tracer(activation: nn.Module):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), activation, nn.Linear(256, 10))

    def trace_at(size: int) -> Trace:
        return trace_training(
            net,
            lambda ps: torch.optim.AdamW(ps, lr=1e-3),
            lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
            (torch.zeros(size, 64), torch.zeros(size, dtype=torch.long)),
        )

    return trace_at


def test_a_step_of_measured_ops_alone_is_planned_without_a_margin_and_any_other_op_brings_it():
    measured = TracedSource(_classifier_tracer(nn.GELU()))
    other = TracedSource(_classifier_tracer(nn.ReLU()))
    for source in (measured, other):
        source(8)
    assert measured.unmeasured == set()
    assert trace_margin(measured) == 0.0
    assert other.unmeasured == {"aten.relu", "aten.threshold_backward"}
    assert trace_margin(other) == TRACE_MARGIN
    bare = plan_by_trace(measured, 8, [64 * MIB], upper=1 << 16, outside=0).predictions[0]
    assert bare.band == 0.0
    kept = plan_by_trace(other, 8, [64 * MIB], upper=1 << 16, outside=0).predictions[0]
    assert kept.band == pytest.approx(TRACE_MARGIN * kept.peak)
