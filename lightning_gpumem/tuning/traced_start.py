"""``BatchSizeTuner(start="trace")``: the step traced beside the first trial, its calibrated largest size.

Why: tracing the step at its two sizes is a second or two of Python (meta tensors first, ``_hw/trace.py``),
which would otherwise run ahead of every trial. Here each size is traced in a forked copy of the process
(``_core/forked.py``), started before the trials, while the first trial runs on the GPU; the guess, asked
after that trial, waits for them. The replays of the check below the size found (``sources/traced.py``,
``BELOW``) run in forked children beside the guess's own trial (``traced_guess``'s ``later``): the guess is
given as soon as the search of the replays has found it, and its check is waited for after its trial
(``Guess.settle``; a check that lowers the size takes the guess back). As many children as end their
replays with that trial (:func:`beside_workers`: a fork of this process, timed at the traces' forks, grows
with its memory, about 20 ms a GiB). Where the process cannot fork (not Linux), or its children cannot run a
backward pass (``_hw/forks.py``: this process trained before), the sizes are traced here before the trials,
and the check is made here before the guess is given.

The children copy the module and optimizer as they were at the fork, before any trial: the trace a fit's
first step would make, as when it ran here.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from functools import partial
from types import TracebackType

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_gpumem._core.forked import ChildFailed, Forked, ForkedMap, cores
from lightning_gpumem._hw.allocator import kernel_device
from lightning_gpumem._hw.forks import backward_forks, without_cuda
from lightning_gpumem._hw.trace import Trace
from lightning_gpumem.tuning.search import Guess
from lightning_gpumem.tuning.search.model import Trial
from lightning_gpumem.tuning.sources.affine import AffineStreams
from lightning_gpumem.tuning.sources.traced import Later, each, traced_guess
from lightning_gpumem.tuning.traced_plan import traced_source
from lightning_gpumem.tuning.trials.saved_run import rng_kept

TRACE_TIMEOUT = 600.0  # seconds a forked trace may take before the search goes on from its probe alone
REPLAY_TIMEOUT = 120.0  # seconds the forked replays may take before they are made here
MAX_WORKERS = 8  # forked children replaying at once (each a copy of the process: under DDP, per rank)
_OWNER = "BatchSizeTuner(start='trace')"


def traced_sizes(init_val: int, upper: int) -> list[int]:
    """The two sizes traced: the first trial's and one more (whose streams give every size's).

    >>> traced_sizes(2, 1000), traced_sizes(2, 3), traced_sizes(4, 4), traced_sizes(8, 4)
    ([2, 5], [2, 3], [4], [4])
    """
    return sorted({min(init_val, upper), min(upper, 2 * init_val + 1)})


class TracedStart:
    """The search's ``guess`` for ``start="trace"``, its traces started at construction (before the trials).

    Call it with a trial (the first) for the guess; ``None`` (with one warning) where the step could not be
    traced or the guess failed: the search then goes on from its probe alone. A context manager: leaving it
    stops the children not waited for.
    """

    def __init__(
        self,
        trainer: pl.Trainer,
        limit: int,
        *,
        upper: int,
        init_val: int,
        validate: bool,
        headroom: float,
    ) -> None:
        self._start = time.perf_counter()
        self._children: dict[int, Forked[Trace]] = {}
        self._guess: Callable[[Trial], Guess | None] | None = None
        self._failed = False
        self._fork_seconds = 0.0  # what one fork of this process took, here (the parent's side)
        self._trial_seconds = 0.0  # the first trial's: the guess's trial takes as long at least
        self._maps: list[ForkedMap[Trial]] = []  # the check's replays, beside the guess's trial
        self._strategy = trainer.strategy
        with rng_kept(trainer):  # the first batches drew from the run's RNG streams
            device = kernel_device(trainer.strategy.root_device)
            # two steps: the second has the optimizer's state, and the first real trial calibrates the rest
            # meta tensors first: the guess is validated by real trials, so a trace of half the time
            source = traced_source(trainer, "BatchSizeTuner", validate, device, steps=2, meta_first=True)
            if source is None:
                self._failed = True
                return
            source = dataclasses.replace(source, affine=AffineStreams(checked=False))  # two traced sizes
            self._source = source
            sizes = traced_sizes(init_val, upper)
            forked = backward_forks() and self._fork(sizes)  # else traced here, before the trials
            later: Later | None = self._later if forked else None  # the check beside the guess's trial
            if getattr(trainer.strategy, "global_rank", 0) != 0:  # rank 0's check decides for every rank
                later = _unasked
            self._guess = traced_guess(
                source, limit, upper=upper, init_val=init_val, headroom=headroom, later=later
            )
            if not forked:
                for size in sizes:
                    if not self._add(size, partial(source.trace_at, size)):
                        return
                self._traced(forked=False)

    def __call__(self, trial: Trial) -> Guess | None:
        """The guess after ``trial`` (the first): the traces waited for, the calibrated largest size.

        Under DDP every rank tries rank 0's guess, and none where a rank has none (a trace that failed
        there), and takes rank 0's check of it: the ranks' trials stay the same.
        """
        guess = self._local(trial)
        strategy = self._strategy
        if not strategy.reduce_boolean_decision(guess is not None, all=True):
            if guess is not None:  # this rank's own failure, or its finding no size, says so itself
                rank_zero_warn(
                    f"{_OWNER}: another rank has no traced guess; the search goes on from its probe alone."
                )
            return None
        if guess is None or getattr(strategy, "world_size", 1) <= 1:
            return guess
        return self._agreed(guess)

    def _agreed(self, guess: Guess) -> Guess:
        """Rank 0's guess on every rank, and rank 0's check of it: a closure is not sent, its result is."""
        strategy = self._strategy
        plain = dataclasses.replace(guess, settle=None)
        agreed, checked = strategy.broadcast((plain, guess.settle is not None), src=0)
        if not checked:
            return agreed
        own = guess.settle if getattr(strategy, "global_rank", 0) == 0 else None

        def settle() -> Guess | None:  # every rank asks at once (the same search): rank 0's check for all
            settled: Guess | None = strategy.broadcast(None if own is None else own(), src=0)
            return settled

        return dataclasses.replace(agreed, settle=settle)

    def _local(self, trial: Trial) -> Guess | None:
        """This rank's guess: the traces waited for, the replays searched."""
        if self._failed or self._guess is None:
            return None
        if self._children and not self._join():
            return None
        start = time.perf_counter()
        self._trial_seconds = trial.seconds
        try:  # a size not traced yet is traced here (the first trial went below `init_val`)
            guess = self._guess(trial)
            if guess is not None and guess.settle is not None:
                guess = dataclasses.replace(guess, settle=partial(self._settle, guess.settle))
            rank_zero_info(
                f"BatchSizeTuner: the traced guess {None if guess is None else guess.size}"
                f" in {time.perf_counter() - start:.1f} s."
            )
            return guess
        except Exception as error:  # never the tuning's end: the probe's search goes on
            self._failed = True
            rank_zero_warn(
                f"{_OWNER}: the traced guess failed ({type(error).__name__}: {error}); the search goes on"
                " from its probe alone."
            )
            return None

    def _settle(self, settle: Callable[[], Guess | None]) -> Guess | None:
        """The guess the check below leaves; on an error ``None`` (taken back), with one warning."""
        try:
            return settle()
        except Exception as error:  # never the tuning's end: the search goes on from its trials
            self._failed = True
            rank_zero_warn(
                f"{_OWNER}: the check below the traced guess failed ({type(error).__name__}: {error}); the"
                " guess is taken back and the search goes on from its trials."
            )
            return None

    def __enter__(self) -> TracedStart:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop the children not waited for."""
        for child in self._children.values():
            child.close()
        self._children.clear()
        for mapped in self._maps:
            mapped.close()
        self._maps.clear()

    def _fork(self, sizes: list[int]) -> bool:
        """A forked child tracing each size; ``False``, none left running, where one could not start."""
        try:
            for size in sizes:
                trace_at = partial(self._source.trace_at, size)
                start = time.perf_counter()
                self._children[size] = Forked(partial(without_cuda, trace_at))
                self._fork_seconds = max(self._fork_seconds, time.perf_counter() - start)
        except Exception:  # no memory or processes left for a copy: traced here, before the trials
            self.close()
            return False
        return True

    def _join(self) -> bool:
        children, self._children = self._children, {}
        waited = time.perf_counter()
        deadline = time.monotonic() + TRACE_TIMEOUT  # for all of them
        try:
            for size, child in children.items():
                left = max(0.0, deadline - time.monotonic())
                if not self._add(size, partial(child.result, left)):
                    return False
        finally:
            for child in children.values():
                child.close()
        self._traced(forked=True, waited=time.perf_counter() - waited)
        return True

    def _add(self, size: int, trace: Callable[[], Trace]) -> bool:
        """``size``'s trace into the source; ``False``, with one warning, where it could not be made."""
        try:
            self._source.add(size, trace())
        except Exception as error:  # the trials run the real step: a real error shows there, not here
            self._failed = True
            forked = isinstance(error, ChildFailed)
            reason = f"{error}" if forked else f"{type(error).__name__}: {error}"
            where = " in a forked process" if forked else ""
            rank_zero_warn(
                f"{_OWNER}: the step could not be traced{where} ({reason}); the search starts from its"
                " probe alone."
            )
            return False
        return True

    def _traced(self, forked: bool, waited: float = 0.0) -> None:
        seconds = time.perf_counter() - self._start
        beside = f" in forked processes, beside the first trial (waited {waited:.1f} s)" if forked else ""
        rank_zero_info(
            f"BatchSizeTuner: the step traced on meta or fake tensors{beside} in {seconds:.1f} s."
        )

    def _later(
        self, run: Callable[[int], Trial], sizes: Sequence[int], replay_seconds: float
    ) -> Callable[[], list[Trial]]:
        """The check's replays started in forked children, beside the guess's trial; what waits for them.

        With one core, nothing runs beside the trial: the replays are made here when waited for.
        """
        if cores() < 2:
            return _unasked(run, sizes, replay_seconds)
        workers = beside_workers(
            len(sizes), replay_seconds, self._fork_seconds, self._trial_seconds, cores()
        )
        mapped = ForkedMap(run, sizes, workers=workers)
        self._maps.append(mapped)

        def wait() -> list[Trial]:
            replayed = mapped.result(REPLAY_TIMEOUT)
            return replayed if replayed is not None else each(run, sizes)

        return wait


