"""LayerMemoryProfiler on a real GPU (`pytest -m gpu`): a Linear stack's activations match the analytic sizes."""

from __future__ import annotations

import itertools

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpumem import LayerMemoryProfiler
from tests.helpers.trainer import quiet_trainer

pytestmark = pytest.mark.gpu

BATCH = 256
WIDTHS = [1024, 4096, 4096, 1024]


class Stack(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for inp, out in itertools.pairwise(WIDTHS):
            layers += [nn.Linear(inp, out), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(BATCH * 4, WIDTHS[0])), batch_size=BATCH)


def test_linear_stack_activations_match_the_analytic_sizes(tmp_path):
    profiler = LayerMemoryProfiler(at_step=1, dirpath=tmp_path)
    quiet_trainer(accelerator="gpu", devices=1, max_steps=3, callbacks=[profiler]).fit(Stack())
    by_name = {r.name: r for r in profiler.records}
    for index, out in ((0, 4096), (1, 4096), (2, 4096), (3, 4096), (4, 1024)):
        expected = (
            BATCH * out * 4
        )  # each layer's output, float32: what it leaves alive for the next one's backward
        assert by_name[f"net.{index}"].activation_bytes == pytest.approx(expected, rel=0.05), index
    for index, (inp, out) in enumerate(itertools.pairwise(WIDTHS)):
        record = by_name[f"net.{2 * index}"]
        assert record.param_bytes == (inp * out + out) * 4
        assert record.grad_bytes == record.param_bytes
    saved = {index: by_name[f"net.{index}"].saved_bytes for index in range(5)}
    # net.0 saves its input (the batch), each ReLU its output; the Linears after a ReLU save that same output.
    assert saved == {0: BATCH * WIDTHS[0] * 4, 1: BATCH * 4096 * 4, 2: 0, 3: BATCH * 4096 * 4, 4: 0}
    assert profiler.step_peak_bytes
    assert profiler.step_peak_bytes > sum(r.activation_bytes for r in profiler.records)
    assert (tmp_path / "layer_memory_step1.csv").exists()
    print(f"\n{profiler.table}")


def test_a_layer_csv_that_cannot_be_written_warns_and_training_goes_on(tmp_path):
    import shutil

    from lightning.pytorch.callbacks import Callback

    target = tmp_path / "layers"

    class FillTheDisk(Callback):  # after setup: the directory becomes a file, so the write fails
        def on_train_start(self, trainer, pl_module):
            shutil.rmtree(target)
            target.write_text("not a directory any more")

    profiler = LayerMemoryProfiler(at_step=1, dirpath=target)
    trainer = quiet_trainer(accelerator="gpu", devices=1, max_steps=3, callbacks=[profiler, FillTheDisk()])
    with pytest.warns(UserWarning, match="LayerMemoryProfiler: could not write"):
        trainer.fit(Stack())
    assert trainer.global_step == 3
    assert profiler.table is not None
    assert profiler.csv_path is None
