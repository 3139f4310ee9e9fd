"""Run by test_conformance.py: a tuned DDP fit and the same fit with the size set by hand, in one process pair.

2 CPU processes (gloo). Rank 1 runs out of memory above batch size 24, rank 0 only above 40, so the tuner must agree
on 24 on both ranks. Each rank writes `rank<N>.pt`: the size chosen, the OOM trials, and what each fit left
(`capture` of the test module), for the test to compare.

Usage: python ddp_conformance_script.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_gpumem import BatchSizeTuner
from tests.helpers.fakes import close_process_group
from tests.helpers.trainer import quiet_trainer
from tests.tuning.test_conformance import SEED, Net, capture

INIT = 2


class RankNet(Net):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch.shape[0] > 24:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated on rank 1)")
        return super().training_step(batch, batch_idx)


def fit(root: Path, batch_size: int, tuner: BatchSizeTuner | None) -> tuple[Trainer, dict]:
    seed_everything(SEED)
    model = RankNet(batch_size=batch_size, train_limit=40, n=128)
    trainer = quiet_trainer(
        root,
        devices=2,
        strategy="ddp",
        max_epochs=2,
        max_steps=5,
        log_every_n_steps=1,
        logger=CSVLogger(root / "logs", name="fit1", version=0),
        callbacks=[*([tuner] if tuner else []), ModelCheckpoint(dirpath=root / "ckpt")],
        enable_checkpointing=True,
    )
    trainer.fit(model)
    return trainer, capture(trainer, root)


def main(out_dir: str) -> None:
    out = Path(out_dir)
    tuner = BatchSizeTuner()
    trainer, tuned = fit(out / "tuned", INIT, tuner)
    _, by_hand = fit(out / "by_hand", tuner.optimal_batch_size, None)
    result = {
        "init": INIT,
        "chosen": tuner.optimal_batch_size,
        "ooms": sum(not t.fits for t in tuner.trials),
        "tuned": tuned,
        "by_hand": by_hand,
    }
    torch.save(result, out / f"rank{trainer.global_rank}.pt")
    close_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