def _unasked(
    run: Callable[[int], Trial], sizes: Sequence[int], replay_seconds: float
) -> Callable[[], list[Trial]]:
    """A check made here only if it is waited for (another rank's, or with one core): nothing started."""
    return partial(each, run, sizes)


def beside_workers(
    count: int, replay_seconds: float, fork_seconds: float, trial_seconds: float, cores: int
) -> int:
    """The forked children for ``count`` replays beside a trial of about ``trial_seconds``.

    The fewest whose replays end with the trial (a child replays its share one after the other, once
    forked); else those whose replays end soonest. Each fork holds the trial back by ``fork_seconds``.

    >>> beside_workers(15, 0.03, 0.05, 0.8, 16), beside_workers(15, 0.06, 0.05, 0.5, 16)
    (1, 3)
    >>> beside_workers(15, 0.3, 0.05, 0.5, 16), beside_workers(15, 0.3, 0.05, 0.5, 2)
    (8, 1)
    """
    most = max(1, min(cores - 1, MAX_WORKERS, count))
    for workers in range(1, most + 1):
        if fork_seconds + math.ceil(count / workers) * replay_seconds <= trial_seconds:
            return workers
    return min(range(1, most + 1), key=lambda w: w * fork_seconds + math.ceil(count / w) * replay_seconds)
