"""BatchSizeTuner: find the largest batch size that fits a memory budget, then train with it (CPU or GPU).

    python examples/tune_batch_size.py                    # GPU: tunes for a 4 GiB budget; CPU: stops at max_val
    python examples/tune_batch_size.py --budget 24GiB     # prove the run fits a 24 GiB card on a bigger one

On a GPU the trials are capped at the budget (`torch.cuda.set_per_process_memory_fraction`), so the size found
fits a card of that size. On CPU nothing runs out of memory: the search stops at `--max-val` with a warning.
"""

from __future__ import annotations

import argparse
import logging

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpumem import BatchSizeTuner, MemoryMonitor


class WideMLP(L.LightningModule):
    def __init__(self, batch_size: int = 2, width: int = 2048) -> None:
        super().__init__()
        self.save_hyperparameters()  # BatchSizeTuner writes the size found to hparams.batch_size
        self.net = nn.Sequential(
            nn.Linear(256, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10)
        )
        generator = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(16384, 256, generator=generator), torch.randint(0, 10, (16384,)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=self.hparams.batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default="4GiB", help="memory budget: '24GiB', '16GB', bytes, or a fraction")
    parser.add_argument("--max-val", type=int, default=4096 if torch.cuda.is_available() else 256)
    parser.add_argument("--logdir", default="lightning_logs")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.INFO)
    budget = float(args.budget) if args.budget.replace(".", "", 1).isdigit() and "." in args.budget else args.budget

    tuner = BatchSizeTuner(budget=budget, max_val=args.max_val)
    trainer = L.Trainer(
        max_steps=100,
        val_check_interval=50,
        logger=TensorBoardLogger(args.logdir, name="tune_batch_size"),
        callbacks=[tuner, MemoryMonitor(log_every_n_steps=10)],
        enable_checkpointing=False,
    )
    model = WideMLP(width=2048 if torch.cuda.is_available() else 256)
    trainer.fit(model)
    print(f"\nbatch size used: {model.hparams.batch_size}")
    for trial in tuner.trials:
        peak = "-" if trial.peak_bytes is None else f"{trial.peak_bytes / 2**30:.2f} GiB"
        print(f"  trial batch_size={trial.batch_size:>5}  {'ok ' if trial.fits else 'OOM'}  peak {peak}")


if __name__ == "__main__":
    main()
