"""How the callbacks find each other in ``trainer.callbacks``: duck-typed, so that no callback imports another.

A callback that has something for the others says so through a method:

- ``_gpumem_budget() -> int | None``: the memory budget in bytes (:class:`~lightning_gpumem.MemoryBudget`); the
  monitor, the release callback and the tuner measure against it.
- ``_summary_context() -> dict``: fields of the fit-end summary's run model (``RunMemory``) it adds, e.g. the tuner's
  ``tuned`` or the layer profiler's ``top_layers``.
- ``_gpumem_oom_recovered()``: told that the OOM just raised was recovered (``AutoMicrobatch``), e.g. so that
  ``OOMSnapshot`` marks the snapshot it wrote for it.
- ``_gpumem_before_peak_reset()``: told that another callback is about to reset the allocator's peak counters, so
  that one keeping a peak window (``MemoryMonitor``) folds it into its running maximum first.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_gpumem._compat import either


def budget_bytes(trainer: pl.Trainer) -> int | None:
    """The budget of the callback that sets one (a :class:`~lightning_gpumem.MemoryBudget`), in bytes, if any."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        budget = getattr(callback, "_gpumem_budget", None)
        value = budget() if callable(budget) else None
        if value is not None:
            return int(value)
    return None


def summary_context(trainer: pl.Trainer) -> dict[str, Any]:
    """What the advice needs besides the measurements: budget, precision, DDP settings and the callbacks' additions."""
    context: dict[str, Any] = {"budget_bytes": budget_bytes(trainer), "precision": str(trainer.precision)}
    module = trainer.lightning_module
    context["gradient_bytes"] = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    if isinstance(trainer.strategy, either("strategies", "DDPStrategy")):
        kwargs = getattr(trainer.strategy, "_ddp_kwargs", {})  # private: the kwargs DDPStrategy passes to DDP
        context["ddp_bucket_view"] = bool(kwargs.get("gradient_as_bucket_view", False))
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        contribute = getattr(callback, "_summary_context", None)
        if callable(contribute):
            context.update(contribute())
    return context


def tell_oom_recovered(trainer: pl.Trainer) -> None:
    """Tell the callbacks that listen (``_gpumem_oom_recovered()``) that the OOM just raised was recovered."""
    _tell(trainer, "_gpumem_oom_recovered")


def tell_peak_reset(trainer: pl.Trainer) -> None:
    """Tell the callbacks that listen (``_gpumem_before_peak_reset()``) that the peak counters are about to be reset."""
    _tell(trainer, "_gpumem_before_peak_reset")


def _tell(trainer: pl.Trainer, method: str) -> None:
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        listen = getattr(callback, method, None)
        if callable(listen):
            listen()
