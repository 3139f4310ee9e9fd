"""Every public argument of every callback, with the bad values a user can pass: refused at construction with a
ValueError or TypeError that names the class and the argument."""

from __future__ import annotations

import collections.abc
import inspect
import itertools
import math
import re
import types

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_gpumem
from lightning_gpumem import (
    AutoMicrobatch,
    BatchSizeTuner,
    EmptyCacheOnThreshold,
    LayerMemoryProfiler,
    MemoryBudget,
    MemoryMonitor,
    MemoryPlanner,
    MemoryProbe,
    MemorySample,
    OOMSnapshot,
    TokenBudgetSampler,
)
from lightning_gpumem._core.checks import require_trainer
from lightning_gpumem._core.units import GIB
from tests.helpers.fakes import FakeProbe
from tests.helpers.trainer import quiet_trainer

NAN, INF = math.nan, math.inf
FLAGS = ["yes", 1, 0, None, 1.0]
COUNTS = [-1, 1.5, True, "3", NAN, INF, None]  # (None only where None is not a documented value)
BUDGETS = [
    "",
    "0B",
    "0.5B",
    "24 parsecs",
    "GiB",
    "-1GiB",
    "nanGiB",
    "infGiB",
    0,
    1,
    -5,
    0.0,
    1.5,
    NAN,
    INF,
    True,
    [1],
]
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
_add(BatchSizeTuner, "method", ["bisect", "", 1, True])
_add(BatchSizeTuner, "length_fn", [5, "", b"input_ids", True, ["input_ids"]])
_add(BatchSizeTuner, "shape_margin", [-0.1, 1.0, 1.5, NAN, INF, "0.2", True])
_add(BatchSizeTuner, "start", ["guess", "", None, 1, True, "Trace"])

_add(MemoryPlanner, "budgets", [[b] for b in BUDGETS if b is not None] + ["24GiB", [], 24, None.__class__])
_add(MemoryPlanner, "init_val", [0, *COUNTS])
_add(MemoryPlanner, "steps_per_trial", [0, *COUNTS])
_add(MemoryPlanner, "batch_arg_name", ["", 5, None, True])
_add(MemoryPlanner, "length_fn", [5, "", b"input_ids", True, ["input_ids"]])
_add(MemoryPlanner, "shape_margin", [-0.1, 1.0, 1.5, NAN, INF, "0.2", True])
for flag in ("validate", "stop", "include_validation"):
    _add(MemoryPlanner, flag, FLAGS)

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

_add(AutoMicrobatch, "grow_after", [0, *COUNTS])
_add(
    AutoMicrobatch, "max_microbatches", [0, 1, *(c for c in COUNTS if c is not None)]
)  # None: the batch's length


@pytest.mark.parametrize(
    ("cls", "name", "value"), CASES, ids=lambda x: x.__name__ if isinstance(x, type) else repr(x)
)
def test_a_bad_argument_is_refused_naming_the_class_and_the_argument(cls, name, value):
    args, kwargs = ((value,), {}) if cls is MemoryBudget else ((), {name: value})
    with pytest.raises((ValueError, TypeError)) as error:
        cls(*args, **kwargs)
    assert re.search(rf"`{cls.__name__}\({name}=", str(error.value)), str(error.value)


def test_the_cases_cover_every_argument_of_every_callback():
    exported = [getattr(lightning_gpumem, name) for name in lightning_gpumem.__all__]
    callbacks = [obj for obj in exported if isinstance(obj, type) and issubclass(obj, Callback)]
    assert AutoMicrobatch in callbacks
    for cls in callbacks:
        arguments = set(inspect.signature(cls).parameters)
        assert {name for case, name, _ in CASES if case is cls} == arguments, cls.__name__


# ---------------------------------------------------------------------------------------------------- hostile values
# Issue 26: huge, tiny and non-finite numbers, bools for ints, endless iterables, huge ranges and foreign sequences.
# Each is refused naming the class and the argument (never a raw OverflowError, AttributeError or MemoryError), or,
# where it is a valid value, taken.


