"""The monitor's bookkeeping, pure: when to reset and read the peak counters, and the running maxima.

No allocator and no Trainer here: the monitor calls the probe as these classes say.

Why peaks are read only on logging steps: resetting and reading the allocator's counters costs tens of
microseconds, so on the other steps the monitor does nothing but an integer check. The peak window opens
(counters reset) at the start of each logged optimizer step and closes at its end, so the logged peak is that
step's own: forward, backward and optimizer step, over all its micro-batches under gradient accumulation.
Whatever happened since the previous reset (the batches that were not logged) is folded into the running
maximum before the reset, so the fit-end summary still covers every batch.
"""

from __future__ import annotations

from typing import Any

from lightning_gpumem._core.sample import MemorySample
from lightning_gpumem.keys import STAGE_OF_LOOP


class PeakWindow:
    """When a training batch resets or reads the peak counters; each method says what the caller must do.

    Example:
        >>> window = PeakWindow()
        >>> window.train_start()
        >>> window.batch_start(logging_step=True)  # (fold what came before, reset the counters)
        (True, True)
        >>> window.batch_end(accumulating=False)  # read and log: the window closes
        True
        >>> window.batch_start(logging_step=True)  # nothing ran unread since the window closed
        (False, True)
    """

    def __init__(self) -> None:
        self.open = False  # the counters were reset for a logged optimizer step still running
        self.just_closed = False  # the previous batch closed a window: nothing unlogged to fold since
        self.training = False

    def train_start(self) -> None:
        """Training starts: evaluation loops from now on fold the training peaks first."""
        self.training = True

    def batch_start(self, logging_step: bool) -> tuple[bool, bool]:
        """At a batch's start: ``(fold, reset)``.

        Fold the peaks since the last reset into the running maximum first; reset the counters.
        """
        if self.open or not logging_step:
            self.just_closed = False
            return False, False
        fold = not self.just_closed  # the batches since the last reset, not logged but part of the maximum
        self.open = True
        return fold, True

    def batch_end(self, accumulating: bool) -> bool:
        """Whether this batch closes a window: read the peaks of the logged optimizer step and log them."""
        if accumulating or not self.open:
            return False
        self.open = False
        self.just_closed = True
        return True

    def loop_start(self) -> bool:
        """An evaluation loop starts (and resets the counters): whether to fold the training peaks first."""
        self.just_closed = False  # the next training window must not skip its fold
        return self.training

    def train_end(self) -> None:
        """Training ends: no window is open."""
        self.training = self.open = self.just_closed = False


class RunningMaxima:
    """The highest values seen in a run, in bytes.

    Peaks per stage (``train``, ``val``, ...) and a few named values.
    """

    def __init__(self) -> None:
        self.peaks: dict[str, tuple[int | None, int | None]] = {}  # stage: (allocated, reserved)
        self.values: dict[str, int | None] = {"non_torch_bytes": None, "host_rss_bytes": None}

    def peak(self, stage: str, allocated: int | None, reserved: int | None) -> None:
        """Raise the stage's peaks to ``allocated`` and ``reserved`` where they are higher."""
        old_allocated, old_reserved = self.peaks.get(stage, (None, None))
        self.peaks[stage] = (larger(old_allocated, allocated), larger(old_reserved, reserved))

    def add(self, stage: str, sample: MemorySample, device_memory: bool) -> None:
        """Fold a logged sample in.

        The stage's peaks (with device memory), the non-PyTorch share and host RSS.
        """
        if device_memory:
            self.peak(stage, sample.peak_allocated_bytes, sample.peak_reserved_bytes)
        self.value("non_torch_bytes", sample.non_torch_bytes)
        self.value("host_rss_bytes", sample.host_rss_bytes)

    def value(self, name: str, value: int | None) -> None:
        """Raise the named maximum to ``value`` where it is higher."""
        self.values[name] = larger(self.values.get(name), value)

    def state_dict(self) -> dict[str, Any]:
        """The maxima as a checkpoint holds them."""
        return {
            "peaks": {stage: list(pair) for stage, pair in self.peaks.items()},
            "maxima": dict(self.values),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a checkpoint's maxima.

        Stages saved under Lightning's loop names (``validate``) map too.
        """
        for stage, (allocated, reserved) in state_dict.get("peaks", {}).items():
            self.peak(STAGE_OF_LOOP.get(stage, stage), allocated, reserved)
        for name, value in state_dict.get("maxima", {}).items():
            self.value(name, value)


def larger(a: int | None, b: int | None) -> int | None:
    """The larger of two values, either of which may be missing."""
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)
