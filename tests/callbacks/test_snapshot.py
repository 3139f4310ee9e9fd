"""OOMSnapshot on CPU (a no-op), its decisions with the writer stubbed, the report on a synthetic snapshot."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_gpumem import OOMSnapshot
from lightning_gpumem._core.snapshot_report import failed_allocation, format_report, live_allocations, render_html
from lightning_gpumem._hw.oom import expecting_oom
from lightning_gpumem.snapshot import MAX_OOM_DUMPS

MIB = 2**20


def _frame(filename: str, line: int, name: str) -> dict:
    return {"filename": filename, "line": line, "name": name}


USER = _frame("/home/me/model.py", 42, "forward")
NOISE = _frame("/site-packages/torch/nn/modules/module.py", 1750, "_call_impl")
SNAPSHOT = {
    "segments": [
        {
            "total_size": 64 * MIB,
            "allocated_size": 48 * MIB,
            "blocks": [
                {"size": 32 * MIB, "state": "active_allocated", "frames": [NOISE, USER]},
                {"size": 16 * MIB, "state": "inactive", "frames": []},
                {"size": 16 * MIB, "state": "active_allocated", "frames": [_frame("/home/me/data.py", 7, "load")]},
            ],
        },
        {
            "total_size": 20 * MIB,
            "allocated_size": 2 * MIB,
            "blocks": [{"size": 2 * MIB, "state": "active_allocated", "frames": []}],
        },
    ],
    "device_traces": [
        [
            {"action": "alloc", "size": 32 * MIB, "frames": [USER]},
            {"action": "oom", "size": 3 * 1024 * MIB, "frames": [_frame("??", 0, "malloc"), NOISE, USER]},
        ]
    ],
}


def test_largest_live_allocations_come_first_with_their_frames():
    allocations = live_allocations(SNAPSHOT, top=2)
    assert [a.size for a in allocations] == [32 * MIB, 16 * MIB]
    assert allocations[0].frames[-1] == "/home/me/model.py:42 in forward"


def test_the_failed_allocation_comes_from_the_history():
    failed = failed_allocation(SNAPSHOT)
    assert failed is not None
    assert failed.size == 3 * 1024 * MIB
    assert all("??" not in frame for frame in failed.frames)  # the allocator's own C++ frames are dropped
    assert failed_allocation({"segments": []}) is None


def test_report_points_at_the_users_line_not_the_machinery():
    report = format_report(SNAPSHOT)
    assert "in use 50.0 MiB of 84.0 MiB reserved" in report
    assert "failed to allocate 3,072.0 MiB at /home/me/model.py:42 in forward" in report
    assert "32.0 MiB  /home/me/model.py:42 in forward" in report
    assert "(no stack recorded)" in report


@pytest.mark.parametrize(
    "library",
    [
        "/opt/venv/lib/python3.12/site-packages/torch/nn/modules/linear.py",  # was reported as the user's line
        "/opt/venv/lib/python3.12/site-packages/torch/nn/functional.py",
        "/opt/venv/lib/python3.12/site-packages/lightning/fabric/utilities/apply_func.py",
        "/usr/lib/python3/dist-packages/torchvision/models/resnet.py",
        "/usr/lib/python3.12/contextlib.py",
        "/home/me/src/pytorch/torch/_tensor.py",  # torch built from a checkout
        "<frozen runpy>",
    ],
)
def test_every_library_frame_is_skipped_for_the_users_line(library):
    snapshot = {
        "segments": [
            {
                "total_size": 8 * MIB,
                "allocated_size": 8 * MIB,
                "blocks": [
                    {"size": 8 * MIB, "state": "active_allocated", "frames": [_frame(library, 134, "forward"), USER]}
                ],
            }
        ]
    }
    assert "8.0 MiB  /home/me/model.py:42 in forward" in format_report(snapshot)


def test_without_a_frame_of_the_users_code_the_outermost_library_frame_is_named_as_such():
    inner = _frame("/venv/lib/python3.11/site-packages/torch/nn/functional.py", 2000, "linear")
    outer = _frame("/venv/lib/python3.11/site-packages/lightning/pytorch/loops/fit_loop.py", 200, "run")
    block = {"size": 4 * MIB, "state": "active_allocated", "frames": [inner, outer]}
    report = format_report({"segments": [{"total_size": 4 * MIB, "allocated_size": 4 * MIB, "blocks": [block]}]})
    assert "4.0 MiB  /venv/lib/python3.11/site-packages/lightning/pytorch/loops/fit_loop.py:200 in run" in report
    assert "(no frame of your code)" in report


def test_html_is_one_file_without_scripts():
    page = render_html(SNAPSHOT, "oom on rank 0 at step 3")
    assert "<script" not in page  # no CDN, nothing to fetch: opens offline
    assert "Failed to allocate 3,072.0 MiB" in page
    assert page.count("fill='#3b7dd8'") == 3  # one rect per live block
    assert "/home/me/model.py:42 in forward" in page


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
        Trainer(
            accelerator="cpu",
            max_steps=2,
            callbacks=[callback],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(BoringModel())
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
