"""OOMSnapshot on a real GPU (`pytest -m gpu`): a forced OOM leaves a pickle, an HTML page and the original error."""

from __future__ import annotations

import pickle

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpumem import MemoryBudget, OOMSnapshot
from lightning_gpumem._core.units import GIB
from tests.helpers.trainer import quiet_trainer

pytestmark = pytest.mark.gpu


class OverBudget(LightningModule):
    """Allocates 3 GiB at training step 2: above a 2 GiB MemoryBudget."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(256, 256)

    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            self.allocate_too_much()
        return self.layer(batch[0]).pow(2).mean()

    def allocate_too_much(self) -> torch.Tensor:
        return torch.empty(3 * GIB, dtype=torch.uint8, device=self.device)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64, 256)), batch_size=8)


class NoOOM(OverBudget):
    def allocate_too_much(self) -> torch.Tensor:
        return torch.empty(0, device=self.device)


def test_a_forced_oom_leaves_a_pickle_an_html_page_and_the_original_error(tmp_path):
    snapshot = OOMSnapshot(dirpath=tmp_path)
    trainer = quiet_trainer(
        accelerator="gpu", devices=1, max_steps=5, callbacks=[MemoryBudget("2GiB"), snapshot]
    )
    with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 3\.00 GiB"):
        trainer.fit(OverBudget())
    pickles = sorted(tmp_path.glob("oom_rank0_step2.pickle"))
    assert pickles, list(tmp_path.iterdir())
    with open(pickles[0], "rb") as f:
        data = pickle.load(f)
    ooms = [e for trace in data["device_traces"] for e in trace if e.get("action") == "oom"]
    assert ooms
    assert any(frame.get("name") == "allocate_too_much" for frame in ooms[-1].get("frames", ()))
    page = (tmp_path / "oom_rank0_step2.html").read_text()
    assert "Failed to allocate 3,072.0 MiB" in page
    assert "allocate_too_much" in page
    events = sum(len(trace) for trace in torch.cuda.memory._snapshot()["device_traces"])
    extra = torch.empty(16 * 2**20, dtype=torch.uint8, device="cuda")
    del extra
    after = sum(len(trace) for trace in torch.cuda.memory._snapshot()["device_traces"])
    assert after == events, "history recording was not turned off at teardown"


def test_at_steps_writes_snapshots_without_an_oom(tmp_path):
    snapshot = OOMSnapshot(dirpath=tmp_path, at_steps=[1, 3])
    quiet_trainer(accelerator="gpu", devices=1, max_steps=4, callbacks=[snapshot]).fit(NoOOM())
    assert sorted(p.name for p in tmp_path.glob("*.pickle")) == [
        "snapshot_rank0_step1.pickle",
        "snapshot_rank0_step3.pickle",
    ]


def test_every_live_allocation_listed_points_at_code_outside_the_libraries_or_says_none_exists(tmp_path):
    from lightning_gpumem._core.snapshot_report import _is_library, format_report

    trainer = quiet_trainer(
        accelerator="gpu",
        devices=1,
        max_steps=5,
        callbacks=[MemoryBudget("2GiB"), OOMSnapshot(dirpath=tmp_path)],
    )
    with pytest.raises(torch.OutOfMemoryError):
        trainer.fit(OverBudget())
    with open(tmp_path / "oom_rank0_step2.pickle", "rb") as f:
        report = format_report(pickle.load(f))
    listed = report.split("largest live allocations", 1)[1].splitlines()[1:]
    assert listed, report
    for line in listed:
        where = line.split(" MiB  ", 1)[1]
        if where.endswith(("(no frame of your code)", "(no stack recorded)")):
            continue
        assert not _is_library(where.rsplit(" in ", 1)[0]), report
    assert (
        "test_snapshot_gpu.py" in report.split("largest live allocations", 1)[0]
    )  # the failed one: this file
    print(f"\n{report}")


def test_a_snapshot_that_cannot_be_written_keeps_the_oom_and_the_callbacks_after_it_run(tmp_path):
    import shutil

    from lightning.pytorch.callbacks import Callback, OnExceptionCheckpoint

    target = tmp_path / "snapshots"

    class FillTheDisk(Callback):  # after setup: the directory becomes a file, so every write fails
        def on_train_start(self, trainer, pl_module):
            shutil.rmtree(target)
            target.write_text("not a directory any more")

    snapshot = OOMSnapshot(dirpath=target)
    trainer = quiet_trainer(
        accelerator="gpu",
        devices=1,
        max_steps=5,
        callbacks=[MemoryBudget("2GiB"), snapshot, FillTheDisk(), OnExceptionCheckpoint(tmp_path / "ckpt")],
        enable_checkpointing=True,
    )
    with (
        pytest.warns(UserWarning, match="OOMSnapshot: could not write the oom snapshot"),
        pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 3\.00 GiB") as raised,
    ):
        trainer.fit(OverBudget())
    assert raised.value.__context__ is None
    assert snapshot.paths == []
    assert (tmp_path / "ckpt" / "on_exception.ckpt").is_file()
    assert not snapshot._recording  # history recording was turned off
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "snapshots"]  # no partial file anywhere
