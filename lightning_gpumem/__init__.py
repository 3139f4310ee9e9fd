"""lightning-gpumem: PyTorch Lightning callbacks that make GPU memory visible and manageable."""

from lightning_gpumem.budget import MemoryBudget
from lightning_gpumem.layers import LayerMemoryProfiler
from lightning_gpumem.monitor import MemoryMonitor
from lightning_gpumem.probe import MemoryProbe, MemorySample
from lightning_gpumem.release import EmptyCacheOnThreshold
from lightning_gpumem.snapshot import OOMSnapshot
from lightning_gpumem.tuning.tuner import BatchSizeTuner

__version__ = "0.1.0"

__all__ = [
    "BatchSizeTuner",
    "EmptyCacheOnThreshold",
    "LayerMemoryProfiler",
    "MemoryBudget",
    "MemoryMonitor",
    "MemoryProbe",
    "MemorySample",
    "OOMSnapshot",
    "__version__",
]
