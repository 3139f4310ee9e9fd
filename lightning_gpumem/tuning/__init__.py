"""Batch-size tuning: a pure search (``search.py``) driven by real trials run through Lightning (``callback.py``).

The names are imported on first use (PEP 562), so ``lightning_gpumem.tuning.search`` loads neither torch nor
Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_gpumem.tuning.callback import BatchSizeTuner
    from lightning_gpumem.tuning.search import SearchResult, Trial, search_batch_size

_EXPORTS = {
    "BatchSizeTuner": "lightning_gpumem.tuning.callback",
    "SearchResult": "lightning_gpumem.tuning.search",
    "Trial": "lightning_gpumem.tuning.search",
    "search_batch_size": "lightning_gpumem.tuning.search",
}
__all__ = ["BatchSizeTuner", "SearchResult", "Trial", "search_batch_size"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
