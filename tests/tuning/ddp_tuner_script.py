"""Run by test_ddp_cpu.py: BatchSizeTuner under DDP with 2 CPU processes (gloo).

Rank 1 runs out of memory above batch size 24 (in training) and rank 0 only above 40, so rank 1 fails trials
alone: the tuner must agree on 24 on both ranks without leaving rank 0 waiting in a collective. Both steps log with
`sync_dist=True`: the OOM rank's agreement collective must not pair with the other rank's logging all-reduce.

Usage: python ddp_tuner_script.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_gpumem import BatchSizeTuner
from tests.helpers.fakes import close_process_group
from tests.helpers.trainer import quiet_trainer


class RankOOM(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 2
        self.data = RandomDataset(32, 4096)

    def training_step(self, batch, batch_idx):
        if batch.shape[0] > (24 if self.global_rank == 1 else 40):
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (simulated on rank {self.global_rank})")
        out = super().training_step(batch, batch_idx)
        self.log("train_loss", out["loss"], sync_dist=True)
        return out

    def validation_step(self, batch, batch_idx):
        out = super().validation_step(batch, batch_idx)
        self.log("val_loss", out["x"], sync_dist=True)
        return out

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


def main(out_dir: str) -> None:
    tuner = BatchSizeTuner()
    model = RankOOM()
    trainer = quiet_trainer(
        out_dir,
        devices=2,
        strategy=DDPStrategy(timeout=timedelta(seconds=60)),
        max_steps=3,
        limit_val_batches=1,
        callbacks=[tuner],
    )
    trainer.fit(model)
    result = {
        "rank": trainer.global_rank,
        "batch_size": model.batch_size,
        "trials": [[t.batch_size, t.fits] for t in tuner.trials],
        "global_step": trainer.global_step,
    }
    Path(out_dir, f"tuner_rank{trainer.global_rank}.json").write_text(json.dumps(result))
    close_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
