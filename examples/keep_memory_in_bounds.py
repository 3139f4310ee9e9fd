"""Keep memory in bounds: MemoryBudget, EmptyCacheOnThreshold and MemoryMonitor's leak detection (CPU or GPU).

    python examples/keep_memory_in_bounds.py                # a run with a validation spike, capped at 4 GiB
    python examples/keep_memory_in_bounds.py --leak         # the same model keeping every loss with its graph

On a GPU:
- `MemoryBudget("4GiB")` caps the process as if the card had 4 GiB (an allocation past it raises OutOfMemoryError);
- each validation allocates a 2 GiB spike that the caching allocator would keep; `EmptyCacheOnThreshold` gives it
  back to the device after validation (above 25% of the budget), and logs `gpumem/cache_releases` and
  `gpumem/released_gib`;
- `MemoryMonitor` logs `gpumem/budget_gib`, shows `mem=peak/budget` in the progress bar and, with `--leak`, warns
  within a few dozen steps that allocated memory keeps growing, with the rate, the step at which the budget runs
  out and the tensors that grew.
On a CPU there is no allocator cache or cap: the first two warn once and do nothing, and leak detection (which reads
the allocator) is off; the run completes.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpumem import EmptyCacheOnThreshold, MemoryBudget, MemoryMonitor
from lightning_gpumem._units import GIB


class SpikyModel(L.LightningModule):
    """An MLP whose validation steps allocate `val_spike_bytes` on the device; `leak` keeps every loss's graph."""

    def __init__(self, val_spike_bytes: int, leak: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1))
        self.val_spike_bytes, self.leak = val_spike_bytes, leak
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.losses.append(loss if self.leak else loss.detach())  # the bug `--leak` shows: graphs kept alive
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        if self.device.type != "cpu":
            spike = torch.empty(self.val_spike_bytes, dtype=torch.uint8, device=self.device)
            spike.fill_(0)  # a one-off large buffer (think: a validation pass with larger shapes)
            del spike
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x).squeeze(-1), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def make_data(n: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 256, generator=generator)
    return TensorDataset(x, x[:, :8].sum(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--leak", action="store_true", help="keep every loss with its graph (a memory leak)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--logdir", default="lightning_logs")
    args = parser.parse_args()

    L.seed_everything(0)
    release = EmptyCacheOnThreshold(threshold=0.25)  # of the 4 GiB budget: release above 1 GiB held
    trainer = L.Trainer(
        max_steps=args.steps,
        val_check_interval=40,
        limit_val_batches=2,
        logger=CSVLogger(args.logdir, name="keep_memory_in_bounds"),
        log_every_n_steps=10,
        callbacks=[MemoryBudget("4GiB"), release, MemoryMonitor(log_every_n_steps=10)],
        enable_checkpointing=False,
    )
    train = DataLoader(make_data(16_384, seed=0), batch_size=256, shuffle=True)
    val = DataLoader(make_data(1_024, seed=1), batch_size=256)
    trainer.fit(SpikyModel(val_spike_bytes=2 * GIB, leak=args.leak), train, val)
    print(
        f"\ncache releases: {release.releases}, given back: {release.released_bytes / GIB:.2f} GiB"
        f" in {release.release_seconds * 1e3:.1f} ms; metrics in {trainer.logger.log_dir}"  # type: ignore[union-attr]
    )


if __name__ == "__main__":
    main()
