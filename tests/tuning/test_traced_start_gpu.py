"""``BatchSizeTuner(start="trace")`` on a real GPU (`pytest -m gpu`): the traced size second, the same answer."""

from __future__ import annotations

import pytest
from lightning.pytorch import seed_everything

from lightning_gpumem import BatchSizeTuner
from lightning_gpumem._core.units import GIB
from tests.tuning.test_callback_gpu import WideMLP, _fit

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:`weights_only` was not set")]


def _tuned(start: str, budget: int, headroom: float = 0.0) -> BatchSizeTuner:
    seed_everything(0)
    tuner = BatchSizeTuner(budget=budget, headroom=headroom, start=start)
    _fit(tuner, WideMLP(), budget)
    return tuner


@pytest.mark.parametrize("budget", [2 * GIB, 3 * GIB])
def test_the_traced_start_finds_the_probes_size_in_at_most_as_many_trials(budget):
    traced = _tuned("trace", budget)
    probed = _tuned("probe", budget)
    sizes = [(t.batch_size, t.fits) for t in traced.trials]
    print(
        f"\n{budget / GIB:.0f} GiB: trace {sizes}; probe {[(t.batch_size, t.fits) for t in probed.trials]}"
    )
    assert abs(traced.optimal_batch_size - probed.optimal_batch_size) <= 0.01 * probed.optimal_batch_size
    assert len(traced.trials) <= len(probed.trials)
    assert (
        len(traced.trials) <= 4
    )  # the probe, the traced size, the edge (and the size kept, where it moved)
    assert all(t.peak_bytes <= budget for t in traced.trials if t.fits)


def test_with_the_default_headroom_the_traced_size_less_it_is_kept_after_two_trials():
    budget = 3 * GIB
    traced = _tuned("trace", budget, headroom=0.05)
    probed = _tuned("probe", budget, headroom=0.05)
    largest = _tuned("probe", budget).optimal_batch_size  # the largest size that runs
    sizes = [(t.batch_size, t.fits) for t in traced.trials]
    print(f"\nheadroom 0.05: trace {sizes}; probe {[(t.batch_size, t.fits) for t in probed.trials]}")
    assert (traced.optimal_batch_size, True) in sizes  # the size kept ran
    assert len(traced.trials) <= 3  # the probe and the size kept (a step back where it failed)
    assert abs(traced.optimal_batch_size - probed.optimal_batch_size) <= 0.02 * probed.optimal_batch_size
    assert traced.optimal_batch_size <= largest
