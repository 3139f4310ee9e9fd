"""OOM forensics: OOMSnapshot and LayerMemoryProfiler on a small model (GPU; partly simulated on CPU).

    python examples/oom_forensics.py              # profile the layers at step 1, snapshot at step 3
    python examples/oom_forensics.py --oom        # also run out of memory at step 5 under a 2 GiB MemoryBudget

On a GPU: `LayerMemoryProfiler(at_step=1)` prints which layer keeps how much memory for backward (and writes a CSV);
`OOMSnapshot(at_steps=[3])` writes snapshot_rank0_step3.pickle/.html; with `--oom` a 3 GiB allocation at step 5 fails
under the 2 GiB budget and OOMSnapshot writes oom_rank0_step5.pickle/.html, prints the failed allocation and the
largest live ones with the lines that made them, and the OutOfMemoryError reaches this script.
On a CPU (or with `--simulate`) a simulated 2 GiB GPU stands in (`examples/_simulated_gpu.py`): the weights, the
gradients, the batch and each layer's output take their bytes of it. LayerMemoryProfiler reads it: parameters,
gradients and what autograd saves are the CPU step's tensors, activations and peaks the simulated GPU's. OOMSnapshot
needs CUDA's allocator history and writes nothing; with `--oom` the simulated GPU raises the OOM, and this script
writes the page OOMSnapshot would from the simulated GPU's record of its allocations (simulated_oom_rank0_step5.html).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
from _simulated_gpu import GIB, SimulatedGPU
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpumem import LayerMemoryProfiler, MemoryBudget, MemoryMonitor, OOMSnapshot


class Model(L.LightningModule):
    """An MLP; ``simulated``: its weights, gradients, batch and layer outputs take their bytes of that GPU."""

    def __init__(self, oom_at: int | None, simulated: SimulatedGPU | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 10)
        )
        self.oom_at, self.simulated = oom_at, simulated
        self.step_blocks: list[int] = []  # this step's batch and layer outputs on the simulated GPU
        if simulated is not None:
            simulated.allocate(2 * sum(p.nbytes for p in self.parameters()))  # weights and gradients
            for layer in self.net:
                layer.register_forward_hook(
                    lambda module, args, out: self.step_blocks.append(simulated.allocate(out.nbytes))
                )

    def training_step(self, batch, batch_idx):
        if self.global_step == self.oom_at:
            self.build_a_huge_buffer()
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def build_a_huge_buffer(self) -> torch.Tensor:
        if self.simulated is not None:
            self.simulated.allocate(3 * GIB)  # raises the simulated GPU's OutOfMemoryError
        return torch.empty(3 * GIB, dtype=torch.uint8, device=self.device)  # the line the report points at

    def on_train_batch_start(self, batch, batch_idx):
        if self.simulated is not None:
            self.step_blocks.append(self.simulated.allocate(sum(t.nbytes for t in batch)))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        while self.step_blocks:
            self.simulated.free(self.step_blocks.pop())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def write_simulated_report(simulated: SimulatedGPU, trainer: L.Trainer) -> Path:
    """The page and the report OOMSnapshot writes on a GPU, here from the simulated GPU's record of its allocations."""
    from lightning_gpumem._core.snapshot_report import (  # OOMSnapshot's own (private) writer
        format_report,
        render_html,
    )

    title = f"simulated oom on rank 0 at step {trainer.global_step}"
    path = Path(trainer.log_dir) / f"simulated_oom_rank0_step{trainer.global_step}.html"
    path.write_text(render_html(simulated.snapshot(), title), encoding="utf-8")
    print(f"OOMSnapshot's report, simulated: {title}\n  {path}\n{format_report(simulated.snapshot())}")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--oom", action="store_true", help="allocate 3 GiB at step 5 under a 2 GiB budget")
    parser.add_argument("--logdir", default="lightning_logs")
    parser.add_argument("--simulate", action="store_true", help="simulate the GPU (the default without one)")
    args = parser.parse_args()

    simulated = None
    if args.simulate or not torch.cuda.is_available():
        simulated = SimulatedGPU(total=2 * GIB).install()
        print(
            f"simulated: {simulated.why}; a simulated 2 GiB card stands in for MemoryBudget('2GiB'). In the layer"
            " table, params, grads and saved are the CPU step's tensors; activations and peaks are the simulated GPU's."
        )
    L.seed_everything(0)
    train = DataLoader(
        TensorDataset(torch.randn(4096, 512), torch.randint(0, 10, (4096,))), 256, shuffle=True
    )
    snapshot = OOMSnapshot(at_steps=[3])
    trainer = L.Trainer(
        accelerator="cpu" if simulated else "auto",
        max_steps=8,
        logger=CSVLogger(args.logdir, name="oom_forensics"),
        callbacks=[MemoryBudget("2GiB"), snapshot, LayerMemoryProfiler(at_step=1), MemoryMonitor()],
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    written: list[Path] = []
    try:
        trainer.fit(Model(oom_at=5 if args.oom else None, simulated=simulated), train)
    except torch.OutOfMemoryError as error:
        print(f"\nThe original error reached the script: {str(error).splitlines()[0]}")
        if simulated is not None:
            written.append(write_simulated_report(simulated, trainer))
    written += [*snapshot.paths, *sorted(Path(trainer.log_dir).glob("layer_memory_step*.csv"))]
    print("\nfiles written:", *written, sep="\n  ")
    if simulated is not None:
        print(
            f"(simulated: {simulated.why}; OOMSnapshot needs CUDA's allocator history and wrote no snapshot itself)"
        )


if __name__ == "__main__":
    main()
