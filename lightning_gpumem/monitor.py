"""MemoryMonitor: per-batch peak memory, allocator, NVML and host memory, logged to every Lightning logger.

Why peaks are read only on logging steps: resetting and reading the allocator's counters costs tens of
microseconds, so on the other steps the callback does nothing but an integer check. The peak window opens
(counters reset) at the start of each logged optimizer step and closes at its end, so the logged peak is that
step's own: forward, backward and optimizer step, over all its micro-batches under gradient accumulation.
Whatever happened since the previous reset (the batches that were not logged) is folded into the running
maximum before the reset, so the fit-end summary still covers every batch.
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from lightning_gpumem._checks import require_flags, require_int
from lightning_gpumem._compat import Callback, either
from lightning_gpumem._distributed import gather_named, gather_values, max_min
from lightning_gpumem._layout import write_layout
from lightning_gpumem._leaks import LeakDetector, LeakVerdict, grown_tensors, tensor_census
from lightning_gpumem._logging import (
    batches_that_stepped,
    is_accumulating,
    is_logging_step,
    log_to_loggers,
    show_in_progress_bar,
)
from lightning_gpumem._summary import RunMemory, format_summary, has_measurements
from lightning_gpumem._units import GIB, MIB, format_gib, to_gib
from lightning_gpumem.budget import budget_bytes
from lightning_gpumem.probe import MemoryProbe, MemorySample

_KEY_PREFIX = {"train": "train", "validate": "val", "test": "test", "predict": "predict"}
# Per-rank values gathered on logging steps and logged as `<key>_max` / `<key>_min` under DDP/FSDP.
_REDUCED = ("peak_allocated_bytes", "peak_reserved_bytes", "nvml_process_bytes", "host_rss_bytes")


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

    _leaks: LeakDetector | None  # set per fit in `_reset_run`, created in `setup`

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
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
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
        if (
            isinstance(leak_threshold_mib, bool)
            or not isinstance(leak_threshold_mib, (int, float))
            or not (0 < leak_threshold_mib < float("inf"))
        ):
            raise ValueError(
                f"`MemoryMonitor(leak_threshold_mib={leak_threshold_mib!r})` is not valid."
                " Expected a finite number of MiB > 0."
            )
        require_int("MemoryMonitor", "leak_warmup_steps", leak_warmup_steps, 0)
        if (
            isinstance(nvml_host_interval_s, bool)
            or not isinstance(nvml_host_interval_s, (int, float))
            or not (0 <= nvml_host_interval_s < float("inf"))
        ):
            raise ValueError(
                f"`MemoryMonitor(nvml_host_interval_s={nvml_host_interval_s!r})` is not valid."
                " Expected a finite number of seconds >= 0."
            )
        self._log_every_n_steps = log_every_n_steps
        self._verbose = verbose
        self._nvml = nvml
        self._host = host
        self._progress_bar = progress_bar
        self._summary = summary
        self._slow_interval_s = float(nvml_host_interval_s)
        self._detect_leaks = detect_leaks
        self._leak_threshold_bytes = int(leak_threshold_mib * MIB)
        self._leak_warmup_steps = leak_warmup_steps
        self._tensorboard_layout = tensorboard_layout
        self._layouts_written: dict[int, tuple[str, ...]] = {}
        self._probe: MemoryProbe | None = None
        self._every_n = 0
        self._announced = False
        self._total_bytes: int | None = None
        self._reset_run()

    @property
    def peaks(self) -> dict[str, tuple[int | None, int | None]]:
        """Running maxima per stage (``"train"``, ``"validate"``, ...): ``(peak allocated, peak reserved)`` bytes."""
        return dict(self._peaks)

    @property
    def last_sample(self) -> MemorySample | None:
        """The most recent sample this rank logged."""
        return self._last_sample

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # a new fit starts from nothing (a checkpoint's `state_dict` is loaded after this hook)
            self._reset_run()
        device = trainer.strategy.root_device
        if self._probe is None or self._probe.device != device:
            self._probe = self._make_probe(device)
            self._total_bytes = self._probe.total_bytes()
        self._every_n = self._log_every_n_steps or trainer.log_every_n_steps  # type: ignore[attr-defined]
        if self._detect_leaks and self._probe.has_allocator and self._leaks is None:
            self._leaks = LeakDetector(self._leak_warmup_steps, threshold_bytes=self._leak_threshold_bytes)
        if self._tensorboard_layout:
            write_layout(trainer, self._layouts_written, device_memory=self._probe.has_allocator)
        if self._announced:
            return
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
        self._peaks: dict[str, tuple[int | None, int | None]] = {}  # stage: (allocated, reserved), bytes
        self._maxima: dict[str, int | None] = {"non_torch_bytes": None, "host_rss_bytes": None}
        self._last_sample: MemorySample | None = None
        self._leaks = None
        self._census_at_start: Any = None
        self.leak: LeakVerdict | None = None
        """The leak found (rate and steps), ``None`` if none was."""
        self._last_slow_read = -math.inf  # time.monotonic() of the last NVML/host reading
        self._last_host_rss: int | None = None
        self._slow_next = True  # under DDP: whether the next logging step reads NVML and host (agreed by ranks)
        self._window_open = False  # the peak counters were reset for a logged optimizer step still running
        self._just_closed = False  # the previous batch closed a window: nothing unlogged to fold since
        self._train_active = False
        self.summary_text: str | None = None
        """The fit-end summary as printed (on rank zero; also when the fit raised), ``None`` before the end of a fit
        or when nothing was measured."""

    def _make_probe(self, device: torch.device) -> MemoryProbe:
        """Create the probe for ``device`` (tests override this to inject a fake sample source)."""
        return MemoryProbe(device, nvml=self._nvml, host=self._host)

    # ------------------------------------------------------------------ training
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._train_active = True
        self._require_probe().reset_peaks()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._window_open or not is_logging_step(trainer, self._every_n):
            self._just_closed = False
            return
        if not self._just_closed:
            self._fold_window("train")  # the batches since the last reset, not logged but part of the maximum
        self._require_probe().reset_peaks()
        self._window_open = True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        if is_accumulating(trainer):
            return
        logged = self._window_open
        if logged:
            self._window_open = False
            self._just_closed = True
            self._measure_and_log(trainer, "train", device_wide=True)
        if self._leaks is not None and self._leaks.wants(trainer.global_step):
            sample = self._last_sample if logged else None  # a logging step has just read the allocator
            self._sample_for_leaks(trainer, None if sample is None else sample.allocated_bytes)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fold_window("train")
        self._train_active = False
        self._window_open = self._just_closed = False

    # ------------------------------------------------------------------ evaluation loops
    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_loop()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_loop(trainer, "validate")

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
        if self._train_active:
            self._fold_window("train")
        self._require_probe().reset_peaks()
        self._just_closed = False  # the next training window must not skip its fold

    def _end_loop(self, trainer: pl.Trainer, stage: str) -> None:
        probe = self._require_probe()
        if trainer.sanity_checking:
            probe.reset_peaks()
            return
        # Device-wide keys go with the training keys during fit; a stand-alone evaluation logs them here.
        self._measure_and_log(trainer, stage, device_wide=trainer.state.fn != "fit")
        probe.reset_peaks()

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
        return {
            "peaks": {stage: list(values) for stage, values in self._peaks.items()},
            "maxima": dict(self._maxima),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for stage, (allocated, reserved) in state_dict.get("peaks", {}).items():
            self._update_peak(stage, allocated, reserved)
        for key, value in state_dict.get("maxima", {}).items():
            self._update_max(key, value)

    # ------------------------------------------------------------------ leaks
    def _sample_for_leaks(self, trainer: pl.Trainer, allocated: int | None) -> None:
        probe, detector = self._require_probe(), self._leaks
        if allocated is None:
            allocated = probe.allocated_bytes()
        if detector is None or allocated is None:
            return
        step = trainer.global_step
        verdict = detector.add(step, allocated)
        if detector.suspected_at is not None and self._census_at_start is None:
            # What was alive when memory first rose by half the threshold: a `gc` scan (milliseconds), so taken only
            # on a suspicion, never on a healthy run; a verdict comes on a later sample, when the leak has grown.
            self._census_at_start = (step, tensor_census(probe.device))
        if verdict is None:
            return
        self.leak = verdict
        budget = budget_bytes(trainer) or self._total_bytes
        rate = verdict.bytes_per_step
        runs_out = ""
        if budget and rate > 0 and budget > allocated:
            at = step + int((budget - allocated) / rate)
            runs_out = f"; at this rate the {format_gib(budget)} budget runs out near step {at}"
        start_step, before = self._census_at_start
        rank_zero_warn(
            f"MemoryMonitor: allocated memory keeps growing, {rate / MIB:.2f} MiB per step over steps"
            f" {verdict.first_step}-{verdict.last_step} (+{verdict.growth_bytes / MIB:.0f} MiB, now"
            f" {format_gib(allocated)}){runs_out}. Tensors that grew since step {start_step}:"
            f" {grown_tensors(before, tensor_census(probe.device))}. Look for tensors kept across steps: a loss or"
            " output appended to a list without `.detach()`, a cache keyed by step, metrics that hold graphs."
        )
        if trainer.is_global_zero:
            log_to_loggers(trainer, {"gpumem/leak_warnings": 1.0}, step=batches_that_stepped(trainer))

    # ------------------------------------------------------------------ helpers
    def _require_probe(self) -> MemoryProbe:
        if self._probe is None:
            raise RuntimeError("MemoryMonitor was used before `setup`; add it to `Trainer(callbacks=[...])`.")
        return self._probe

    def _fold_window(self, stage: str) -> None:
        """Add the peaks since the last reset to ``stage``'s running maximum."""
        probe = self._require_probe()
        if probe.has_allocator:
            self._update_peak(stage, *probe.read_peaks())

    def _update_peak(self, stage: str, allocated: int | None, reserved: int | None) -> None:
        old_allocated, old_reserved = self._peaks.get(stage, (None, None))
        self._peaks[stage] = (_max(old_allocated, allocated), _max(old_reserved, reserved))

    def _update_max(self, key: str, value: int | None) -> None:
        self._maxima[key] = _max(self._maxima.get(key), value)

    def _measure_and_log(self, trainer: pl.Trainer, stage: str, device_wide: bool) -> None:
        probe = self._require_probe()
        now = time.monotonic()
        distributed = trainer.world_size > 1
        # NVML and psutil cost tens to hundreds of µs: read them at most every `nvml_host_interval_s`. Under DDP
        # rank zero's clock decides for all ranks, one logging step ahead, through the gather below.
        slow = self._slow_next if distributed else now - self._last_slow_read >= self._slow_interval_s
        if slow:
            self._last_slow_read = now
        sample = probe.read(nvml=self._nvml and slow, host=self._host and slow)
        self._last_sample = sample
        if sample.host_rss_bytes is not None:
            self._last_host_rss = sample.host_rss_bytes
        if probe.has_allocator:
            self._update_peak(stage, sample.peak_allocated_bytes, sample.peak_reserved_bytes)
        self._update_max("non_torch_bytes", sample.non_torch_bytes)
        self._update_max("host_rss_bytes", sample.host_rss_bytes)

        prefix = _KEY_PREFIX[stage]
        metrics = _stage_metrics(prefix, sample) if probe.has_allocator else {}
        if device_wide:
            metrics.update(_device_wide_metrics(sample))
            budget = budget_bytes(trainer)
            if budget is not None:
                metrics["gpumem/budget_gib"] = budget / GIB
            rate = self._leaks.rate() if self._leaks is not None else None
            if rate is not None:
                metrics["gpumem/leak_mib_per_step"] = rate / MIB
            if self._verbose:
                metrics.update({f"gpumem/allocator/{k}": float(v) for k, v in probe.allocator_stats().items()})
        if distributed:  # collective: every rank reaches this point on the same steps
            due = float(time.monotonic() - self._last_slow_read >= self._slow_interval_s)
            rows = gather_values(trainer, [*(getattr(sample, name) for name in _REDUCED), due])
            self._slow_next = bool(rows[0][-1])
            for column, name in enumerate(_REDUCED):
                key = _reduced_key(prefix, name)
                if key is None or (name.startswith("peak") and not probe.has_allocator):
                    continue
                high, low = max_min(rows, column)
                if high is not None and low is not None:
                    metrics[f"{key}_max"] = high / GIB
                    metrics[f"{key}_min"] = low / GIB
        if trainer.is_global_zero:
            log_to_loggers(trainer, metrics, step=batches_that_stepped(trainer))
            if self._progress_bar and stage == "train":
                show_in_progress_bar(trainer, "mem", self._progress_text(sample, budget_bytes(trainer)))

    def _progress_text(self, sample: MemorySample, budget: int | None = None) -> str:
        if sample.peak_allocated_bytes is None:
            rss = self._last_host_rss
            return f"rss {rss / GIB:.1f} GiB" if rss is not None else "n/a"
        total = budget or self._total_bytes
        shown = f"{sample.peak_allocated_bytes / GIB:.1f}"
        return f"{shown}/{total / GIB:.1f} GiB" if total else f"{shown} GiB"

    def _gather_run(self, trainer: pl.Trainer, collective: bool = True) -> RunMemory:
        probe = self._require_probe()
        stages = list(_KEY_PREFIX)
        last = self._last_sample or MemorySample()
        values: dict[str, float | None] = {}
        for stage in stages:
            values[f"{stage}_allocated"], values[f"{stage}_reserved"] = self._peaks.get(stage, (None, None))
        values |= {
            "non_torch": self._maxima.get("non_torch_bytes"),
            "host_rss": self._maxima.get("host_rss_bytes"),
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
            for stage in stages
            if self._peaks.get(stage) is not None
        }
        return RunMemory(
            device_name=probe.device_name if probe.device.type == "cpu" else f"{probe.device_name} ({probe.device})",
            total_bytes=self._total_bytes or last.nvml_total_bytes,
            stage_peaks=peaks,
            max_non_torch_bytes=high("non_torch"),
            max_host_rss_bytes=high("host_rss"),
            alloc_retries=high("alloc_retries"),
            num_ooms=high("num_ooms"),
            max_inactive_split_bytes=high("inactive_split"),
            max_reserved_bytes=high("reserved"),
            world_size=trainer.world_size,
            **_run_context(trainer),
        )


