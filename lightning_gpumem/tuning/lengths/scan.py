"""The lengths of a dataset's samples, scanned once, so that trials can run its longest samples first.

A batch size tuned on the batches a loader yields first holds only until a batch of longer samples arrives.
With a ``length_fn`` the tuner scans the dataset's lengths (within a time limit: past it, the samples scanned
so far, said so) and its trials draw the longest samples first (``tuning/loaders.py``), collated by the
user's own ``collate_fn``, so they pad as the fit will.
"""

from __future__ import annotations

import itertools
import numbers
import random
import time
from collections.abc import Callable, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any

from lightning_gpumem._core.batching import MAX_LENGTH
from lightning_gpumem._core.checks import as_whole_number, plain_scalar, shown

LengthFn = Callable[[Any], int] | str
"""How a sample's size is measured: a function of the sample, or the key (or attribute) of a field holding
the length, or the sequence whose ``len`` is the length. What it gives must be a whole number from 0 to 2**53
of any numeric type, or a sequence (:func:`sample_length`)."""

SCAN_SECONDS = 30.0  # a scan longer than this stops, and the trials use the longest samples scanned so far


@dataclass(frozen=True)
class Lengths:
    """What a scan found.

    Attributes:
        order: dataset indices, the longest scanned sample first (then the samples not scanned, in index
            order).
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

        The scan order depends on the seed alone, so ranks that scanned different numbers of samples agree on
        the first ``count`` of them (the fewest any rank scanned).

        >>> found = scan_lengths([[1], [1, 2, 3], [1, 2]], len, seed=0)
        >>> found.first(1).scanned, found.first(1).total, found.first(5) is found
        (1, 3, True)
        """
        if count >= self.scanned:
            return self
        kept = dict(list(self.measured.items())[: max(0, count)])
        return _found(kept, self.total, self.seconds)


def sample_length(sample: Any, length_fn: LengthFn, index: int | None = None) -> int:
    """The length of one sample, measured by ``length_fn``.

    ``length_fn`` may give a whole number of any numeric type (a Python or numpy integer, ``3.0``, a 0-d
    tensor), from 0 to :data:`~lightning_gpumem._core.batching.MAX_LENGTH`, or a sequence (a list, a tensor)
    whose length is the sample's. Anything else is refused, naming ``length_fn``, the sample and what it
    gave: a ``bool``, text (a ``str`` or ``bytes``: its characters are not its tokens; a function may say
    they are), a mapping or ``None`` (``TypeError``); NaN, an infinity or ``3.7`` (``TypeError``: not a whole
    number); a negative or astronomically long length (``ValueError``). A key or attribute the sample lacks
    raises a ``ValueError`` that names them, chained to the ``KeyError``/``AttributeError``; an error of the
    user's own code (the function) is raised unchanged, with a note naming ``length_fn`` and the sample.

    Args:
        sample: the dataset's sample (``dataset[index]``).
        length_fn: see :data:`LengthFn`.
        index: the sample's index in its dataset, for the messages (``None``: not known).

    Returns:
        The length.

    Raises:
        TypeError: ``length_fn`` gave no whole number and no sequence.
        ValueError: ``length_fn`` gave a negative or too long length, or could not be applied to the sample.

    Example:
        >>> sample_length({"input_ids": [5, 6, 7]}, "input_ids")
        3
        >>> sample_length({"n": 12}, "n")
        12
        >>> sample_length([1, 2], len)
        2
        >>> sample_length({"n": 12}, "tokens", index=4)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: `length_fn='tokens'` found no key 'tokens' in sample 4 (type dict, keys 'n'). ...
    """
    value = _apply(sample, length_fn, index)
    if type(value) is int and 0 <= value <= MAX_LENGTH:  # the common case, fast
        return value
    number = plain_scalar(value)
    if isinstance(number, (str, bytes)):  # text, not yet tokens
        raise TypeError(
            f"{_gave(length_fn, value, index)}. Expected {_EXPECTED}; not text (where its characters are its"
            " length, say so: `length_fn=lambda sample: len(sample[...])`)."
        )
    if isinstance(number, (bool, Mapping)) or number is None:
        raise TypeError(f"{_gave(length_fn, value, index)}. Expected {_EXPECTED}.")
    if isinstance(number, numbers.Real):
        whole = as_whole_number(value)
        if whole is None:
            raise TypeError(f"{_gave(length_fn, value, index)}: not a whole number. Expected {_EXPECTED}.")
    elif getattr(value, "ndim", 1) != 0 and isinstance(value, Sized):
        try:
            whole = len(value)
        except TypeError:  # sized, yet without a length
            raise TypeError(f"{_gave(length_fn, value, index)}. Expected {_EXPECTED}.") from None
        except OverflowError:  # longer than any index: range(10**20)
            raise ValueError(f"{_gave(length_fn, value, index)}. Expected {_EXPECTED}.") from None
    else:
        raise TypeError(f"{_gave(length_fn, value, index)}. Expected {_EXPECTED}.")
    if not 0 <= whole <= MAX_LENGTH:
        raise ValueError(f"{_gave(length_fn, value, index)}. Expected {_EXPECTED}.")
    return whole