class Foreign(collections.abc.Sequence):
    """A stand-in for OmegaConf's ``ListConfig`` (a Hydra config's list): a ``Sequence``, but not a list or tuple."""

    def __init__(self, *items: object) -> None:
        self._items = list(items)

    def __getitem__(self, index):
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Foreign{tuple(self._items)!r}"


class Endless:
    """Like ``itertools.count()`` (an iterator without a length), but fails the test instead of hanging it."""

    def __iter__(self):
        return self

    def __next__(self) -> int:
        self.n = getattr(self, "n", -1) + 1
        if self.n > 10**7:
            raise AssertionError("read 10**7 items of an endless iterator: the constructor would hang on it")
        return self.n

    def __repr__(self) -> str:
        return "Endless()"


HUGE_RANGE = range(0, 10**12, 100)
HUGE_SIZE = "9" * 400 + "GiB"
HOOK = "train_batch_end"


# (constructor, kwargs, expected exception type or None where the value is taken, a substring naming the argument)
HOSTILE = [
    (MemoryMonitor, {"leak_threshold_mib": 1e303}, ValueError, "leak_threshold_mib="),
    (MemoryMonitor, {"leak_threshold_mib": 10**400}, ValueError, "leak_threshold_mib="),
    (MemoryMonitor, {"leak_threshold_mib": 1e-300}, ValueError, "leak_threshold_mib="),  # 0 bytes
    (MemoryMonitor, {"leak_threshold_mib": 1e-7}, ValueError, "leak_threshold_mib="),  # under 1 byte
    (MemoryMonitor, {"leak_threshold_mib": 2.0**44}, None, ""),  # 2**64 bytes: the largest taken
    (MemoryMonitor, {"leak_threshold_mib": 2.0**45}, ValueError, "leak_threshold_mib="),
    (MemoryMonitor, {"nvml_host_interval_s": 10**400}, ValueError, "nvml_host_interval_s="),
    (MemoryMonitor, {"nvml_host_interval_s": 1e303}, None, ""),  # never again after the first read: allowed
    (MemoryMonitor, {"log_every_n_steps": 10**400}, None, ""),
    (MemoryMonitor, {"leak_warmup_steps": False}, ValueError, "leak_warmup_steps="),
    (MemoryBudget, {"budget": HUGE_SIZE}, ValueError, "budget="),
    (MemoryBudget, {"budget": 10**400}, ValueError, "budget="),
    (MemoryBudget, {"budget": 2**64 + 1}, ValueError, "budget="),
    (MemoryBudget, {"budget": "17EiB"}, ValueError, "budget="),  # no such unit
    (MemoryBudget, {"budget": "16777217TiB"}, ValueError, "budget="),  # 2**64 bytes and a TiB
    (MemoryBudget, {"budget": 1e-300}, ValueError, "budget="),  # under 1 MiB of any device
    (
        MemoryBudget,
        {"budget": 1e-10},
        None,
        "",
    ),  # 8 bytes of 80 GiB, 1.8 GB of 2**64 bytes: refused at setup
    (MemoryBudget, {"budget": (1,)}, TypeError, "budget="),
    (MemoryBudget, {"budget": np.array([2**30])}, TypeError, "budget="),
    (BatchSizeTuner, {"budget": HUGE_SIZE}, ValueError, "budget="),
    (MemoryPlanner, {"budgets": [HUGE_SIZE]}, ValueError, "budgets="),
    (MemoryPlanner, {"budgets": [10**400]}, ValueError, "budgets="),
    (MemoryPlanner, {"budgets": {"24GiB"}}, ValueError, "budgets="),  # a set: not an ordered list of budgets
    (MemoryPlanner, {"budgets": Endless()}, ValueError, "budgets="),
    (MemoryPlanner, {"budgets": Foreign("24GiB", 0.5)}, None, ""),  # a Hydra ListConfig: taken
    (MemoryPlanner, {"init_val": 10**400}, None, ""),
    (BatchSizeTuner, {"budget": 10**400}, ValueError, "budget="),
    (BatchSizeTuner, {"budget": 1e-300}, ValueError, "budget="),
    (BatchSizeTuner, {"budget": 0.5}, None, ""),
    (BatchSizeTuner, {"headroom": 1e303}, ValueError, "headroom="),
    (BatchSizeTuner, {"headroom": 10**400}, ValueError, "headroom="),
    (BatchSizeTuner, {"headroom": 1e-300}, None, ""),
    (BatchSizeTuner, {"max_val": 10**400}, None, ""),  # an upper bound: no bound in practice
    (BatchSizeTuner, {"max_val": True}, ValueError, "max_val="),
    (BatchSizeTuner, {"headroom": np.array([0.1, 0.2])}, ValueError, "headroom="),
    (EmptyCacheOnThreshold, {"threshold": 1e303}, ValueError, "threshold="),
    (EmptyCacheOnThreshold, {"threshold": 10**400}, ValueError, "threshold="),
    (EmptyCacheOnThreshold, {"threshold": np.array([0.5, 0.6])}, ValueError, "threshold="),
    (EmptyCacheOnThreshold, {"relative_to": np.array([1, 2])}, ValueError, "relative_to="),
    (EmptyCacheOnThreshold, {"measure": np.array([1, 2])}, ValueError, "measure="),
    (EmptyCacheOnThreshold, {"min_steps_between": 10**400}, None, ""),
    (EmptyCacheOnThreshold, {"min_steps_between": False}, ValueError, "min_steps_between="),
    (EmptyCacheOnThreshold, {"hooks": itertools.count()}, ValueError, "hooks="),
    (EmptyCacheOnThreshold, {"hooks": (h for h in [HOOK])}, ValueError, "hooks="),  # a generator: no length
    (EmptyCacheOnThreshold, {"hooks": HUGE_RANGE}, ValueError, "hooks="),
    (EmptyCacheOnThreshold, {"hooks": {HOOK: 1}}, ValueError, "hooks="),
    (EmptyCacheOnThreshold, {"hooks": np.array(5)}, ValueError, "hooks="),  # sized, without a length
    (EmptyCacheOnThreshold, {"hooks": [HOOK, np.array([1, 2])]}, ValueError, "hooks="),
    (EmptyCacheOnThreshold, {"hooks": (HOOK,)}, None, ""),
    (EmptyCacheOnThreshold, {"hooks": Foreign(HOOK, "validation_end")}, None, ""),
    (EmptyCacheOnThreshold, {"hooks": np.array([HOOK])}, None, ""),
    (EmptyCacheOnThreshold, {"hooks": frozenset({HOOK})}, None, ""),
    (OOMSnapshot, {"at_steps": HUGE_RANGE}, None, ""),
    (OOMSnapshot, {"at_steps": Endless()}, ValueError, "at_steps="),
    (OOMSnapshot, {"at_steps": (5, 10)}, None, ""),
    (OOMSnapshot, {"at_steps": Foreign(5, 10)}, None, ""),
    (OOMSnapshot, {"at_steps": np.array([5, 10])}, None, ""),
    (OOMSnapshot, {"at_steps": [1e303]}, ValueError, "at_steps="),
    (OOMSnapshot, {"at_steps": [10**400]}, None, ""),  # never reached, but an integer >= 0
    (OOMSnapshot, {"max_entries": 10**400}, ValueError, "max_entries="),  # the allocator takes a C size_t
    (OOMSnapshot, {"max_entries": True}, ValueError, "max_entries="),
    (LayerMemoryProfiler, {"top_k": 10**400}, None, ""),
    (LayerMemoryProfiler, {"at_step": 10**400}, None, ""),
    (LayerMemoryProfiler, {"top_k": True}, ValueError, "top_k="),
    (LayerMemoryProfiler, {"at_step": 1e303}, ValueError, "at_step="),
    (AutoMicrobatch, {"grow_after": 1e303}, ValueError, "grow_after="),
    (AutoMicrobatch, {"grow_after": 0}, ValueError, "grow_after="),
    (AutoMicrobatch, {"grow_after": NAN}, ValueError, "grow_after="),
    (AutoMicrobatch, {"grow_after": INF}, ValueError, "grow_after="),
    (AutoMicrobatch, {"grow_after": "16"}, ValueError, "grow_after="),
    (AutoMicrobatch, {"max_microbatches": 1}, ValueError, "max_microbatches="),
    (AutoMicrobatch, {"max_microbatches": INF}, ValueError, "max_microbatches="),
    (AutoMicrobatch, {"grow_after": 10**400}, None, ""),
    (AutoMicrobatch, {"grow_after": True}, ValueError, "grow_after="),
    (AutoMicrobatch, {"max_microbatches": 10**400}, None, ""),
    (AutoMicrobatch, {"max_microbatches": True}, ValueError, "max_microbatches="),
    (AutoMicrobatch, {"max_microbatches": NAN}, ValueError, "max_microbatches="),
    (BatchSizeTuner, {"length_fn": len}, None, ""),
    (BatchSizeTuner, {"length_fn": "input_ids"}, None, ""),
    (MemoryPlanner, {"length_fn": len, "shape_margin": 0}, None, ""),
    (TokenBudgetSampler, {"lengths": [3, 5], "max_tokens": 10**400}, None, ""),  # no batch costs that much
    (TokenBudgetSampler, {"lengths": [3, 5], "max_tokens": 1e303}, ValueError, "max_tokens="),
    (TokenBudgetSampler, {"lengths": [3, 5], "max_tokens": True}, ValueError, "max_tokens="),
    (
        TokenBudgetSampler,
        {"lengths": [3, 5], "max_tokens": 4},
        ValueError,
        "max_tokens=",
    ),  # below the longest
    (TokenBudgetSampler, {"lengths": [3, 2.5], "max_tokens": 10}, TypeError, "lengths="),
    (TokenBudgetSampler, {"lengths": [3, -1], "max_tokens": 10}, ValueError, "lengths="),
    (TokenBudgetSampler, {"lengths": np.array([3, 5]), "max_tokens": 10}, None, ""),
    (TokenBudgetSampler, {"lengths": Foreign(3, 5), "max_tokens": 10}, None, ""),
    (TokenBudgetSampler, {"lengths": [3, 5], "max_tokens": 10, "quadratic": NAN}, ValueError, "quadratic="),
    (
        TokenBudgetSampler,
        {"lengths": [3, 5], "max_tokens": 10, "rank": 2, "num_replicas": 2},
        ValueError,
        "rank=",
    ),
    (MemoryProbe, {"device": "cpu"}, None, ""),
    (MemoryProbe, {"device": None}, TypeError, "device=None"),
    (MemoryProbe, {"device": True}, TypeError, "device=True"),
    (MemoryProbe, {"device": 1.5}, TypeError, "device=1.5"),
    (MemoryProbe, {"device": "gpu"}, ValueError, "device='gpu'"),
    (MemoryProbe, {"device": "cpu", "nvml": "yes"}, TypeError, "nvml="),
    (MemoryProbe, {"device": "cpu", "host": None}, TypeError, "host="),
]

