"""Quickstart: a small real training run with MemoryMonitor and TensorBoard logging (CPU or GPU).

    python examples/quickstart.py            # 9 s on 2 CPU cores with warm caches; uses the GPU if there is one
    tensorboard --logdir lightning_logs      # then open the "gpumem" section, or the "Custom Scalars" tab
    python -m lightning_gpumem report lightning_logs --png memory.png   # a table and a picture of the run

On a GPU you get per-batch peak / allocated / reserved curves, NVML (nvidia-smi) numbers, the non-PyTorch share
and utilisation; on CPU, host memory only. A summary table with advice is printed when the fit ends.
"""

from __future__ import annotations

import argparse
import logging

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpumem import MemoryMonitor


class Classifier(L.LightningModule):
    """An MLP on synthetic data: 32 features, 10 classes."""

    def __init__(self, hidden: int = 512, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(32, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(-1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def make_data(n: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=generator)
    y = (x[:, :10] * torch.arange(1, 11)).argmax(-1)  # a learnable rule
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--logdir", default="lightning_logs")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.INFO)

    L.seed_everything(0)
    train = DataLoader(make_data(20_000, seed=0), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(make_data(4_000, seed=1), batch_size=args.batch_size)
    logger = TensorBoardLogger(args.logdir, name="quickstart")
    trainer = L.Trainer(
        max_epochs=args.epochs,
        logger=logger,
        callbacks=[MemoryMonitor(log_every_n_steps=10)],
        log_every_n_steps=10,
        enable_checkpointing=False,
    )
    trainer.fit(Classifier(), train, val)
    print(
        f"\nTensorBoard logs in {logger.log_dir}\nView them with: tensorboard --logdir {args.logdir}"
        " (the Custom Scalars tab puts each stage's curves in one chart)"
        f"\nSummarize them with: python -m lightning_gpumem report {args.logdir} --png memory.png"
    )


if __name__ == "__main__":
    main()
