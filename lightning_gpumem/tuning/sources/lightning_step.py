"""The user's Lightning training step, traced at any batch size: what a :class:`TracedSource` asks for.

Why: the trace (``_hw/trace.py``) takes a network, an optimizer, a step and a batch; a fit has a
``LightningModule``, its ``configure_optimizers``, its ``training_step`` and a dataloader of one batch size.
:func:`lightning_tracer` turns the second into the first once, at fit start, and gives ``trace_at(size)``.

How:

- The batch at any size: each tensor whose first dimension is the batch's size (:func:`batch_size_of`, or the
  size given) becomes its first row, copied to the CPU, expanded to ``size`` rows (:func:`resize_batch`). An
  expanded row is a view: no memory at any size, while the trace copies the batch onto the device as the
  step's own (full-size) allocation. The rows are real, so token ids stay valid indices; values matter
  nowhere else, as the trace runs on fake tensors. Other tensors and values are kept as they are.
- The step: ``training_step(batch, 0)`` on the trace's copy of the module, which gets the Trainer (a deep
  copy drops it: ``LightningModule.__getstate__``) so that ``self.trainer`` reads as in the fit, and whose
  ``log`` and ``log_dict`` do nothing (:func:`~lightning_gpumem._pl.patching.patched`): logging needs the
  running loop, and the copy's values are fake (nothing reaches the Trainer's metrics). The user's module,
  optimizer and Trainer are untouched.
- The optimizer: the Trainer's (``trainer.optimizers``: at fit start Lightning has made it from
  ``configure_optimizers``); before that, made by ``configure_optimizers()`` on the user's module, in any
  form Lightning accepts, the schedulers discarded. ``None`` there gives an optimizer that does nothing, as
  Lightning's own stand-in does (gradients are never freed then). It is copied with its state when
  ``trace_at`` runs.
- Precision, from ``trainer.precision``: ``"16-mixed"`` and ``"bf16-mixed"`` trace under CUDA's autocast
  policy (the trace's ``autocast_dtype``), with the weights' casts cached or not as the precision plugin's
  autocast does (:func:`autocast_caches`); with ``"16-true"``, ``"bf16-true"`` and ``"64-true"`` Lightning
  has cast the module at setup and makes the step's new tensors in that dtype; the trace does the same.
- Metrics: the copy's torchmetrics ``Metric`` modules neither update nor compute (their updates count
  classes with data-dependent ops: ``bincount``); their ``forward`` and ``compute`` give a 0-d zero. Their
  states (a few numbers a class) and their updates' temporaries (a few vectors of the batch's length) are
  not in the trace.
- Validation, where a validation batch is given and the module has its own ``validation_step``:
  ``validation_step(batch, 0)`` at the same size, ``log`` silenced, after the copy's
  ``on_validation_model_zero_grad`` (Lightning's frees the gradients), as under ``torch.inference_mode()``
  where the fit's validation loop uses it (autocast then keeps no casts of the weights).

What the trace is not told: gradient accumulation and clipping, DDP's gradient buckets, learning-rate
schedulers, ``GradScaler``, and the hooks around the step (``on_before_batch_transfer``,
``on_after_batch_transfer``, ``on_train_batch_start``, ``on_before_backward``, ``on_after_backward``,
``on_before_optimizer_step``); the batch is taken as ``training_step`` receives it. A tensor is resized in
its first dimension only, and lists of per-sample values (strings) are not resized.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gpumem._core.checks import require_int, require_int_or_none, require_trainer, shown
from lightning_gpumem._core.kernels import H100, Device
from lightning_gpumem._hw.trace import Trace, trace_training
from lightning_gpumem._pl.compat import either
from lightning_gpumem._pl.patching import patched

Tracer = Callable[[int], Trace]

MANUAL = "manual optimisation: the step drives its own optimizers"
NO_LOSS = "training_step returned None: Lightning skips such a batch, there is no loss to trace"

# trainer.precision -> the autocast dtype of mixed precision; the default dtype of the step's new tensors
_AUTOCAST = {
    "16-mixed": torch.float16,
    "bf16-mixed": torch.bfloat16,
    "16": torch.float16,
    "bf16": torch.bfloat16,
}
_DEFAULT_DTYPE = {"16-true": torch.float16, "bf16-true": torch.bfloat16, "64-true": torch.float64}
_FULL = ("32-true", "32")


def lightning_tracer(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    batch: Any,
    *,
    val_batch: Any = None,
    steps: int = 3,
    batch_size: int | None = None,
    device: Device | None = H100,
    meta_first: bool = False,
) -> Tracer:
    """``trace_at(size)``: the trace of ``module``'s training (and validation) step at batch size ``size``.

    Call it at fit start (a callback's ``on_fit_start``), on any accelerator; each ``trace_at`` copies the
    module and optimizer as they are then, and leaves them, the Trainer and the batches untouched.

    Args:
        trainer: the Trainer fitting ``module`` (its optimizers and precision are read).
        module: the ``LightningModule``.
        batch: one training batch, as ``training_step`` receives it.
        val_batch: one validation batch, to trace ``validation_step`` at the same size (where ``module``
            has its own); ``None``: no validation.
        steps: training steps per trace (the second is the first with gradients and optimizer state; the
            third repeats it, so the replay can repeat it again: ``sources/steps.py``).
        batch_size: the size of ``batch`` (``None``: :func:`batch_size_of`); its tensors whose first
            dimension is this are resized.
        device: the card whose kernels' own buffers the trace asks for (``_core/kernels.py``); ``None``:
            none.
        meta_first: trace on meta tensors first, on fake tensors where the step fails there
            (``trace_training``'s: about half the time, the same events on most models).

    Returns:
        ``trace_at(size) -> Trace``; a step that cannot be traced gives ``Trace.cannot_trace`` (manual
        optimisation: :data:`MANUAL`; ``training_step`` returning ``None``: :data:`NO_LOSS`; more than one
        optimizer; a precision not modelled; an op fake tensors cannot run), not an error. The step's own
        errors propagate.

    Raises:
        TypeError: ``trainer`` or ``module`` is not Lightning's.
        ValueError: ``steps`` or ``batch_size`` is not a positive integer, or ``batch`` has no tensor to read
            its size from.

    Example:
        >>> class Net(pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layer = nn.Linear(4, 2)
        ...     def training_step(self, batch, batch_idx):
        ...         return self.layer(batch).sum()
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
        >>> trace_at = lightning_tracer(pl.Trainer(accelerator="cpu", logger=False), Net(), torch.ones(3, 4))
        >>> trace = trace_at(16)
        >>> trace.cannot_trace, sum(e.size for e in trace.events if e.action == "alloc") > 0
        (None, True)
    """
    require_trainer("lightning_tracer", trainer)
    if not isinstance(module, either("core.module", "LightningModule")):
        raise TypeError(
            f"`lightning_tracer(module={shown(module)})` is not valid. Expected a `LightningModule` (of"
            " lightning.pytorch or pytorch_lightning)."
        )
    require_int("lightning_tracer", "steps", steps, 1)
    require_int_or_none("lightning_tracer", "batch_size", batch_size, 1, "read it from the batch")
    train_rows = _first_rows("batch", batch, batch_size)
    validates = val_batch is not None and _overrides(module, "validation_step")
    val_rows = _first_rows("val_batch", val_batch, None, required=False) if validates else None
    if not module.automatic_optimization:
        return _cannot(MANUAL)
    optimizer = _optimizer(trainer, module)
    if isinstance(optimizer, str):
        return _cannot(optimizer)
    precision = str(trainer.precision)
    if precision not in (*_AUTOCAST, *_DEFAULT_DTYPE, *_FULL):
        return _cannot(f"precision {precision!r} is not modelled (32-, 64-, 16- and bf16-, true or mixed)")
    dtype = _DEFAULT_DTYPE.get(precision)

    def train(copy: nn.Module, data: Any) -> Any:
        output = _run_step(copy, trainer, "training_step", data, dtype)
        if output is None:
            raise _NoLoss(NO_LOSS)
        return output

    def validate(copy: nn.Module, data: Any) -> Any:
        copy.on_validation_model_zero_grad()  # type: ignore[operator]  # Lightning frees the gradients first
        return _run_step(copy, trainer, "validation_step", data, dtype)

    caches = autocast_caches(trainer.precision_plugin)

    def trace_at(size: int) -> Trace:
        require_int("trace_at", "size", size, 1)
        try:
            return trace_training(
                module,
                optimizer,
                train,
                _expand(train_rows, size),
                steps=steps,
                validate=None if val_rows is None else validate,
                val_batch=None if val_rows is None else _expand(val_rows, size),
                autocast_dtype=_AUTOCAST.get(precision),
                device=device,
                inference_mode=_val_inference_mode(trainer),
                autocast_cache=caches,
                meta_first=meta_first,
            )
        except _NoLoss as error:
            return Trace(cannot_trace=str(error))

    return trace_at


def autocast_caches(plugin: Any) -> bool:
    """Whether the precision plugin's autocast keeps each weight's cast for its region (``cache_enabled``).

    Read by entering its context (on a CPU-only torch a CUDA autocast warns and turns itself off, but sets
    the flag): Lightning 2.6's ``MixedPrecision`` turns the cache off (2.4's keeps it); a custom plugin may
    do either.

    >>> from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    >>> autocast_caches(Precision())
    True
    """
    make = getattr(plugin, "autocast_context_manager", None)
    if make is None:
        return True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        context = make()
        if not isinstance(context, torch.autocast):
            return True
        with context:
            return torch.is_autocast_cache_enabled()


def _val_inference_mode(trainer: pl.Trainer) -> bool:
    """Whether the fit validates under ``torch.inference_mode()`` (``Trainer(inference_mode=True)``)."""
    return bool(getattr(trainer.fit_loop.epoch_loop.val_loop, "inference_mode", True))


def batch_size_of(batch: Any) -> int | None:
    """The first dimension of the batch's first tensor of at least one dimension; ``None`` without one.

    Tensors are found in tensors, mappings, sequences and dataclasses, in their order.

    >>> batch_size_of({"x": torch.zeros(8, 3), "y": torch.zeros(8)}), batch_size_of((torch.tensor(1.0), "a"))
    (8, None)
    """
    for tensor in _tensors(batch):
        if tensor.dim() > 0:
            return int(tensor.shape[0])
    return None


def resize_batch(batch: Any, size: int, batch_size: int | None = None) -> Any:
    """``batch`` at ``size`` rows: each tensor of ``batch_size`` rows becomes its first row, expanded.

    The rows are copied to the CPU and expanded (a view, no memory at any size); other values are kept.

    Args:
        batch: tensors in mappings, sequences or dataclasses.
        size: the new batch size.
        batch_size: the batch's size (``None``: :func:`batch_size_of`).

    Returns:
        The batch, of the same structure, at ``size``.

    Raises:
        ValueError: ``size`` or ``batch_size`` is not a positive integer, or the batch has no tensor to read
            its size from.

    >>> resized = resize_batch({"ids": torch.tensor([[5, 6], [7, 8]]), "n": 2}, 3)
    >>> resized["ids"].tolist(), resized["n"]
    ([[5, 6], [5, 6], [5, 6]], 2)
    """
    require_int("resize_batch", "size", size, 1)
    require_int_or_none("resize_batch", "batch_size", batch_size, 1, "read it from the batch")
    return _expand(_first_rows("batch", batch, batch_size, owner="resize_batch"), size)


class _NoLoss(Exception):
    """``training_step`` gave no loss; the message says so."""


class _NoOptimizer(Optimizer):
    """What Lightning trains with where ``configure_optimizers`` returns ``None``: it steps nothing."""

    def __init__(self) -> None:
        super().__init__([torch.zeros(1)], {})

    @override
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: Lightning's stand-in keeps the gradients."""

    @override
    def step(self, closure: Any = None) -> Any:
        """Nothing but the closure."""
        return None if closure is None else closure()


class _Rows:
    """A batch whose tensors of ``batch_size`` rows are replaced by their first row (on the CPU)."""

    def __init__(self, batch: Any, batch_size: int | None) -> None:
        self.batch_size = batch_size
        self.rows = apply_to_collection(batch, Tensor, self._first_row)

    def _first_row(self, tensor: Tensor) -> Tensor | _Row:
        if tensor.dim() == 0 or tensor.shape[0] != self.batch_size:
            return tensor
        return _Row(tensor[:1].detach().to("cpu", copy=True))


class _Row:
    """One tensor's first row, to expand."""

    def __init__(self, row: Tensor) -> None:
        self.row = row


def _first_rows(
    name: str, batch: Any, batch_size: int | None, required: bool = True, owner: str = "lightning_tracer"
) -> _Rows:
    """The batch's first rows; a batch without a sized tensor is kept as it is where not ``required``."""
    size = batch_size if batch_size is not None else batch_size_of(batch)
    if (size is None or size < 1) and required:
        raise ValueError(
            f"`{owner}({name}={shown(batch)})` is not valid. Expected a batch with a tensor whose first"
            " dimension (of at least 1) is the batch size, or `batch_size=` to say it."
        )
    return _Rows(batch, size)


def _expand(rows: _Rows, size: int) -> Any:
    return apply_to_collection(rows.rows, _Row, lambda kept: kept.row.expand(size, *kept.row.shape[1:]))


def _tensors(batch: Any) -> list[Tensor]:
    found: list[Tensor] = []
    apply_to_collection(batch, Tensor, found.append)
    return found


def _optimizer(trainer: pl.Trainer, module: pl.LightningModule) -> Optimizer | str:
    """The optimizer to trace with, or why there is none to trace with."""
    optimizers: list[Any] | None = list(trainer.optimizers)
    if not optimizers:  # before Lightning's setup made them
        configured = module.configure_optimizers()
        optimizers = _configured(configured)
        if optimizers is None:
            return f"configure_optimizers returned {shown(configured)}, not a form Lightning takes"
    if not optimizers:
        return _NoOptimizer()
    if len(optimizers) > 1:
        return f"{len(optimizers)} optimizers: automatic optimisation takes one"
    if not isinstance(optimizers[0], Optimizer):
        return f"the optimizer {type(optimizers[0]).__name__} is not a torch.optim.Optimizer"
    return optimizers[0]


def _configured(configured: Any) -> list[Any] | None:
    """The optimizers in ``configure_optimizers()``'s result, in any form Lightning takes; else ``None``."""
    if configured is None:
        return []
    if _is_optimizer(configured):
        return [configured]
    if isinstance(configured, Mapping):
        return [configured["optimizer"]] if "optimizer" in configured else None
    if not isinstance(configured, (list, tuple)):
        return None
    if len(configured) == 2 and isinstance(configured[0], list) and all(map(_is_optimizer, configured[0])):
        return list(configured[0])  # ([optimizers], [schedulers])
    if all(isinstance(item, Mapping) and "optimizer" in item for item in configured):
        return [item["optimizer"] for item in configured]
    if all(map(_is_optimizer, configured)):
        return list(configured)
    return None


def _is_optimizer(value: object) -> bool:
    """An optimizer as Lightning takes one (``Optimizable``: ``step`` and ``zero_grad``)."""
    if isinstance(value, Optimizer):
        return True
    return callable(getattr(value, "step", None)) and callable(getattr(value, "zero_grad", None))


def _run_step(copy: nn.Module, trainer: pl.Trainer, name: str, batch: Any, dtype: torch.dtype | None) -> Any:
    """``copy.<name>(batch, 0)`` attached to ``trainer``: no logging, metrics idle, new tensors ``dtype``."""
    copy.trainer = trainer  # type: ignore[assignment]  # the copy's is None (LightningModule.__getstate__)
    silenced: list[tuple[object, str, Callable[..., Any]]] = [
        (copy, "log", _ignore),
        (copy, "log_dict", _ignore),
    ]
    for metric in _metrics(copy):
        silenced += [(metric, "forward", _zero), (metric, "update", _ignore), (metric, "compute", _zero)]
    with contextlib.ExitStack() as stack:
        for owner, attribute, replacement in silenced:
            stack.enter_context(patched(owner, attribute, replacement))
        stack.enter_context(_default_dtype(dtype))
        return getattr(copy, name)(batch, 0)


def _metrics(module: nn.Module) -> list[nn.Module]:
    """The torchmetrics metrics in ``module`` (duck-typed: ``metric_state``, ``update``, ``reset``)."""
    return [
        child
        for child in module.modules()
        if isinstance(getattr(child, "metric_state", None), dict)
        and callable(getattr(child, "update", None))
        and callable(getattr(child, "reset", None))
    ]


def _ignore(*_args: Any, **_kwargs: Any) -> None:
    """``log``, ``log_dict`` and a metric's ``update`` during the trace."""


def _zero(*_args: Any, **_kwargs: Any) -> Tensor:
    """A metric's ``forward`` and ``compute`` during the trace: a scalar, as most metrics give."""
    return torch.zeros(())


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """Tensors made without a dtype are ``dtype``, as Lightning's true-precision plugins make them."""
    if dtype is None:
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _overrides(module: pl.LightningModule, name: str) -> bool:
    """Whether ``module`` has its own ``<name>`` (not ``LightningModule``'s of either namespace)."""
    own = getattr(type(module), name, None)
    bases = either("core.module", "LightningModule")
    return own is not None and all(own is not getattr(base, name, None) for base in bases)


def _cannot(reason: str) -> Tracer:
    def trace_at(size: int) -> Trace:
        require_int("trace_at", "size", size, 1)
        return Trace(cannot_trace=reason)

    return trace_at