# Issue 41: every argument of MemoryPlanner and TokenBudgetSampler, and `length_fn` of both tuners, with non-finite,
# huge and negative numbers, bools for ints, numpy values, strings, bytes and mappings.
TOKENS = {"lengths": [3, 5], "max_tokens": 10}
_PLANNER = [
    ("budgets", [NAN], ValueError),
    ("budgets", [INF], ValueError),
    ("budgets", [-1], ValueError),
    ("budgets", [1e400], ValueError),
    ("budgets", [2**70], ValueError),  # beyond 2**64 bytes
    ("budgets", [True], TypeError),
    ("budgets", [np.int64(2**34)], TypeError),
    ("budgets", [np.bool_(True)], TypeError),
    ("budgets", [""], ValueError),
    ("budgets", [b"24GiB"], TypeError),
    ("budgets", [{"size": "24GiB"}], TypeError),
    ("budgets", [None], TypeError),
    ("budgets", b"24GiB", ValueError),
    ("budgets", {"card": "24GiB"}, ValueError),
    ("budgets", np.array(["24GiB"]), ValueError),
    ("budgets", ("24GiB" for _ in range(1)), ValueError),
    ("budgets", [np.float64(0.5)], None),  # a fraction of the device
    ("budgets", ["24 GiB", 2**64], None),  # 2**64 bytes: the largest taken
    *(
        (flag, value, TypeError)
        for flag in ("validate", "stop", "include_validation")
        for value in (NAN, np.bool_(True), "yes", b"", {}, 1)
    ),
    *(
        (count, value, ValueError)
        for count in ("init_val", "steps_per_trial")
        for value in (NAN, INF, 1e400, -1, 0, True, np.int64(2), np.float64(2.0), "2", b"2", {}, [2])
    ),
    ("init_val", 2**70, None),  # the search's start: the dataset bounds it
    ("steps_per_trial", 10**400, None),  # as many as the user asks for
    *(
        ("batch_arg_name", value, ValueError)
        for value in ("", b"batch_size", NAN, 2**70, True, {}, ["batch_size"])
    ),
    *(
        ("shape_margin", value, ValueError)
        for value in (NAN, INF, -1, 1e400, 2**70, 10**400, True, np.bool_(True), "0.2", b"", {}, [0.2])
    ),
    ("shape_margin", np.float64(0.1), None),
    ("shape_margin", np.float32(0.1), None),  # was refused: any real number type is a number
    ("shape_margin", torch.tensor(0.1), None),
]
_LENGTH_FNS = [
    *(
        (value, TypeError)
        for value in (5, 2**70, NAN, True, np.int64(1), "", b"input_ids", ["input_ids"], {"n": 1})
    ),
    (None, None),
    (lambda sample: len(sample), None),
    ("input_ids", None),
    (np.str_("input_ids"), None),
]
_SAMPLER = [
    ("lengths", [3, 10**400], ValueError),  # was a raw OverflowError
    ("lengths", [3, 2**64], ValueError),
    ("lengths", [3, NAN], TypeError),
    ("lengths", [3, INF], TypeError),
    ("lengths", [3, True], TypeError),
    ("lengths", [3, "5"], TypeError),
    ("lengths", [3, b"5"], TypeError),
    ("lengths", [3, None], TypeError),
    ("lengths", "35", TypeError),
    ("lengths", {0: 3, 1: 5}, TypeError),
    ("lengths", (n for n in [3, 5]), TypeError),
    ("lengths", np.array(5), TypeError),
    ("lengths", [], None),  # no sample: an empty plan
    ("lengths", [3.0, np.float32(5.0)], None),  # whole numbers of any type
    ("lengths", [3, np.uint64(5)], None),
    ("max_tokens", NAN, ValueError),
    ("max_tokens", INF, ValueError),
    ("max_tokens", 1e400, ValueError),
    ("max_tokens", -1, ValueError),
    ("max_tokens", 0, ValueError),
    ("max_tokens", "10", ValueError),
    ("max_tokens", np.float64(10.0), ValueError),
    ("max_tokens", np.int64(10), None),  # was refused
    ("max_tokens", torch.tensor(10), None),
    ("sampler", 5, TypeError),  # was ignored
    ("sampler", "sequential", TypeError),
    ("sampler", b"", TypeError),
    ("sampler", {"rank": 0}, TypeError),
    ("sampler", NAN, TypeError),
    ("sampler", None, None),
    (
        "cost",
        np.array(["padded", "tokens"]),
        ValueError,
    ),  # was numpy's "truth value of an array is ambiguous"
    ("cost", "", ValueError),
    ("cost", b"padded", ValueError),
    ("cost", None, ValueError),
    ("cost", True, ValueError),
    ("quadratic", 1e308, ValueError),  # was a raw OverflowError
    ("quadratic", 10**400, ValueError),
    ("quadratic", NAN, ValueError),
    ("quadratic", INF, ValueError),
    ("quadratic", -1, ValueError),
    ("quadratic", True, ValueError),
    ("quadratic", "0.1", ValueError),
    ("quadratic", np.float32(0.0), None),  # was refused
    ("max_samples", 0, ValueError),
    ("max_samples", NAN, ValueError),
    ("max_samples", True, ValueError),
    ("max_samples", "4", ValueError),
    ("max_samples", 10**400, None),  # no limit in practice
    ("max_samples", np.int64(4), None),
    ("shuffle", np.bool_(True), TypeError),
    ("shuffle", 1, TypeError),
    ("shuffle", None, TypeError),
    ("seed", NAN, ValueError),
    ("seed", 1.0, ValueError),
    ("seed", True, ValueError),
    ("seed", "0", ValueError),
    ("seed", None, ValueError),
    ("seed", 10**400, None),  # any integer seeds `random.Random`
    ("seed", -1, None),
    ("seed", np.int64(3), None),
    ("drop_last", "yes", TypeError),
    ("drop_last", 0, TypeError),
    ("num_replicas", 2**21, ValueError),  # was a plan of 2**21 batches
    ("num_replicas", 10**400, ValueError),  # was a plan that never ends
    ("num_replicas", 0, ValueError),
    ("num_replicas", INF, ValueError),
    ("num_replicas", True, ValueError),
    ("rank", 10**400, ValueError),  # was taken, refused only when planned
    ("rank", -1, ValueError),
    ("rank", NAN, ValueError),
    ("rank", False, ValueError),
]
HOSTILE += [(MemoryPlanner, {name: value}, error, f"{name}=") for name, value, error in _PLANNER]
HOSTILE += [
    (cls, {"length_fn": value}, error, "length_fn=")
    for cls in (BatchSizeTuner, MemoryPlanner)
    for value, error in _LENGTH_FNS
]
HOSTILE += [
    (TokenBudgetSampler, {**TOKENS, name: value}, error, f"{name}=") for name, value, error in _SAMPLER
]
HOSTILE.append((BatchSizeTuner, {"method": np.array(["predict", "bisect"])}, ValueError, "method="))

