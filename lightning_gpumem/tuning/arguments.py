"""The tuner's and the planner's arguments checked at construction, each refusal naming the argument."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_deprecation

from lightning_gpumem._core.cards import card_bytes
from lightning_gpumem._core.checks import require_flags, require_fraction, require_int, require_length_fn
from lightning_gpumem._core.units import check_budget

METHODS = ("predict", "search")  # the names of the former methods, both now the one search


STARTS = ("probe", "trace")
"""Where the tuner's search starts: its probe alone, or the step traced on fake tensors as well."""


def check_tuner(
    *,
    budget: Any,
    headroom: Any,
    init_val: Any,
    max_val: Any,
    steps_per_trial: Any,
    batch_arg_name: Any,
    method: Any,
    length_fn: Any,
    shape_margin: Any,
    start: Any = "probe",
    **flags: Any,
) -> None:
    """Refuse a bad ``BatchSizeTuner`` argument, naming it; warn where ``method`` is given."""
    if not isinstance(start, str) or start not in STARTS:
        raise ValueError(f"`BatchSizeTuner(start={start!r})` is not valid. Expected one of {STARTS}.")
    if budget is not None:
        check_budget(budget, "BatchSizeTuner")  # type and format now; the size against the device at fit
    require_fraction("BatchSizeTuner", "headroom", headroom)
    require_int("BatchSizeTuner", "init_val", init_val, 1)
    require_int("BatchSizeTuner", "steps_per_trial", steps_per_trial, 1)
    whole = isinstance(max_val, int) and not isinstance(max_val, bool)
    if max_val is not None and (not whole or max_val < init_val):
        raise ValueError(
            f"`BatchSizeTuner(max_val={max_val!r})` is not valid. Expected None or an integer >= init_val"
            f" ({init_val})."
        )
    _require_name("BatchSizeTuner", batch_arg_name)
    if method is not None:
        if not isinstance(method, str) or method not in METHODS:
            raise ValueError(
                f"`BatchSizeTuner(method={method!r})` is not valid. Expected None or one of {METHODS}."
            )
        rank_zero_deprecation("`BatchSizeTuner(method=...)` is deprecated and ignored: there is one search.")
    require_length_fn("BatchSizeTuner", length_fn)
    require_fraction("BatchSizeTuner", "shape_margin", shape_margin, none_ok=True)
    require_flags("BatchSizeTuner", **flags)


def check_planner(
    *,
    budgets: Any,
    init_val: Any,
    steps_per_trial: Any,
    batch_arg_name: Any,
    length_fn: Any,
    shape_margin: Any,
    **flags: Any,
) -> None:
    """Refuse a bad ``MemoryPlanner`` argument (``ValueError``/``TypeError`` naming it)."""
    if budgets is not None:
        if isinstance(budgets, (str, bytes)) or not isinstance(budgets, Sequence) or not budgets:
            raise ValueError(
                f"`MemoryPlanner(budgets={budgets!r})` is not valid. Expected None or a non-empty list of"
                ' budgets (bytes, a fraction of the device, a string such as "24GiB", or a card such as'
                ' "A100-40GB").'
            )
        for budget in budgets:  # type and format now; the size against the device at fit
            if card_bytes(budget) is None:  # a card's name ("H100-80GB") is a budget too
                check_budget(budget, "MemoryPlanner", "budgets")
    require_flags("MemoryPlanner", **flags)
    require_int("MemoryPlanner", "init_val", init_val, 1)
    require_int("MemoryPlanner", "steps_per_trial", steps_per_trial, 1)
    _require_name("MemoryPlanner", batch_arg_name)
    require_length_fn("MemoryPlanner", length_fn)
    require_fraction("MemoryPlanner", "shape_margin", shape_margin, none_ok=True)


def _require_name(owner: str, name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"`{owner}(batch_arg_name={name!r})` is not valid. Expected a name.")
