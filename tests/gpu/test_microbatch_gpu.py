"""AutoMicrobatch on a real GPU (`pytest -m gpu`): a batch of 4x longer sequences under a MemoryBudget."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from lightning_gpumem import AutoMicrobatch, MemoryBudget

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from auto_microbatch import LONG_BATCH, STEPS, TinyLM, budget_between_normal_and_long

pytestmark = pytest.mark.gpu


def _fit(callbacks, precision="32-true", steps=STEPS):
    seed_everything(0)
    model = TinyLM()
    trainer = Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=steps,
        precision=precision,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    torch.cuda.empty_cache()
    return trainer, model


def test_the_long_batch_kills_the_run_without_the_callback_and_not_with_it():
    budget = budget_between_normal_and_long()
    with pytest.raises(torch.OutOfMemoryError):
        _fit([MemoryBudget(budget)])
    callback = AutoMicrobatch()
    with pytest.warns(UserWarning, match=f"at step {LONG_BATCH} with the batch of 16"):
        trainer, _ = _fit([MemoryBudget(budget), callback])
    assert trainer.global_step == STEPS
    assert callback.oom_recoveries >= 1
    assert callback.microbatches == 1  # grown back after the long batch
    print(f"\nbudget {budget}: {callback.oom_recoveries} recoveries")


@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-mixed"])
def test_a_recovered_run_matches_a_run_that_had_room(precision):
    budget = budget_between_normal_and_long()
    _, reference = _fit([], precision=precision, steps=LONG_BATCH + 4)
    with pytest.warns(UserWarning, match="AutoMicrobatch"):
        _, model = _fit([MemoryBudget(budget), AutoMicrobatch()], precision=precision, steps=LONG_BATCH + 4)
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, expected, atol=2e-3 if precision != "32-true" else 1e-4, rtol=0)


def test_a_recovered_oom_leaves_a_snapshot_marked_recovered(tmp_path):
    from lightning_gpumem import OOMSnapshot

    budget = budget_between_normal_and_long()
    with pytest.warns(UserWarning, match="AutoMicrobatch"):
        trainer, _ = _fit([MemoryBudget(budget), OOMSnapshot(dirpath=tmp_path), AutoMicrobatch()], steps=LONG_BATCH + 2)
    assert trainer.global_step == LONG_BATCH + 2
    assert sorted(tmp_path.glob(f"oom_recovered_rank0_step{LONG_BATCH}.*")), sorted(tmp_path.iterdir())
