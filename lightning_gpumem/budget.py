"""MemoryBudget: hold this process to a memory budget, as if the card were smaller.

Why the allocator's own cap (``torch.cuda.set_per_process_memory_fraction``) and not a check of our own: the
cap is enforced at every allocation, before the memory is taken, and an allocation past it raises the very
``torch.OutOfMemoryError`` a smaller card would raise, after the allocator has freed its cache and retried,
as it would there. A run that fits under ``MemoryBudget("24GiB")`` on an 80 GiB card fits a 24 GiB card (less
what that card's CUDA context takes, which the cap does not count).
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_gpumem._core.checks import require_trainer
from lightning_gpumem._core.units import check_budget, format_gib, parse_budget
from lightning_gpumem._hw.probe import Probe, make_probe
from lightning_gpumem._pl.compat import Callback


class MemoryBudget(Callback):
    r"""Cap this process's device memory at a budget from setup to teardown, then restore the previous cap.

    Allocations past the budget raise ``torch.OutOfMemoryError``, as on a card of that size, so a run can be
    proven to fit a smaller card on a bigger one. The budget is also what the other callbacks of this package
    measure against: :class:`~lightning_gpumem.MemoryMonitor` logs it and shows usage against it in the
    progress bar, :class:`~lightning_gpumem.EmptyCacheOnThreshold` takes its threshold as a fraction of it.
    Under DDP each rank is capped on its own device. Without a CUDA device it warns once and does nothing.

    **Logged metrics**: none of its own; with a :class:`~lightning_gpumem.MemoryMonitor` in the callbacks,
    ``gpumem/budget_gib`` (GiB) is logged with the device-wide keys.

    Args:
        budget: the memory this process may use: bytes (``int``), a fraction of the device's memory in (0, 1]
            (``float``), or a string such as ``"24GiB"``, ``"16GB"`` or ``"512MiB"``.

    Raises:
        TypeError: if ``budget`` is not an ``int``, ``float`` or ``str``.
        ValueError: if it is not a size of 1 MiB to 2**64 bytes, a fraction in (0, 1] or a size string; at
            setup, if a fraction comes to less than 1 MiB of the device.

    Example::

        from lightning import Trainer
        from lightning_gpumem import MemoryBudget, MemoryMonitor

        # On an 80 GiB card: does this run fit a 24 GiB one?
        trainer = Trainer(callbacks=[MemoryBudget("24GiB"), MemoryMonitor()])
    """

    def __init__(self, budget: int | float | str) -> None:
        check_budget(budget, "MemoryBudget")  # the form now; its size against the device in `setup`
        self.budget = budget
        self.budget_bytes: int | None = None
        """The budget in bytes once set up on a CUDA device (``None`` before, and without one)."""
        self._probe: Probe | None = None
        self._previous_fraction: float | None = None
        self._warned = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_trainer("MemoryBudget", trainer)
        device = trainer.strategy.root_device
        probe = make_probe(device, self)
        total = probe.total_bytes() if probe.device.type == "cuda" else None
        if not total:
            if not self._warned:
                self._warned = True
                rank_zero_warn(
                    f"MemoryBudget: `{device}` has no memory cap to set; the budget is not enforced."
                )
            return
        self._probe = probe
        budget = parse_budget(self.budget, total, "MemoryBudget")
        if budget > total:
            rank_zero_warn(
                f"MemoryBudget(budget={self.budget!r}) is {format_gib(budget)}, more than the device's"
                f" {format_gib(total)}: the device's memory is the limit."
            )
        self.budget_bytes = min(budget, total)
        previous = probe.set_memory_fraction(self.budget_bytes / total)
        # a second setup (fit, then test) keeps the first one's previous cap
        if self._previous_fraction is None:
            self._previous_fraction = previous
        rank_zero_info(f"MemoryBudget: this process is capped at {format_gib(self.budget_bytes)}.")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._restore()  # Lightning skips the callbacks' `teardown` after an exception

    def _restore(self) -> None:
        if self._probe is not None and self._previous_fraction is not None:
            self._probe.set_memory_fraction(self._previous_fraction)
        self._previous_fraction = None

    def gpumem_budget(self) -> int | None:
        """The budget in bytes once set up; the other callbacks find it through ``_pl.peers``."""
        return self.budget_bytes