def _run_context(trainer: pl.Trainer) -> dict[str, Any]:
    """What the advice needs besides the measurements: precision, DDP settings, profiled layers, a tuned size.

    The other callbacks say what they add through a ``_summary_context()`` method (duck-typed: the monitor imports
    none of them).
    """
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


def _max(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


def _stage_metrics(prefix: str, sample: MemorySample) -> dict[str, float]:
    pairs = {
        f"gpumem/{prefix}_peak_allocated_gib": sample.peak_allocated_bytes,
        f"gpumem/{prefix}_peak_reserved_gib": sample.peak_reserved_bytes,
        f"gpumem/{prefix}_allocated_gib": sample.allocated_bytes,
        f"gpumem/{prefix}_reserved_gib": sample.reserved_bytes,
    }
    return {key: value / GIB for key, value in pairs.items() if value is not None}


def _device_wide_metrics(sample: MemorySample) -> dict[str, float]:
    gib = {
        "gpumem/inactive_split_gib": to_gib(sample.inactive_split_bytes),
        "gpumem/nvml_used_gib": to_gib(sample.nvml_used_bytes),
        "gpumem/nvml_total_gib": to_gib(sample.nvml_total_bytes),
        "gpumem/nvml_process_gib": to_gib(sample.nvml_process_bytes),
        "gpumem/non_torch_gib": to_gib(sample.non_torch_bytes),
        "gpumem/host_rss_gib": to_gib(sample.host_rss_bytes),
        "gpumem/host_available_gib": to_gib(sample.host_available_bytes),
    }
    counts = {
        "gpumem/alloc_retries": sample.alloc_retries,
        "gpumem/ooms": sample.num_ooms,
        "gpumem/gpu_util_pct": sample.gpu_util_pct,
    }
    merged = {**gib, **counts}
    return {key: float(value) for key, value in merged.items() if value is not None}


def _reduced_key(prefix: str, name: str) -> str | None:
    if name == "peak_allocated_bytes":
        return f"gpumem/{prefix}_peak_allocated_gib"
    if name == "peak_reserved_bytes":
        return f"gpumem/{prefix}_peak_reserved_gib"
    if name == "nvml_process_bytes":
        return "gpumem/nvml_process_gib"
    if name == "host_rss_bytes":
        return "gpumem/host_rss_gib"
    return None
