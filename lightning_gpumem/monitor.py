"""MemoryMonitor: per-batch peak memory, allocator, NVML and host memory, logged to every Lightning logger.

The callback wires Lightning's hooks to pure parts: when to reset and read the peak counters and the running maxima
(``_peak_window``), the keys (``keys``, ``_sample_metrics``), leak verdicts (``_leaks``), the fit-end run model and
its advice (``_fit_run``, ``_summary``). It reads the hardware through a probe (``probe.make_probe``) only.
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from lightning_gpumem import keys
from lightning_gpumem._checks import is_int_at_least, require_flags, require_int, require_number
from lightning_gpumem._compat import Callback
from lightning_gpumem._distributed import gather_named
from lightning_gpumem._fit_run import gather_run
from lightning_gpumem._layout import write_layout
from lightning_gpumem._leak_watch import LeakWatch
from lightning_gpumem._leaks import LeakVerdict
from lightning_gpumem._logging import (
    batches_that_stepped,
    is_accumulating,
    is_logging_step,
    log_to_loggers,
    show_in_progress_bar,
)
from lightning_gpumem._peak_window import PeakWindow, RunningMaxima
from lightning_gpumem._registry import budget_bytes
from lightning_gpumem._sample_metrics import REDUCED, cross_rank_metrics, device_wide_metrics, stage_metrics
from lightning_gpumem._summary import format_summary, has_measurements
from lightning_gpumem._units import GIB, MIB
from lightning_gpumem.probe import MemorySample, Probe, make_probe


class MemoryMonitor(Callback):
    r"""Log the memory of every training batch, validation/test/predict loop, NVML and the host.

    On each logging step (every ``log_every_n_steps`` training batches, Lightning's setting by default) the peak
    counters are reset at batch start and read at batch end, so ``*_peak_*`` is the peak of that batch alone.
    Validation, test and predict report the peak over the whole loop when it ends. Under DDP/FSDP every rank
    measures and the peaks are also logged as cross-rank ``_max``/``_min``. At fit end a summary table with advice
    is printed on rank zero. On a machine without an accelerator only host memory is logged. The running maxima
    behind the summary and leak detection start over at each fit (a monitor reused for a second fit reports that fit
    only); on ``fit(ckpt_path=...)`` the maxima continue from the checkpoint.

    **Logged metrics** (GiB unless stated; ``<stage>`` is ``train`` on logging steps, ``val``/``test``/``predict``
    at the end of those loops):

    ==========================================  ============================================================
    Key                                         Meaning
    ==========================================  ============================================================
    ``gpumem/<stage>_peak_allocated_gib``       peak memory held by tensors in the batch (or loop)
    ``gpumem/<stage>_peak_reserved_gib``        peak memory held by the caching allocator in it
    ``gpumem/<stage>_allocated_gib``            memory held by tensors at its end
    ``gpumem/<stage>_reserved_gib``             memory held by the caching allocator at its end
    ``gpumem/inactive_split_gib``               cached memory in split blocks (fragmentation)
    ``gpumem/alloc_retries``                    count of cudaMalloc retries after a cache flush, cumulative
    ``gpumem/ooms``                             count of out-of-memory errors raised, cumulative
    ``gpumem/nvml_used_gib``                    device memory used by all processes (``nvidia-smi``)
    ``gpumem/nvml_total_gib``                   device memory (MIG instance under MIG)
    ``gpumem/nvml_process_gib``                 device memory NVML attributes to this process
    ``gpumem/non_torch_gib``                    ``nvml_process`` minus reserved: CUDA context, NCCL, cuBLAS
    ``gpumem/gpu_util_pct``                     GPU utilisation in percent (NVML)
    ``gpumem/host_rss_gib``                     host resident memory of this process
    ``gpumem/host_available_gib``               host memory available
    ``gpumem/train_peak_allocated_gib_max``     (DDP/FSDP) the same over ranks, also ``_min``; likewise for
                                                ``train_peak_reserved``, ``nvml_process``, ``host_rss``
    ``gpumem/budget_gib``                       (with a :class:`~lightning_gpumem.MemoryBudget`) the budget
    ``gpumem/leak_mib_per_step``                (``detect_leaks``) growth of allocated memory, MiB per step
    ``gpumem/leak_warnings``                    (``detect_leaks``) 1 at the step a leak was flagged (count)
    ``gpumem/allocator/<stat>``                 (``verbose=True``) every allocator statistic, raw value
    ==========================================  ============================================================

    Un-suffixed keys are rank zero's values. The device-wide keys (allocator counters, NVML, host) are logged
    with the training keys, and at the end of a stand-alone ``validate``/``test``/``predict`` run. The progress bar
    shows the last logged batch's peak against the device, or against the budget of a
    :class:`~lightning_gpumem.MemoryBudget`: ``mem=12.3/139.8 GiB``.

    **Leak detection** (``detect_leaks``, on an accelerator): after ``leak_warmup_steps`` optimizer steps, allocated
    memory is sampled at the end of every second training batch, every fourth once the history is long (one
    allocator read each). When it keeps rising (the medians of each quarter of the history above the one before, and
    the rise above ``leak_threshold_mib``) a warning is printed once on rank zero with the rate, the step at which
    the budget would run out, and the live tensors (by shape and dtype) that grew since memory first rose by half the
    threshold. A run whose batch shapes vary, or whose memory grows once and stays, is not flagged.

    **TensorBoard**: with ``tensorboard_layout`` a *Custom Scalars* layout is written to every ``TensorBoardLogger``
    so that each stage's peak, allocated, reserved and NVML curves (and the budget) share one chart; open
    TensorBoard's "Custom Scalars" tab. ``python -m lightning_gpumem report LOGDIR`` summarizes the logs afterwards.

    Args:
        log_every_n_steps: log every this many training batches; ``None`` uses ``Trainer(log_every_n_steps=...)``.
        verbose: also log the allocator's full statistics dictionary (~120 keys) on each logging step.
        nvml: read NVML (``nvidia-smi``'s numbers, this process's use, utilisation) on logging steps.
        host: read host memory (``psutil``) on logging steps.
        progress_bar: show the last logged peak in the progress bar as ``mem``.
        summary: print a summary table with advice on rank zero at fit end.
        nvml_host_interval_s: read NVML and host memory at most this often, in seconds (``0``: on every logging
            step). They change slowly and cost tens to hundreds of microseconds each, unlike the allocator's
            counters, which are read on every logging step; their keys are logged only when read.
        detect_leaks: watch allocated memory for a sustained rise and warn once (see above).
        leak_threshold_mib: the rise, in MiB, that a sustained trend must exceed to be called a leak.
        leak_warmup_steps: optimizer steps before the first sample (optimizer state and caches settle first).
        tensorboard_layout: write the custom-scalars layout described above to every ``TensorBoardLogger``.

    Raises:
        ValueError: if ``log_every_n_steps`` is not a positive integer or ``None``, or ``nvml_host_interval_s`` is
            negative.
        TypeError: if a flag is not a ``bool``.

    Example::

        from lightning import Trainer
        from lightning_gpumem import MemoryMonitor

        trainer = Trainer(callbacks=[MemoryMonitor()], log_every_n_steps=10)
    """

    _leaks: LeakWatch | None  # set per fit in `_reset_run`, created in `setup`

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        verbose: bool = False,
        nvml: bool = True,
        host: bool = True,
        progress_bar: bool = True,
        summary: bool = True,
        nvml_host_interval_s: float = 1.0,
        detect_leaks: bool = True,
        leak_threshold_mib: float = 32.0,
        leak_warmup_steps: int = 10,
        tensorboard_layout: bool = True,
    ) -> None:
        if log_every_n_steps is not None and not is_int_at_least(log_every_n_steps, 1):
            raise ValueError(
                f"`MemoryMonitor(log_every_n_steps={log_every_n_steps!r})` is not valid."
                " Expected a positive integer, or None to use the Trainer's `log_every_n_steps`."
            )
        require_flags(
            "MemoryMonitor",
            verbose=verbose,
            nvml=nvml,
            host=host,
            progress_bar=progress_bar,
            summary=summary,
            detect_leaks=detect_leaks,
            tensorboard_layout=tensorboard_layout,
        )
        require_number("MemoryMonitor", "leak_threshold_mib", leak_threshold_mib, 0, "MiB", above=True)
        require_int("MemoryMonitor", "leak_warmup_steps", leak_warmup_steps, 0)
        require_number("MemoryMonitor", "nvml_host_interval_s", nvml_host_interval_s, 0, "seconds")
        self._log_every_n_steps = log_every_n_steps
        self._verbose, self._nvml, self._host = verbose, nvml, host
        self._progress_bar, self._summary = progress_bar, summary
        self._slow_interval_s = float(nvml_host_interval_s)
        self._detect_leaks = detect_leaks
        self._leak_threshold_bytes = int(leak_threshold_mib * MIB)
        self._leak_warmup_steps = leak_warmup_steps
        self._tensorboard_layout = tensorboard_layout
        self._layouts_written: dict[int, tuple[str, ...]] = {}
        self._probe: Probe | None = None
        self._every_n = 0
        self._announced = False
        self._total_bytes: int | None = None
        self._reset_run()

    @property
    def peaks(self) -> dict[str, tuple[int | None, int | None]]:
        """Running maxima per stage (``"train"``, ``"val"``, ...): ``(peak allocated, peak reserved)`` bytes."""
        return dict(self._maxima.peaks)

    @property
    def last_sample(self) -> MemorySample | None:
        """The most recent sample this rank logged."""
        return self._last_sample

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # a new fit starts from nothing (a checkpoint's `state_dict` is loaded after this hook)
            self._reset_run()
        device = trainer.strategy.root_device
        if self._probe is None or self._probe.device != device:
            self._probe = make_probe(device, self, nvml=self._nvml, host=self._host)
            self._total_bytes = self._probe.total_bytes()
        self._every_n = self._log_every_n_steps or trainer.log_every_n_steps  # type: ignore[attr-defined]
        if self._detect_leaks and self._probe.has_allocator and self._leaks is None:
            self._leaks = LeakWatch(self._probe, self._leak_warmup_steps, self._leak_threshold_bytes)
        if self._tensorboard_layout:
            write_layout(trainer, self._layouts_written, device_memory=self._probe.has_allocator)
        if not self._announced:
            self._announced = True
            if not self._probe.has_allocator:
                rank_zero_info(f"MemoryMonitor: no accelerator memory to read on `{device}`; logging host memory only.")
            if not trainer.loggers:
                rank_zero_warn(
                    "MemoryMonitor: the Trainer has no logger (`logger=False`); memory is shown in the progress bar"
                    " and the fit-end summary only."
                )

    def _reset_run(self) -> None:
        """The state of one fit, from nothing: running maxima, leak detection, the peak window, the summary."""
        self._maxima = RunningMaxima()
        self._window = PeakWindow()
        self._last_sample: MemorySample | None = None
        self._leaks = None
        self.leak: LeakVerdict | None = None
        """The leak found (rate and steps), ``None`` if none was."""
        self._last_slow_read = -math.inf  # time.monotonic() of the last NVML/host reading
        self._last_host_rss: int | None = None
        self._slow_next = True  # under DDP: whether the next logging step reads NVML and host (agreed by ranks)
        self.summary_text: str | None = None
        """The fit-end summary as printed (on rank zero; also when the fit raised), ``None`` before the end of a fit
        or when nothing was measured."""

    # ------------------------------------------------------------------ training
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._window.train_start()
        self._require_probe().reset_peaks()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        fold, reset = self._window.batch_start(is_logging_step(trainer, self._every_n))
        if fold:
            self._fold("train")
        if reset:
            self._require_probe().reset_peaks()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        accumulating = is_accumulating(trainer)
        logged = self._window.batch_end(accumulating)
        if logged:
            self._measure_and_log(trainer, "train", device_wide=True)
        if self._leaks is not None and not accumulating and self._leaks.wants(trainer.global_step):
            sample = self._last_sample if logged else None  # a logging step has just read the allocator
            allocated = None if sample is None else sample.allocated_bytes
            self.leak = self._leaks.sample(trainer, allocated, self._total_bytes) or self.leak

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fold("train")
        self._window.train_end()

    # ------------------------------------------------------------------ evaluation loops
    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_loop()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_loop(trainer, "val")

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_loop()

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_loop(trainer, "test")

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_loop()

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_loop(trainer, "predict")

    def _start_loop(self) -> None:
        if self._window.loop_start():
            self._fold("train")
        self._require_probe().reset_peaks()

    def _end_loop(self, trainer: pl.Trainer, stage: str) -> None:
        if not trainer.sanity_checking:  # device-wide keys go with the training keys in a fit
            self._measure_and_log(trainer, stage, device_wide=trainer.state.fn != "fit")
        self._require_probe().reset_peaks()

    # ------------------------------------------------------------------ summary and state
    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        run = self._gather_run(trainer)  # collective: every rank calls it
        if not self._summary or not trainer.is_global_zero or not has_measurements(run):
            return  # nothing was measured (no logging step, no validation): no empty table
        self.summary_text = format_summary(run)
        rank_zero_info(self.summary_text)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # What was measured before the fit raised, from this rank alone (the others may never get here). Never
        # raises: Lightning runs the other callbacks' `on_exception` and the loggers' finalize after this.
        fitting = trainer.state.fn == "fit"
        if not fitting or not self._summary or not trainer.is_global_zero or self._probe is None:
            return
        try:
            run = self._gather_run(trainer, collective=False)
            if has_measurements(run):
                self.summary_text = format_summary(run, interrupted=type(exception).__name__)
                rank_zero_info(self.summary_text)
        except Exception as error:  # the user's exception is what matters; say why there is no summary
            rank_zero_warn(f"MemoryMonitor: no summary after the fit raised ({type(error).__name__}: {error}).")

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._maxima.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._maxima.load_state_dict(state_dict)

    # ------------------------------------------------------------------ helpers
    def _require_probe(self) -> Probe:
        if self._probe is None:
            raise RuntimeError("MemoryMonitor was used before `setup`; add it to `Trainer(callbacks=[...])`.")
        return self._probe

    def _fold(self, stage: str) -> None:
        """Add the peaks since the last reset to ``stage``'s running maximum."""
        probe = self._require_probe()
        if probe.has_allocator:
            self._maxima.peak(stage, *probe.read_peaks())

    def _measure_and_log(self, trainer: pl.Trainer, stage: str, device_wide: bool) -> None:
        probe = self._require_probe()
        now = time.monotonic()
        distributed = trainer.world_size > 1
        # NVML and psutil cost tens to hundreds of µs: read them at most every `nvml_host_interval_s`. Under DDP
        # rank zero's clock decides for all ranks, one logging step ahead, through the gather below.
        slow = self._slow_next if distributed else now - self._last_slow_read >= self._slow_interval_s
        if slow:
            self._last_slow_read = now
        sample = self._last_sample = probe.read(nvml=self._nvml and slow, host=self._host and slow)
        if sample.host_rss_bytes is not None:
            self._last_host_rss = sample.host_rss_bytes
        if probe.has_allocator:
            self._maxima.peak(stage, sample.peak_allocated_bytes, sample.peak_reserved_bytes)
        self._maxima.value("non_torch_bytes", sample.non_torch_bytes)
        self._maxima.value("host_rss_bytes", sample.host_rss_bytes)
        metrics = stage_metrics(stage, sample) if probe.has_allocator else {}
        budget = budget_bytes(trainer)
        if device_wide:
            metrics.update(device_wide_metrics(sample))
            if budget is not None:
                metrics[keys.BUDGET.format()] = budget / GIB
            rate = self._leaks.rate() if self._leaks is not None else None
            if rate is not None:
                metrics[keys.LEAK_RATE.format()] = rate / MIB
            if self._verbose:
                stat = keys.ALLOCATOR_STAT.name
                metrics.update({stat.format(stat=k): float(v) for k, v in probe.allocator_stats().items()})
        if distributed:  # collective: every rank reaches this point on the same steps
            values = {field: getattr(sample, field) for field in REDUCED}
            values["due"] = float(time.monotonic() - self._last_slow_read >= self._slow_interval_s)
            spread = gather_named(trainer, values)
            self._slow_next = spread["due"][0] == 1.0  # due on any rank: every rank reads NVML and host next
            metrics.update(cross_rank_metrics(stage, spread, probe.has_allocator))
        if trainer.is_global_zero:
            log_to_loggers(trainer, metrics, step=batches_that_stepped(trainer))
            if self._progress_bar and stage == "train":
                show_in_progress_bar(trainer, "mem", self._progress_text(sample, budget))

    def _progress_text(self, sample: MemorySample, budget: int | None = None) -> str:
        if sample.peak_allocated_bytes is None:
            rss = self._last_host_rss
            return f"rss {rss / GIB:.1f} GiB" if rss is not None else "n/a"
        total = budget or self._total_bytes
        shown = f"{sample.peak_allocated_bytes / GIB:.1f}"
        return f"{shown}/{total / GIB:.1f} GiB" if total else f"{shown} GiB"

    def _gather_run(self, trainer: pl.Trainer, collective: bool = True) -> Any:
        probe = self._require_probe()
        name = probe.device_name if probe.device.type == "cpu" else f"{probe.device_name} ({probe.device})"
        return gather_run(trainer, self._maxima, self._last_sample, name, self._total_bytes, collective)
