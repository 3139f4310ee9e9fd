"""The monitor's leak detection wired to the run: allocator samples, the census of live tensors, the warning.

The verdicts are :class:`~lightning_gpumem._core.leaks.LeakDetector`'s (pure); this adds what needs the
hardware and the Trainer, so the monitor calls three methods (:meth:`LeakWatch.due`,
:meth:`LeakWatch.sample`, :meth:`LeakWatch.rate`).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_gpumem import keys
from lightning_gpumem._core.leaks import LeakDetector, LeakVerdict, grown_tensors
from lightning_gpumem._core.units import MIB, format_gib
from lightning_gpumem._hw.probe import Probe, tensor_census
from lightning_gpumem._pl.logging import batches_that_stepped, log_to_loggers, steps_to_next_log
from lightning_gpumem._pl.peers import budget_bytes


class LeakWatch:
    """Feeds a :class:`LeakDetector` at training-batch ends; warns once, on rank zero, of a leak."""

    def __init__(self, probe: Probe, warmup_steps: int, threshold_bytes: int) -> None:
        self.probe = probe
        self.detector = LeakDetector(warmup_steps, threshold_bytes=threshold_bytes)
        self.verdict: LeakVerdict | None = None
        # (step, census) when memory first rose by half the threshold
        self._census: tuple[int, Any] | None = None
        # the step of the batch end `due` was asked at, next log in
        self._at: tuple[int, int | None] = (0, None)

    def due(self, trainer: pl.Trainer, logged: bool, every_n_steps: int) -> bool:
        """Whether this training-batch end takes a sample (the allocator is read only then).

        ``logged``: a logging step, whose read is free. Steps are the loggers'
        (:func:`batches_that_stepped`).
        """
        step = batches_that_stepped(trainer)
        self._at = (step, 0 if logged else steps_to_next_log(step, every_n_steps))
        return self.detector.wants(*self._at)

    def rate(self) -> float | None:
        """Growth of allocated memory in bytes per step, ``None`` until it means something.

        The detector's estimate (:meth:`LeakDetector.rate`): nothing before its early phase (32 samples) is
        over unless a leak was flagged, and a flagged leak's own rate from then on.
        """
        return self.detector.rate()

    def sample(
        self, trainer: pl.Trainer, allocated: int | None, total_bytes: int | None
    ) -> LeakVerdict | None:
        """Add the sample :meth:`due` asked for; warn once it shows a leak.

        ``allocated`` is read now when ``None``.
        """
        allocated = self.probe.allocated_bytes() if allocated is None else allocated
        if allocated is None:
            return None
        step, next_log_in = self._at
        verdict = self.detector.add(step, allocated, next_log_in)
        if self.detector.suspected_at is not None and self._census is None:
            # What was alive when memory first rose by half the threshold: a `gc` scan (milliseconds), so
            # taken only on a suspicion, never on a healthy run; a verdict comes on a later sample, when the
            # leak has grown.
            self._census = (step, tensor_census(self.probe.device))
        if verdict is None or self._census is None or self._census[0] == step:
            return None  # (a verdict always follows a census taken at an earlier sample)
        self.verdict = verdict
        start_step, before = self._census
        budget = budget_bytes(trainer) or total_bytes
        rate = verdict.bytes_per_step
        runs_out = ""
        if budget and rate > 0 and budget > allocated:
            at = step + int((budget - allocated) / rate)
            runs_out = f"; at this rate the {format_gib(budget)} budget runs out near step {at}"
        rank_zero_warn(
            f"MemoryMonitor: allocated memory keeps growing, {rate / MIB:.2f} MiB per step over steps"
            f" {verdict.first_step}-{verdict.last_step} (+{verdict.growth_bytes / MIB:.0f} MiB, now"
            f" {format_gib(allocated)}){runs_out}. Tensors that grew since step {start_step}:"
            f" {grown_tensors(before, tensor_census(self.probe.device))}. Look for tensors kept across"
            " steps: a loss or output appended to a list without `.detach()`, a cache keyed by step, metrics"
            " that hold graphs."
        )
        if trainer.is_global_zero:
            log_to_loggers(trainer, {keys.LEAK_WARNINGS.format(): 1.0}, step=batches_that_stepped(trainer))
        return verdict
