"""Floor 1, the only code that reads or changes the device: the probe, NVML, the allocator, OOM recognition.

Imports ``_core`` and ``keys`` only; everything above receives a
:class:`~lightning_gpumem._core.sample.MemorySample`.
"""
