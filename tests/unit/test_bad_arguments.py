"""Every public argument of every callback, with the bad values a user can pass: refused at construction with a
ValueError or TypeError that names the class and the argument."""

from __future__ import annotations

import math
import re

import pytest

from lightning_gpumem import (
    BatchSizeTuner,
    EmptyCacheOnThreshold,
    LayerMemoryProfiler,
    MemoryBudget,
    MemoryMonitor,
    OOMSnapshot,
)

NAN, INF = math.nan, math.inf
FLAGS = ["yes", 1, 0, None, 1.0]
COUNTS = [-1, 1.5, True, "3", NAN, INF, None]  # (None only where None is not a documented value)
BUDGETS = ["", "0B", "0.5B", "24 parsecs", "GiB", "-1GiB", "nanGiB", "infGiB", 0, 1, -5, 0.0, 1.5, NAN, INF, True, [1]]
PATHS = [123, 4.5, True, "", ["a"]]

CASES: list[tuple[type, str, object]] = []


def _add(cls: type, name: str, values: list) -> None:
    CASES.extend((cls, name, value) for value in values)


for flag in ("verbose", "nvml", "host", "progress_bar", "summary", "detect_leaks", "tensorboard_layout"):
    _add(MemoryMonitor, flag, FLAGS)
_add(MemoryMonitor, "log_every_n_steps", [0, -1, 1.5, True, "10", NAN])
_add(MemoryMonitor, "nvml_host_interval_s", [-1.0, NAN, INF, "1", True, None])
_add(MemoryMonitor, "leak_threshold_mib", [0, -1.0, NAN, INF, "32", True, None])
_add(MemoryMonitor, "leak_warmup_steps", COUNTS)

_add(BatchSizeTuner, "budget", [b for b in BUDGETS if b is not None])
_add(BatchSizeTuner, "headroom", [-0.1, 1.0, 1.5, NAN, INF, "0.05", True, None])
_add(BatchSizeTuner, "init_val", [0, *COUNTS])
_add(BatchSizeTuner, "max_val", [0, -1, 1.5, True, "64", NAN, 1])  # 1 < init_val=2
_add(BatchSizeTuner, "steps_per_trial", [0, *COUNTS])
_add(BatchSizeTuner, "batch_arg_name", ["", 5, None, True])
for flag in ("include_validation", "keep_effective_batch", "retune_on_resume"):
    _add(BatchSizeTuner, flag, FLAGS)

_add(MemoryBudget, "budget", [*BUDGETS, None])

_add(EmptyCacheOnThreshold, "threshold", [0.0, -0.5, 1.5, NAN, INF, "0.9", True, None])
_add(EmptyCacheOnThreshold, "relative_to", ["host", "", None, 1])
_add(EmptyCacheOnThreshold, "measure", ["rss", "", None, 1])
_add(EmptyCacheOnThreshold, "collect_garbage", FLAGS)
_add(EmptyCacheOnThreshold, "min_steps_between", COUNTS)
_add(EmptyCacheOnThreshold, "hooks", ["after_lunch", "", (), None, 123, ["train_batch_end", 5]])

_add(OOMSnapshot, "dirpath", PATHS)
_add(OOMSnapshot, "max_entries", [0, *COUNTS])
_add(OOMSnapshot, "at_steps", [5, "5", [-1], [1.5], [True], [NAN], 1.5])

_add(LayerMemoryProfiler, "at_step", COUNTS)
_add(LayerMemoryProfiler, "top_k", [0, *COUNTS])
_add(LayerMemoryProfiler, "dirpath", PATHS)


@pytest.mark.parametrize(("cls", "name", "value"), CASES, ids=lambda x: x.__name__ if isinstance(x, type) else repr(x))
def test_a_bad_argument_is_refused_naming_the_class_and_the_argument(cls, name, value):
    args, kwargs = ((value,), {}) if cls is MemoryBudget else ((), {name: value})
    with pytest.raises((ValueError, TypeError)) as error:
        cls(*args, **kwargs)
    assert re.search(rf"`{cls.__name__}\({name}=", str(error.value)), str(error.value)
