"""TensorBoard's *Custom Scalars* layout for the monitor's keys: one chart per stage, its curves together.

TensorBoard draws every scalar key in its own chart. The custom-scalars dashboard instead draws the charts a
layout names, each with all the keys its regular expressions match (TensorBoard joins a chart's expressions
and applies them with ``re.match``); each expression is one key of :mod:`lightning_gpumem.keys`, followed by
``.*`` where the key has cross-rank ``_max``/``_min``/``_rank<r>`` variants.
:class:`~lightning_gpumem.MemoryMonitor` writes this layout to every TensorBoard logger; other loggers have
no such dashboard and are left alone.
"""

from __future__ import annotations

import re
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from lightning_gpumem import keys
from lightning_gpumem._pl.compat import either

CATEGORY = "gpumem"
_STAGE_CHARTS = {
    "train": "train: per-batch peak, allocated, reserved, NVML (GiB)",
    "val": "validation: loop peak, allocated, reserved, NVML (GiB)",
    "test": "test: loop peak, allocated, reserved, NVML (GiB)",
    "predict": "predict: loop peak, allocated, reserved, NVML (GiB)",
}
_FN_STAGES = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}


def _tags(*found: keys.Key, stage: str | None = None) -> list[str]:
    """Expressions that match ``found`` as logged for ``stage``, with their cross-rank suffixes if any."""
    return [re.escape(key.format(stage)) + (".*" if key.ranks else "") for key in found]


def memory_layout(
    stages: tuple[str, ...] = ("train", "val"), device_memory: bool = True
) -> dict[str, dict[str, list[Any]]]:
    """The layout with one chart per stage in ``stages`` (``train``, ``val``, ``test``, ``predict``).

    Without ``device_memory`` (no accelerator: only host memory is logged) only the host chart, so no chart
    is empty.
    """
    host = ["Multiline", _tags(keys.HOST_RSS, keys.HOST_AVAILABLE)]
    if not device_memory:
        return {CATEGORY: {"host: RSS, available (GiB)": host}}
    charts: dict[str, list[Any]] = {}
    for stage in stages:
        tags = _tags(keys.PEAK_ALLOCATED, keys.PEAK_RESERVED, keys.ALLOCATED, keys.RESERVED, stage=stage)
        charts[_STAGE_CHARTS[stage]] = ["Multiline", [*tags, *_tags(keys.NVML_PROCESS, keys.BUDGET)]]
    device = _tags(keys.NVML_USED, keys.NVML_TOTAL, keys.NVML_PROCESS, keys.NON_TORCH)
    charts["device: NVML used, total, this process, non-PyTorch (GiB)"] = ["Multiline", device]
    charts["host: RSS, available (GiB)"] = host
    charts["allocator events: retries, OOMs, cache releases (count)"] = [
        "Multiline",
        _tags(keys.ALLOC_RETRIES, keys.OOMS, keys.CACHE_RELEASES),
    ]
    return {CATEGORY: charts}


def write_layout(
    trainer: pl.Trainer, written: dict[int, tuple[str, ...]], device_memory: bool = True
) -> None:
    """Write :func:`memory_layout` to each TensorBoard logger, on global rank zero, when its stages grow.

    TensorBoard shows only the layout written last in a run, so each write covers every stage this monitor
    has run with that logger (a ``fit`` then a ``test`` gives train, validation and test charts). ``written``
    maps ``id(logger)`` to the stages written and is updated.
    """
    if not trainer.is_global_zero:
        return
    fn = str(trainer.state.fn.value) if trainer.state.fn else "fit"
    for logger in trainer.loggers:
        if not isinstance(logger, either("loggers", "TensorBoardLogger")):
            continue
        before = written.get(id(logger), ())
        stages = tuple(s for s in _STAGE_CHARTS if s in before or s in _FN_STAGES.get(fn, ("train", "val")))
        if stages == before:
            continue
        try:  # the experiment is made on first use: a full disk fails here
            add_custom_scalars = getattr(getattr(logger, "experiment", None), "add_custom_scalars", None)
            if not callable(add_custom_scalars):
                continue
            written[id(logger)] = stages
            add_custom_scalars(memory_layout(stages, device_memory))
        except Exception as error:  # a layout is a convenience: never fail the run for it
            rank_zero_warn(
                f"MemoryMonitor: could not write the TensorBoard custom-scalars layout ({error!r})."
            )
