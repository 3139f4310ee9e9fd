"""The one trial bench ``BatchSizeTuner`` and ``MemoryPlanner`` share.

Its parts: session, runner, drawing, cap, release. ``with TrialBench(...) as bench:`` opens a
:class:`~lightning_gpumem.tuning.trials.session.TrialSession` on the user's Trainer, expects out-of-memory
errors (they are the trials' findings, not the run's), draws the heaviest batches first where the caller says
how, and measures each trial with a :class:`TrialRunner`. ``bench.capped`` caps the allocator under a limit
for the trials inside it. On every exit path (a result, the user's error, Ctrl-C) the cap is put back, the
session restores the run, and the allocator is brought back to the layout the bench started from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from types import TracebackType
from typing import Any

import lightning.pytorch as pl

from lightning_gpumem._hw.allocator import release_to
from lightning_gpumem._hw.oom import expecting_oom
from lightning_gpumem._hw.probe import Probe
from lightning_gpumem.tuning.search.model import Trial
from lightning_gpumem.tuning.trials.measure import LEFTOVER_BYTES, BatchCheck, TrialRunner
from lightning_gpumem.tuning.trials.session import TrialSession


class TrialBench:
    """Trials at any size on ``trainer``, undone on leaving (see the module docstring).

    Args:
        trainer: the user's Trainer, at fit start (or an epoch's start).
        owner: the callback running the trials.
        probe: the device's probe.
        batch_arg_name: the attribute holding the batch size.
        steps: optimizer steps per trial.
        validate: one validation batch per trial where the fit validates.
        accumulation_for: ``accumulate_grad_batches`` for a size.
        check_batches: refuses a ``batch_arg_name`` that does not set the training batches (``None``: no
            check).
        counts_samples: the size is a number of samples (``False`` for a token budget).
        drawing: a context in which the loaders draw the heaviest batches first (``None``: as they are).
        raising: wraps the runner (e.g. refuses a size past the longest samples the data holds).
    """

    def __init__(
        self,
        trainer: pl.Trainer,
        owner: object,
        probe: Probe,
        *,
        batch_arg_name: str,
        steps: int,
        validate: bool,
        accumulation_for: Callable[[int], int],
        check_batches: BatchCheck | None = None,
        counts_samples: bool = True,
        drawing: AbstractContextManager[Any] | None = None,
        raising: Callable[[TrialRunner], Callable[[int], Trial]] | None = None,
    ) -> None:
        self.trainer, self.owner, self.probe = trainer, owner, probe
        self._options = dict(
            steps=steps,
            validate=validate,
            accumulation_for=accumulation_for,
            check_batches=check_batches,
            counts_samples=counts_samples,
        )
        self._name = batch_arg_name
        self._drawing = drawing
        self._raising = raising
        self._stack = ExitStack()
        self._session: TrialSession | None = None
        self._run: Callable[[int], Trial] | None = None
        self.runner: TrialRunner | None = None
        self.baseline: int | None = None

    def __enter__(self) -> TrialBench:
        self.baseline = self.probe.allocated_bytes()  # what each trial starts from, and the bench ends at
        self._stack.callback(release_to, self.probe, self.baseline, LEFTOVER_BYTES)
        try:
            self._session = self._stack.enter_context(
                TrialSession(self.trainer, self._name, owner=self.owner)
            )
            self._stack.enter_context(expecting_oom())
            self._stack.enter_context(self._drawing or nullcontext())
            self.runner = TrialRunner(self._session, self.probe, **self._options)  # type: ignore[arg-type]
            self._run = self._raising(self.runner) if self._raising is not None else self.runner
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> bool | None:
        return self._stack.__exit__(kind, error, traceback)

    @property
    def session(self) -> TrialSession:
        """The open trial session."""
        if self._session is None:
            raise RuntimeError("TrialBench: trials run only inside `with TrialBench(...)`.")
        return self._session

    def run(self, size: int) -> Trial:
        """One trial at ``size``, measured (through ``raising`` where given)."""
        if self._run is None:
            raise RuntimeError("TrialBench: trials run only inside `with TrialBench(...)`.")
        return self._run(size)

    @contextmanager
    def capped(self, limit: int | None) -> Iterator[None]:
        """The allocator capped at ``limit`` bytes for the trials inside, put back on leaving.

        Nothing where ``None`` or not a CUDA device.
        """
        total = self.probe.total_bytes() if limit is not None and self.probe.device.type == "cuda" else None
        if not total or limit is None:
            yield
            return
        previous = self.probe.set_memory_fraction(min(1.0, limit / total))
        try:
            yield
        finally:
            self.probe.set_memory_fraction(previous)
