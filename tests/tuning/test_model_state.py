"""The tuner's checkpoint file (a sharded strategy, or a host without room for a copy): never left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import lightning_gpumem.tuning.trials.model_state as model_state
    model_state._host_has_room = lambda nbytes: False  # the copy goes through a checkpoint file
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
    from torch.utils.data import DataLoader
    from lightning_gpumem import BatchSizeTuner

    class Slow(BoringModel):
        def __init__(self):
            super().__init__()
            self.batch_size = 2

        def training_step(self, batch, batch_idx):
            time.sleep(float(os.environ["STEP_S"]))
            return super().training_step(batch, batch_idx)

        def train_dataloader(self):
            return DataLoader(RandomDataset(32, 4096), batch_size=self.batch_size)

    os.chdir(sys.argv[2])  # the process's directory is not the run's
    trainer = Trainer(
        default_root_dir=sys.argv[1], max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[BatchSizeTuner(max_val=8)],
    )
    trainer.fit(Slow())
    """
)


def _start(tmp_path: Path, step_s: float) -> tuple[subprocess.Popen, Path, Path]:
    root, cwd = tmp_path / "run", tmp_path / "elsewhere"
    root.mkdir()
    cwd.mkdir()
    env = {**os.environ, "STEP_S": str(step_s), "PYTHONPATH": str(Path(__file__).parents[2])}
    process = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(root), str(cwd)], env=env, stderr=subprocess.PIPE, text=True
    )
    return process, root, cwd


@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or sys.platform == "win32", reason="POSIX signals")
def test_a_sigterm_during_the_trials_removes_the_checkpoint_file(tmp_path):
    # was: `.gpumem_tuner_<uuid>.ckpt` left in the working directory when a scheduler's time limit sent SIGTERM
    process, root, cwd = _start(tmp_path, step_s=5)
    deadline = time.monotonic() + 120
    while (
        not list(root.glob(".gpumem_tuner_*.ckpt"))
        and time.monotonic() < deadline
        and process.poll() is None
    ):
        time.sleep(0.1)
    assert list(root.glob(".gpumem_tuner_*.ckpt")), "the trials never wrote their checkpoint file"
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGTERM, stderr[-2000:]  # it still ends as a SIGTERM ends it
    assert not list(root.glob(".gpumem_tuner_*")), "the checkpoint file was left behind"
    assert not list(cwd.iterdir())  # and nothing went to the process's directory


def test_the_checkpoint_file_is_in_the_runs_directory_and_removed_after_the_trials(tmp_path):
    process, root, cwd = _start(tmp_path, step_s=0)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-2000:]
    assert "Restored all states from the checkpoint at " + str(root) in stderr  # under default_root_dir
    assert not list(root.glob(".gpumem_tuner_*"))
    assert not list(cwd.iterdir())


@pytest.mark.parametrize("one_buffer", [False, True], ids=["each-its-own", "one-buffer"])
def test_the_host_copy_of_tied_weights_is_made_once_and_restores_both_names(monkeypatch, one_buffer):
    import torch

    from lightning_gpumem._hw import host_copy
    from lightning_gpumem.tuning.trials.model_state import _copy_to_host

    if one_buffer:  # the CPU stands in for a device
        monkeypatch.setattr(host_copy, "_sliceable", lambda tensor: tensor.is_contiguous())
        monkeypatch.setattr(host_copy, "MIN_BYTES", 0)

    model = torch.nn.ModuleDict({"head": torch.nn.Linear(4, 6), "embed": torch.nn.Embedding(6, 4)})
    model["embed"].weight = model["head"].weight  # tied, as GPT-2's embedding and head
    halves = torch.arange(8.0)
    state = model.state_dict()
    copy = _copy_to_host({"model": state, "halves": [halves[:4], halves[4:]], "again": halves[:4]})
    assert copy["model"]["head.weight"] is copy["model"]["embed.weight"]
    assert copy["model"]["head.weight"].data_ptr() != state["head.weight"].data_ptr()
    assert copy["again"] is copy["halves"][0]  # the same view of the same storage
    assert copy["halves"][1] is not copy["halves"][0]  # views of other elements: copies of their own
    assert copy["halves"][1].tolist() == [4.0, 5.0, 6.0, 7.0]
    assert copy["model"]._metadata == state._metadata
    buffers = {tensor.untyped_storage().data_ptr() for tensor in copy["model"].values()}
    assert len(buffers) == (1 if one_buffer else 2)
    expected = {key: value.clone() for key, value in state.items()}
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    model.load_state_dict(copy["model"])
    assert all(torch.equal(model.state_dict()[key], value) for key, value in expected.items())


def test_a_conjugate_view_of_a_weight_is_not_taken_for_the_weight_and_both_restore_exactly():
    import torch

    from lightning_gpumem.tuning.trials.model_state import _copy_to_host

    class Complex(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
            self.register_buffer("wc", self.w.detach().conj())  # the same storage, the conjugate values

    model = Complex()
    expected = model.w.detach().clone()
    copy = _copy_to_host(model.state_dict())
    assert copy["w"] is not copy["wc"]
    with torch.no_grad():
        model.w.add_(1.0)
    model.load_state_dict(copy)
    assert torch.equal(model.w.detach(), expected)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_nested_tensor_in_a_state_is_copied_as_before():
    import torch

    from lightning_gpumem.tuning.trials.model_state import _copy_to_host

    nested = torch.nested.nested_tensor([torch.ones(2), torch.zeros(3)])
    copy = _copy_to_host({"state": {0: {"nested": nested}}})
    assert copy["state"][0]["nested"].is_nested
    assert [t.tolist() for t in copy["state"][0]["nested"].unbind()] == [[1.0, 1.0], [0.0, 0.0, 0.0]]
