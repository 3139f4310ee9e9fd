"""A traced stream replayed as a fit runs it: its last step repeated until the allocator's layout settles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_gpumem._core.alloc_events import Event
from lightning_gpumem.tuning.sources.allocator import replay
from lightning_gpumem.tuning.sources.steps import next_step, replay_steady, split_steps
from tests.helpers.benchmark_gpt import gpt_tracer

ROOT = Path(__file__).resolve().parents[3]
GIB = 2**30
MIB = 2**20


def step(grads: int | None, new: int, size: int = 64) -> list[Event]:
    """Frees the previous step's gradient, makes a temporary and a gradient of its own."""
    freed = [Event("free", grads)] if grads is not None else []
    made = [Event("alloc", new, size), Event("free", new), Event("alloc", new + 1, 8)]
    return [Event("mark", label="train"), *freed, *made]


def test_the_step_after_two_like_steps_frees_what_the_last_one_made():
    assert next_step(step(1, 2), step(3, 4), 100) == step(5, 100)


@pytest.mark.parametrize(
    "last",
    [step(3, 4, size=65), step(3, 4)[:-1], [*step(3, 4)[:1], Event("free", 0), *step(3, 4)[2:]]],
    ids=["other-size", "shorter", "frees-an-older-block"],
)
def test_steps_that_are_not_the_same_requests_make_no_next_step(last):
    assert next_step(step(1, 2), last, 100) is None


def test_a_stream_is_cut_into_what_comes_before_its_steps_its_steps_and_validation():
    stream = [
        Event("alloc", 1, 8),
        *step(None, 2),
        *step(3, 4),
        Event("mark", label="val"),
        Event("alloc", 9, 4),
    ]
    head, steps, tail = split_steps(stream)
    assert head == stream[:1]
    assert steps == [step(None, 2), step(3, 4)]
    assert tail == stream[-2:]


def test_validation_after_the_repeated_steps_frees_what_it_made():
    stream = [Event("alloc", 1, 4096), *step(None, 2), *step(3, 4), *step(5, 6)]
    stream += [Event("mark", label="val"), Event("alloc", 50, 1 << 20), Event("free", 50)]
    result, _ = replay_steady(stream, max_steps=8)
    assert result.fits
    assert result.phase_peaks["val"][0] == replay(stream).phase_peaks["val"][0]


# --------------------------------------------------------------------------------- the 236M GPT under 12 GiB
@pytest.fixture(scope="module")
def gpt_at():
    trace_at = gpt_tracer()
    return lambda size: trace_at(size).events


def test_a_size_whose_third_step_ran_out_of_memory_on_the_gpu_does_not_fit_the_steady_replay(gpt_at):
    """benchmarks/results/tuner-12gib.json: on an H200 under 12 GiB the GPT ran 50 steps at 16; at 17 it ran out
    of memory in its third step. The first two steps of 17 fit (after a retry); the steps after them do not."""
    truth = json.loads((ROOT / "benchmarks" / "results" / "tuner-12gib.json").read_text())
    largest = truth["workloads"]["gpt"]["true_max"]["true_max"]
    limit = 12 * GIB
    over = gpt_at(largest + 1)
    head, steps, _ = split_steps(over)
    assert len(steps) == 3
    assert replay([*head, *steps[0], *steps[1]], limit_bytes=limit).fits
    assert not replay_steady(over, limit_bytes=limit)[0].fits
    fits, ran = replay_steady(gpt_at(largest), limit_bytes=limit)
    assert fits.fits
    assert ran > 3  # the layout kept changing after the traced steps: more were replayed
