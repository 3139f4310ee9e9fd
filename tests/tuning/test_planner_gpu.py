"""MemoryPlanner and the predicting BatchSizeTuner on a real GPU (`pytest -m gpu`): real peaks, real caps, real OOMs."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpumem import BatchSizeTuner, MemoryPlanner
from lightning_gpumem._core.units import GIB
from tests.helpers.trainer import quiet_trainer

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:`weights_only` was not set")]


class MLP(LightningModule):
    """~38M parameters (AdamW: ~0.6 GiB fixed) on 64 tokens a sample: a few MiB of activations per sample."""

    def __init__(self, batch_size: int = 64) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.net = nn.Sequential(
            nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(),
            nn.Linear(4096, 10),
        )  # fmt: skip
        generator = torch.Generator().manual_seed(0)
        self.data = TensorDataset(
            torch.randn(2048, 64, 1024, generator=generator), torch.randint(0, 10, (2048,))
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).mean(dim=1), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x).mean(dim=1), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


class Peaks(Callback):
    """The fit's own peak allocated and reserved bytes (from the first training batch on), under an optional cap."""

    def __init__(self, cap: int | None = None) -> None:
        self.cap, self.allocated, self.reserved = cap, 0, 0

    def on_train_start(self, trainer, pl_module):
        if self.cap is not None:
            torch.cuda.set_per_process_memory_fraction(
                self.cap / torch.cuda.get_device_properties(0).total_memory
            )
        torch.cuda.reset_peak_memory_stats()

    def on_train_end(self, trainer, pl_module):
        self.allocated, self.reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        torch.cuda.set_per_process_memory_fraction(1.0)


def _fit(model, *callbacks, **kwargs):
    trainer = quiet_trainer(
        accelerator="gpu", devices=1, max_steps=3, limit_val_batches=1, num_sanity_val_steps=0,
        callbacks=list(callbacks), **kwargs,
    )  # fmt: skip
    trainer.fit(model)
    return trainer


def test_the_plan_predicts_the_real_fits_peak_and_each_budgets_largest_size_runs_under_it():
    planner, peaks = MemoryPlanner(budgets=["8GiB", "4GiB"]), Peaks()
    model = MLP(batch_size=96)
    _fit(model, planner, peaks)
    plan = planner.plan
    print(
        f"\nplan: probes {[p.size for p in plan.probes]}, predictions {planner.predictions}, seconds {planner.seconds}"
    )
    assert plan.verdict == "settled"
    assert plan.need(96) == pytest.approx(peaks.allocated, rel=0.05)  # the fit at the user's size, planned
    assert plan.outside is None or 0 < plan.outside < 4 * GIB  # the CUDA context, as NVML sees it
    eight, four = planner.predictions
    assert eight.validated  # each ran in a trial under its budget's cap
    assert four.validated
    assert eight.largest > four.largest > 96
    for prediction in (
        eight,
        four,
    ):  # and runs again in a fit capped at the budget less the memory outside PyTorch
        fitted = Peaks(cap=prediction.limit)
        trainer = _fit(MLP(batch_size=prediction.largest), fitted)
        assert trainer.global_step == 3
        assert fitted.reserved <= prediction.limit


def test_stop_is_a_dry_run_on_the_gpu():
    planner = MemoryPlanner(budgets=["4GiB"], validate=False, stop=True)
    trainer = _fit(MLP(), planner)
    assert planner.plan is not None
    assert trainer.global_step == 0
    assert planner.probe_seconds is not None
    assert planner.probe_seconds < 30


def test_the_tuner_predicts_validates_and_closes_in_with_real_out_of_memory_errors():
    tuner = BatchSizeTuner(budget="4GiB", headroom=0.0)
    model = MLP()
    trainer = _fit(model, tuner, Peaks(cap=4 * GIB))
    result = tuner.result
    print(
        f"\n4 GiB: {result.batch_size}, {result.reason}, {[(t.batch_size, t.fits) for t in result.trials]}"
    )
    for t in result.trials:  # the peaks each move read
        print(
            f"  {t.batch_size}: reserved {t.peak_bytes}, train {t.train_peak_bytes}, val {t.val_peak_bytes}"
        )
    kept = next(t for t in reversed(result.trials) if t.batch_size == result.batch_size)
    assert kept.fits
    assert kept.peak_bytes <= 4 * GIB
    assert len(result.trials) <= 8  # probe, predict, validate, close
    failed = [t.batch_size for t in result.trials if not t.fits and t.batch_size > result.batch_size]
    if result.reason == "bracketed":  # closed in: the smallest failure above is within 1% (plus one)
        assert min(failed) - result.batch_size - 1 <= 0.01 * result.batch_size + 1
    assert model.batch_size == result.batch_size
    assert trainer.global_step == 3  # and the fit ran at it under the same cap


class FewDraws(MLP):
    """The MLP on 256 tokens a sample (~25 MiB of activations), through a sampler drawing 200 samples an epoch."""

    def __init__(self, batch_size: int) -> None:
        super().__init__(batch_size)
        generator = torch.Generator().manual_seed(0)
        self.data = TensorDataset(
            torch.randn(400, 256, 1024, generator=generator), torch.randint(0, 10, (400,))
        )

    def train_dataloader(self):
        from torch.utils.data import WeightedRandomSampler

        sampler = WeightedRandomSampler([1.0] * len(self.data), num_samples=200, replacement=True)
        return DataLoader(self.data, batch_size=self.batch_size, sampler=sampler)


def test_default_budgets_clamped_to_the_samples_an_epoch_draws_give_a_validated_plan():
    # Issue 41: every default budget's largest size clamps to the 200 samples the sampler draws, so the validation
    # trials run one size several times (was: ZeroDivisionError ending the fit; sizes past 200 never ran).
    sizes: list[int] = []

    class Sizes(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            sizes.append(batch[0].shape[0])

    planner = MemoryPlanner()
    trainer = quiet_trainer(accelerator="gpu", devices=1, max_steps=2, callbacks=[planner, Sizes()])
    trainer.fit(FewDraws(batch_size=8))
    assert trainer.global_step == 2
    assert planner.plan is not None
    assert planner.plan.verdict == "settled"
    probes = [p.size for p in planner.plan.probes]
    assert probes == sorted(set(probes))
    assert max(probes) <= 200
    assert all(p.validated and p.largest == 200 for p in planner.predictions), planner.predictions
    assert sizes[-2:] == [8, 8]  # the fit ran at its own size after the trials
