"""OOMSnapshot on CPU (a no-op) and its decisions with the writer stubbed."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_gpumem import OOMSnapshot
from lightning_gpumem._hw.oom import expecting_oom
from lightning_gpumem.snapshot import MAX_OOM_DUMPS
from tests.helpers.trainer import quiet_trainer


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"max_entries": 0}, r"max_entries=0"), ({"at_steps": [1, -2]}, r"at_steps=\[1, -2\]")],
)
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=r"OOMSnapshot\(" + match):
        OOMSnapshot(**kwargs)


def test_on_cpu_it_warns_once_and_writes_nothing(tmp_path):
    callback = OOMSnapshot(dirpath=tmp_path)
    with pytest.warns(UserWarning, match="OOMSnapshot: `cpu` has no CUDA allocator history"):
        quiet_trainer(max_steps=2, callbacks=[callback]).fit(BoringModel())
    assert callback.paths == []
    assert list(tmp_path.iterdir()) == []


class Recorder(OOMSnapshot):
    """The decisions only: `dump` records its kind instead of reading CUDA."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._recording = True
        self.dumps: list[str] = []

    def dump(self, kind="snapshot", print_report=True):
        self.dumps.append(kind)
        return ("p", "h")

    def _stop(self):
        self._recording = False


def test_an_oom_is_dumped_once_by_the_observer_and_not_again_by_on_exception():
    callback = Recorder()
    callback.on_out_of_memory()
    callback.on_exception(None, None, torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert callback.dumps == ["oom"]
    assert not callback._recording  # Lightning calls no `teardown` after an exception: history is off now
    without_observer = Recorder()
    without_observer.on_exception(None, None, torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert without_observer.dumps == ["oom"]


def test_user_errors_and_planned_ooms_write_nothing():
    callback = Recorder()
    callback.on_exception(None, None, ValueError("shape mismatch"))
    with expecting_oom():  # the batch-size search's trials
        callback.on_out_of_memory()
        callback.on_exception(None, None, torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert callback.dumps == []


def test_a_loop_that_catches_ooms_cannot_fill_the_disk():
    callback = Recorder()
    for _ in range(3 * MAX_OOM_DUMPS):
        callback.on_out_of_memory()
    assert callback.dumps == ["oom"] * MAX_OOM_DUMPS
