"""Leak detection: memory that keeps growing step after step, told apart from noise and one-off growth.

Why this test: allocated memory at the end of a training batch is flat in a healthy run (weights, gradients
and optimizer state persist; activations are freed), give or take the batch itself when shapes vary. A leak
(a loss appended with its graph, a cache keyed by step) adds to it at every step. The detector keeps a sample
every few steps after a warm-up, thinned to at most ``max_samples`` by doubling the stride, so the history
spans the whole run; it cuts the history (and its recent half) into quarters, and calls it a leak when the
median of every quarter is above the one before (a sustained rise, not one jump), the rise between the first
and last quarters is more than ``threshold_bytes``, and memory rises with time in rank order (Kendall's tau
at least 0.8: noise around a level, such as batches of varying shapes, scores near 0). Medians and ranks, not
means, so a few odd batches do not count.

What it costs: one allocator read per sample, so samples are taken every ``every`` steps only for the first
32 samples, then every ``4 * every`` steps (the recent window's stride: one read per 8 steps by default, as a
read costs tens of µs on a GPU), and a sample due near a logging step, whose read is free, is taken there. A
verdict is a few sorts of at most 64 values, and Kendall's tau (quadratic) runs only when the cheap tests
already point to a leak. A rise of half the threshold first makes the history *suspect* (so that the caller
can take a baseline of the live tensors then, not on every healthy run); a verdict is given only on a later
sample than the suspicion.

The rate it reports for logging is the one a verdict gives, and none before the early phase (the first 32
samples) is over: a rise over fewer steps after the warm-up is memory settling as much as a leak.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter

RECENT_SAMPLES = 16  # the last samples at 4x the base stride: a late leak shows within ~128 steps
RECENT_STRIDE = 4  # the stride of later samples, in multiples of ``every``
EARLY_SAMPLES = 32  # samples taken every ``every`` steps first: a leak from the start shows in ~50 steps
EVALUATE_EVERY = 4  # samples between two looks at the history
MIN_SAMPLES = 12  # three per quarter: a median of fewer is one noisy batch away from a false rise
MIN_TAU = 0.8  # Kendall's tau of memory with time: 1 for a clean leak; noise: 0 +- 0.2 at 12 samples


@dataclass(frozen=True)
class LeakVerdict:
    """A sustained rise in allocated memory: its rate, and the steps it was measured over."""

    bytes_per_step: float
    first_step: int
    last_step: int
    growth_bytes: int


class LeakDetector:
    """Feed ``add(step, allocated_bytes)`` at training-batch ends; it returns a verdict once a leak shows.

    Example:
        >>> detector = LeakDetector(warmup_steps=5, every=1, threshold_bytes=2**20)
        >>> [detector.add(step, 10 * 2**20) for step in range(40)].count(None)  # flat: never a leak
        40
        >>> leaky = LeakDetector(warmup_steps=5, every=1, threshold_bytes=2**20)
        >>> verdicts = [leaky.add(step, 2**20 * (10 + step)) for step in range(40)]
        >>> first = next(v for v in verdicts if v is not None)
        >>> round(first.bytes_per_step / 2**20, 1), verdicts.count(None)  # 1 MiB per step, reported once
        (1.0, 39)
    """

    def __init__(
        self,
        warmup_steps: int = 10,
        every: int = 2,
        threshold_bytes: int = 32 * 2**20,
        max_samples: int = 64,
    ) -> None:
        self.warmup_steps = warmup_steps
        self.every = every
        self.threshold_bytes = threshold_bytes
        self.max_samples = max_samples
        self.samples: list[tuple[int, int]] = []
        # the last samples as taken, never thinned
        self.recent: deque[tuple[int, int]] = deque(maxlen=RECENT_SAMPLES)
        self.flagged = False
        self._flagged_rate: float | None = None  # the verdict's rate, once one is given
        self.suspected_at: int | None = None
        """The step of the first sample where the history had risen by half the threshold (``None``: not
        yet)."""
        self._stride = every
        self._count = 0
        # of `samples` as they are now (`None`: not computed since they changed)
        self._rate: float | None = None
        self._last: int | None = None  # the step of the last sample
        self._last_kept: int | None = None  # the step of the last sample kept in `samples`

    def spacing(self) -> int:
        """Steps between two samples.

        ``every`` for the first ``EARLY_SAMPLES``, then ``RECENT_STRIDE * every``.
        """
        return self.every if self._count < EARLY_SAMPLES else RECENT_STRIDE * self.every

    def wants(self, step: int, next_log_in: int | None = None) -> bool:
        """Whether a sample is due at ``step`` (so the caller reads memory only then).

        ``next_log_in``: steps until the next logging step, whose allocator read is free (0: ``step`` is
        one). A logging step takes a sample once half the spacing has passed; a sample due within half the
        spacing of the next logging step waits for it. ``None``: every ``spacing()`` steps.
        """
        if step < self.warmup_steps or self.flagged:
            return False
        if self._last is None:
            return True
        since, spacing = step - self._last, self.spacing()
        if next_log_in == 0:
            return since >= max(1, spacing // 2)
        return since >= spacing and (next_log_in is None or next_log_in > spacing // 2)

    def add(self, step: int, allocated_bytes: int, next_log_in: int | None = None) -> LeakVerdict | None:
        """Record a sample if :meth:`wants` it.

        Returns:
            The verdict, the first time the history shows a leak; else ``None``.
        """
        if not self.wants(step, next_log_in):
            return None
        self.recent.append((step, allocated_bytes))
        self._count += 1
        self._last = step
        if self._last_kept is None or step - self._last_kept >= self._stride:
            self.samples.append((step, allocated_bytes))
            self._last_kept = step
            self._rate = None
            if len(self.samples) > self.max_samples:  # keep the whole run in view at half the resolution
                self.samples = self.samples[::2]
                self._stride *= 2
        if self._count % EVALUATE_EVERY:
            return None  # a verdict costs a few sorts: looked for every few samples only
        verdict = self._verdict_of([self.samples, self.samples[len(self.samples) // 2 :]], step)
        if verdict is None and len(self.recent) == RECENT_SAMPLES:
            verdict = self._verdict_of([list(self.recent)], step)  # a leak that started late
        return self._flag(step, verdict)

    def _flag(self, step: int, verdict: LeakVerdict | None) -> LeakVerdict | None:
        if verdict is None or self.suspected_at is None or self.suspected_at >= step:
            return None  # a verdict follows a suspicion raised on an earlier sample
        self.flagged = True
        self._flagged_rate = verdict.bytes_per_step
        return verdict

    def rate(self) -> float | None:
        """Growth in bytes per step, the estimate a verdict gives; ``None`` until the early phase is over.

        Once a leak is flagged, the verdict's own rate (sampling stops there, so it holds). Before, the rise
        of the whole history (quarter medians, first to last), from the :data:`EARLY_SAMPLES`-th sample on:
        by then the history spans about ``EARLY_SAMPLES * every`` steps after the warm-up (steps 10-72 by
        default). A rise seen over less is memory settling (the allocator, optimizer state, caches) as much
        as a leak; a leak that outgrows the threshold within the early phase is flagged there, and its rate
        given from then on. Before a verdict the rate is what both the whole history and its recent half
        support (the smaller of their two rises, 0 where they disagree in sign): a rise that stopped, memory
        settling, does not keep showing as growth. The history must also span ``(EARLY_SAMPLES - 1) * every``
        steps, however often a logging step adds a sample.
        """
        if self._flagged_rate is not None:
            return self._flagged_rate
        if self._count < EARLY_SAMPLES or len(self.samples) < MIN_SAMPLES:
            return None
        if self.samples[-1][0] - self.samples[0][0] < (EARLY_SAMPLES - 1) * self.every:
            return None  # samples taken every step (every step logged) span too few steps yet
        if self._rate is None:  # asked on every logging step; the samples change every few
            n = len(self.samples)
            rises = [_rise(self.samples[start:])[0] for start in (0, n // 2) if n - start >= MIN_SAMPLES]
            # what both the whole history and its recent half support: a rise that stopped (memory settling
            # after the warm-up) or only just began shows as the smaller; halves that disagree in sign, none
            same_sign = all(r > 0 for r in rises) or all(r < 0 for r in rises)
            self._rate = min(rises, key=abs) if same_sign else 0.0
        return self._rate

    def verdict(self) -> LeakVerdict | None:
        """A leak verdict from the history, or ``None``.

        It looks at the whole history, its recent half, and the last samples at the full rate.
        """
        return self._verdict_of([self.samples, self.samples[len(self.samples) // 2 :], list(self.recent)])

    def _verdict_of(self, parts: list[list[tuple[int, int]]], step: int | None = None) -> LeakVerdict | None:
        for part in parts:
            if len(part) < MIN_SAMPLES:
                continue
            values = list(map(itemgetter(1), part))
            if max(values) - min(values) <= self.threshold_bytes / 2:
                continue  # a flat history (the common case), ruled out without sorting
            rate, growth, rising = _rise(part)
            if not rising or growth <= self.threshold_bytes / 2:
                continue
            if self.suspected_at is None and step is not None:
                self.suspected_at = step  # the sample now, not the part's last (thinned histories skip some)
            # Kendall's tau last: O(n^2), so only where the cheap tests already point to a leak.
            if growth > self.threshold_bytes and _kendall_tau([v for _, v in part]) >= MIN_TAU:
                return LeakVerdict(rate, part[0][0], part[-1][0], int(growth))
        return None


def _rise(samples: list[tuple[int, int]]) -> tuple[float, float, bool]:
    """Rate (bytes/step) and growth between the first and last quarter medians; whether each quarter rose."""
    n = len(samples)
    steps, values = zip(*samples, strict=True)
    bounds = [(i * n // 4, (i + 1) * n // 4) for i in range(4)]
    medians = [_median(sorted(values[a:b])) for a, b in bounds]
    centres = [_median(steps[a:b]) for a, b in bounds]  # steps are in order already
    growth = medians[-1] - medians[0]
    span = centres[-1] - centres[0]
    rate = growth / span if span > 0 else 0.0
    return rate, growth, all(b > a for a, b in itertools.pairwise(medians))


def _median(ordered: Sequence[int]) -> float:
    """The median of values already in order."""
    mid = len(ordered) // 2
    return float(ordered[mid]) if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _kendall_tau(values: list[int]) -> float:
    """Kendall's tau-a of ``values`` against their order: the share of rising pairs minus falling ones."""
    n = len(values)
    score = 0
    for i in range(n - 1):
        a = values[i]
        for b in values[i + 1 :]:
            score += (b > a) - (b < a)
    return 2 * score / (n * (n - 1))


def grown_tensors(
    before: Counter[tuple[tuple[int, ...], str]], after: Counter[tuple[tuple[int, ...], str]]
) -> str:
    """The five (shape, dtype) groups that grew most, comma-separated: ``"float32[64, 1024] +12.0 MiB"``."""
    grown = sorted(((after[k] - before.get(k, 0), k) for k in after), reverse=True)
    parts = [
        f"{dtype}{list(shape)} +{delta / 2**20:.1f} MiB" for delta, (shape, dtype) in grown[:5] if delta > 0
    ]
    return ", ".join(parts) if parts else "none found among Python-visible tensors"
