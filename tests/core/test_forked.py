"""``_core/forked.py``: work in forked children, its result or the reason there is none."""

from __future__ import annotations

import os
import sys
import time

import pytest

from lightning_gpumem._core.forked import ChildFailed, Forked, can_fork, cores, forked_map

pytestmark = pytest.mark.skipif(not can_fork(), reason="forks on Linux only")


def test_the_childs_value_comes_back_and_the_parent_is_left_as_it_was():
    seen = {"value": 1}

    def work():
        seen["value"] = 2  # the child's copy
        return os.getpid(), seen["value"]

    pid, value = Forked(work).result(timeout=60.0)
    assert pid != os.getpid()
    assert value == 2
    assert seen == {"value": 1}


def test_an_error_in_the_child_is_named():
    def work():
        raise KeyError("boom")

    with pytest.raises(ChildFailed, match=r"^KeyError: 'boom'$"):
        Forked(work).result(timeout=60.0)


def test_a_result_that_cannot_be_pickled_is_named():
    with pytest.raises(ChildFailed, match=r"(Pickling|Attribute|Type)Error"):
        Forked(lambda: lambda: None).result(timeout=60.0)


def test_a_child_that_dies_gives_its_status():
    with pytest.raises(ChildFailed, match=r"ended with status .* and no result"):
        Forked(lambda: os._exit(3)).result(timeout=60.0)


def test_a_child_past_its_timeout_is_killed_and_reaped():
    child = Forked(lambda: time.sleep(60))
    pid = child._pid
    start = time.monotonic()
    with pytest.raises(ChildFailed, match=r"no answer within 0 s"):
        child.result(timeout=0.2)
    assert time.monotonic() - start < 5
    with pytest.raises(ChildProcessError):  # reaped: no such child left
        os.waitpid(pid, os.WNOHANG)


def test_a_child_not_waited_for_is_killed_on_close():
    child = Forked(lambda: time.sleep(60))
    pid = child._pid
    child.close()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    with pytest.raises(ChildFailed, match="closed before its result"):
        child.result(timeout=1.0)


def test_a_large_result_passes_the_pipe():
    data = list(range(1_000_000))
    assert Forked(lambda: data).result(timeout=60.0) == data


@pytest.mark.parametrize("workers", [2, 3, 7])
def test_forked_map_is_map(workers):
    items = list(range(-10, 11))
    assert forked_map(abs, items, workers=workers, timeout=60.0) == [abs(i) for i in items]


def test_forked_map_gives_none_where_it_cannot_share_or_a_child_fails():
    assert forked_map(abs, [-1, 2], workers=1, timeout=60.0) is None  # one worker: the caller maps
    assert forked_map(abs, [-1], workers=4, timeout=60.0) is None

    def failing(item):
        if item == 3:
            raise ValueError("three")
        return item

    assert forked_map(failing, [1, 2, 3, 4], workers=2, timeout=60.0) is None


def test_cores_counts_this_processs_cores():
    assert 1 <= cores() <= (os.cpu_count() or 1)


def test_can_fork_is_linux_only(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert not can_fork()
    with pytest.raises(OSError, match="no fork on darwin"):
        Forked(lambda: 1)
