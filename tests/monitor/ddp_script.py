"""Run by test_ddp_cpu.py: 2 CPU processes (gloo). Rank r's fake allocator peaks at (r + 1) GiB on every batch.

Usage: python ddp_script.py LOG_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch.loggers import CSVLogger

from lightning_gpumem import MemoryMonitor
from lightning_gpumem._core.units import GIB
from tests.helpers.fakes import FakeMonitor, FakeProbe, FakeRelease, SpikeModel, close_process_group
from tests.helpers.trainer import quiet_trainer


class RankModel(SpikeModel):
    def training_step(self, batch, batch_idx):
        self.fake.spike((self.global_rank + 1) * GIB)
        return super().training_step(batch, batch_idx)


def main(log_dir: str) -> None:
    probe = FakeProbe(base=0)
    fake_monitor = FakeMonitor(probe, log_every_n_steps=2)
    real_monitor = MemoryMonitor(log_every_n_steps=2)  # real CPU probe: host memory per rank
    release = FakeRelease(
        probe, threshold=1.5 / 24
    )  # mark 1.5 GiB of the fake's 24: rank 1 (2 GiB) releases
    trainer = quiet_trainer(
        devices=2,
        strategy="ddp",
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=0,
        logger=CSVLogger(log_dir),
        callbacks=[fake_monitor, real_monitor, release],
        log_every_n_steps=2,
    )
    trainer.fit(RankModel(probe))
    result = {
        "rank": trainer.global_rank,
        "peaks": fake_monitor.peaks,
        "summary": fake_monitor.summary_text,
        "releases": release.releases,
    }
    Path(log_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    close_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
