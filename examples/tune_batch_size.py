"""BatchSizeTuner: find the largest batch size that fits a memory budget, then train with it (GPU; simulated on CPU).

    python examples/tune_batch_size.py                    # tune for a 4 GiB budget, then 100 steps
    python examples/tune_batch_size.py --budget 24GiB     # prove the run fits a 24 GiB card on a bigger one

On a GPU the trials are capped at the budget (`torch.cuda.set_per_process_memory_fraction`), so the size found
fits a card of that size: the trials past it run out of memory for real. On a CPU (or with `--simulate`) nothing
runs out of memory, so a simulated GPU stands in (`examples/_simulated_gpu.py`): an 80 GiB card capped at the
budget, whose memory each sample's activations fill with 48 MiB, and the model raises the `OutOfMemoryError` a GPU
would past the cap. The search, its trials and the size chosen are the tuner's own; the memory is simulated.
"""

from __future__ import annotations

import argparse
import logging

import lightning as L
import torch
from _simulated_gpu import GIB, MIB, SimulatedGPU
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_gpumem import BatchSizeTuner, MemoryMonitor
from lightning_gpumem._core.units import parse_budget

SEQ, FEATURES = 64, 256
SIMULATED_SAMPLE_BYTES = 48 * MIB  # the activations of one sample on the simulated GPU


class Sequences(Dataset):
    """``n`` sequences of ``SEQ`` random feature vectors, drawn on the fly; the label: the first feature's sign."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        x = torch.randn(SEQ, FEATURES, generator=torch.Generator().manual_seed(index))
        return x, int(x[0, 0] > 0)


class TokenMLP(L.LightningModule):
    """An MLP over every position of a sequence, mean-pooled; ``simulated``: it moves that GPU's memory instead."""

    def __init__(
        self, batch_size: int = 2, width: int = 2048, simulated: SimulatedGPU | None = None
    ) -> None:
        super().__init__()
        self.save_hyperparameters(
            ignore="simulated"
        )  # BatchSizeTuner writes the size found to hparams.batch_size
        self.net = nn.Sequential(
            nn.Linear(FEATURES, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 2)
        )
        self.simulated = simulated
        if simulated is not None:  # weights, gradients and AdamW's two moments stay allocated
            simulated.allocate(4 * sum(p.numel() * p.element_size() for p in self.parameters()))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.simulated is not None:
            self.simulated.spike(len(x) * SIMULATED_SAMPLE_BYTES)  # raises OutOfMemoryError past the cap
        loss = nn.functional.cross_entropy(self.net(x).mean(1), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        if self.simulated is not None:
            self.simulated.spike(len(x) * SIMULATED_SAMPLE_BYTES // 2)  # no graph kept: less than training
        self.log("val_loss", nn.functional.cross_entropy(self.net(x).mean(1), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        return DataLoader(Sequences(2**17), batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(Sequences(2**12), batch_size=self.hparams.batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--budget", default="4GiB", help="memory budget: '24GiB', '16GB', bytes, or a fraction"
    )
    parser.add_argument("--max-val", type=int, default=4096)
    parser.add_argument("--logdir", default="lightning_logs")
    parser.add_argument("--simulate", action="store_true", help="simulate the GPU (the default without one)")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.INFO)
    budget = (
        float(args.budget)
        if args.budget.replace(".", "", 1).isdigit() and "." in args.budget
        else args.budget
    )

    simulated = None
    if args.simulate or not torch.cuda.is_available():
        simulated = SimulatedGPU(total=80 * GIB, limit=parse_budget(budget, 80 * GIB, "tune_batch_size"))
        simulated.install()
        print(
            f"simulated: {simulated.why}; a simulated 80 GiB card capped at the {simulated.limit / GIB:.1f} GiB budget"
            f" stands in, each sample taking {SIMULATED_SAMPLE_BYTES // MIB} MiB of it (past the cap the model raises"
            " the OutOfMemoryError a GPU would)."
        )
    tuner = BatchSizeTuner(budget=budget, max_val=args.max_val)
    trainer = L.Trainer(
        accelerator="cpu" if simulated else "auto",
        max_steps=100,
        val_check_interval=50,
        limit_val_batches=4,
        logger=TensorBoardLogger(args.logdir, name="tune_batch_size"),
        callbacks=[tuner, MemoryMonitor(log_every_n_steps=10)],
        enable_checkpointing=False,
    )
    model = TokenMLP(
        width=128 if simulated else 2048, simulated=simulated
    )  # a narrow model: CPU steps stay fast
    trainer.fit(model)
    print(f"\nbatch size used: {model.hparams.batch_size}")
    for trial in tuner.trials:
        peak = "-" if trial.peak_bytes is None else f"{trial.peak_bytes / GIB:.2f} GiB"
        print(f"  trial batch_size={trial.batch_size:>5}  {'ok ' if trial.fits else 'OOM'}  peak {peak}")
    if simulated:
        print(
            f"(simulated: {simulated.why}; the peaks and OOMs above are the simulated GPU's, not measured)"
        )


if __name__ == "__main__":
    main()
