"""OOM forensics: OOMSnapshot and LayerMemoryProfiler on a small model (CPU or GPU).

    python examples/oom_forensics.py              # profile the layers at step 1, snapshot at step 3
    python examples/oom_forensics.py --oom        # also run out of memory at step 5 under a 2 GiB MemoryBudget

On a GPU:
- `LayerMemoryProfiler(at_step=1)` prints which layer keeps how much memory for backward (and writes a CSV);
- `OOMSnapshot(at_steps=[3])` writes snapshot_rank0_step3.pickle/.html; with `--oom` a 3 GiB allocation at step 5
  fails under the 2 GiB budget and OOMSnapshot writes oom_rank0_step5.pickle/.html, prints the failed allocation
  and the largest live ones with the lines that made them, and the OutOfMemoryError reaches this script.
On a CPU the callbacks warn once and do nothing; the run completes.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpumem import LayerMemoryProfiler, MemoryBudget, MemoryMonitor, OOMSnapshot
from lightning_gpumem._units import GIB


class Model(L.LightningModule):
    def __init__(self, oom_at: int | None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 10))
        self.oom_at = oom_at

    def training_step(self, batch, batch_idx):
        if self.global_step == self.oom_at and self.device.type == "cuda":
            self.build_a_huge_buffer()
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def build_a_huge_buffer(self) -> torch.Tensor:
        return torch.empty(3 * GIB, dtype=torch.uint8, device=self.device)  # the line the report points at

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--oom", action="store_true", help="allocate 3 GiB at step 5 under a 2 GiB budget")
    parser.add_argument("--logdir", default="lightning_logs")
    args = parser.parse_args()

    L.seed_everything(0)
    data = TensorDataset(torch.randn(4096, 512), torch.randint(0, 10, (4096,)))
    snapshot = OOMSnapshot(at_steps=[3])
    trainer = L.Trainer(
        max_steps=8,
        logger=CSVLogger(args.logdir, name="oom_forensics"),
        callbacks=[MemoryBudget("2GiB"), snapshot, LayerMemoryProfiler(at_step=1), MemoryMonitor()],
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    try:
        trainer.fit(Model(oom_at=5 if args.oom else None), DataLoader(data, batch_size=256, shuffle=True))
    except torch.OutOfMemoryError as error:
        print(f"\nThe original error reached the script: {str(error).splitlines()[0]}")
    print("\nfiles written:", *snapshot.paths, sep="\n  ")


if __name__ == "__main__":
    main()
