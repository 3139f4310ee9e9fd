"""``_core/forked.py``: work in forked children, its result or the reason there is none."""

from __future__ import annotations

import gc
import os
import resource
import signal
import sys
import time

import pytest

from lightning_gpumem._core import forked
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


def test_the_childs_signal_handlers_are_the_systems_and_the_parents_are_kept():
    def handler(number, frame):
        raise AssertionError("the parent's handler")

    before = signal.signal(signal.SIGUSR1, handler)
    try:
        in_child = Forked(lambda: signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL).result(60.0)
        assert in_child
        assert signal.getsignal(signal.SIGUSR1) is handler
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set()  # nothing left held here
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_the_parents_objects_are_frozen_in_the_child_only():
    assert gc.get_freeze_count() == 0
    assert Forked(gc.get_freeze_count).result(60.0) > 0
    assert gc.get_freeze_count() == 0


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_fork_that_fails_leaves_no_pipe_open(monkeypatch):
    def no_room():
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(forked, "_fork", no_room)
    before = _open_descriptors()
    with pytest.raises(OSError, match="Cannot allocate memory"):
        Forked(lambda: 1)
    assert _open_descriptors() == before
    assert forked_map(abs, [-1, 2, -3], workers=2, timeout=60.0) is None  # the caller maps them


def test_a_pipe_above_descriptor_1023_is_waited_on():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the hard limit on open files is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    spare = []
    try:
        with open(os.devnull) as null:
            while not spare or spare[-1] < 1100:  # every descriptor below taken: the pipe's is above
                spare.append(os.dup(null.fileno()))
            child = Forked(lambda: 7)
            assert child._read > 1023
            assert child.result(60.0) == 7
    finally:
        for descriptor in spare:
            os.close(descriptor)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
