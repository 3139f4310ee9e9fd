"""Keep memory in bounds: MemoryBudget, EmptyCacheOnThreshold and MemoryMonitor's leak detection (CPU or GPU).

    python examples/keep_memory_in_bounds.py                # a run with a validation spike, capped at 4 GiB
    python examples/keep_memory_in_bounds.py --leak         # the same model keeping every layer's output, every step

On a GPU:
- `MemoryBudget("4GiB")` caps the process as if the card had 4 GiB (an allocation past it raises OutOfMemoryError);
- each validation allocates a 2 GiB spike that the caching allocator would keep; `EmptyCacheOnThreshold` gives it
  back to the device after validation (above 25% of the budget), and logs `gpumem/cache_releases` and
  `gpumem/released_gib`;
- `MemoryMonitor` logs `gpumem/budget_gib`, shows `mem=peak/budget` in the progress bar and, with `--leak`, warns
  within a few dozen steps that allocated memory keeps growing, with the rate, the step at which the budget runs
  out and the tensors that grew.
On a CPU (or with `--simulate`) there is no allocator cache or cap: `MemoryBudget` and `EmptyCacheOnThreshold` would
warn once and do nothing, and leak detection (which reads the allocator) would be off. A simulated 4 GiB card stands
in (`examples/_simulated_gpu.py`): the model moves its memory by what each step and the validation spike take on a
GPU, and the three callbacks read it; the releases and the leak warning are theirs, the memory is simulated.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from _simulated_gpu import GIB, SimulatedGPU
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpumem import EmptyCacheOnThreshold, MemoryBudget, MemoryMonitor


class SpikyModel(L.LightningModule):
    """An MLP whose validation steps allocate `val_spike_bytes` on the device; `leak` keeps every layer's outputs.

    `simulated`: the model moves that simulated GPU's memory by the bytes its tensors take.
    """

    def __init__(self, val_spike_bytes: int, leak: bool, simulated: SimulatedGPU | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1)
        )
        self.val_spike_bytes, self.leak, self.simulated = val_spike_bytes, leak, simulated
        self.kept: list[list[torch.Tensor]] = []
        if simulated is not None:  # weights, gradients and AdamW's two moments stay allocated
            simulated.allocate(4 * sum(p.numel() * p.element_size() for p in self.parameters()))

    def training_step(self, batch, batch_idx):
        x, y = batch
        outputs = [x]
        for layer in self.net:
            outputs.append(layer(outputs[-1]))
        loss = nn.functional.mse_loss(outputs[-1].squeeze(-1), y)
        if self.leak:
            self.kept.append(
                outputs[1:]
            )  # the bug `--leak` shows: every layer's output of every step kept (4 MiB)
        if self.simulated is not None:  # those outputs on the simulated GPU: freed after the step, or kept
            handle = self.simulated.allocate(sum(output.nbytes for output in outputs[1:]))
            if not self.leak:
                self.simulated.free(handle)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        if self.simulated is not None:
            self.simulated.spike(
                self.val_spike_bytes
            )  # freed to the simulated cache, which keeps it reserved
        elif self.device.type != "cpu":
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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--leak", action="store_true", help="keep every loss with its graph (a memory leak)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--logdir", default="lightning_logs")
    parser.add_argument("--simulate", action="store_true", help="simulate the GPU (the default without one)")
    args = parser.parse_args()

    simulated = None
    if args.simulate or not torch.cuda.is_available():
        simulated = SimulatedGPU(total=4 * GIB).install()
        print(
            f"simulated: {simulated.why}; a simulated 4 GiB card stands in for MemoryBudget('4GiB') (a cap only CUDA"
            " has): the model moves its memory, the callbacks read it."
        )
    L.seed_everything(0)
    release = EmptyCacheOnThreshold(threshold=0.25)  # of the 4 GiB budget: release above 1 GiB held
    trainer = L.Trainer(
        accelerator="cpu" if simulated else "auto",
        max_steps=args.steps,
        val_check_interval=40,
        limit_val_batches=2,
        # No sanity check: it would run the process's first matrix product after the first spike is freed, and cuBLAS
        # would put its workspace inside the cached spike, which then could not be given back (fragmentation).
        num_sanity_val_steps=0,
        logger=CSVLogger(args.logdir, name="keep_memory_in_bounds"),
        log_every_n_steps=10,
        callbacks=[MemoryBudget("4GiB"), release, MemoryMonitor(log_every_n_steps=10)],
        enable_checkpointing=False,
    )
    train = DataLoader(make_data(16_384, seed=0), batch_size=256, shuffle=True)
    val = DataLoader(make_data(1_024, seed=1), batch_size=256)
    trainer.fit(SpikyModel(val_spike_bytes=2 * GIB, leak=args.leak, simulated=simulated), train, val)
    print(
        f"\ncache releases: {release.releases}, given back: {release.released_bytes / GIB:.2f} GiB"
        f" in {release.release_seconds * 1e3:.1f} ms; metrics in {trainer.logger.log_dir}"  # type: ignore[union-attr]
    )
    if simulated:
        print(
            f"(simulated: {simulated.why}; the memory given back and any leak are the simulated GPU's, not measured)"
        )


if __name__ == "__main__":
    main()
