"""Trials without a GPU: the training step traced at a size, replayed through the allocator model.

A :class:`TracedSource` is a :class:`~lightning_gpumem.tuning.search.model.TrialSource`: the search and the
plan ask it for a size's trial as they ask real trials, and it answers from the step traced on fake tensors
(``_hw/trace.py``) replayed through the model of the caching allocator (``sources/allocator.py``). A size's
trace is kept, so asking again under another limit only replays it (milliseconds); once three traced sizes
show each request affine in the batch size (``sources/affine.py``), other sizes' streams are made from them
instead of traced, and :meth:`TracedSource.confirm` traces the largest of those to check.

The trace asks for what kernels allocate for themselves where the shapes decide it (cuBLAS workspaces,
reductions' staging buffers: ``_core/kernels.py``); DDP's gradient buckets are added before the first step,
and, for a card, the memory outside PyTorch (:data:`CONTEXT_BYTES`, the CUDA context and the libraries'
handles).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from lightning_gpumem._core.alloc_events import Event
from lightning_gpumem._core.units import GIB
from lightning_gpumem._hw.trace import Trace
from lightning_gpumem.tuning.search.headroom import size_to_keep
from lightning_gpumem.tuning.search.model import Trial, accepted
from lightning_gpumem.tuning.search.plan import Prediction
from lightning_gpumem.tuning.search.policy import Guess, SearchResult, search_batch_size
from lightning_gpumem.tuning.sources.affine import AffineStreams
from lightning_gpumem.tuning.sources.allocator import Replay
from lightning_gpumem.tuning.sources.steps import replay_steady

# memory a CUDA process holds outside PyTorch's allocator: the context, cuBLAS/cuDNN handles, loaded
# kernels (docs/memory_planner.md, "Without a GPU", has where the figure comes from)
CONTEXT_BYTES = 3 * GIB // 4
TRAIN_PHASES = ("train", "optimizer")


class CannotTrace(Exception):
    """The step cannot be traced: the reason names the op and where it ran."""


@dataclass
class TracedSource:
    """Trials from traces: ``source(size) -> Trial``, the replay of the step traced at ``size``.

    Attributes:
        trace_at: traces the training (and validation) step at a batch size.
        limit_bytes: the allocator's cap in the replay (``None``: no cap, the peaks as they come).
        expandable_segments: replay through the ``expandable_segments:True`` allocator.
        bucket_bytes: DDP's gradient buckets (a copy of the gradients, made when the model is wrapped), or 0.
        synthesise: make the streams of sizes not traced from three traced ones where they are affine.
        unmeasured: the ops the traces ran whose kernels' own memory is not known (``Trace.unmeasured``).
    """

    trace_at: Callable[[int], Trace]
    limit_bytes: int | None = None
    expandable_segments: bool = False
    traces: dict[int, list[Event]] = field(default_factory=dict)
    bucket_bytes: int = 0
    synthesise: bool = True
    traced: dict[int, list[Event]] = field(default_factory=dict)
    affine: AffineStreams = field(default_factory=AffineStreams)
    unmeasured: set[str] = field(default_factory=set)

    def __call__(self, size: int, /) -> Trial:
        """The trial of ``size``: its replay's peaks, or an OOM where the replay met the cap.

        Raises:
            CannotTrace: where the step cannot be traced (an op without a fake kernel, a data-dependent op).
        """
        return trial_of(size, self.replay(size))

    def replay(self, size: int) -> Replay:
        """The replay of ``size``'s stream under :attr:`limit_bytes` (traced, or made, once per size).

        The training steps go on past the traced ones until the allocator's layout settles, as a fit's steps
        do (``sources/steps.py``).
        """
        events = self.traces.get(size)
        if events is None:
            events = self.affine.at(size) if self.synthesise else None
            if events is None:
                events = self._trace(size)
                self.affine.learn(self.traced)
            else:
                self.affine.synthesised.add(size)
            self.traces[size] = events
        replayed, _ = replay_steady(
            events, limit_bytes=self.limit_bytes, expandable_segments=self.expandable_segments
        )
        return replayed

    def confirm(self) -> bool:
        """Trace the largest size whose stream was made, not traced: whether the two are the same.

        Where they differ, streams are no longer made, and those made are dropped (asked again, they are
        traced). ``True`` where none was made.
        """
        made = self.affine.synthesised
        if not made:
            return True
        largest = max(made)
        if self._trace(largest) == self.traces[largest]:
            return True
        for size in made:
            self.traces.pop(size, None)
        self.affine.turn_off()
        return False

    def add(self, size: int, trace: Trace) -> None:
        """``size``'s trace, made elsewhere (a forked child's), as if traced here.

        Raises:
            CannotTrace: where the trace could not be made.
        """
        self.traces[size] = self._traced(size, trace)
        self.affine.learn(self.traced)

    def _trace(self, size: int) -> list[Event]:
        return self._traced(size, self.trace_at(size))

    def _traced(self, size: int, trace: Trace) -> list[Event]:
        if trace.cannot_trace is not None:
            raise CannotTrace(trace.cannot_trace)
        self.unmeasured |= trace.unmeasured
        buckets = [Event("alloc", block=-1, size=self.bucket_bytes)] if self.bucket_bytes else []
        events = self.traced[size] = [*buckets, *trace.events]
        return events

    def under(self, limit_bytes: int | None) -> TracedSource:
        """The same source (its traces shared) replaying under another cap."""
        return replace(self, limit_bytes=limit_bytes)  # the same dicts and affine state, shared


def trial_of(size: int, replayed: Replay) -> Trial:
    """A replay as a trial: reserved and live peaks, the training and validation phases' live peaks.

    >>> from lightning_gpumem._core.units import MIB
    >>> from lightning_gpumem.tuning.sources.allocator import replay
    >>> # 3 MiB opens a 20 MiB segment, and 5 MiB more fit in it
    >>> events = [Event("alloc", 1, 3 * MIB), Event("mark", label="train"), Event("alloc", 2, 5 * MIB)]
    >>> trial = trial_of(4, replay(events))
    >>> trial.fits, trial.peak_bytes // MIB, trial.allocated_bytes // MIB, trial.train_peak_bytes // MIB
    (True, 20, 8, 8)
    """
    if not replayed.fits:
        return Trial(size, fits=False, retries=replayed.retries, samples=size)
    phases = replayed.phase_peaks
    train = [phases[label][0] for label in TRAIN_PHASES if label in phases]
    val = phases["val"][0] if "val" in phases else None
    return Trial(
        size,
        fits=True,
        peak_bytes=replayed.peak_reserved,
        allocated_bytes=replayed.peak_allocated,
        train_peak_bytes=max(train) if train else replayed.peak_allocated,
        val_peak_bytes=val,
        retries=replayed.retries,
        samples=size,
    )


# the fraction of a limit a traced plan leaves free for what the trace does not see (kernels' buffers it does
# not ask for, e.g. cuDNN's convolutions'), where the step ran an op outside MEASURED_OPS; the measured
# errors are in docs/benchmarks.md, "Planning without a GPU"
TRACE_MARGIN = 0.01


def trace_margin(source: TracedSource) -> float:
    """The margin of a plan from ``source``'s traces.

    :data:`TRACE_MARGIN` where they ran an op not measured exact against the H100 (``MEASURED_OPS`` of
    ``_core/kernels.py``), else 0: every request of such a step is in its trace.
    """
    return TRACE_MARGIN if source.unmeasured else 0.0


@dataclass(frozen=True)
class TracedPlan:
    """A plan from traces: the points traced and one prediction per budget.

    Attributes:
        points: the trials traced, in the order the searches asked for them.
        predictions: per budget (largest first), the run's peak and the largest size that fits.
        seconds: wall time of the tracing and the replays.
    """

    points: tuple[Trial, ...]
    predictions: tuple[Prediction, ...]
    seconds: float


# sizes below a traced largest size whose replays are checked too: where the cache's layout decides whether
# the largest requests find room, a size can fit above one that does not, and such a fit is luck
BELOW = 16


# maps a capped source over sizes: the replays of the check below a size found (a plain loop by default; the
# tuner's shares them among forked children, ``tuning/traced_start.py``)
Replays = Callable[[Callable[[int], Trial], Sequence[int]], list[Trial]]

# starts those replays (given the seconds one took in the search) and gives what waits for them: the tuner's
# run in forked children beside its next trial
Later = Callable[[Callable[[int], Trial], Sequence[int], float], Callable[[], list[Trial]]]


def each(run: Callable[[int], Trial], sizes: Sequence[int]) -> list[Trial]:
    """:data:`Replays` one after the other, here."""
    return [run(size) for size in sizes]


def largest_traced(
    source: TracedSource,
    limit: int,
    *,
    init_val: int,
    upper: int,
    tolerance: float,
    replays: Replays = each,
) -> SearchResult:
    """The largest size whose replay, and the replays of the :data:`BELOW` sizes under it, fit ``limit``.

    The search (:func:`~lightning_gpumem.tuning.search.policy.search_batch_size`) assumes a size fits where a
    larger one does. The allocator's replay is not always so: where the largest requests fit only as the
    blocks before them happen to lie, a size can fit above one that runs out of memory (the 236M GPT with
    activation checkpointing under 24 GiB: 78 and 80-84 do not, 79 and 85-88 do; on the H100, 79 ran and 80
    did not). So
    the sizes under the one found are replayed too (by ``replays``; a size the search replayed is not
    replayed again), and a failure among them lowers the answer to the size below it: what is returned has
    :data:`BELOW` fitting sizes under it (or all of them).
    """
    run = source.under(limit)
    found = search_batch_size(run, init_val=init_val, upper=upper, limit_bytes=limit, tolerance=tolerance)
    fresh = unchecked(found)
    return checked(found, limit, dict(zip(fresh, replays(run, fresh), strict=True)))


def unchecked(found: SearchResult) -> list[int]:
    """The sizes under ``found``'s that its check below replays: the :data:`BELOW` the search did not."""
    if found.batch_size is None:
        return []
    seen = {trial.batch_size for trial in found.trials}
    return [size for size in _below(found.batch_size) if size not in seen]