if not torch.cuda.is_available():
    HOSTILE += [
        (MemoryProbe, {"device": 0}, ValueError, "device=0"),
        (MemoryProbe, {"device": torch.device("cuda")}, ValueError, "device=device(type='cuda')"),
        (MemoryProbe, {"device": "cuda:0"}, ValueError, "device='cuda:0'"),
    ]
else:
    HOSTILE.append(
        (MemoryProbe, {"device": f"cuda:{torch.cuda.device_count()}"}, ValueError, "device='cuda:")
    )


@pytest.mark.parametrize("cls", [MemoryPlanner, TokenBudgetSampler])
def test_the_table_tries_every_argument_of_the_planner_and_the_sampler(cls):
    tried = {name for case in HOSTILE if not hasattr(case, "values") and case[0] is cls for name in case[1]}
    assert tried == set(inspect.signature(cls).parameters)


def test_the_table_covers_every_exported_class():
    exported = {getattr(lightning_gpumem, name) for name in lightning_gpumem.__all__} - {
        lightning_gpumem.__version__
    }
    covered = {case.values[0] if hasattr(case, "values") else case[0] for case in HOSTILE}
    assert exported - covered == {MemorySample}  # a record the probe fills: it takes what it is given


def _id(value: object) -> str:
    text = value.__name__ if isinstance(value, type) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@pytest.mark.parametrize(("cls", "kwargs", "error", "names"), HOSTILE, ids=_id)
