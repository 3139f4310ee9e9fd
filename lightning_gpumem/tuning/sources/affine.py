"""Allocation streams at any batch size from streams traced at three: each request's bytes affine in it.

Tracing a step on fake tensors takes a second or more; the search asks for many sizes. Where the streams of
two traced sizes align event by event (the same requests, frees and marks in the same order) and each
request's bytes differ by a whole number per sample, the stream at any size is the first one with each
request grown by that number per sample. A kernel's scratch buffer is not affine (its size follows the
card's multiprocessors): its recipe (the shapes it is computed from) is grown instead, and its size computed
again (``_core/kernels.py``). That is only believed once a third traced size is exactly what the two
predict; a step whose requests are not affine (a branch on the batch size, a rounding per batch) fails the
check and is traced at every size. Pure: stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_gpumem._core.alloc_events import Event
from lightning_gpumem._core.kernels import scratch_bytes

# bytes per sample, or (for a kernel's scratch buffer) its recipe's numbers per sample
Slope = int | tuple[int, ...]


@dataclass
class AffineStreams:
    """Learns the affine stream from traced sizes (:meth:`learn`), then makes any size's (:meth:`at`).

    Attributes:
        state: ``"unknown"`` (fewer than three sizes traced), ``"on"`` (the third matched) or ``"off"``.
        synthesised: the sizes whose streams were made, not traced (their user adds them).

    Example:
        >>> def traced(n):
        ...     return [Event("alloc", 1, 100 + 8 * n), Event("mark", label="train"), Event("free", 1)]
        >>> streams = AffineStreams()
        >>> streams.learn({2: traced(2), 5: traced(5), 9: traced(9)})
        >>> streams.state, streams.at(40) == traced(40)
        ('on', True)
    """

    state: str = "unknown"
    synthesised: set[int] = field(default_factory=set)
    checked: bool = True  # False: believed from two traced sizes (where real trials check what it makes)
    _size: int = 0
    _events: list[Event] = field(default_factory=list)
    _slopes: list[Slope] = field(default_factory=list)

    def learn(self, traced: dict[int, list[Event]]) -> None:
        """From the three smallest sizes of ``traced`` (size -> stream): on where affine, else off.

        Not :attr:`checked`: from the two smallest, on where they align.
        """
        if self.state != "unknown" or len(traced) < (3 if self.checked else 2):
            return
        first, second, *rest = sorted(traced)
        slopes = _slopes(traced[first], first, traced[second], second)
        third = rest[0] if rest and self.checked else None
        if slopes is None or (
            third is not None and _grown(traced[first], slopes, third - first) != traced[third]
        ):
            self.state = "off"
            return
        self.state, self._size, self._events, self._slopes = "on", first, traced[first], slopes

    def at(self, size: int) -> list[Event] | None:
        """The stream at ``size`` where the streams are affine.

        ``None`` where they are not, or where a request would shrink below 0 bytes.
        """
        if self.state != "on":
            return None
        return _grown(self._events, self._slopes, size - self._size)

    def turn_off(self) -> None:
        """Trace every size from now on (a synthesised stream differed from its trace)."""
        self.state = "off"
        self.synthesised.clear()


def _slopes(a: list[Event], size_a: int, b: list[Event], size_b: int) -> list[Slope] | None:
    """Bytes per sample of each event between two aligned streams; ``None`` where they do not align."""
    if len(a) != len(b) or size_a == size_b:
        return None
    slopes: list[Slope] = []
    for x, y in zip(a, b, strict=True):
        if (x.action, x.block, x.stream, x.label, len(x.kernel)) != (
            y.action,
            y.block,
            y.stream,
            y.label,
            len(y.kernel),
        ):
            return None
        pairs = zip(x.kernel, y.kernel, strict=True) if x.kernel else [(x.size, y.size)]
        per_sample = []
        for before, after in pairs:
            slope, rest = divmod(after - before, size_b - size_a)
            if rest:
                return None
            per_sample.append(slope)
        slopes.append(tuple(per_sample) if x.kernel else per_sample[0])
    return slopes


def _grown(events: list[Event], slopes: list[Slope], samples: int) -> list[Event] | None:
    grown = []
    for event, slope in zip(events, slopes, strict=True):
        if isinstance(slope, tuple):  # a kernel's scratch: its recipe grows, its size is computed again
            recipe = tuple(n + s * samples for n, s in zip(event.kernel, slope, strict=True))
            if min(recipe) < 0:
                return None
            grown.append(event.resized(scratch_bytes(recipe), kernel=recipe))
            continue
        if slope == 0:
            grown.append(event)
            continue
        size = event.size + slope * samples
        if size < 0:
            return None
        grown.append(event.resized(size))
    return grown
