"""MemoryMonitor: per-batch peak memory, allocator, NVML and host memory, logged to every Lightning logger.

The callback wires Lightning's hooks to the parts in this folder: when to reset and read the peak counters
and the running maxima (``peak_window.py``, pure), the logged keys (``metrics.py``, pure, from ``keys.py``),
leak detection (``leak_watch.py``, whose verdicts are ``_core/leaks.py``'s), the fit-end run model
(``fit_run.py``) that ``_core/summary.py`` prints with its advice, and the TensorBoard layout
(``layout.py``). It reads the hardware through a probe (``_hw/probe.py``'s ``make_probe``) only.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from lightning_gpumem import keys
from lightning_gpumem._core import checks as _checks
from lightning_gpumem._core.checks import require_flags, require_int, require_int_or_none, require_number
from lightning_gpumem._core.leaks import LeakVerdict
from lightning_gpumem._core.summary import RunMemory, print_summary
from lightning_gpumem._core.units import MIB
from lightning_gpumem._hw.probe import MemorySample, Probe, make_probe
from lightning_gpumem._pl import logging as _logging
from lightning_gpumem._pl.compat import Callback
from lightning_gpumem._pl.distributed import gather_named
from lightning_gpumem._pl.peers import budget_bytes
from lightning_gpumem.monitor.fit_run import gather_run
from lightning_gpumem.monitor.layout import write_layout
from lightning_gpumem.monitor.leak_watch import LeakWatch
from lightning_gpumem.monitor.metrics import (
    REDUCED,
    SlowReads,
    cross_rank_metrics,
    logged_metrics,
    progress_text,
)
from lightning_gpumem.monitor.peak_window import PeakWindow, RunningMaxima


@keys.document
class MemoryMonitor(Callback):
    r"""Log the memory of every training batch, validation/test/predict loop, NVML and the host.

    On each logging step (every ``log_every_n_steps`` training batches) the peak counters are reset at batch
    start and read at batch end, so ``*_peak_*`` is that batch's own peak; validation, test and predict log
    the peak of the whole loop. Under DDP/FSDP every rank measures, and peaks are also logged as cross-rank
    ``_max``/``_min``. At fit end rank zero prints a summary with advice. Without an accelerator only host
    memory is logged. The maxima behind the summary start over at each fit, and continue from the checkpoint
    on ``fit(ckpt_path=...)``.

    **Logged metrics** (``<stage>`` is ``train`` on logging steps, ``val``/``test``/``predict`` at the end of
    those loops; the table comes from :mod:`lightning_gpumem.keys`):

    {logged_metrics}

    Un-suffixed keys are rank zero's. The progress bar shows ``mem=12.3/139.8 GiB``: the last logged peak
    against the device, or the budget of a :class:`~lightning_gpumem.MemoryBudget`.

    **Leak detection** (``detect_leaks``, on an accelerator): allocated memory is sampled at training-batch
    ends after ``leak_warmup_steps``; a sustained rise above ``leak_threshold_mib`` is warned about once on
    rank zero, with its rate, when the budget would run out and the live tensors that grew.
    ``gpumem/leak_mib_per_step`` is the rate a verdict gives
    (:meth:`~lightning_gpumem._core.leaks.LeakDetector.rate`), logged only once it means something: from the
    end of the detector's early phase (its first 32 samples, about every second step after the warm-up: near
    step 72 by default), over which a rise is memory settling as much as a leak, or from a leak flagged
    earlier; a flagged leak's rate stays the logged one. Leak detection is described in
    ``docs/memory_in_bounds.md``. **TensorBoard**: ``tensorboard_layout`` writes a *Custom Scalars* layout so
    each stage's curves share a chart, described in ``docs/monitor.md``.

    Args:
        log_every_n_steps: log every this many training batches; ``None`` uses
            ``Trainer(log_every_n_steps=...)``.
        verbose: also log the allocator's full statistics dictionary (~120 keys) on each logging step.
        nvml: read NVML (``nvidia-smi``'s numbers, this process's use, utilisation) on logging steps.
        host: read host memory (``psutil``) on logging steps.
        progress_bar: show the last logged peak in the progress bar as ``mem``.
        summary: print a summary table with advice on rank zero at fit end.
        nvml_host_interval_s: read NVML and host memory (slow to change, tens to hundreds of µs to read) at
            most this often, in seconds (``0``: on every logging step); their keys are logged only when read.
        detect_leaks: watch allocated memory for a sustained rise and warn once (see above).
        leak_threshold_mib: the rise, in MiB, that a sustained trend must exceed to be called a leak.
        leak_warmup_steps: optimizer steps before the first sample (optimizer state and caches settle first).
        tensorboard_layout: write the custom-scalars layout described above to every ``TensorBoardLogger``.

    Raises:
        ValueError: if a number is out of range (``log_every_n_steps``, ``nvml_host_interval_s``,
            ``leak_*``).
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
        require_int_or_none(
            "MemoryMonitor", "log_every_n_steps", log_every_n_steps, 1, "use the Trainer's setting"
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
        _checks.require_size("MemoryMonitor", "leak_threshold_mib", leak_threshold_mib, MIB, "MiB")
        require_int("MemoryMonitor", "leak_warmup_steps", leak_warmup_steps, 0)
        require_number("MemoryMonitor", "nvml_host_interval_s", nvml_host_interval_s, 0, "seconds")
        self._log_every_n_steps, self._tensorboard_layout = log_every_n_steps, tensorboard_layout
        self._verbose, self._nvml, self._host = verbose, nvml, host
        self._progress_bar, self._summary = progress_bar, summary
        self._slow_interval_s = float(nvml_host_interval_s)
        self._leak_settings = (leak_warmup_steps, int(leak_threshold_mib * MIB)) if detect_leaks else None
        self._layouts_written: dict[int, tuple[str, ...]] = {}
        self._probe: Probe | None = None
        self._every_n, self._announced = 0, False
        self._total_bytes: int | None = None
        self._reset_run()

    @property
    def peaks(self) -> dict[str, tuple[int | None, int | None]]:
        """Running maxima per stage (``"train"``, ``"val"``, ...).

        ``(peak allocated, peak reserved)``, in bytes.
        """
        return dict(self._maxima.peaks)

    @property
    def last_sample(self) -> MemorySample | None:
        """The most recent sample this rank logged."""
        return self._last_sample

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _checks.require_trainer("MemoryMonitor", trainer)
        # a new fit starts from nothing (a checkpoint's `state_dict` is loaded after this hook)
        if stage == "fit":
            self._reset_run()
        device = trainer.strategy.root_device
        if self._probe is None or self._probe.device != device:
            self._probe = make_probe(device, self, nvml=self._nvml, host=self._host)
            self._total_bytes = self._probe.total_bytes()
        self._every_n = self._log_every_n_steps or trainer.log_every_n_steps  # type: ignore[attr-defined]
        if self._leak_settings and self._probe.has_allocator and self._leaks is None:
            self._leaks = LeakWatch(self._probe, *self._leak_settings)
        if self._tensorboard_layout:
            write_layout(trainer, self._layouts_written, device_memory=self._probe.has_allocator)
        if not self._announced:  # once per monitor, not per fit
            self._announced = True
            if not self._probe.has_allocator:
                rank_zero_info(
                    f"MemoryMonitor: no accelerator memory to read on `{device}`; logging host memory only."
                )
            if not trainer.loggers:
                rank_zero_warn(
                    "MemoryMonitor: no logger (`logger=False`): memory shows in the progress bar and"
                    " summary."
                )

    def _reset_run(self) -> None:
        """One fit's state, from nothing: running maxima, leak detection, the peak window, the summary."""
        self._maxima = RunningMaxima()
        self._window = PeakWindow()
        self._last_sample: MemorySample | None = None
        self._leaks = None
        self.leak: LeakVerdict | None = None
        """The leak found (rate and steps), ``None`` if none was."""
        self._slow = SlowReads(self._slow_interval_s)  # when logging steps also read NVML and host memory
        self._last_host_rss: int | None = None
        self.summary_text: str | None = None
        """The fit-end summary as printed on rank zero (also when the fit raised); ``None`` if none was."""

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._window.train_start()
        self._require_probe(trainer).reset_peaks()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        fold, reset = self._window.batch_start(_logging.is_logging_step(trainer, self._every_n))
        if fold:
            self._fold("train", trainer)
        if reset:
            self._require_probe(trainer).reset_peaks()

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._require_probe(trainer)
        accumulating = _logging.is_accumulating(trainer)
        # a logging step: its allocator read feeds the leak watch too
        logged = self._window.batch_end(accumulating)
        leak_sample = (
            not accumulating and self._leaks is not None and self._leaks.due(trainer, logged, self._every_n)
        )
        if logged:
            self._measure_and_log(trainer, "train", device_wide=True, leak_sample=leak_sample)
        elif leak_sample:
            self._watch_leaks(trainer, None)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fold("train", trainer)
        self._window.train_end()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._window.loop_start():
            self._fold("train", trainer)
        self._require_probe(trainer).reset_peaks()

    on_test_start = on_predict_start = on_validation_start  # every loop starts alike

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_loop(trainer, "val")

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_loop(trainer, "test")

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_loop(trainer, "predict")

    def _end_loop(self, trainer: pl.Trainer, stage: str) -> None:
        probe = self._require_probe(trainer)
        if not trainer.sanity_checking:  # device-wide keys go with the training keys in a fit
            self._measure_and_log(trainer, stage, device_wide=trainer.state.fn != "fit")
        probe.reset_peaks()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        run = self._gather_run(trainer)  # collective: every rank calls it
        if self._summary and trainer.is_global_zero:
            self.summary_text = print_summary(run, rank_zero_info)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # This rank's measurements alone (the others may never get here); never raises (other callbacks run
        # next).
        if (
            self._probe is None
            or trainer.state.fn != "fit"
            or not self._summary
            or not trainer.is_global_zero
        ):
            return
        try:
            run = self._gather_run(trainer, collective=False)
            self.summary_text = print_summary(run, rank_zero_info, type(exception).__name__)
        except Exception as error:  # the user's exception is what matters; say why there is no summary
            rank_zero_warn(
                f"MemoryMonitor: no summary after the fit raised ({type(error).__name__}: {error})."
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._maxima.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._maxima.load_state_dict(state_dict)

    def _require_probe(self, trainer: object) -> Probe:
        # used outside a Trainer (Fabric's `call`: a TypeError naming it), or before `setup`
        if self._probe is None:
            _checks.require_trainer("MemoryMonitor", trainer)
            raise RuntimeError(
                "MemoryMonitor was used before `setup`; add it to `Trainer(callbacks=[...])`."
            )
        return self._probe

    def gpumem_before_peak_reset(self) -> None:
        """Another callback is about to reset the allocator's peak counters: fold what they hold first."""
        if self._probe is not None and self._window.training and not self._window.open:
            self._fold("train", None)

    def _fold(self, stage: str, trainer: object) -> None:
        """Add the peaks since the last reset to ``stage``'s running maximum."""
        if (probe := self._require_probe(trainer)).has_allocator:
            self._maxima.peak(stage, *probe.read_peaks())

    def _watch_leaks(self, trainer: pl.Trainer, allocated: int | None) -> None:
        self.leak = (
            self._leaks.sample(trainer, allocated, self._total_bytes) if self._leaks else None
        ) or self.leak

    def _measure_and_log(
        self, trainer: pl.Trainer, stage: str, device_wide: bool, leak_sample: bool = False
    ) -> None:
        probe = self._require_probe(trainer)
        distributed = trainer.world_size > 1
        slow = self._slow.now(distributed)
        sample = self._last_sample = probe.read(nvml=self._nvml and slow, host=self._host and slow)
        if leak_sample:
            self._watch_leaks(trainer, sample.allocated_bytes)
        self._last_host_rss = sample.host_rss_bytes or self._last_host_rss
        self._maxima.add(stage, sample, probe.has_allocator)
        budget = budget_bytes(trainer)
        rate = self._leaks.rate() if self._leaks is not None else None
        stats = probe.allocator_stats() if self._verbose and device_wide else None
        metrics = logged_metrics(stage, sample, probe.has_allocator, device_wide, budget, rate, stats)
        if distributed:  # collective: every rank reaches this point on the same steps
            spread = gather_named(
                trainer, {**{f: getattr(sample, f) for f in REDUCED}, "due": self._slow.due()}
            )
            self._slow.agree(spread["due"][0] == 1.0)
            metrics.update(cross_rank_metrics(stage, spread, probe.has_allocator))
        if trainer.is_global_zero:
            _logging.log_to_loggers(trainer, metrics, step=_logging.batches_that_stepped(trainer))
            if self._progress_bar and stage == "train" and trainer.progress_bar_callback is not None:
                text = progress_text(sample, budget or self._total_bytes, self._last_host_rss)
                _logging.show_in_progress_bar(trainer, "mem", text)

    def _gather_run(self, trainer: pl.Trainer, collective: bool = True) -> RunMemory:
        probe, last = self._require_probe(trainer), self._last_sample
        return gather_run(trainer, self._maxima, last, probe, self._total_bytes, collective)