def test_a_hostile_value_is_refused_by_name_or_taken(cls, kwargs, error, names):
    if error is None:
        cls(**kwargs)
        return
    with pytest.raises(error) as info:
        cls(**kwargs)
    assert f"`{cls.__name__}(" in str(info.value), str(info.value)
    assert names in str(info.value), str(info.value)


def test_hooks_from_a_hydra_config_are_taken_as_plain_names():
    omegaconf = pytest.importorskip("omegaconf")  # not a dependency: where it is installed
    hooks = omegaconf.OmegaConf.create([HOOK, "validation_end"])  # a ListConfig
    assert EmptyCacheOnThreshold(hooks=hooks).hooks == {HOOK, "validation_end"}


def test_foreign_sequences_of_hooks_give_the_state_key_of_a_list():
    # a checkpoint written with `hooks=[...]` must load into a callback configured with any other sequence
    key = EmptyCacheOnThreshold(hooks=[HOOK, "validation_end"]).state_key
    for hooks in (
        Foreign(HOOK, "validation_end"),
        np.array([HOOK, "validation_end"]),
        ("validation_end", HOOK),
    ):
        assert EmptyCacheOnThreshold(hooks=hooks).state_key == key


def test_a_budget_fraction_under_1_mib_of_the_device_is_refused_at_setup():
    probe = FakeProbe(total=80 * GIB)
    probe.device = torch.device("cuda")  # MemoryBudget caps CUDA devices only; only the type is read
    budget = MemoryBudget(1e-10)  # 8 bytes of 80 GiB
    budget.fake = probe  # read through the tests' probe factory
    with pytest.raises(
        ValueError, match=r"`MemoryBudget\(budget=1e-10\)` is 8 bytes of the device's 80.0 GiB"
    ):
        budget.setup(
            quiet_trainer(enable_progress_bar=True, enable_model_summary=True), BoringModel(), "fit"
        )


