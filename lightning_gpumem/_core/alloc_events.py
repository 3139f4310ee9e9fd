"""The allocation stream: what a traced training step asked of the allocator, in order.

Produced by the trace (``_hw/trace.py``) and replayed by the model of the caching allocator
(``tuning/sources/allocator.py``); pure, stdlib only, so both floors can share it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Action = Literal["alloc", "free", "mark"]


@dataclass(frozen=True)
class Event:
    """One request to the allocator, or a mark between phases of the step.

    Attributes:
        action: ``"alloc"`` (a storage of ``size`` bytes was created), ``"free"`` (storage ``block`` died) or
            ``"mark"`` (a phase begins: ``label`` names it, e.g. ``"train"``, ``"optimizer"``, ``"val"``).
        block: an id unique among live storages (a free names the alloc it ends); 0 for a mark.
        size: bytes requested (the storage's ``nbytes``), before any rounding; 0 for a mark.
        stream: the CUDA stream the request is on (0: the default stream).
        label: the phase a mark begins; empty otherwise.
        kernel: for a kernel's scratch buffer, the recipe its ``size`` follows from
            (:func:`~lightning_gpumem._core.kernels.scratch_bytes`), so that a stream made for another batch
            size computes it again; empty otherwise.
    """

    action: Action
    block: int = 0
    size: int = 0
    stream: int = 0
    label: str = ""
    kernel: tuple[int, ...] = ()

    def resized(self, size: int, kernel: tuple[int, ...] | None = None) -> Event:
        """This event asking ``size`` bytes (and following ``kernel``, where given).

        ``dataclasses.replace``, without its cost: a replay makes thousands.

        >>> Event("alloc", 3, 512).resized(1024)
        Event(action='alloc', block=3, size=1024, stream=0, label='', kernel=())
        """
        return Event(
            self.action, self.block, size, self.stream, self.label, self.kernel if kernel is None else kernel
        )

    def renamed(self, block: int) -> Event:
        """This event of ``block`` instead (``dataclasses.replace``, without its cost)."""
        return Event(self.action, block, self.size, self.stream, self.label, self.kernel)
