"""The allocator changed: cache and cuBLAS workspaces given back, garbage collected only where it frees a trial's."""

from __future__ import annotations

import pytest
import torch

from lightning_gpumem._core.units import GIB, MIB
from lightning_gpumem._hw import allocator
from tests.helpers.fakes import FakeProbe

LEFTOVER_BYTES = MIB


def test_each_trial_and_the_fit_start_without_cache_or_cublas_workspaces(monkeypatch):
    calls: list[str] = []

    class Probe:
        device = torch.device("cuda", 0)

        def release_cache(self) -> None:
            calls.append("empty_cache")

    monkeypatch.setattr(
        torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("workspaces"), raising=False
    )
    allocator.start_clean(Probe())
    assert calls == [
        "workspaces",
        "empty_cache",
    ]  # the workspaces first, so that their segments can be released
    calls.clear()
    Probe.device = torch.device("cpu")
    allocator.start_clean(Probe())
    assert calls == ["empty_cache"]


@pytest.mark.parametrize(
    ("excess", "freed_by", "collected", "floor"),
    [
        (MIB, None, [], None),  # a few logged scalars: left to Python's collector
        (68 * MIB, 1, [1], None),  # a failed trial's young cycles
        (68 * MIB, 2, [1, 2], 0),  # older cycles: the full collection
        (68 * MIB, None, [1, 2], 68 * MIB),  # nothing to collect: the floor for the next trials
    ],
    ids=["leftover", "young", "old", "uncollectable"],
)
def test_release_collects_young_cycles_first_and_the_full_heap_only_if_needed(
    monkeypatch, excess, freed_by, collected, floor
):
    probe = FakeProbe(base=GIB)
    probe.allocate(excess)
    generations = []

    def collect(generation=2):
        generations.append(generation)
        if generation == freed_by:
            probe.free(excess)

    monkeypatch.setattr(allocator.gc, "collect", collect)
    result = allocator.release_to(probe, GIB, LEFTOVER_BYTES, blind=False)
    assert generations == collected
    assert result == (None if floor is None else GIB + floor)


@pytest.mark.parametrize(("blind", "collected"), [(True, [1, 2]), (False, [])])
def test_release_without_allocated_bytes_collects_only_when_blind(monkeypatch, blind, collected):
    probe = FakeProbe()
    monkeypatch.setattr(probe, "allocated_bytes", lambda: None)
    generations = []
    monkeypatch.setattr(allocator.gc, "collect", lambda generation=2: generations.append(generation))
    assert allocator.release_to(probe, None, LEFTOVER_BYTES, blind=blind) is None
    assert generations == collected