# ---------------------------------------------------------------------------------------------------- Fabric
@pytest.mark.parametrize(
    ("make", "hooks"),
    [
        (
            MemoryMonitor,
            ["setup", "on_train_start", "on_train_batch_end", "on_validation_end", "on_fit_end"],
        ),
        (EmptyCacheOnThreshold, ["setup", "on_train_batch_end", "on_validation_end"]),
        (lambda: MemoryBudget("1GiB"), ["setup"]),
    ],
)
def test_under_fabric_the_callbacks_say_they_need_a_trainer(make, hooks):
    from lightning.fabric import Fabric

    callback = make()
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[callback])
    arguments = {"setup": (None, "fit"), "on_train_batch_end": (None, None, None, 0)}
    for hook in (
        hooks
    ):  # was: AttributeError: 'Fabric' object has no attribute 'accumulate_grad_batches' (and others)
        with pytest.raises(
            TypeError, match=rf"{type(callback).__name__} needs a Lightning `Trainer`; it got `Fabric`"
        ):
            fabric.call(hook, fabric, *arguments.get(hook, (None,)))


def test_require_trainer_takes_the_trainers_of_both_lightning_namespaces():
    require_trainer("X", quiet_trainer(enable_progress_bar=True, enable_model_summary=True))
    pytorch_lightning = pytest.importorskip("pytorch_lightning")
    require_trainer(
        "X",
        quiet_trainer(
            enable_progress_bar=True, enable_model_summary=True, trainer_class=pytorch_lightning.Trainer
        ),
    )
    with pytest.raises(TypeError, match="X needs a Lightning `Trainer`; it got `SimpleNamespace`"):
        require_trainer("X", types.SimpleNamespace(strategy=None))
