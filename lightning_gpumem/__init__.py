"""lightning-gpumem: PyTorch Lightning callbacks that make GPU memory visible and manageable.

The callbacks are imported on first use (PEP 562), so ``gpumem`` and ``lightning_gpumem.report`` start
without importing torch or Lightning; where Lightning is imported already, they are imported with the package
(see the end).
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "AutoMicrobatch": "lightning_gpumem.microbatch.callback",
    "BatchSizeTuner": "lightning_gpumem.tuning.callback",
    "EmptyCacheOnThreshold": "lightning_gpumem.release",
    "LayerMemoryProfiler": "lightning_gpumem.layers",
    "MemoryBudget": "lightning_gpumem.budget",
    "MemoryMonitor": "lightning_gpumem.monitor.callback",
    "MemoryPlanner": "lightning_gpumem.tuning.planner",
    "MemoryProbe": "lightning_gpumem._hw.probe",
    "MemorySample": "lightning_gpumem._core.sample",
    "OOMSnapshot": "lightning_gpumem.snapshot",
    "TokenBudgetSampler": "lightning_gpumem.tuning.lengths.token_budget",
}

__all__ = [
    "AutoMicrobatch",
    "BatchSizeTuner",
    "EmptyCacheOnThreshold",
    "LayerMemoryProfiler",
    "MemoryBudget",
    "MemoryMonitor",
    "MemoryPlanner",
    "MemoryProbe",
    "MemorySample",
    "OOMSnapshot",
    "TokenBudgetSampler",
    "__version__",
]

if TYPE_CHECKING:
    from lightning_gpumem._core.sample import MemorySample
    from lightning_gpumem._hw.probe import MemoryProbe
    from lightning_gpumem.budget import MemoryBudget
    from lightning_gpumem.layers import LayerMemoryProfiler
    from lightning_gpumem.microbatch.callback import AutoMicrobatch
    from lightning_gpumem.monitor.callback import MemoryMonitor
    from lightning_gpumem.release import EmptyCacheOnThreshold
    from lightning_gpumem.snapshot import OOMSnapshot
    from lightning_gpumem.tuning.callback import BatchSizeTuner
    from lightning_gpumem.tuning.lengths.token_budget import TokenBudgetSampler
    from lightning_gpumem.tuning.planner import MemoryPlanner


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_gpumem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if "lightning.pytorch" in sys.modules or "pytorch_lightning" in sys.modules:
    # Lightning, and so torch, is loaded already: the laziness would save nothing. Define the callbacks now,
    # so that LightningCLI's short form (`--trainer.callbacks+=MemoryMonitor`), which looks among the
    # `Callback` subclasses defined so far, finds them after a plain `import lightning_gpumem`.
    for _name in _EXPORTS:
        __getattr__(_name)
    del _name
