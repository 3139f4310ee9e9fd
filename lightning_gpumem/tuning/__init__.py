"""Batch-size tuning and memory planning, driven by real trials run through Lightning.

``search/`` is pure (one model of memory against the batch size, the plan, the search, the headroom);
``trials/`` runs trials on the user's Trainer and undoes them (one bench for both callbacks); ``lengths/``
holds what variable-length data needs (the length scan, longest-first drawing, ``TokenBudgetSampler``).
``callback.py`` (BatchSizeTuner) and ``planner.py`` (MemoryPlanner) are the callbacks; ``bounds.py`` and
``record.py`` the tuner's bounds and report.

The names are imported on first use (PEP 562), so ``lightning_gpumem.tuning.search`` loads neither torch nor
Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_gpumem.tuning.callback import BatchSizeTuner
    from lightning_gpumem.tuning.lengths.token_budget import TokenBudgetSampler
    from lightning_gpumem.tuning.planner import MemoryPlanner
    from lightning_gpumem.tuning.search import SearchResult, Trial, search_batch_size, search_by_plan

_EXPORTS = {
    "BatchSizeTuner": "lightning_gpumem.tuning.callback",
    "MemoryPlanner": "lightning_gpumem.tuning.planner",
    "search_by_plan": "lightning_gpumem.tuning.search",
    "SearchResult": "lightning_gpumem.tuning.search",
    "Trial": "lightning_gpumem.tuning.search",
    "search_batch_size": "lightning_gpumem.tuning.search",
    "TokenBudgetSampler": "lightning_gpumem.tuning.lengths.token_budget",
}
__all__ = [
    "BatchSizeTuner",
    "MemoryPlanner",
    "SearchResult",
    "TokenBudgetSampler",
    "Trial",
    "search_batch_size",
    "search_by_plan",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