def checked(found: SearchResult, limit: int, replayed: dict[int, Trial]) -> SearchResult:
    """``found`` with the check below it: the replays of :func:`unchecked`'s sizes in ``replayed``."""
    best = found.batch_size
    if best is None:
        return found
    seen = {trial.batch_size: trial for trial in found.trials} | replayed
    extra = [seen[size] for size in _below(best)]
    failing = [trial.batch_size for trial in extra if not accepted(trial, limit)]
    if failing:
        best = min(failing) - 1
    trials = found.trials + tuple(extra)
    if best == found.batch_size:
        return replace(found, trials=trials)
    if best < 1:
        return SearchResult(None, trials, "nothing_fits")
    return SearchResult(best, trials, "bracketed", f"the replay at {best + 1} does not fit")


def _below(size: int) -> list[int]:
    return list(range(size - 1, max(1, size - BELOW) - 1, -1))


def traced_guess(
    source: TracedSource,
    limit: int,
    *,
    upper: int,
    init_val: int,
    headroom: float = 0.0,
    replays: Replays = each,
    later: Later | None = None,
) -> Callable[[Trial], Guess | None]:
    """The search's ``guess`` from a trace: its largest size, calibrated by the first real trial.

    The guess, given the first real trial, searches the replays under ``limit`` less what that trial's
    reserved peak measured above its replay's (the memory the trace does not see, or sees too much of, taken
    as fixed); each size's stream is traced (or made) once and kept. Where that trial has no peak to
    calibrate with, the search is under ``limit`` itself. Less ``headroom`` (``search/headroom.py``), where
    that gives something up, it is the size to keep: run once, it ends the search, with no trial of the
    largest size and the edge above it. Nothing is given up at ``upper``. Nothing is traced or replayed
    before the guess is first asked.

    The check below the size found (:func:`largest_traced`'s) is made by ``replays`` before the guess is
    given; with ``later``, it is started instead and the guess given at once, its ``settle`` waiting for
    the check (the search asks after the guess's trial): the guess the check leaves.

    Raises (from the guess):
        CannotTrace: where the step cannot be traced.
    """

    @functools.cache
    def search(under: int, start: int) -> tuple[SearchResult, float]:  # under `limit` itself: asked once
        begun = time.perf_counter()
        found = search_batch_size(
            source.under(under), init_val=start, upper=upper, limit_bytes=under, tolerance=0.0
        )
        return found, (time.perf_counter() - begun) / max(1, len(found.trials))

    def calibrated(trial: Trial) -> tuple[int, int]:
        """The limit the replays are searched under after ``trial``, and the size the search starts at."""
        replayed = source.under(None)(trial.batch_size)
        if trial.peak_bytes is None or replayed.peak_bytes is None:
            return limit, init_val
        shifted = limit - (trial.peak_bytes - replayed.peak_bytes)
        return (limit, init_val) if shifted == limit else (shifted, trial.batch_size)

    def kept(found: SearchResult) -> Guess | None:
        if found.batch_size is None:
            return None
        size = size_to_keep(found.batch_size, headroom, upper)
        return Guess(size, kept=size < found.batch_size)

    def guess(trial: Trial) -> Guess | None:
        under, start = calibrated(trial)
        found, seconds = search(under, start)
        fresh = unchecked(found)
        run = source.under(under)
        if later is None or not fresh:
            return kept(checked(found, under, dict(zip(fresh, replays(run, fresh), strict=True))))
        wait = later(run, fresh, seconds)
        given = kept(found)

        def settle() -> Guess | None:
            return kept(checked(found, under, dict(zip(fresh, wait(), strict=True))))

        return None if given is None else replace(given, settle=settle)

    return guess


