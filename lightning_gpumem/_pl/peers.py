"""How the callbacks find each other in ``trainer.callbacks``: small protocols, no callback imports another.

A callback that has something for the others implements one of these methods (public, so that a user's own
callback can take part too):

- :class:`BudgetSource` ``gpumem_budget() -> int | None``: the memory budget in bytes
  (:class:`~lightning_gpumem.MemoryBudget`); the monitor, the release callback and the tuner measure against
  it.
- :class:`SummaryContributor` ``gpumem_summary_context() -> dict``: fields of the fit-end summary's run model
  (``RunMemory``) it adds, e.g. the tuner's ``tuned`` or the layer profiler's ``top_layers``.
- ``gpumem_oom_recovered()``: told that the OOM just raised was recovered (``AutoMicrobatch``), e.g. so that
  ``OOMSnapshot`` marks the snapshot it wrote for it.
- ``gpumem_before_peak_reset()``: told that another callback is about to reset the allocator's peak counters,
  so that one keeping a peak window (``MemoryMonitor``) folds it into its running maximum first.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl

from lightning_gpumem._pl.compat import either


@runtime_checkable
class BudgetSource(Protocol):
    """A callback that sets a memory budget."""

    def gpumem_budget(self) -> int | None:
        """The budget in bytes (``None``: none)."""


@runtime_checkable
class SummaryContributor(Protocol):
    """A callback that adds fields to the fit-end summary's run model."""

    def gpumem_summary_context(self) -> dict[str, Any]:
        """The fields it adds."""


def budget_bytes(trainer: pl.Trainer) -> int | None:
    """The budget of the callback that sets one, in bytes, if any.

    That callback is a :class:`~lightning_gpumem.MemoryBudget`, or another :class:`BudgetSource`.
    """
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        value = callback.gpumem_budget() if isinstance(callback, BudgetSource) else None
        if value is not None:
            return int(value)
    return None


def summary_context(trainer: pl.Trainer) -> dict[str, Any]:
    """What the advice needs besides the measurements.

    The budget, the precision, the DDP settings and the callbacks' additions.
    """
    context: dict[str, Any] = {"budget_bytes": budget_bytes(trainer), "precision": str(trainer.precision)}
    module = trainer.lightning_module
    context["gradient_bytes"] = sum(
        p.numel() * p.element_size() for p in module.parameters() if p.requires_grad
    )
    if isinstance(trainer.strategy, either("strategies", "DDPStrategy")):
        # private: the kwargs DDPStrategy passes to DDP
        kwargs = getattr(trainer.strategy, "_ddp_kwargs", {})
        context["ddp_bucket_view"] = bool(kwargs.get("gradient_as_bucket_view", False))
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, SummaryContributor):
            context.update(callback.gpumem_summary_context())
    return context


def tell_oom_recovered(trainer: pl.Trainer) -> None:
    """Tell the callbacks that listen (``gpumem_oom_recovered()``) that the OOM just raised was recovered."""
    _tell(trainer, "gpumem_oom_recovered")


def tell_peak_reset(trainer: pl.Trainer) -> None:
    """Tell the callbacks that listen that the peak counters are about to be reset.

    They listen with ``gpumem_before_peak_reset()``.
    """
    _tell(trainer, "gpumem_before_peak_reset")


def _tell(trainer: pl.Trainer, method: str) -> None:
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        listen = getattr(callback, method, None)
        if callable(listen):
            listen()
