"""EmptyCacheOnThreshold, MemoryBudget and leak detection on a real GPU (`pytest -m gpu`)."""

from __future__ import annotations

import gc

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpumem import EmptyCacheOnThreshold, MemoryBudget, MemoryMonitor, MemoryProbe
from lightning_gpumem._core.units import GIB, MIB

pytestmark = pytest.mark.gpu


class Module(LightningModule):
    """A small MLP; `val_spike` bytes allocated and freed in each validation step; `keep` appends each loss."""

    def __init__(self, val_spike: int = 0, keep: str = "", batch_size: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1))
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


def _trainer(callbacks, **kwargs) -> Trainer:
    defaults = dict(
        accelerator="gpu",
        devices=1,
        max_steps=20,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    defaults.update(kwargs)
    return Trainer(**defaults)


def _clean() -> None:
    gc.collect()
    torch.cuda.empty_cache()


class Reading(Callback):
    """Reserved and NVML process memory at validation end (placed before and after the release callback)."""

    def __init__(self) -> None:
        self.probe = MemoryProbe(torch.device("cuda", torch.cuda.current_device()), nvml=True, host=False)
        self.reserved: list[int] = []
        self.nvml: list[int | None] = []

    def on_validation_end(self, trainer, pl_module):
        torch.cuda.synchronize()
        sample = self.probe.read(nvml=True, host=False)
        self.reserved.append(sample.reserved_bytes)
        self.nvml.append(sample.nvml_process_bytes)


def test_a_validation_spike_of_several_gib_is_given_back_to_the_device():
    _clean()
    before, after = Reading(), Reading()
    release = EmptyCacheOnThreshold(threshold=0.25)  # of an 8 GiB budget: 2 GiB
    trainer = _trainer([MemoryBudget("8GiB"), before, release, after], max_steps=8, val_check_interval=4)
    trainer.fit(Module(val_spike=4 * GIB))
    assert release.releases == 2  # once per validation (steps 4 and 8), not on the training steps
    assert release.released_bytes >= 2 * 4 * GIB
    for held, freed in zip(before.reserved, after.reserved, strict=True):
        assert held - freed >= 4 * GIB  # the allocator's reserved memory dropped by the spike
    if before.nvml[0] is not None:  # NVML sees this process: what nvidia-smi shows dropped too
        for held, freed in zip(before.nvml, after.nvml, strict=True):
            assert held - freed >= 4 * GIB - 64 * MIB
    ms = release.release_seconds * 1e3
    print(f"\nreleased {release.released_bytes / GIB:.2f} GiB in {ms:.1f} ms; NVML {before.nvml} -> {after.nvml}")


def test_memory_budget_caps_the_process_until_teardown():
    _clean()
    outcomes: dict[str, object] = {}

    class TryAllocations(Callback):
        def on_train_start(self, trainer, pl_module):
            try:
                torch.empty(3 * GIB, dtype=torch.uint8, device="cuda")
                outcomes["3GiB"] = "ok"
            except torch.OutOfMemoryError:
                outcomes["3GiB"] = "oom"
            one = torch.empty(GIB, dtype=torch.uint8, device="cuda")
            one.fill_(1)
            outcomes["1GiB"] = "ok"
            del one

    budget = MemoryBudget("2GiB")
    _trainer([budget, TryAllocations()], max_steps=2).fit(Module())
    assert outcomes == {"3GiB": "oom", "1GiB": "ok"}
    assert budget.budget_bytes == 2 * GIB
    big = torch.empty(3 * GIB, dtype=torch.uint8, device="cuda")  # the cap was undone at teardown
    del big
    _clean()


def test_a_loss_kept_with_its_graph_is_flagged_within_50_steps():
    _clean()
    monitor = MemoryMonitor(summary=False)
    with pytest.warns(UserWarning, match=r"allocated memory keeps growing") as record:
        _trainer([monitor], max_steps=60, limit_val_batches=0).fit(Module(keep="graph", batch_size=512))
    assert monitor.leak is not None
    assert monitor.leak.last_step <= 50
    message = next(str(w.message) for w in record if "keeps growing" in str(w.message))
    assert "float32[512, 1024]" in message  # the activations the kept graphs hold, found by the gc scan
    print(f"\n{message}")
    _clean()


def test_the_same_module_with_detach_is_not_flagged_over_300_steps():
    _clean()
    monitor = MemoryMonitor(summary=False)
    _trainer([monitor], max_steps=300, limit_val_batches=0).fit(Module(keep="detached", batch_size=512))
    assert monitor.leak is None
