"""BatchSizeTuner on a real GPU (`pytest -m gpu`): budget enforced, real OOMs, memory released, fit fits."""

from __future__ import annotations

import gc
import math

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpumem import BatchSizeTuner
from lightning_gpumem._core.units import GIB
from lightning_gpumem.tuning.search.headroom import TUNER_TOLERANCE
from tests.helpers.trainer import quiet_trainer

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:`weights_only` was not set")]


class WideMLP(LightningModule):
    """~38M parameters (AdamW: ~0.6 GiB fixed) and ~0.1 MiB of activations per sample."""

    def __init__(self, batch_size: int = 2) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.net = nn.Sequential(
            nn.Linear(1024, 4096),
            nn.GELU(),
            nn.Linear(4096, 4096),
            nn.GELU(),
            nn.Linear(4096, 4096),
            nn.GELU(),
            nn.Linear(4096, 10),
        )
        generator = torch.Generator().manual_seed(0)
        self.data = TensorDataset(
            torch.randn(32768, 1024, generator=generator), torch.randint(0, 10, (32768,))
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        # drop_last: every training batch has the shape the trials ran. A smaller last batch is a shape no trial saw,
        # and at ~12k samples per batch here it is a third of an epoch of 2.6 batches (docs/batch_size_tuner.md).
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


class Capture(Callback):
    """Allocated memory when fit starts (placed before and after the tuner), without the cuBLAS workspaces.

    The first matmul on a thread creates cuBLAS/cuBLASLt workspaces that live as long as the process (measured on
    the H200: 2 x 32 MiB + 1 MiB after any first training step, tuner or not); they are a library's lazy
    initialisation, not a trace of the trials, so they are dropped before reading.
    """

    def on_fit_start(self, trainer, pl_module):
        torch.cuda.synchronize()
        clear = getattr(
            torch._C, "_cuda_clearCublasWorkspaces", None
        )  # private; absent: counted, test may fail
        if clear is not None:
            clear()
        torch.cuda.empty_cache()
        self.allocated = torch.cuda.memory_allocated()


class CapDuringFit(Callback):
    """Holds the real fit to the same budget, so an over-large size would OOM here."""

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def on_train_start(self, trainer, pl_module):
        torch.cuda.set_per_process_memory_fraction(
            self.budget / torch.cuda.get_device_properties(0).total_memory
        )

    def on_train_end(self, trainer, pl_module):
        torch.cuda.set_per_process_memory_fraction(1.0)


def _warm_up() -> None:
    """One real step without the tuner first: what any first step creates for the whole process (cuBLAS workspaces,
    per thread) then exists before `before` is read, so `after - before` counts only what the tuner left."""
    quiet_trainer(
        accelerator="gpu", devices=1, max_steps=1, limit_val_batches=1, num_sanity_val_steps=0
    ).fit(WideMLP(batch_size=64))
    gc.collect()
    torch.cuda.empty_cache()


def _fit(
    tuner: BatchSizeTuner, model: LightningModule, budget: int, **kwargs
) -> tuple[Trainer, Capture, Capture]:
    _warm_up()
    before, after = Capture(), Capture()
    trainer = quiet_trainer(
        accelerator="gpu",
        devices=1,
        max_steps=5,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        callbacks=[before, tuner, after, CapDuringFit(budget)],
        enable_model_summary=True,
        **kwargs,
    )
    trainer.fit(model)
    return trainer, before, after


def test_budget_is_met_in_few_trials_and_the_fit_fits():
    budget = 2 * GIB
    tolerance = TUNER_TOLERANCE  # how close the search closes in on the boundary
    tuner = BatchSizeTuner(budget="2GiB", headroom=0.05)
    model = WideMLP()
    trainer, before, after = _fit(tuner, model, budget)
    size = tuner.optimal_batch_size
    print(  # shown when an assertion fails
        f"\n2 GiB budget: batch_size={size}, reason {tuner.result.reason}, trials (size, fits, reserved, allocated):"
        f" {[(t.batch_size, t.fits, t.peak_bytes, t.allocated_bytes) for t in tuner.trials]}"
    )
    assert model.batch_size == size > 64
    ran = [t for t in tuner.trials if t.fits]
    largest = max(t.batch_size for t in ran)  # the largest size that ran under the 2 GiB cap
    assert all(t.peak_bytes <= budget for t in ran)
    failed = [t.batch_size for t in tuner.trials if not t.fits and t.batch_size > largest]
    bracketed = tuner.result.reason == "bracketed" and failed
    held = (
        min(failed) - 1 if bracketed else largest
    )  # one less than the smallest failure (within 1-2% above)
    first_choice = min(largest, math.ceil(19 * held / 20))  # at most 5% of it given up
    kept = next(
        t for t in reversed(tuner.trials) if t.batch_size == size
    )  # the size kept, run from the fit's state
    assert kept.fits
    if size != first_choice:  # it did not run (large blocks near a tight cap): the search went on below it
        assert size < first_choice
        assert (first_choice, False) in [(t.batch_size, t.fits) for t in tuner.trials]
    larger = [t for t in tuner.trials if t.batch_size > largest]
    if tuner.result.reason == "bracketed":  # a larger size ran out of memory under the cap, within 1% above
        assert larger
        assert all(not t.fits for t in larger)
        assert min(t.batch_size for t in larger) - largest - 1 <= tolerance * largest
    else:  # one more sample was predicted to cross the budget
        assert tuner.result.reason == "predicted", tuner.result
    assert len(tuner.trials) <= 16
    assert (
        after.allocated - before.allocated < 2**20
    )  # nothing left behind (the logged val_loss is a few bytes)
    assert trainer.global_step == 5  # the real fit ran under the same 2 GiB cap without OOM
    big = torch.empty(3 * GIB, dtype=torch.uint8, device="cuda")  # the cap was lifted afterwards
    del big


def test_real_out_of_memory_errors_are_caught_and_released():
    budget = GIB
    tuner = BatchSizeTuner(budget=budget, init_val=8192)
    model = WideMLP()
    _, before, after = _fit(tuner, model, budget)
    assert not tuner.trials[0].fits  # 8192 samples do not fit in 1 GiB: a real torch.OutOfMemoryError
    assert tuner.optimal_batch_size < 8192
    assert after.allocated - before.allocated < 2**20


class OneCycleMLP(WideMLP):
    """WideMLP whose schedule is built from `estimated_stepping_batches`, the pattern in Lightning's docs."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-4)
        total = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=total)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]


def _plain_fit(model: LightningModule, callbacks: list, budget: int) -> Trainer:
    torch.manual_seed(0)
    trainer = quiet_trainer(
        accelerator="gpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=6,
        limit_val_batches=2,
        callbacks=[*callbacks, CapDuringFit(budget)],
    )
    trainer.fit(model)
    return trainer


def test_a_tuned_fit_equals_the_fit_with_that_size_set_by_hand_after_real_ooms():
    """The conformance contract on the GPU: real OOMs in trials, then the same weights, optimizer and schedule."""
    budget = 2 * GIB
    tuner = BatchSizeTuner(budget="2GiB", init_val=8192)  # the first trial runs out of memory for real
    torch.manual_seed(0)  # the same initial weights in both fits
    tuned = OneCycleMLP()
    tuned_trainer = _plain_fit(tuned, [tuner], budget)
    size = tuner.optimal_batch_size
    assert tuner.result.num_ooms >= 1
    gc.collect()
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    by_hand = OneCycleMLP(batch_size=size)
    hand_trainer = _plain_fit(by_hand, [], budget)
    assert tuned_trainer.global_step == hand_trainer.global_step > 0
    for (name, a), (_, b) in zip(tuned.state_dict().items(), by_hand.state_dict().items()):
        assert torch.equal(a, b), name
    for a, b in zip(tuned_trainer.optimizers[0].state.values(), hand_trainer.optimizers[0].state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    sched_a = tuned_trainer.lr_scheduler_configs[0].scheduler.state_dict()
    sched_b = hand_trainer.lr_scheduler_configs[0].scheduler.state_dict()
    assert sched_a["total_steps"] == sched_b["total_steps"] == hand_trainer.estimated_stepping_batches
    assert sched_a == sched_b
    print(
        f"\nconformance on the GPU: batch_size={size}, {len(tuner.trials)} trials, {tuner.result.num_ooms} OOM"
    )


class Layout(Callback):
    """The allocator when fit starts (placed before the tuner), when training starts, and its peak over two steps."""

    def on_fit_start(self, trainer, pl_module):
        torch.cuda.synchronize()
        self.fit_start = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())

    def on_train_start(self, trainer, pl_module):
        torch.cuda.synchronize()
        self.train_start = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
        torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 1:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_reserved()


def test_the_fit_starts_from_a_fresh_layout_and_a_trial_predicts_it_block_for_block():
    """Trials leave no cuBLAS workspace behind: the fit starts as a fresh process does, and peaks as its trial did.

    In a fresh process (no warm-up here) the first trial's first matrix products make the workspaces (one per
    thread: the backward runs on its own). Kept, they would pin the segments they were cut from and the fit would
    start from another layout than any trial (measured on a GPT: a trial at 38 ran, the fit at 38 after it ran out
    of memory).
    """
    layout = Layout()
    tuner = BatchSizeTuner(budget="2GiB", headroom=0.0, include_validation=False, steps_per_trial=2)
    model = WideMLP()
    trainer = quiet_trainer(
        accelerator="gpu",
        devices=1,
        max_steps=2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[layout, tuner, CapDuringFit(2 * GIB)],
    )
    trainer.fit(model)
    (allocated, reserved), (allocated_before, reserved_before) = layout.train_start, layout.fit_start
    assert (
        0 <= allocated - allocated_before < 2**20
    )  # only the weights, as before the trials (and a few scalars)
    assert 0 <= reserved - reserved_before <= 2 * 2**20  # at most one small-pool segment for those scalars
    trial = next(t for t in tuner.trials if t.batch_size == tuner.optimal_batch_size and t.fits)
    assert layout.peak == trial.peak_bytes  # the same allocations in the same order: the same blocks
    print(
        f"\nfresh layout: fit start {layout.fit_start}, train start {layout.train_start}; size"
        f" {tuner.optimal_batch_size}: trial peak {trial.peak_bytes}, fit peak {layout.peak}"
    )
