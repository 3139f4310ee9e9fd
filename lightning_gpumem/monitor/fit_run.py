"""The fit's :class:`~lightning_gpumem._core.summary.RunMemory`, from the ranks' running maxima."""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_gpumem._core.summary import RunMemory
from lightning_gpumem._hw.probe import MemorySample, Probe
from lightning_gpumem._pl.distributed import gather_named
from lightning_gpumem._pl.peers import summary_context
from lightning_gpumem.keys import STAGES
from lightning_gpumem.monitor.peak_window import RunningMaxima


def gather_run(
    trainer: pl.Trainer,
    maxima: RunningMaxima,
    last: MemorySample | None,
    probe: Probe,
    total_bytes: int | None,
    collective: bool = True,
) -> RunMemory:
    """The run as the fit-end summary shows it: every value the highest over ranks (gathered by name).

    With the context the Trainer and the other callbacks give
    (:func:`~lightning_gpumem._pl.peers.summary_context`).

    ``collective=False`` uses this rank's values alone (after an exception, when the other ranks may not get
    here).
    """
    last = last or MemorySample()
    device_name = (
        probe.device_name if probe.device.type == "cpu" else f"{probe.device_name} ({probe.device})"
    )
    values: dict[str, float | None] = {}
    for stage in STAGES:
        values[f"{stage}_allocated"], values[f"{stage}_reserved"] = maxima.peaks.get(stage, (None, None))
    values |= {
        "non_torch": maxima.values.get("non_torch_bytes"),
        "host_rss": maxima.values.get("host_rss_bytes"),
        "alloc_retries": last.alloc_retries,
        "num_ooms": last.num_ooms,
        "inactive_split": last.inactive_split_bytes,
        "reserved": last.reserved_bytes,
    }
    spread = gather_named(trainer, values, collective)  # by name: the highest over ranks

    def high(name: str) -> int | None:
        value = spread[name][0]
        return None if value is None else int(value)

    peaks = {
        stage: (high(f"{stage}_allocated"), high(f"{stage}_reserved"))
        for stage in STAGES
        if stage in maxima.peaks
    }
    return RunMemory(
        device_name=device_name,
        total_bytes=total_bytes or last.nvml_total_bytes,
        stage_peaks=peaks,
        max_non_torch_bytes=high("non_torch"),
        max_host_rss_bytes=high("host_rss"),
        alloc_retries=high("alloc_retries"),
        num_ooms=high("num_ooms"),
        max_inactive_split_bytes=high("inactive_split"),
        max_reserved_bytes=high("reserved"),
        world_size=trainer.world_size,
        **summary_context(trainer),
    )
