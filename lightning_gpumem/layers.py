"""LayerMemoryProfiler: which layer holds the memory of a training step.

Why these measurements: what a layer costs is mostly what it keeps for backward. Allocated memory after a
leaf module's forward minus before it is what that forward left alive (its output and what autograd saved),
the figure activation checkpointing would save. Peaks come from the allocator's peak counter, reset at each
hook. Backward is timed without module backward hooks (they wrap tensors and break in-place layers such as
``ReLU(inplace=True)``): a pre-hook on the ``grad_fn`` of each module's output marks where backward enters
that module, so a module's backward window runs from there to where backward enters the next one, or to the
end of backward.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_gpumem import keys
from lightning_gpumem._core.checks import require_int, require_trainer
from lightning_gpumem._core.files import check_dirpath, prepare_dir, unique_path, write_atomic
from lightning_gpumem._hw.probe import Probe, make_probe
from lightning_gpumem._pl.compat import Callback
from lightning_gpumem._pl.logging import log_table, run_dir

_MIB = 2**20


@dataclass
class LayerRecord:
    """One leaf module's memory in the profiled step, all in bytes."""

    name: str
    kind: str
    param_bytes: int = 0
    grad_bytes: int = 0
    activation_bytes: int = 0
    forward_peak_bytes: int = 0
    backward_peak_bytes: int = 0
    # tensors autograd saved for backward in its forward (storage bytes, each storage once)
    saved_bytes: int = 0


