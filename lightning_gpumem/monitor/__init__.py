"""MemoryMonitor (``callback.py``) and what only it uses: peak window, metrics, leak watch, fit run, layout.

The callback is imported on first use (PEP 562): the pure modules of this folder load neither torch nor
Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_gpumem.monitor.callback import MemoryMonitor

__all__ = ["MemoryMonitor"]


def __getattr__(name: str) -> Any:
    if name != "MemoryMonitor":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("lightning_gpumem.monitor.callback"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
