"""The lengths of a dataset's samples, scanned once, so that trials can run its longest samples first.

A batch size tuned on the batches a loader yields first holds only until a batch of longer samples arrives. With a
``length_fn`` the tuner scans the dataset's lengths (within a time limit: past it, the samples scanned so far, said
so) and its trials draw the longest samples first (``tuning/loaders.py``), collated by the user's own ``collate_fn``,
so they pad as the fit will.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

LengthFn = Callable[[Any], int] | str
"""How a sample's size is measured: a function of the sample, or the key (or attribute) of a field holding the
length, or the sequence whose ``len`` is the length."""

SCAN_SECONDS = 30.0  # a scan longer than this stops, and the trials use the longest samples scanned so far


@dataclass(frozen=True)
class Lengths:
    """What a scan found.

    Attributes:
        order: dataset indices, the longest scanned sample first (then the samples not scanned, in index order).
        longest: the longest length scanned.
        scanned: samples scanned.
        total: samples in the dataset.
        seconds: time the scan took.
        measured: each scanned index's length, in the order scanned.
    """

    order: list[int]
    longest: int
    scanned: int
    total: int
    seconds: float
    measured: dict[int, int] = field(default_factory=dict, repr=False)

    @property
    def complete(self) -> bool:
        """Whether every sample was scanned."""
        return self.scanned == self.total

    def first(self, count: int) -> Lengths:
        """What the scan would have found had it stopped after ``count`` samples.

        The scan order depends on the seed alone, so ranks that scanned different numbers of samples agree on the
        first ``count`` of them (the fewest any rank scanned).

        >>> found = scan_lengths([[1], [1, 2, 3], [1, 2]], len, seed=0)
        >>> found.first(1).scanned, found.first(1).total, found.first(5) is found
        (1, 3, True)
        """
        if count >= self.scanned:
            return self
        kept = dict(list(self.measured.items())[: max(0, count)])
        return _found(kept, self.total, self.seconds)


def sample_length(sample: Any, length_fn: LengthFn) -> int:
    """The length of one sample, measured by ``length_fn``.

    >>> sample_length({"input_ids": [5, 6, 7]}, "input_ids")
    3
    >>> sample_length({"n": 12}, "n")
    12
    >>> sample_length([1, 2], len)
    2
    """
    if isinstance(length_fn, str):
        value = sample[length_fn] if isinstance(sample, Mapping) else getattr(sample, length_fn)
    else:
        value = length_fn(sample)
    if isinstance(value, bool):
        raise TypeError(f"`length_fn` gave {value!r} for a sample; expected a non-negative integer (or a sequence).")
    if not isinstance(value, int):
        try:
            value = int(value) if getattr(value, "ndim", 1) == 0 else len(value)
        except TypeError:
            raise TypeError(
                f"`length_fn` gave {type(value).__name__} for a sample; expected a non-negative integer (or a"
                " sequence whose length is the sample's)."
            ) from None
    if value < 0:
        raise ValueError(f"`length_fn` gave {value} for a sample; expected a non-negative integer.")
    return int(value)


def scan_lengths(
    dataset: Sequence[Any], length_fn: LengthFn, *, max_seconds: float = SCAN_SECONDS, seed: int = 0
) -> Lengths:
    """Measure every sample's length, in a random order, stopping after ``max_seconds``.

    Args:
        dataset: a map-style dataset (``len`` and ``[]``).
        length_fn: see :data:`LengthFn`.
        max_seconds: past this the scan stops with the samples scanned so far (a random subset).
        seed: the scan's order (the same on every rank).

    Returns:
        The indices, longest scanned first.

    Example:
        >>> found = scan_lengths([[1], [1, 2, 3], [1, 2]], len)
        >>> found.order, found.longest, found.complete
        ([1, 2, 0], 3, True)
    """
    total = len(dataset)
    indices = list(range(total))
    random.Random(seed).shuffle(indices)  # noqa: S311 - an order to scan in, not a secret
    start = time.perf_counter()
    lengths: dict[int, int] = {}
    for count, index in enumerate(indices):
        lengths[index] = sample_length(dataset[index], length_fn)
        if count % 64 == 63 and time.perf_counter() - start > max_seconds:
            break
    return _found(lengths, total, time.perf_counter() - start)


def _found(lengths: dict[int, int], total: int, seconds: float) -> Lengths:
    scanned = sorted(lengths, key=lambda i: (-lengths[i], i))
    rest = [i for i in range(total) if i not in lengths] if len(lengths) < total else []
    return Lengths(
        order=scanned + rest,
        longest=lengths[scanned[0]] if scanned else 0,
        scanned=len(lengths),
        total=total,
        seconds=seconds,
        measured=lengths,
    )