def plan_by_trace(
    source: TracedSource,
    size: int,
    budgets: Sequence[int],
    *,
    upper: int,
    init_val: int = 2,
    outside: int = CONTEXT_BYTES,
    margin: float | None = None,
) -> TracedPlan:
    """For each budget, the run's traced peak and the largest size whose traced reserved peak fits.

    The budget less ``outside`` is the allocator's limit; the largest size is :func:`largest_traced`'s (to
    1%) on traced trials under that limit less ``margin`` of it (``None``: :func:`trace_margin`'s), so it is
    never above what the replay says fits. The peak at ``size`` is its replay without a cap, with ``margin``
    of it as the band.

    Raises:
        CannotTrace: where the step cannot be traced.
    """
    start = time.perf_counter()
    while True:
        asked, predictions = _plan(source, size, budgets, upper, init_val, outside, margin)
        if source.confirm():  # a size made from the affine streams, traced: the same, or all traced again
            break
    return TracedPlan(tuple(asked), tuple(predictions), time.perf_counter() - start)


def _plan(
    source: TracedSource,
    size: int,
    budgets: Sequence[int],
    upper: int,
    init_val: int,
    outside: int,
    margin: float | None,
) -> tuple[list[Trial], list[Prediction]]:
    uncapped = source.under(None)
    # the run's size and two more, uncapped: the plan's lines have points even where no budget fits one
    asked: list[Trial] = [uncapped(s) for s in sorted({init_val, size, 2 * size})]
    if margin is None:
        margin = trace_margin(source)
    peak = float(next(t for t in asked if t.batch_size == size).peak_bytes or 0)
    band = margin * peak
    predictions = []
    for budget in budgets:
        limit = max(0, budget - outside)
        capped = math.floor((1.0 - margin) * limit)
        found = largest_traced(source, capped, init_val=init_val, upper=upper, tolerance=0.01)
        asked += found.trials
        fits = peak + band <= limit
        predictions.append(Prediction(budget, limit, found.batch_size, False, peak, band, fits, traced=True))
    return asked, predictions
