"""The true-max search of ``benchmarks/tuner.py`` from a given first size, and the truths ``traced_plan.py`` reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def tuner():
    sys.path.insert(0, str(BENCHMARKS))
    import tuner

    return tuner


def _walk(gallop, truth: int, guess: int, upper: int = 1024) -> tuple[int, list[int]]:
    """The sizes tried one at a time from ``guess`` until a pass sits next to a failure, and the pass."""
    passed: dict[int, bool] = {}
    while True:
        fails = [s for s, ok in passed.items() if not ok]
        hi = min(fails) if fails else None
        lo = max((s for s, ok in passed.items() if ok and (hi is None or s < hi)), default=0)
        if hi == lo + 1 or (hi is None and lo >= upper):
            return lo, list(passed)
        sizes = gallop(lo, hi, upper, guess)
        assert len(sizes) == 1
        assert sizes[0] not in passed
        passed[sizes[0]] = sizes[0] <= truth


@pytest.mark.parametrize(
    ("truth", "guess", "tried"),
    [
        (87, 86, [86, 87, 89, 88]),  # the GPT under 48 GiB on the H100
        (29, 29, [29, 30]),
        (275, 270, [270, 271, 273, 277, 275, 276]),
        (10, 14, [14, 13, 11, 7, 9, 10]),
        (1024, 1024, [1024]),  # the search's bound
    ],
)
def test_the_truth_gallops_from_the_guess_then_bisects(tuner, truth, guess, tried):
    found, sizes = _walk(tuner._gallop, truth, guess)
    assert (found, sizes) == (truth, tried)


def test_the_plans_truths_are_settled_ones_and_a_bound_is_marked(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    from traced_plan import truths

    def entry(true_max, status):
        return {"true_max": {"true_max": true_max, "status": status, "probes": []}}

    data = {
        "settings": {"budget_gib": 48.0},
        "device": {"name": "H100"},
        "workloads": {
            "gpt": entry(87, "exact"),
            "encoder": entry(270, "time_limit"),  # a pass, its edge not found: no truth
            "resnet": entry(1024, "upper_bound"),
        },
    }
    path = tmp_path / "truth.json"
    path.write_text(json.dumps(data))
    found = truths([str(path)])
    assert sorted(found) == ["gpt", "resnet"]
    assert (found["gpt"][48.0]["true_max"], found["gpt"][48.0]["at_bound"]) == (87, False)
    assert found["resnet"][48.0]["at_bound"] is True
