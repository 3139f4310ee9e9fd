"""A run with every lightning-gpumem curve, then its report: table, PNG and HTML (CPU or GPU).

    python examples/memory_report.py                       # GPU: tuning, then 300 steps; CPU: host memory only
    python -m lightning_gpumem report lightning_logs/memory_report --png memory.png   # the same report again
    tensorboard --logdir lightning_logs                    # then the "Custom Scalars" tab

On a GPU: `MemoryBudget("4GiB")` caps the process as if the card had 4 GiB; `BatchSizeTuner(budget="2.5GiB")`
finds the largest batch size whose training and validation steps fit 2.5 GiB and keeps 95% of it, leaving room for
the rest; every validation allocates a 1 GiB buffer (think: larger shapes in evaluation) that the cache keeps, and
`EmptyCacheOnThreshold(0.75)` gives it back to the device once reserved memory passes 3 GiB;
`MemoryMonitor` logs the per-batch peak, allocated, reserved, NVML and the budget to TensorBoard and writes the
custom-scalars layout. The report at the end reads those logs back. `examples/make_pictures.sh` turns them into the
pictures in docs/
"""

from __future__ import annotations

import argparse
import importlib.util
import logging

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_gpumem import BatchSizeTuner, EmptyCacheOnThreshold, MemoryBudget, MemoryMonitor
from lightning_gpumem._core.units import GIB
from lightning_gpumem.cli import report
from lightning_gpumem.tuning.search import Trial


class Tensors(Dataset):
    """Samples of ``x`` and ``y``, fetched a whole batch at a time (``__getitems__``): batches of tens of thousands
    of samples would otherwise spend most of each step indexing and collating one sample at a time."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        index = torch.as_tensor(indices)
        return [self.x[index], self.y[index]]


def _batch(data: list[torch.Tensor]) -> list[torch.Tensor]:
    return data  # already a batch: `Tensors.__getitems__` stacked it


class DeepMLP(L.LightningModule):
    """An 8-layer MLP (about 0.5 GiB of weights, gradients and AdamW state at width 2048) with a validation spike.

    Eight layers keep each activation a small share of the budget: with two or three layers the few activation
    blocks are so large (1.4 GiB each at the size that fits 8 GiB, measured) that fragmentation alone can exhaust the
    budget.
    """

    def __init__(
        self,
        batch_size: int = 2,
        width: int = 2048,
        depth: int = 8,
        samples: int = 65_536,
        val_spike_gib: float = 1.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()  # BatchSizeTuner writes the size found to hparams.batch_size
        layers: list[nn.Module] = [nn.Linear(1024, width), nn.GELU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 10))
        generator = torch.Generator().manual_seed(0)
        self.data = Tensors(
            torch.randn(samples, 1024, generator=generator), torch.randint(0, 10, (samples,))
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        if self.device.type == "cuda" and batch_idx == 0:
            spike = torch.empty(int(self.hparams.val_spike_gib * GIB), dtype=torch.uint8, device=self.device)
            spike.fill_(1)
            del spike  # freed to the cache, which keeps it reserved
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        return DataLoader(
            self.data, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True, collate_fn=_batch
        )

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=self.hparams.batch_size, collate_fn=_batch)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--budget", default="4GiB", help="the process's cap: '24GiB', '16GB', bytes, or a fraction"
    )
    parser.add_argument("--tune-for", default="2.5GiB", help="the budget the batch size is tuned for")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--logdir", default="lightning_logs")
    parser.add_argument(
        "--png", default=None, help="where to draw the timeline (default: in the run's directory)"
    )
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.INFO)
    gpu = torch.cuda.is_available()

    L.seed_everything(0)
    logger = TensorBoardLogger(args.logdir, name="memory_report")
    trainer = L.Trainer(
        max_steps=args.steps,
        val_check_interval=max(1, args.steps // 4),
        limit_val_batches=4,
        check_val_every_n_epoch=None,
        logger=logger,
        log_every_n_steps=5,
        callbacks=[
            MemoryBudget(args.budget),
            BatchSizeTuner(budget=args.tune_for, max_val=None if gpu else 64),
            EmptyCacheOnThreshold(threshold=0.75, min_steps_between=1),
            MemoryMonitor(log_every_n_steps=5),
        ],
        enable_checkpointing=False,
        precision="bf16-mixed" if gpu else "32-true",
    )
    model = DeepMLP(width=2048 if gpu else 256, samples=65_536 if gpu else 2_048)
    trainer.fit(model)
    tuner = next(c for c in trainer.callbacks if isinstance(c, BatchSizeTuner))  # type: ignore[attr-defined]
    print("\ntuner trials (batch size, ran, peak reserved GiB):")

    def peak(t: Trial) -> str:  # `-`: nothing measured (a CPU)
        return "-" if t.peak_bytes is None else f"{t.peak_bytes / GIB:.2f}"

    print(", ".join(f"({t.batch_size}, {t.fits}, {peak(t)})" for t in tuner.trials))
    print()
    png = args.png or f"{logger.log_dir}/memory.png"
    report(
        logger.log_dir,
        png=png if importlib.util.find_spec("matplotlib") else None,
        html=f"{logger.log_dir}/memory.html",
    )


if __name__ == "__main__":
    main()
