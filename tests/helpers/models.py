"""Models more than one test module trains: simulated OOMs on the CPU, layers that drive a fake allocator, and the
modules of the GPU tests."""

from __future__ import annotations

import gc

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpumem._core.units import GIB, MIB
from tests.helpers.fakes import FakeProbe


class OOMSteps:
    """Raises the OOM torch raises once a batch is larger than `train_limit` (`val_limit` in validation).

    The steps of `OOMModel`, for a `BoringModel` of either Lightning namespace: ``class OOMModel(OOMSteps,
    BoringModel)`` with ``pytorch_lightning``'s `BoringModel` is the same model under the older namespace.
    """

    def __init__(
        self, batch_size: int = 2, train_limit: int = 10**9, val_limit: int = 10**9, n: int = 640
    ) -> None:
        super().__init__()
        self.batch_size, self.train_limit, self.val_limit = batch_size, train_limit, val_limit
        self.train_data, self.val_data = (
            RandomDataset(32, n),
            RandomDataset(32, 64),
        )  # drawn once, not per reload

    def training_step(self, batch, batch_idx):
        if batch.shape[0] > self.train_limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if batch.shape[0] > self.val_limit:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated, validation)")
        return super().validation_step(batch, batch_idx)

    def train_dataloader(self):
        return DataLoader(self.train_data, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_data, batch_size=self.batch_size)


class OOMModel(OOMSteps, BoringModel):
    """A `BoringModel` with a `batch_size` that runs out of memory above `train_limit` (`val_limit` in validation)."""


class Keep(nn.Module):
    """A layer whose forward leaves `nbytes` allocated on the fake (its activations) and spikes `temp` more."""

    def __init__(self, fake: FakeProbe, nbytes: int, temp: int = 0) -> None:
        super().__init__()
        self.fake, self.nbytes, self.temp = fake, nbytes, temp

    def forward(self, x):
        self.fake.spike(self.temp)
        self.fake.allocate(self.nbytes)
        return x * 2


class LayerNet(LightningModule):
    """Two linear layers, each followed by a `Keep` (3 MiB kept and a 5 MiB spike, then 1 MiB kept) on the fake."""

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


# ---------------------------------------------------------------------------------------------------- GPU
class SpikeModule(LightningModule):
    """Allocates `train_spike` extra bytes on training step `spike_step`, `val_spike` in every validation step."""

    def __init__(self, spike_step: int = -1, train_spike: int = GIB, val_spike: int = 0) -> None:
        super().__init__()
        self.layer = nn.Linear(1024, 1024)
        self.spike_step, self.train_spike, self.val_spike = spike_step, train_spike, val_spike

    def _spike(self, nbytes: int) -> None:
        if nbytes:
            extra = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            extra.fill_(1)
            del extra

    def training_step(self, batch, batch_idx):
        if self.global_step == self.spike_step:
            self._spike(self.train_spike)
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self._spike(self.val_spike)
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(640, 1024)), batch_size=64)

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(128, 1024)), batch_size=64)


class CudaMLP(LightningModule):
    """A small MLP; `val_spike` bytes allocated and freed in each validation step; `keep` appends each loss."""

    def __init__(self, val_spike: int = 0, keep: str = "", batch_size: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1)
        )
        self.val_spike, self.keep, self.batch_size = val_spike, keep, batch_size
        self.kept: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        loss = self.net(batch[0]).pow(2).mean()
        # A second loss kept for a report, computed with grad on: backward never runs through it, so its graph keeps
        # every saved activation alive (the training loss's own saved tensors are freed by its backward, so keeping
        # *that* one grows memory by bytes a step, which no MiB threshold should call a leak).
        report = self.net(batch[0]).abs().mean()
        if self.keep == "graph":
            self.kept.append(report)  # the leak: ~6 MiB of activations a step at batch 512
        elif self.keep == "detached":
            self.kept.append(report.detach())  # a scalar a step
        return loss

    def validation_step(self, batch, batch_idx):
        if self.val_spike:
            extra = torch.empty(self.val_spike, dtype=torch.uint8, device=self.device)
            extra.fill_(1)
            del extra
        return self.net(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(self.batch_size * 8, 1024)), batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(128, 1024)), batch_size=64)


def free_cuda_memory() -> None:
    """Collect garbage and give the allocator's cache back, so a GPU test starts from what the process holds."""
    gc.collect()
    torch.cuda.empty_cache()
