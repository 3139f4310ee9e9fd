"""AutoMicrobatch (``callback.py``) and its parts (``split.py``: split a batch, combine logs, when to split).

The callback is imported on first use (PEP 562), so importing the folder loads neither torch nor Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_gpumem.microbatch.callback import AutoMicrobatch

__all__ = ["AutoMicrobatch"]


def __getattr__(name: str) -> Any:
    if name != "AutoMicrobatch":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("lightning_gpumem.microbatch.callback"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
