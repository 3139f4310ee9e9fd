"""AutoMicrobatch on a real GPU (`pytest -m gpu`): a batch of 4x longer sequences under a MemoryBudget."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, seed_everything

from lightning_gpumem import AutoMicrobatch, MemoryBudget
from tests.helpers.trainer import quiet_trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from auto_microbatch import LONG_BATCH, STEPS, TinyLM, budget_between_normal_and_long

pytestmark = pytest.mark.gpu


def _fit(callbacks, precision="32-true", steps=STEPS):
    seed_everything(0)
    model = TinyLM()
    trainer = quiet_trainer(
        accelerator="gpu", devices=1, max_steps=steps, precision=precision, callbacks=callbacks
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


class Gradients(Callback):
    """The gradients the optimizer steps with at ``step`` (unscaled: Lightning unscales before this hook)."""

    def __init__(self, step: int) -> None:
        self.step, self.grads = step, None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.step:
            self.grads = [p.grad.detach().float().clone() for p in pl_module.parameters()]


def _relative_error(got, expected):
    return max(
        ((g - e).norm() / e.norm().clamp_min(1e-12)).item() for g, e in zip(got, expected, strict=True)
    )


@pytest.mark.parametrize(
    ("precision", "tolerance"), [("32-true", 1e-4), ("16-mixed", 2e-2), ("bf16-mixed", 2e-2)]
)
def test_a_recovered_step_takes_the_gradients_of_the_step_that_had_room(precision, tolerance):
    """The split step's gradients equal the unsplit step's (up to the order of the sums), and the run goes on alike."""
    budget = budget_between_normal_and_long(
        {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(precision)
    )
    seed_everything(0)
    start = TinyLM()  # the weights both fits start from (`_fit` seeds the same way)
    reference_grads = Gradients(LONG_BATCH)
    _, reference = _fit([reference_grads], precision=precision, steps=LONG_BATCH + 4)
    split_grads, callback = Gradients(LONG_BATCH), AutoMicrobatch()
    with pytest.warns(UserWarning, match=f"at step {LONG_BATCH} with the batch of 16"):
        _, model = _fit(
            [MemoryBudget(budget), callback, split_grads], precision=precision, steps=LONG_BATCH + 4
        )
    assert callback.oom_recoveries >= 1
    grads_error = _relative_error(split_grads.grads, reference_grads.grads)
    # After the step: the weights' distance from the reference, against how far training moved them.
    reference_weights = [r.detach().cpu() for r in reference.parameters()]
    moved = [r - s.detach() for r, s in zip(reference_weights, start.parameters(), strict=True)]
    apart = [m.detach().cpu() - r for m, r in zip(model.parameters(), reference_weights, strict=True)]
    weights_error = max((a.norm() / m.norm()).item() for a, m in zip(apart, moved, strict=True))
    print(f"\n{precision}: gradients {grads_error:.2e}, weights {weights_error:.2e} (relative)")
    assert grads_error <= tolerance
    assert weights_error <= 10 * tolerance


def test_a_recovered_oom_leaves_a_snapshot_marked_recovered(tmp_path):
    from lightning_gpumem import OOMSnapshot

    budget = budget_between_normal_and_long()
    with pytest.warns(UserWarning, match="AutoMicrobatch"):
        trainer, _ = _fit(
            [MemoryBudget(budget), OOMSnapshot(dirpath=tmp_path), AutoMicrobatch()], steps=LONG_BATCH + 2
        )
    assert trainer.global_step == LONG_BATCH + 2
    assert sorted(tmp_path.glob(f"oom_recovered_rank0_step{LONG_BATCH}.*")), sorted(tmp_path.iterdir())


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_update_watch_sees_a_cuda_adamw_update(implementation):
    """The version counters it reads are bumped by the CUDA optimizers' foreach and fused kernels."""
    from tests.helpers.microbatch import watched_step

    result = watched_step(torch.optim.AdamW, device="cuda", **{implementation: True})
    assert result == [False, True, False, True]
