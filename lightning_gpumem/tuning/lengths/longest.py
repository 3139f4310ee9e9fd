"""Trials that draw each dataset's longest samples first.

One length scan per dataset and fit, agreed across ranks. Shared by ``BatchSizeTuner`` and ``MemoryPlanner``
(their ``length_fn``): :meth:`LongestFirst.drawing` rebuilds the fit's loaders in longest-first order while
trials run (``loaders.longest_first``), and :meth:`LongestFirst.raising` raises a ``length_fn`` error once
the trial it happened in has ended.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_gpumem._hw.allocator import expandable_segments
from lightning_gpumem._pl.distributed import gather_values
from lightning_gpumem.tuning.lengths.scan import LengthFn, Lengths, sample_length, scan_lengths
from lightning_gpumem.tuning.trials import loaders

T = TypeVar("T")

SHAPE_MARGIN = 0.2
"""The budget's fraction trials leave free where shapes vary, with PyTorch's default allocator
(``shape_margin``)."""
SHAPE_MARGIN_EXPANDABLE = 0.06
"""The same with ``expandable_segments:True``, which maps pages instead of caching whole segments and
fragments far less (``docs/benchmarks.md`` has the epochs that chose it)."""


def margin_for(shape_margin: float | None, varying: bool) -> float:
    """The fraction of the budget trials leave free: ``shape_margin`` where shapes vary, else its default."""
    if not varying:
        return 0.0
    if shape_margin is not None:
        return shape_margin
    return SHAPE_MARGIN_EXPANDABLE if expandable_segments() else SHAPE_MARGIN


def margin_tip(shape_margin: float | None) -> str:
    """How to need a smaller margin, where the user set none and the allocator is the default one."""
    if shape_margin is not None or expandable_segments():
        return ""
    return (
        "; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before CUDA starts) fragments less and"
        f" needs {SHAPE_MARGIN_EXPANDABLE:.0%}"
    )


class LongestFirst:
    """The longest-first order of each dataset the trials meet, scanned once (one per search or plan).

    Args:
        owner: the callback's name, for its warnings.
        length_fn: how a sample's size is measured (:data:`~lightning_gpumem.tuning.lengths.LengthFn`).
    """

    def __init__(self, owner: str, length_fn: LengthFn) -> None:
        self.owner = owner
        self.length_fn = length_fn
        self._orders: dict[tuple[Any, ...], list[int]] = {}  # a dataset's indices, longest first
        # length_fn's error in a dataloader hook, raised after the trial
        self._error: BaseException | None = None
        self._skipped: list[str] = []  # why length_fn was not applied to a loader

    @contextmanager
    def drawing(self, trainer: pl.Trainer) -> Iterator[None]:
        """Within the block the fit's train and val loaders draw their longest samples first.

        Says which did not.
        """
        with loaders.longest_first(trainer, partial(self.order_for, trainer)) as skipped:
            yield
        for reason in dict.fromkeys([*skipped, *self._skipped]):
            rank_zero_warn(
                f"{self.owner}: `length_fn` was not applied: {reason}; its trials drew the first batches."
            )

    def raising(self, runner: Callable[[int], T]) -> Callable[[int], T]:
        """``runner``, raising an error of ``length_fn`` once the trial has ended.

        The error is kept by :meth:`order_for`.
        """

        def run(size: int) -> T:
            trial = runner(size)
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            return trial

        return run

    def order_for(self, trainer: pl.Trainer, dataset: Any) -> list[int] | None:
        """The indices of ``dataset``, longest first (scanned once).

        Called from within Lightning's dataloader request, which leaves Lightning's patches of ``DataLoader``
        and ``BatchSampler`` in place when an exception passes through it: an error of ``length_fn`` is kept
        and raised once the trial has ended (:meth:`raising`). Under DDP the ranks agree on the samples
        scanned (:func:`agreed`), so a scan cut short by its time limit gives every rank the same order.
        """
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            self._skipped.append(f"{type(dataset).__name__} has no `len` and `[]` to measure its samples by")
            return None
        key, found = None, None
        try:
            # hooks may build a new dataset object for every loader
            key = fingerprint(dataset, self.length_fn)
            if key in self._orders:
                return self._orders[key]
            found = scan_lengths(dataset, self.length_fn)
        except BaseException as error:  # length_fn's error, or Ctrl-C in the scan: raised after the trial
            self._error = self._error or error
        try:
            found = agreed(trainer, found)  # collective: every rank that scans gets here, failed or not
        except BaseException as error:
            self._error = self._error or error
            return None
        if key is None or found is None:
            return None
        if not found.complete:
            rank_zero_warn(
                f"{self.owner}: scanned the lengths of {found.scanned} of {found.total} samples in"
                f" {found.seconds:.0f} s, a random subset; the trials run the longest of those"
                f" ({found.longest}). A longer sample may exist: pass a faster `length_fn` (a length field,"
                " not the sample's tokenization)."
            )
        self._orders[key] = found.order
        return found.order


def agreed(trainer: pl.Trainer, found: Lengths | None) -> Lengths | None:
    """Under DDP, the first samples of the scan that every rank scanned (the scan order is the same on all).

    Collective: every rank calls it, with ``None`` where its scan failed.
    """
    if trainer.world_size <= 1:
        return found
    counts = [row[0] for row in gather_values(trainer, [None if found is None else found.scanned])]
    fewest = min((int(count) for count in counts if count is not None), default=None)
    return found if found is None or fewest is None else found.first(fewest)


def fingerprint(dataset: Any, length_fn: LengthFn) -> tuple[Any, ...]:
    """What tells a dataset apart from another.

    Its type, length and the lengths of eight samples spread over it.
    """
    n = len(dataset)
    spread = sorted({i * (n - 1) // 7 for i in range(8)}) if n else []
    return (type(dataset).__qualname__, n, tuple(sample_length(dataset[i], length_fn, i) for i in spread))
