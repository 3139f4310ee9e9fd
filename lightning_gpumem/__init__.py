"""lightning-gpumem: PyTorch Lightning callbacks that make GPU memory visible and manageable."""

from lightning_gpumem.monitor import MemoryMonitor
from lightning_gpumem.probe import MemoryProbe, MemorySample

__version__ = "0.1.0"

__all__ = ["MemoryMonitor", "MemoryProbe", "MemorySample", "__version__"]
