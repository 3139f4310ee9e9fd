"""``BatchSizeTuner(start="trace")``: the step traced beside the first trial, its calibrated largest size.

Why: tracing the step at its two sizes on fake tensors is seconds of Python (the 236M GPT's about 2 s a size,
Hugging Face's GPT-2 about 4 s, on 2 cores), which before ran ahead of every trial. Here each size is traced
in a forked copy of the process (``_core/forked.py``), started before the trials, while the first trial runs
on the GPU; the guess, asked after that trial, waits for them. The replays of the check below the size found
(``sources/traced.py``, ``BELOW``) are shared among forked children (one per core left, 8 at most) only where
that is faster by the costs measured here: a fork of this process (the traces' forks, timed; it grows with
the process's memory, about 20 ms a GiB) against one replay (the check's first, timed).
Where the process cannot fork (not Linux), or its children cannot run a backward pass (``_hw/forks.py``: this
process trained before), the sizes are traced here before the trials, as the replays are.

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

from lightning_gpumem._core.forked import ChildFailed, Forked, cores, forked_map
from lightning_gpumem._hw.allocator import kernel_device
from lightning_gpumem._hw.forks import backward_forks, without_cuda
from lightning_gpumem._hw.trace import Trace
from lightning_gpumem.tuning.search import Guess
from lightning_gpumem.tuning.search.model import Trial
from lightning_gpumem.tuning.sources.affine import AffineStreams
from lightning_gpumem.tuning.sources.traced import each, traced_guess
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
            replays = self._replays if forked else each
            self._guess = traced_guess(
                source, limit, upper=upper, init_val=init_val, headroom=headroom, replays=replays
            )
            if not forked:
                for size in sizes:
                    if not self._add(size, partial(source.trace_at, size)):
                        return
                self._traced(forked=False)

    def __call__(self, trial: Trial) -> Guess | None:
        """The guess after ``trial`` (the first): the traces waited for, the calibrated largest size.

        Under DDP every rank tries rank 0's guess, and none where a rank has none (a trace that failed
        there): the ranks' trials stay the same.
        """
        guess = self._local(trial)
        strategy = self._strategy
        if not strategy.reduce_boolean_decision(guess is not None, all=True):
            if guess is not None:  # this rank's own failure, or its finding no size, says so itself
                rank_zero_warn(
                    f"{_OWNER}: another rank has no traced guess; the search goes on from its probe alone."
                )
            return None
        agreed: Guess | None = strategy.broadcast(guess, src=0)
        return agreed

    def _local(self, trial: Trial) -> Guess | None:
        """This rank's guess: the traces waited for, the replays searched."""
        if self._failed or self._guess is None:
            return None
        if self._children and not self._join():
            return None
        start = time.perf_counter()
        try:  # a size not traced yet is traced here (the first trial went below `init_val`)
            guess = self._guess(trial)
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

    def _replays(self, run: Callable[[int], Trial], sizes: Sequence[int]) -> list[Trial]:
        """The check's replays: the first here, timed; the rest forked where that is faster, else here."""
        if not sizes:
            return []
        start = time.perf_counter()
        first = run(sizes[0])
        rest = sizes[1:]
        workers = fork_workers(len(rest), time.perf_counter() - start, self._fork_seconds, cores())
        return [first, *_forked_replays(run, rest, workers)]


def fork_workers(count: int, replay_seconds: float, fork_seconds: float, cores: int) -> int:
    """The forked children that replay ``count`` sizes soonest; 1 where replaying them here is sooner.

    A fork costs this process ``fork_seconds`` each and the last child as much again before it starts; a
    child replays its share one after the other. Forks pay for replays of tenths of a second, not for
    hundredths in a process of several GiB.

    >>> fork_workers(15, 0.02, 0.05, 16), fork_workers(15, 0.3, 0.05, 16), fork_workers(15, 0.3, 0.05, 2)
    (1, 8, 1)
    """
    best, soonest = 1, count * replay_seconds
    for workers in range(2, min(cores - 1, MAX_WORKERS, count) + 1):
        seconds = (workers + 1) * fork_seconds + math.ceil(count / workers) * replay_seconds
        if seconds < soonest:
            best, soonest = workers, seconds
    return best


def _forked_replays(run: Callable[[int], Trial], sizes: Sequence[int], workers: int) -> list[Trial]:
    """The replays of ``sizes`` shared among ``workers`` forked children; here where fewer than two."""
    mapped = forked_map(run, sizes, workers=workers, timeout=REPLAY_TIMEOUT)
    return mapped if mapped is not None else each(run, sizes)
