"""``BatchSizeTuner(start="trace")`` on a real GPU (`pytest -m gpu`): the traced size second, the GPU's verdicts.

The MLP's memory is not monotone in the batch size near these budgets: the allocator's segments fragment
differently at each size (on the H100 at 2 GiB, 10624 runs, 10731 does not, 11737 does). The trace replays
that: where the GPU's allocator did not give its cache back, each size either start tried runs in the replay
exactly where it ran on the GPU. The traced start keeps the largest size below the first one that fails, which
may be below a larger size that runs past a failing one (the probe's search can jump there). At 3 GiB a size
above half the samples is an epoch of one batch: the trials go on into the next epochs, so their second step (the
first with AdamW's state) is tried, as the replay's is.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from lightning.pytorch import seed_everything
from torch import nn

from lightning_gpumem import BatchSizeTuner
from lightning_gpumem._core.kernels import Device
from lightning_gpumem._core.units import GIB
from lightning_gpumem._hw.trace import trace_training
from lightning_gpumem.tuning.search.model import Trial
from lightning_gpumem.tuning.sources.steps import replay_steady
from tests.helpers.trainer import quiet_trainer
from tests.tuning.test_callback_gpu import WideMLP, _fit, _warm_up

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:`weights_only` was not set")]


def _tuned(start: str, budget: int, headroom: float = 0.0, capped_fit: bool = True) -> BatchSizeTuner:
    """The tuner after a fit: under the cap (``capped_fit``), or a fit of one step without it.

    With no headroom the size kept is the largest that ran in the trials, which the fit's later steps may not
    run in the same budget (docs/batch_size_tuner.md, "Limits"): such fits run uncapped; the trials ran under
    the budget either way.
    """
    seed_everything(0)
    tuner = BatchSizeTuner(budget=budget, headroom=headroom, start=start)
    if capped_fit:
        _fit(tuner, WideMLP(), budget)
    else:
        _warm_up()  # as `_fit`: the process's cuBLAS workspaces exist before the trials
        quiet_trainer(
            accelerator="gpu",
            devices=1,
            max_steps=1,
            limit_val_batches=1,
            num_sanity_val_steps=0,
            callbacks=[tuner],
        ).fit(WideMLP())
    return tuner


def _replayed(size: int, budget: int) -> tuple[bool, int]:
    """Whether ``size`` runs in the replay of WideMLP's traced step under ``budget``, and the retries."""
    net = copy.deepcopy(WideMLP().net)

    def loss(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(module(batch[0]), batch[1])

    properties = torch.cuda.get_device_properties(0)
    trace = trace_training(
        net,
        lambda ps: torch.optim.AdamW(ps, lr=1e-4),
        loss,
        (torch.empty(size, 1024), torch.zeros(size, dtype=torch.long)),
        steps=2,
        validate=loss,
        device=Device(properties.multi_processor_count, properties.max_threads_per_multi_processor),
    )
    assert trace.cannot_trace is None
    replayed, _ = replay_steady(trace.events, limit_bytes=budget)
    return replayed.fits, replayed.retries


def _verdicts(trials: list[Trial], budget: int) -> list[tuple[int, bool, int | None, bool, int]]:
    """Per size tried: the GPU's verdict and retries, the replay's."""
    sizes = {t.batch_size: t for t in trials}
    return [(s, t.fits, t.retries, *_replayed(s, budget)) for s, t in sorted(sizes.items())]


@pytest.mark.parametrize("budget", [2 * GIB, 3 * GIB])
def test_the_replay_gives_the_gpus_verdicts_and_the_traced_start_runs_few_trials(budget):
    traced = _tuned("trace", budget, capped_fit=False)
    probed = _tuned("probe", budget, capped_fit=False)
    verdicts = _verdicts([*traced.trials, *probed.trials], budget)
    print(
        f"\n{budget / GIB:.0f} GiB: trace {[(t.batch_size, t.fits) for t in traced.trials]}; probe"
        f" {[(t.batch_size, t.fits) for t in probed.trials]}\n(size, GPU runs, GPU retries, replay runs,"
        f" replay retries): {verdicts}"
    )
    # a size that ran only by the allocator giving its cache back may not run the fit's later steps, which
    # the replay repeats until the layout settles: there the replay may say no
    plain = [(size, gpu, replay) for size, gpu, retries, replay, _ in verdicts if retries == 0 or not gpu]
    assert [(size, gpu) for size, gpu, _ in plain] == [(size, replay) for size, _, replay in plain]
    assert (traced.optimal_batch_size, True) in [(t.batch_size, t.fits) for t in traced.trials]
    assert all(t.peak_bytes <= budget for t in traced.trials if t.fits)
    if budget == 2 * GIB:  # on the H100 the edge above the traced size fails: the search ends there
        assert len(traced.trials) <= min(4, len(probed.trials))  # the probe, the traced size, the edge
        assert traced.optimal_batch_size <= probed.optimal_batch_size


def test_with_a_headroom_the_traced_size_less_it_is_kept_after_two_trials_and_the_fit_runs():
    budget = 3 * GIB
    traced = _tuned("trace", budget, headroom=0.05)  # the fit runs under the cap: an OOM fails the test
    largest = _tuned("probe", budget, capped_fit=False).optimal_batch_size  # the largest size that ran
    sizes = [(t.batch_size, t.fits) for t in traced.trials]
    print(f"\nheadroom 0.05: trace {sizes}; the probe's largest size {largest}")
    assert (traced.optimal_batch_size, True) in sizes  # the size kept ran
    assert len(traced.trials) <= 3  # the probe and the size kept (a step back where it failed)
    assert traced.optimal_batch_size <= largest


# run in a fresh process: a forked child can trace only until its parent's first backward pass on the GPU
_FORKED = """
import json, warnings
from lightning_gpumem._hw.forks import backward_forks
from lightning_gpumem.tuning import traced_start
from lightning_gpumem.tuning.sources import traced
from lightning.pytorch import seed_everything
from lightning_gpumem import BatchSizeTuner
from tests.helpers.trainer import quiet_trainer
from tests.tuning.test_callback_gpu import WideMLP

def tuned():  # no warm-up step: the first tuning is the process's first backward pass
    seed_everything(0)
    tuner = BatchSizeTuner(budget=3 << 30, headroom=0.05, start="trace")
    quiet_trainer(
        accelerator="gpu", devices=1, max_steps=1, limit_val_batches=1, num_sanity_val_steps=0,
        callbacks=[tuner],
    ).fit(WideMLP())
    return [t.batch_size for t in tuner.trials]

added, forks = {}, []
real_add, real_start = traced.TracedSource.add, traced_start.TracedStart.__init__

def add(self, size, trace):
    added.setdefault(str(len(forks)), {})[str(size)] = repr(trace.events)
    return real_add(self, size, trace)

def start(self, *args, **kwargs):
    forks.append(backward_forks())
    return real_start(self, *args, **kwargs)

traced.TracedSource.add, traced_start.TracedStart.__init__ = add, start
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    sizes = [tuned() for _ in range(2)]
warned = [str(w.message) for w in caught if "start='trace'" in str(w.message)]
print(json.dumps({"forks": forks, "added": added, "sizes": sizes, "warned": warned}))
"""


def test_a_fresh_process_traces_in_forked_children_what_it_traces_itself_after_a_backward_pass():
    """The first tuning forks (nothing ran backward yet); the second, after the first fit, traces here."""
    done = subprocess.run(
        [sys.executable, "-c", _FORKED], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\nforks {result['forks']}; sizes tried {result['sizes']}")
    assert result["forks"] == [True, False]  # the first fit's backward passes closed the forked path
    assert not result["warned"]
    forked, here = result["added"]["1"], result["added"]["2"]
    assert sorted(forked) == sorted(here) == ["2", "5"]
    assert forked == here  # a child of a CUDA process traces what the process itself does
    assert all(len(sizes) <= 4 for sizes in result["sizes"])  # the probe, the traced size, the edge
