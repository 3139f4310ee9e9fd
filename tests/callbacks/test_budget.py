"""MemoryBudget with a fake allocator under a real CPU Trainer, and on a plain CPU."""

from __future__ import annotations

import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_gpumem import MemoryBudget
from lightning_gpumem._core.units import GIB
from tests.helpers.fakes import CudaFakeProbe, FakeBudget, FakeMonitor, column, read_csv_metrics
from tests.helpers.trainer import csv_epoch_trainer


@pytest.mark.parametrize(
    ("budget", "error"), [("24 parsecs", ValueError), (0, ValueError), (1.5, ValueError), ([1], TypeError)]
)
def test_bad_budgets_name_themselves(budget, error):
    with pytest.raises(error, match=r"MemoryBudget\(budget="):
        MemoryBudget(budget)


def test_budget_caps_from_setup_to_teardown_and_restores_the_previous_cap(tmp_path):
    probe = CudaFakeProbe(base=GIB, total=80 * GIB)
    probe.fraction = 0.75  # a cap the user had set before
    seen = []

    class Spy(FakeMonitor):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(probe.fraction)
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    budget = FakeBudget(probe, "20GiB")
    csv_epoch_trainer(tmp_path, [budget, Spy(probe)], limit_train_batches=3, limit_val_batches=0).fit(
        BoringModel()
    )
    assert seen == [pytest.approx(0.25)] * 3
    assert budget.budget_bytes == 20 * GIB
    assert probe.fraction == 0.75  # restored at teardown
    assert column(read_csv_metrics(tmp_path), "gpumem/budget_gib")[0] == pytest.approx(20.0)


def test_budget_above_the_device_warns_and_caps_at_the_device(tmp_path):
    probe = CudaFakeProbe(base=GIB, total=16 * GIB)
    budget = FakeBudget(probe, "24GiB")
    with pytest.warns(
        UserWarning, match=r"MemoryBudget\(budget='24GiB'\) is 24.0 GiB, more than the device's 16.0"
    ):
        csv_epoch_trainer(tmp_path, [budget], limit_train_batches=1, limit_val_batches=0).fit(BoringModel())
    assert budget.budget_bytes == 16 * GIB


def test_budget_fraction_of_the_device(tmp_path):
    probe = CudaFakeProbe(base=GIB, total=80 * GIB)
    budget = FakeBudget(probe, 0.25)
    csv_epoch_trainer(tmp_path, [budget], limit_train_batches=1, limit_val_batches=0).fit(BoringModel())
    assert budget.budget_bytes == 20 * GIB


def test_budget_on_cpu_warns_once_and_does_nothing(tmp_path):
    budget = MemoryBudget("2GiB")
    with pytest.warns(UserWarning, match="MemoryBudget: `cpu` has no memory cap"):
        csv_epoch_trainer(tmp_path, [budget], limit_train_batches=2).fit(BoringModel())
    assert budget.budget_bytes is None


def test_progress_bar_shows_usage_against_the_budget(tmp_path):
    probe = CudaFakeProbe(base=GIB, total=80 * GIB)
    monitor = FakeMonitor(probe)
    trainer = csv_epoch_trainer(
        tmp_path,
        [FakeBudget(probe, "8GiB"), monitor],
        limit_train_batches=2,
        limit_val_batches=0,
        enable_progress_bar=True,
    )
    trainer.fit(BoringModel())
    assert trainer.progress_bar_metrics["mem"] == "1.0/8.0 GiB"


def test_budget_is_undone_when_the_fit_raises(tmp_path):
    """Lightning calls no callback `teardown` after an exception: the cap must still be lifted."""
    probe = CudaFakeProbe(base=GIB, total=80 * GIB)

    class Broken(BoringModel):
        def training_step(self, batch, batch_idx):
            raise ValueError("user bug")

    with pytest.raises(ValueError, match="user bug"):
        csv_epoch_trainer(tmp_path, [FakeBudget(probe, "8GiB")], limit_val_batches=0).fit(Broken())
    assert probe.fraction == 1.0