_EXPECTED = (
    f"a whole number from 0 to 2**{MAX_LENGTH.bit_length() - 1} (the sample's length), or a sequence whose"
    " length is the sample's"
)


def _name(length_fn: LengthFn) -> str:
    """``length_fn`` as a message shows it: a key's repr, a function's name.

    The name leaves out the function it is local to.
    """
    if isinstance(length_fn, str):
        return repr(length_fn)
    name = getattr(length_fn, "__qualname__", None) or type(length_fn).__name__
    return str(name).rsplit("<locals>.", 1)[-1]


def _sample(index: int | None) -> str:
    return "a sample" if index is None else f"sample {index}"


def _gave(length_fn: LengthFn, value: object, index: int | None) -> str:
    return (
        f"`length_fn={_name(length_fn)}` gave {shown(value)} (type {type(value).__name__}) for"
        f" {_sample(index)}"
    )


def _apply(sample: Any, length_fn: LengthFn, index: int | None) -> Any:
    """What ``length_fn`` gives for ``sample``: its value (a key or an attribute) or the function's result.

    A key or an attribute the sample lacks raises a ``ValueError`` naming ``length_fn`` and the sample,
    chained to the ``KeyError``/``AttributeError``. An error raised by the user's own code (the function, a
    mapping's or a property's code) is the user's: it is raised unchanged, with a note naming ``length_fn``
    and the sample.
    """
    if not isinstance(length_fn, str):
        try:
            return length_fn(sample)
        except Exception as error:
            error.add_note(_raised_by(length_fn, index))
            raise
    if isinstance(sample, Mapping):
        try:
            return sample[length_fn]
        except Exception as error:
            # the mapping's own code raised it
            if not isinstance(error, KeyError) or _has(sample, length_fn):
                error.add_note(_raised_by(length_fn, index))
                raise
            keys = ", ".join(repr(key) for key in itertools.islice(sample, 8)) + (
                ", ..." if len(sample) > 8 else ""
            )
            raise ValueError(
                f"`length_fn={length_fn!r}` found no key {length_fn!r} in {_sample(index)} (type"
                f" {type(sample).__name__}, keys {keys or 'none'}). Expected the key of a field every sample"
                " has, or a function of a sample returning its length."
            ) from error
    try:
        return getattr(sample, length_fn)
    except Exception as error:
        # a property's own error
        if not isinstance(error, AttributeError) or hasattr(type(sample), length_fn):
            error.add_note(_raised_by(length_fn, index))
            raise
        raise ValueError(
            f"`length_fn={length_fn!r}` found no attribute {length_fn!r} on {_sample(index)} (type"
            f" {type(sample).__name__}). Expected the key (or attribute) of a field every sample has, or a"
            " function of a sample returning its length."
        ) from error


def _raised_by(length_fn: LengthFn, index: int | None) -> str:
    return f"(raised by `length_fn={_name(length_fn)}` for {_sample(index)})"


def _has(mapping: Mapping[Any, Any], key: str) -> bool:
    try:
        return key in mapping
    except Exception:
        return False


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

    Raises:
        TypeError: ``length_fn`` gave no length for a sample (see :func:`sample_length`; the message names
            ``length_fn``, the sample's index and what it gave).
        ValueError: ``length_fn`` gave a negative or too long length, or names a key a sample lacks (the
            error chained as ``__cause__``).

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
        lengths[index] = sample_length(dataset[index], length_fn, index)
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