def layer_table(
    records: list[LayerRecord], top_k: int, step: int, step_peak: int | None, other: dict[str, int]
) -> str:
    """The ``top_k`` layers by memory saved for backward, and totals reconciled with the step's peak.

    ``activations`` is what a layer's forward left allocated (its output and what it saved); ``saved`` what
    autograd kept of it for backward (each storage counted once, for the first layer that saved it):
    activation checkpointing frees the latter.

    Example:
        >>> rows = [LayerRecord("fc1", "Linear", 4 * _MIB, 4 * _MIB, 2 * _MIB, 3 * _MIB, 5 * _MIB, 1 * _MIB)]
        >>> table = layer_table(rows, 10, step=1, step_peak=12 * _MIB, other={"optimizer state": 0})
        >>> print(table)  # doctest: +NORMALIZE_WHITESPACE
        Layer memory at step 1 (MiB; top 1 of 1 layers by memory saved for backward)
        layer  type    params  grads  activations  saved  fwd peak  bwd peak
        fc1    Linear     4.0    4.0          2.0    1.0       3.0       5.0
        total: parameters 4.0 + gradients 4.0 + saved for backward 1.0 + optimizer state 0.0 = 9.0 MiB;
        the step's measured peak 12.0 MiB (the layers account for 75%; the rest is the batch, temporaries
        and workspaces)
    """
    ranked = sorted(records, key=lambda r: (r.saved_bytes, r.activation_bytes), reverse=True)[:top_k]
    header = ("layer", "type", "params", "grads", "activations", "saved", "fwd peak", "bwd peak")
    rows = [
        (
            r.name,
            r.kind,
            *(
                f"{v / _MIB:.1f}"
                for v in (
                    r.param_bytes,
                    r.grad_bytes,
                    r.activation_bytes,
                    r.saved_bytes,
                    r.forward_peak_bytes,
                    r.backward_peak_bytes,
                )
            ),
        )
        for r in ranked
    ]
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]

    def line(row: tuple[str, ...]) -> str:
        cells = [
            str(c).ljust(w) if i < 2 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    params = sum(r.param_bytes for r in records)
    grads = sum(r.grad_bytes for r in records)
    saved = sum(r.saved_bytes for r in records)
    total = params + grads + saved + sum(other.values())
    parts = " + ".join(
        [
            f"parameters {params / _MIB:.1f}",
            f"gradients {grads / _MIB:.1f}",
            f"saved for backward {saved / _MIB:.1f}",
        ]
        + [f"{name} {value / _MIB:.1f}" for name, value in other.items()]
    )
    footer = f"total: {parts} = {total / _MIB:.1f} MiB"
    if step_peak:
        share = 100 * total / step_peak
        footer += (
            f"; the step's\nmeasured peak {step_peak / _MIB:.1f} MiB (the layers account for {share:.0f}%;"
            " the rest is the batch, temporaries and workspaces)"
        )
    title = (
        f"Layer memory at step {step} (MiB; top {len(ranked)} of {len(records)} layers by memory saved for"
        " backward)"
    )
    return "\n".join([title, line(header), *(line(r) for r in rows), footer])


def to_csv(records: list[LayerRecord]) -> str:
    """Every layer, in forward order, bytes."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    names = [f.name for f in fields(LayerRecord)]
    writer.writerow(names)
    for record in records:
        writer.writerow([getattr(record, name) for name in names])
    return buffer.getvalue()


class _StepRecorder:
    """One training step's recording: hooks on every leaf module, a saved-tensors hook, what they measured.

    :meth:`start` registers forward hooks on every leaf module and enters a ``saved_tensors_hooks`` context
    whose pack hook attributes each tensor saved for backward to the leaf module running; :meth:`end_forward`
    leaves that context when backward begins (only the forward's saved tensors count); :meth:`end_backward`
    closes the last backward window and reads the gradients; :meth:`end_step` reads the step's last peak and
    stops. :meth:`stop` leaves the context if it is still entered and removes the hooks; it is idempotent,
    and the callback calls it on every way out of the step (its end, an exception or Ctrl-C, a step skipped,
    teardown), so the context is entered once and left exactly once. A stopped recorder's hooks that outlive
    it (``grad_fn`` pre-hooks on a graph kept past the step) do nothing.

    Attributes:
        step: the ``global_step`` recorded.
        records: every leaf module's record, in forward order.
        step_peak_bytes: peak allocated memory over the step so far, in bytes.
        saved_outside: bytes saved for backward outside any leaf module (the loss, for one).
    """

    def __init__(self, probe: Probe, step: int) -> None:
        self.step = step
        self.records: list[LayerRecord] = []
        self.step_peak_bytes = 0
        self.saved_outside = 0
        self._probe = probe
        self._recording = False
        self._handles: list[RemovableHandle] = []
        self._saved_hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._by_module: dict[torch.nn.Module, LayerRecord] = {}
        self._before: dict[torch.nn.Module, int] = {}
        self._backward_open: LayerRecord | None = None
        self._before_backward = 0
        self._param_storages: set[int] = set()
        self._seen_storages: set[int] = set()
        self._running: list[LayerRecord] = []

    def start(self, module: torch.nn.Module) -> None:
        """Hook every leaf module of ``module``, enter the saved-tensors context; on an error, undo both."""
        self._recording = True
        try:
            self._param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            hooks.__enter__()  # left in `end_forward`, else in `stop`
            self._saved_hooks = hooks
            for name, leaf in module.named_modules():
                if next(leaf.children(), None) is not None:
                    continue  # leaves only: a parent's window would contain its children's
                record = LayerRecord(name or type(leaf).__name__, type(leaf).__name__)
                record.param_bytes = sum(
                    p.numel() * p.element_size() for p in leaf.parameters(recurse=False)
                )
                self.records.append(record)
                self._by_module[leaf] = record
                self._handles.append(leaf.register_forward_pre_hook(self._forward_pre))
                self._handles.append(leaf.register_forward_hook(self._forward_post))
            self._reset()
        except BaseException:
            self.stop()
            raise

    def end_forward(self) -> None:
        """Backward begins: leave the saved-tensors context (a no-op once left)."""
        self._leave_saved_hooks()

    def end_backward(self) -> None:
        """Backward ended: close the last module's backward window and read every leaf's gradient bytes."""
        if not self._recording:
            return
        self._close_backward()
        for module, record in self._by_module.items():
            record.grad_bytes = sum(
                p.grad.numel() * p.grad.element_size()
                for p in module.parameters(recurse=False)
                if p.grad is not None
            )

    def end_step(self) -> None:
        """The step ended: read its last peak, then :meth:`stop` (also where the reading fails)."""
        try:
            if self._recording:
                self._read_peak()
        finally:
            self.stop()

    def stop(self) -> None:
        """Leave the saved-tensors context if it is still entered and remove the hooks; idempotent."""
        self._recording = False
        self._leave_saved_hooks()
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        self._by_module, self._before, self._running, self._backward_open = {}, {}, [], None

    def _leave_saved_hooks(self) -> None:
        hooks, self._saved_hooks = self._saved_hooks, None  # cleared first: never left twice
        if hooks is not None:
            hooks.__exit__(None, None, None)

    # ------------------------------------------------------------------ measuring
    def _allocated(self) -> int:
        return self._probe.allocated_bytes() or 0

    def _reset(self) -> None:
        self._probe.reset_peaks()

    def _read_peak(self) -> int:
        peak = self._probe.read_peaks()[0] or 0
        self.step_peak_bytes = max(self.step_peak_bytes, peak)
        return peak

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        on_device = tensor.device == self._probe.device
        if on_device and pointer not in self._param_storages and pointer not in self._seen_storages:
            self._seen_storages.add(pointer)
            if self._running:
                self._running[-1].saved_bytes += storage.nbytes()
            else:
                self.saved_outside += storage.nbytes()
        return tensor

    def _forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        self._read_peak()
        self._reset()
        self._before[module] = self._allocated()
        self._running.append(self._by_module[module])

    def _forward_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        record = self._by_module[module]
        if self._running and self._running[-1] is record:
            self._running.pop()
        record.forward_peak_bytes = max(0, self._read_peak() - self._before.get(module, 0))
        record.activation_bytes = max(0, self._allocated() - self._before.get(module, 0))
        self._reset()
        grad_fn = _first_grad_fn(output)
        if grad_fn is not None and torch.is_grad_enabled():
            grad_fn.register_prehook(lambda grad_outputs, record=record: self._open_backward(record))

    def _open_backward(self, record: LayerRecord) -> None:
        if not self._recording:
            return  # a graph kept past the step: its backward is not this step's
        self._close_backward()
        self._backward_open = record
        self._before_backward = self._allocated()
        self._reset()

    def _close_backward(self) -> None:
        # Read the peak even with no module open: between the last forward and the first backward hook run
        # the loss and its backward (a large-vocabulary cross-entropy is often the step's real peak).
        peak = self._read_peak()
        record = self._backward_open
        if record is not None:
            record.backward_peak_bytes = max(record.backward_peak_bytes, peak - self._before_backward)
        self._reset()
        self._backward_open = None


@keys.document
class LayerMemoryProfiler(Callback):
    r"""Measure, for one training step, what each layer holds: parameters, gradients, activations, peaks.

    At training step ``at_step`` hooks on every leaf module record, on the allocator: parameter and gradient
    bytes, the activation bytes its forward leaves alive for backward (allocated after minus before), and the
    peaks during its forward and its backward. The ``top_k`` layers by activation memory are printed as a
    table on rank zero, with totals reconciled against the step's measured peak; the table goes to the
    loggers that take tables (TensorBoard text, a W&B table, an MLflow artifact, a
    ``gpumem_layer_memory.csv`` in each other logger's run directory) and every layer to
    ``layer_memory_step<n>.csv`` in the first logger's run directory (or ``dirpath``; ``-v1``, ``-v2``...
    where another run took the name). A file that cannot be written is named in a warning and training goes
    on. The layers with the most activation memory are the candidates for activation checkpointing. The hooks
    are removed after that step, so other steps run untouched. Without an accelerator it warns once and does
    nothing.

    The hooks, and the ``saved_tensors_hooks`` context that counts what autograd saves, are removed on every
    way out of the step: its end, an error or Ctrl-C in it (the error propagates unchanged), teardown. A step
    skipped before it ran (the module's ``on_train_batch_start`` returned ``-1``) records nothing: the next
    batch starting at ``at_step`` is profiled.

    The peak counters are reset at each hook during that one step, so a
    :class:`~lightning_gpumem.MemoryMonitor`'s ``train_peak_*`` for the profiled step covers only its end;
    the table's footer has the step's whole peak.

    **Logged metrics** (a table, no scalars; from :mod:`lightning_gpumem.keys`):

    {logged_metrics}

    Args:
        at_step: the training step (``global_step`` when it starts) to profile; after the first one, the
            optimizer state exists and the step is a steady-state one.
        top_k: layers in the printed table.
        dirpath: where to write the CSV (``~`` expanded); ``None``: the first logger's run directory
            (``trainer.log_dir`` for TensorBoard and CSV, ``<save_dir>/<name>/<version>`` for MLflow and W&B,
            as ``ModelCheckpoint``), else ``default_root_dir``.

    Raises:
        ValueError: if ``at_step`` is not an integer >= 0, ``top_k`` not an integer >= 1, or ``dirpath``
            cannot be a directory (an existing file, a path under a file, a blank name, a NUL byte, a name
            over 255 bytes); at ``setup``, if ``dirpath`` cannot be created or written to.
        TypeError: if ``dirpath`` is not a path.

    Example::

        from lightning import Trainer
        from lightning_gpumem import LayerMemoryProfiler

        trainer = Trainer(callbacks=[LayerMemoryProfiler(at_step=1)])
    """

    def __init__(self, at_step: int = 1, top_k: int = 10, dirpath: str | Path | None = None) -> None:
        require_int("LayerMemoryProfiler", "at_step", at_step, 0)
        require_int("LayerMemoryProfiler", "top_k", top_k, 1)
        self.at_step = at_step
        self.top_k = top_k
        self.dirpath = check_dirpath("LayerMemoryProfiler", dirpath)
        self.records: list[LayerRecord] = []
        """Every leaf module's record from the profiled step, in forward order."""
        self.table: str | None = None
        """The printed table (``None`` before the profiled step)."""
        self.step_peak_bytes: int | None = None
        """Peak allocated memory over the whole profiled step, in bytes."""
        self.csv_path: Path | None = None
        """The CSV file written (``None`` before the profiled step, or where it could not be written)."""
        self._probe: Probe | None = None  # set at `setup` where the device has allocator statistics
        self._recorder: _StepRecorder | None = None  # the step being recorded, from its start to its way out
        self._warned = False

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_trainer("LayerMemoryProfiler", trainer)
        if self.dirpath is not None and trainer.is_global_zero:
            prepare_dir("LayerMemoryProfiler", self.dirpath)
        probe = make_probe(trainer.strategy.root_device, self)
        if not probe.has_allocator:
            if not self._warned:
                self._warned = True
                rank_zero_warn(
                    f"LayerMemoryProfiler: `{probe.device}` has no allocator statistics to read; doing"
                    " nothing."
                )
            return
        self._probe = probe

    def gpumem_summary_context(self) -> dict[str, Any]:
        """What this adds to ``MemoryMonitor``'s fit-end advice: the layers by memory saved for backward."""
        if not self.records:
            return {}
        ranked = sorted(self.records, key=lambda r: r.saved_bytes, reverse=True)
        return {"top_layers": [(r.name, r.saved_bytes) for r in ranked if r.saved_bytes > 0]}

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        probe = self._probe
        if (
            probe is None
            or self._recorder is not None
            or self.table is not None
            or trainer.global_step != self.at_step
        ):
            return
        recorder = _StepRecorder(probe, trainer.global_step)
        self.records, self.step_peak_bytes = recorder.records, 0  # filled as the step runs
        recorder.start(pl_module)
        self._recorder = recorder

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        if self._recorder is not None:
            self._recorder.end_forward()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._recorder is not None:
            self._recorder.end_backward()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        recorder = self._stop()
        if recorder is not None:
            self.step_peak_bytes = recorder.step_peak_bytes  # what the step measured before it failed

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._drop_skipped_step()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._drop_skipped_step()

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
    ) -> None:
        recorder = self._recorder
        if recorder is None:
            return
        recorder.end_step()
        self._recorder = None
        self.step_peak_bytes = recorder.step_peak_bytes
        other = {
            "optimizer state": _optimizer_state_bytes(trainer),
            "saved outside layers": recorder.saved_outside,
        }
        self.table = layer_table(self.records, self.top_k, recorder.step, self.step_peak_bytes, other)
        if not trainer.is_global_zero:
            return
        rank_zero_info(self.table)
        directory = run_dir(trainer, self.dirpath)
        path = unique_path(directory / f"layer_memory_step{recorder.step}.csv")  # another run's stays
        try:
            write_atomic(path, to_csv(self.records))
            self.csv_path = path
        except OSError as error:  # the table was printed and goes to the loggers; training goes on
            rank_zero_warn(f"LayerMemoryProfiler: could not write {path} ({error!r}).")
        names = [f.name for f in fields(LayerRecord)]
        rows = [[getattr(record, name) for name in names] for record in self.records]
        table = f"```\n{self.table}\n```"
        log_table(
            trainer,
            keys.LAYER_MEMORY.format(),
            names,
            rows,
            trainer.global_step,
            table,
            "LayerMemoryProfiler",
            directory,
        )

    def _stop(self) -> _StepRecorder | None:
        """Stop the step's recorder, if one is recording; returns it."""
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.stop()
        return recorder

    def _drop_skipped_step(self) -> None:
        # Still recording when the epoch or the fit ends: the step never ran (`on_train_batch_start` returned
        # -1 in the module). Nothing was measured; the next batch starting at `at_step` is profiled.
        if self._stop() is not None:
            self.records, self.step_peak_bytes = [], None


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _first_grad_fn(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.grad_fn
    if isinstance(output, (list, tuple)):
        for item in output:
            found = _first_grad_fn(item)
            if found is not None:
                return found
    if isinstance(output, dict):
        return _first_grad_fn(list(output.values()))
    return None


def _optimizer_state_bytes(trainer: pl.Trainer) -> int:
    total = 0
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                    total += value.numel() * value.element_size()
    return total
