"""LayerMemoryProfiler with a fake allocator under a real CPU Trainer: every layer's bytes are known."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpumem import LayerMemoryProfiler
from lightning_gpumem._core.units import MIB
from tests._fakes import FakeProbe


class Keep(nn.Module):
    """A layer whose forward leaves `nbytes` allocated on the fake (its activations) and spikes `temp` more."""

    def __init__(self, fake: FakeProbe, nbytes: int, temp: int = 0) -> None:
        super().__init__()
        self.fake, self.nbytes, self.temp = fake, nbytes, temp

    def forward(self, x):
        self.fake.spike(self.temp)
        self.fake.allocate(self.nbytes)
        return x * 2


class Net(LightningModule):
    def __init__(self, fake: FakeProbe) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.keep1 = Keep(fake, 3 * MIB, temp=5 * MIB)
        self.fc2 = nn.Linear(16, 4)
        self.keep2 = Keep(fake, 1 * MIB)

    def training_step(self, batch, batch_idx):
        return self.keep2(self.fc2(self.keep1(self.fc1(batch[0])))).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=8)


class FakeProfiler(LayerMemoryProfiler):
    def __init__(self, fake: FakeProbe, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fake = fake


def _fit(tmp_path, callback, model, steps=3):
    Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=CSVLogger(tmp_path),
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(model)


def test_each_layer_gets_its_activations_params_grads_and_peaks(tmp_path):
    fake = FakeProbe(base=100 * MIB)
    profiler = FakeProfiler(fake, at_step=1, top_k=3)
    _fit(tmp_path, profiler, Net(fake))
    by_name = {r.name: r for r in profiler.records}
    assert list(by_name) == ["fc1", "keep1", "fc2", "keep2"]  # leaves, in forward order
    assert by_name["keep1"].activation_bytes == 3 * MIB
    assert by_name["keep1"].forward_peak_bytes == 5 * MIB  # the temporary, freed before the forward returned
    assert by_name["keep2"].activation_bytes == 1 * MIB
    assert by_name["fc1"].param_bytes == (8 * 16 + 16) * 4
    assert by_name["fc1"].grad_bytes == by_name["fc1"].param_bytes
    assert by_name["keep1"].param_bytes == 0
    table = profiler.table
    assert table is not None
    assert table.splitlines()[0] == "Layer memory at step 1 (MiB; top 3 of 4 layers by memory saved for backward)"
    assert "saved for backward" in table
    assert "measured peak" in table
    csv_files = list(tmp_path.rglob("layer_memory_step1.csv"))
    assert len(csv_files) == 1
    assert csv_files[0].read_text().splitlines()[2].startswith("keep1,Keep,0,0,3145728,5242880")


class SavedNet(LightningModule):
    """Real tensors on the CPU: fc1 (8->64) saves its input batch, ReLU its output, fc2 (64->16) its input (ReLU's
    output: already counted), the loss's pow its input (outside any module)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 16)

    def training_step(self, batch, batch_idx):
        return self.fc2(self.act(self.fc1(batch[0]))).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(96, 8)), batch_size=32)


def test_memory_saved_for_backward_is_counted_once_per_storage_for_the_layer_that_saved_it(tmp_path):
    fake = FakeProbe(base=100 * MIB)  # device: cpu, so the saved CPU tensors count
    profiler = FakeProfiler(fake, at_step=1)
    _fit(tmp_path, profiler, SavedNet())
    saved = {r.name: r.saved_bytes for r in profiler.records}
    assert saved["fc1"] == 32 * 8 * 4  # its input (the batch); the weight is a parameter, not counted
    assert saved["act"] == 32 * 64 * 4  # its output
    assert saved["fc2"] == 0  # its input is ReLU's output, counted there
    assert "saved outside layers 0.0" in profiler.table  # pow's input (32x16 floats): 2 KiB, shown as 0.0 MiB
    assert profiler._saved_hooks is None  # the hooks were left before backward


def test_only_the_chosen_step_is_profiled_and_hooks_are_removed(tmp_path):
    fake = FakeProbe(base=100 * MIB)
    model = Net(fake)
    profiler = FakeProfiler(fake, at_step=0)
    _fit(tmp_path, profiler, model, steps=2)
    assert profiler.table is not None
    assert profiler.table.startswith("Layer memory at step 0")
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_on_cpu_it_warns_once_and_does_nothing(tmp_path):
    profiler = LayerMemoryProfiler()
    with pytest.warns(UserWarning, match="LayerMemoryProfiler: `cpu` has no allocator statistics"):
        _fit(tmp_path, profiler, BoringModel())
    assert profiler.table is None
    assert not list(tmp_path.rglob("layer_memory_*.csv"))


@pytest.mark.parametrize(("kwargs", "match"), [({"at_step": -1}, r"at_step=-1"), ({"top_k": 0}, r"top_k=0")])
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=r"LayerMemoryProfiler\(" + match):
        LayerMemoryProfiler(**kwargs)
