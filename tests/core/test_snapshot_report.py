"""The OOM report on a synthetic allocator snapshot: the largest live allocations, the failed one, the user's line."""

from __future__ import annotations

import pytest

from lightning_gpumem._core.snapshot_report import (
    failed_allocation,
    format_report,
    live_allocations,
    render_html,
)
from lightning_gpumem._core.units import MIB
from tests.helpers.fakes import SNAPSHOT, USER, frame


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
                    {
                        "size": 8 * MIB,
                        "state": "active_allocated",
                        "frames": [frame(library, 134, "forward"), USER],
                    }
                ],
            }
        ]
    }
    assert "8.0 MiB  /home/me/model.py:42 in forward" in format_report(snapshot)


def test_without_a_frame_of_the_users_code_the_outermost_library_frame_is_named_as_such():
    inner = frame("/venv/lib/python3.11/site-packages/torch/nn/functional.py", 2000, "linear")
    outer = frame("/venv/lib/python3.11/site-packages/lightning/pytorch/loops/fit_loop.py", 200, "run")
    block = {"size": 4 * MIB, "state": "active_allocated", "frames": [inner, outer]}
    report = format_report(
        {"segments": [{"total_size": 4 * MIB, "allocated_size": 4 * MIB, "blocks": [block]}]}
    )
    assert (
        "4.0 MiB  /venv/lib/python3.11/site-packages/lightning/pytorch/loops/fit_loop.py:200 in run"
        in report
    )
    assert "(no frame of your code)" in report


def test_html_is_one_file_without_scripts():
    page = render_html(SNAPSHOT, "oom on rank 0 at step 3")
    assert "<script" not in page  # no CDN, nothing to fetch: opens offline
    assert "Failed to allocate 3,072.0 MiB" in page
    assert page.count("fill='#3b7dd8'") == 3  # one rect per live block
    assert "/home/me/model.py:42 in forward" in page
