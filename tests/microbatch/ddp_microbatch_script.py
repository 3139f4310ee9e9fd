"""Run by test_ddp_cpu.py: 2 CPU ranks (gloo); rank 1 alone runs out of memory in some batches.

Usage: python ddp_microbatch_script.py OUT_DIR CASE...
  CASE: WHERE:ACCUMULATE (WHERE: forward or backward), each writing `<WHERE>-<ACCUMULATE>-rank<N>.pt`, all in one
        rank pair; or user-collective alone (the run must fail, not hang).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from lightning_gpumem import AutoMicrobatch
from lightning_gpumem.microbatch import callback as microbatch
from tests.helpers.fakes import close_process_group
from tests.helpers.microbatch import STEPS, Net
from tests.helpers.trainer import quiet_trainer


class RankOneNet(Net):
    """Only rank 1 runs out of memory (its batches of 16 above 5 samples, in the pressure batches)."""

    def training_step(self, batch, batch_idx):
        if self.global_rank != 1:
            self.limit = None
        loss = super().training_step(batch, batch_idx)
        self.log("synced_loss", loss, sync_dist=True)  # a collective in training_step: must not hang either
        return loss


class GathersInStep(RankOneNet):
    """A collective of the user's own inside `training_step`, after the point where rank 1 runs out of memory."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return self.all_gather(loss, sync_grads=True).mean()


class Splits(Callback):
    """The split each optimizer step ran with."""

    def __init__(self, auto: AutoMicrobatch) -> None:
        self.auto, self.history = auto, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.history.append(self.auto.microbatches)


def fit(root: Path, model: Net, callbacks, accumulate: int) -> Trainer:
    trainer = quiet_trainer(
        root,
        devices=2,
        strategy="ddp",
        max_steps=STEPS // 2,
        accumulate_grad_batches=accumulate,
        callbacks=callbacks,
    )
    trainer.fit(model)
    return trainer


def main(out_dir: str, cases: list[str]) -> None:
    out = Path(out_dir)
    if cases == ["user-collective"]:  # must end (the agreement times out), not hang
        microbatch.AGREE_TIMEOUT_S = 5.0
        fit(out, GathersInStep(limit=5, where="forward", pressure={2}), [AutoMicrobatch()], 1)
        return
    for case in cases:
        where, accumulate = case.split(":")
        run_case(out / case.replace(":", "-"), where, int(accumulate))
    close_process_group()


def run_case(out: Path, where: str, accumulate: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    seed_everything(0)
    reference = Net()
    fit(out, reference, [], accumulate)
    seed_everything(0)
    pressure = {3, 5} if accumulate > 1 else range(2, 6)  # with accumulation: second batches of windows
    model = RankOneNet(limit=5, where=where, pressure=pressure)
    auto = AutoMicrobatch(grow_after=4)
    splits = Splits(auto)
    trainer = fit(out, model, [auto, splits], accumulate)
    result = {
        "reference": torch.cat([p.detach().flatten() for p in reference.parameters()]),
        "weights": torch.cat([p.detach().flatten() for p in model.parameters()]),
        "splits": splits.history,
        "recoveries": auto.oom_recoveries,
        "global_step": trainer.global_step,
    }
    torch.save(result, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
