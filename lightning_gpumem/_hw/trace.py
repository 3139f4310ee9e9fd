"""A training step traced on fake tensors: the allocations and frees it would ask of the CUDA allocator.

Why: the tuner and the planner want a batch size's reserved peak without running the batch on the GPU. The
ordered stream of requests (``_core/alloc_events.Event``) replayed through a model of the caching allocator
(``tuning/sources/allocator.py``) gives it, on a machine without a GPU.

How. The module, the optimizer and the batches are copied onto fake tensors (``FakeTensorMode``: shapes,
dtypes and strides, no memory) and the steps run on the copies under a recording ``TorchDispatchMode``. Each
op's output whose storage was not seen before is an allocation of the storage's ``nbytes``; its free is the
death of the storage's Python object (torch keeps one object per storage while the storage lives, so a weak
reference to it dies with the storage). Views and in-place results share a storage and allocate nothing.
The steps follow Lightning's automatic optimization: forward, ``zero_grad(set_to_none=True)``, backward,
``optimizer.step()``; a step's gradients live until the next step's ``zero_grad``, through its forward and
through validation.

The copies are fake *CPU* tensors: on a CPU-only torch, autograd aborts the process on a fake CUDA tensor (a
device named in the forward, ``x.cuda()`` or ``device="cuda"``, is taken as the CPU). What CUDA does
differently is applied by hand, in the forward and in forwards that activation checkpointing recomputes:

- an optimizer whose ``foreach`` is left to torch (``None``) takes the multi-tensor path, as on CUDA, whose
  temporaries set the peak at small batches; an explicit ``False`` or ``fused`` is kept;
- with ``autocast_dtype``, CUDA autocast's op lists are applied to torch's Python functions (lower precision,
  float32, float32 through ``dtype=``, the widest type; a float32 weight is cast once per forward, as
  autocast caches it). CPU autocast's lists differ: on CUDA ``layer_norm``, ``softmax``, ``pow`` and the
  losses give float32;
- ``F.scaled_dot_product_attention`` takes a fused kernel's memory instead of CPU's math path: for half
  precision without a mask cuDNN's attention (the ``device``'s choice, as on the H100 with torch 2.11: RNG
  seed and offset, output, float32 statistics; in backward dq, dk, dv and one workspace) or FlashAttention
  (output, float32 logsumexp; in backward dq, dk, dv and the kernel's float32 ``softmax_d`` and
  ``dq_accum``), memory-efficient attention otherwise (output, float32 logsumexp padded to 32 rows when
  gradients are needed, a boolean mask as a bias padded to 16 columns; dq, dk, dv);
- ``F.dropout`` keeps CUDA's one-byte mask (``native_dropout``) instead of CPU's input-sized one;
- tensors made from Python data (``torch.tensor``), what is computed from them alone, and 0-d optimizer state
  are host memory, as the optimizers' step counters are on CUDA;
- with a ``device``, what kernels allocate for themselves where the shapes decide it (``_core/kernels.py``):
  each thread's cuBLAS workspaces at its first matrix multiply, the staging buffer of a reduction split
  across thread blocks, and embedding backward's sort buffers and partial sums.

Not in the stream: other kernels' own buffers (cuDNN's convolution workspaces, the memory-efficient
attention backward's workspace, ``scale_grad_by_freq``'s counts) and what ``GradScaler`` adds. A
data-dependent op (``.item()`` on a computed value, ``nonzero``, boolean indexing) or an op without a fake
kernel ends the trace with ``cannot_trace`` naming the op and the module it ran in.

Private torch: ``torch._subclasses.fake_tensor`` (``FakeTensorMode`` and the exceptions it raises) and
``torch.utils._python_dispatch.TorchDispatchMode``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import math
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)
from torch.nn import functional as F
from torch.optim import Optimizer
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_gpumem._core.alloc_events import Event
from lightning_gpumem._core.checks import require_int
from lightning_gpumem._core.kernels import (
    EMBEDDING_BACKWARD_ORDER,
    H100,
    MEASURED_OPS,
    Device,
    embedding_recipes,
    reduce_recipes,
    scratch_bytes,
)
from lightning_gpumem._hw.meta_memo import MetaMemo, tensors_in

Step = Callable[[nn.Module, Any], Any]
MakeOptimizer = Callable[[Iterable[nn.Parameter]], Optimizer]

# What fake tensors cannot do: read values, give data-dependent shapes, run ops without a fake kernel.
_UNTRACEABLE = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
    UnsupportedFakeTensorException,
    NotImplementedError,
)
_FROM_DATA = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}
_ADD = torch.ops.aten.add.Tensor
_EMBEDDING_BACKWARD = torch.ops.aten.embedding_dense_backward.default
_CUDNN_EXTRA = (
    256  # bytes cuDNN's attention backward asks beyond its two buffers (H100, torch 2.11: two shapes)
)
_HALF = (torch.float16, torch.bfloat16)
# reductions run by ATen's Reduce.cuh, whose staging buffer the trace asks for (``_core/kernels.py``)
_REDUCTIONS = {
    torch.ops.aten.sum.dim_IntList,
    torch.ops.aten.sum.default,
    torch.ops.aten.mean.dim,
    torch.ops.aten.mean.default,
}
# matrix multiplies: the first of a thread creates its cuBLAS handle's workspaces
_MATMULS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
}
_UNTRACKED, _HOST = 0, -1  # a storage's state besides its block: there before the trace, or host memory

# CUDA autocast's op lists (aten/src/ATen/autocast_mode.cpp), by the name of torch's Python function.
_LOWER = "lower"  # floating arguments cast to the autocast dtype
_FP32 = "fp32"  # half-precision arguments cast to float32
_FP32_DTYPE = "fp32_dtype"  # a half-precision input run with dtype=torch.float32
_PROMOTE = "promote"  # floating arguments cast to the widest among them
_LOWER_OPS = """linear matmul __matmul__ __rmatmul__ mm mv bmm addmm addmv addr baddbmm addbmm einsum
    chain_matmul multi_dot linalg_vecdot conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d
    conv_transpose3d prelu lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell scaled_dot_product_attention"""
_FP32_OPS = """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow __pow__
    __rpow__ __rdiv__ __rtruediv__ softplus layer_norm group_norm cosine_similarity poisson_nll_loss
    cosine_embedding_loss nll_loss hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss
    margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss
    binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp"""
_FP32_DTYPE_OPS = "softmax log_softmax softmin cumsum cumprod sum prod linalg_vector_norm linalg_matrix_norm"
_PROMOTE_OPS = "addcdiv addcmul atan2 bilinear cross dot vdot grid_sample index_put tensordot scatter_add"
_AUTOCAST = {
    name: policy
    for names, policy in (
        (_LOWER_OPS, _LOWER),
        (_FP32_OPS, _FP32),
        (_FP32_DTYPE_OPS, _FP32_DTYPE),
        (_PROMOTE_OPS, _PROMOTE),
    )
    for name in names.split()
}

# Python functions of torch.nn.functional whose inner calls of that module's functions the mode must see, and
# the inner calls routed through the policy while they run.
_COMPOSITES = frozenset({"multi_head_attention_forward"})
_ROUTED = (*_AUTOCAST, "scaled_dot_product_attention", "dropout", "cross_entropy")


@dataclass(frozen=True)
class Trace:
    """What a traced training step asked of the allocator.

    Attributes:
        events: allocations and frees in order, parameters, buffers and optimizer state first; marks
            ``"train"`` at each training step, ``"optimizer"`` before each ``optimizer.step()``, ``"val"``
            before validation.
        cannot_trace: why the trace stopped early (``"cannot trace: aten.nonzero at `head` (Linear)"``), else
            ``None``; ``events`` then holds what came before.
        ops: the names of the ops run (``"aten.mm"``, ``"aten.add.Tensor"``) and of the fused attention
            kernels (``"scaled_dot_product_attention (cudnn)"``).
    """

    events: list[Event] = field(default_factory=list)
    cannot_trace: str | None = None
    ops: frozenset[str] = field(default=frozenset(), compare=False)

    @property
    def unmeasured(self) -> frozenset[str]:
        """The ops run outside ``MEASURED_OPS`` (``_core/kernels.py``): buffers of theirs may be missing."""
        return self.ops - MEASURED_OPS


def trace_training(
    module: nn.Module,
    make_optimizer: MakeOptimizer | Optimizer,
    step: Step,
    batch: Any,
    *,
    steps: int = 3,
    validate: Step | None = None,
    val_batch: Any = None,
    autocast_dtype: torch.dtype | None = None,
    device: Device | None = H100,
    inference_mode: bool = False,
    autocast_cache: bool = True,
    meta_first: bool = False,
) -> Trace:
    """Trace ``steps`` training steps (and a validation step) on fake copies, as they would run on a GPU.

    The module, the optimizer and the batches are untouched: the steps run on fake copies (the module's other
    attributes are deep-copied, or shared where they are neither tensors, modules nor containers), in the
    order of Lightning's automatic optimization: forward, ``zero_grad(set_to_none=True)``, backward,
    ``optimizer.step()``.

    Args:
        module: the network, on any device; its parameters and buffers are counted as on the GPU.
        make_optimizer: builds the optimizer from parameters; or an optimizer of ``module``'s parameters,
            copied with its state (its 0-d state, the step counters, read as numbers).
        step: ``step(module, batch)`` returns the loss (or a mapping with ``"loss"``).
        batch: what ``step`` gets; each step has its own copy on the GPU, freed after ``optimizer.step()``.
        steps: training steps to trace; the second is the first with gradients and optimizer state, the third
            the first like the one before it (from two like steps a replay makes the later ones).
        validate: ``validate(module, batch)`` after the training steps, in ``eval()`` under
            ``torch.no_grad()``.
        val_batch: what ``validate`` gets (``batch`` when ``None``).
        autocast_dtype: ``torch.float16`` or ``torch.bfloat16`` to run ``step`` and ``validate`` under CUDA's
            autocast policy, as Lightning's mixed precision does.
        device: the card whose kernels' own buffers are asked for (``_core/kernels.py``: the cuBLAS
            workspaces of the first matrix multiplies, reductions' staging buffers, whose size depends on its
            multiprocessors); ``None``: the tensors alone.
        inference_mode: ``validate`` runs as under ``torch.inference_mode()`` (Lightning's validation, by
            default): autocast keeps no casts of the weights there (under ``torch.no_grad()`` it keeps each
            weight's cast until the region ends).
        autocast_cache: autocast keeps each float32 weight's cast until its region ends
            (``torch.autocast``'s ``cache_enabled``; Lightning 2.6's mixed precision turns it off, 2.4's
            keeps it); else each op casts anew, and a cast lives as long as what holds it (autograd, for
            backward; under activation checkpointing, nothing).
        meta_first: first run the steps on meta tensors with no fake mode (about half the time: the same
            events on the GPTs and ViT, ResNet's batch norms a few more); where anything fails there (an op
            without a meta kernel, a value read, a tensor moved to the CPU), on fake tensors as without it.

    Returns:
        The :class:`Trace`; a step that cannot be traced gives ``cannot_trace`` rather than raising. Errors
        of the step's own propagate.

    Example:
        >>> net = nn.Linear(4, 2)
        >>> trace = trace_training(net, lambda ps: torch.optim.SGD(ps, lr=0.1), lambda m, x: m(x).sum(),
        ...                        torch.ones(3, 4))
        >>> [e.size for e in trace.events[:3]], trace.cannot_trace
        ([32, 8, 0], None)
    """
    require_int("trace_training", "steps", steps, 1)
    _check_callables(make_optimizer, step, validate)
    if autocast_dtype is not None and autocast_dtype not in _HALF:
        raise ValueError(
            f"`trace_training(autocast_dtype={autocast_dtype!r})` is not valid. Expected torch.float16, "
            "torch.bfloat16 or None."
        )
    run = partial(
        _trace_copies,
        module,
        make_optimizer,
        step,
        batch,
        steps=steps,
        validate=validate,
        val_batch=val_batch,
        autocast_dtype=autocast_dtype,
        device=device,
        inference_mode=inference_mode,
        autocast_cache=autocast_cache,
    )
    if meta_first:
        try:
            trace = run(stand_in="meta")
        except Exception:  # what meta tensors cannot do: the fake tensors' trace says what the step does
            trace = None
        if trace is not None and trace.cannot_trace is None:
            return trace
    return run(stand_in="cpu")


def _trace_copies(
    module: nn.Module,
    make_optimizer: MakeOptimizer | Optimizer,
    step: Step,
    batch: Any,
    *,
    steps: int,
    validate: Step | None,
    val_batch: Any,
    autocast_dtype: torch.dtype | None,
    device: Device | None,
    inference_mode: bool,
    autocast_cache: bool,
    stand_in: str,
) -> Trace:
    """The steps on copies on ``stand_in``: ``"cpu"``, fake CPU tensors; ``"meta"``, meta tensors."""
    mode: Any = FakeTensorMode(allow_non_fake_inputs=True) if stand_in == "cpu" else contextlib.nullcontext()
    with torch.device("cpu"):  # the stand-in for the GPU, whatever default device the caller set
        fake_module, fakes = _fake_module(module, mode, stand_in)
        optimizer = _fake_optimizer(make_optimizer, fake_module, fakes, mode, stand_in)
        with mode:
            return _record(
                fake_module,
                optimizer,
                step,
                _fake_data(batch, stand_in),
                steps=steps,
                validate=validate,
                val_batch=_fake_data(val_batch, stand_in),
                policy=_CudaPolicy(autocast_dtype, device, autocast_cache, stand_in),
                device=device,
                inference_mode=inference_mode,
            )


def record_training(
    module: nn.Module,
    optimizer: Optimizer,
    step: Step,
    batch: Any,
    *,
    steps: int = 3,
    validate: Step | None = None,
    val_batch: Any = None,
) -> Trace:
    """Record the steps :func:`trace_training` runs on the module, optimizer and batches given, as they are.

    On real CPU tensors this is the real step (it trains the module): what the trace is checked against. No
    copy is made and CUDA's behaviour is not applied (the optimizer's ``foreach`` is as given); tensors made
    from Python data and 0-d optimizer state are host memory here too.

    Args:
        module: the network.
        optimizer: its optimizer.
        step: as for :func:`trace_training`.
        batch: as for :func:`trace_training`.
        steps: as for :func:`trace_training`.
        validate: as for :func:`trace_training`.
        val_batch: as for :func:`trace_training`.

    Returns:
        The :class:`Trace`.
    """
    require_int("record_training", "steps", steps, 1)
    return _record(
        module,
        optimizer,
        step,
        batch,
        steps=steps,
        validate=validate,
        val_batch=val_batch,
        policy=None,
    )


def _record(
    module: nn.Module,
    optimizer: Optimizer,
    step: Step,
    batch: Any,
    *,
    steps: int,
    validate: Step | None,
    val_batch: Any,
    policy: _CudaPolicy | None,
    device: Device | None = None,
    inference_mode: bool = False,
) -> Trace:
    cuda = contextlib.nullcontext() if policy is None else policy
    recorder = _Recorder(device)
    handles = recorder.follow(module) + ([] if policy is None else policy.follow(module))
    try:
        with recorder:
            recorder.register(module.parameters(), host=False)
            recorder.register(module.buffers(), host=False)
            for state in _optimizer_state(optimizer):
                recorder.register([state], host=state.dim() == 0)
            for _ in range(steps):
                recorder.mark("train")
                module.train()
                device_batch = _copy_tensors(batch)
                with cuda:
                    loss = _loss(step(module, device_batch))
                if policy is not None:
                    policy.forward_done()
                recorder.phase = "optimizer.zero_grad"
                optimizer.zero_grad(set_to_none=True)
                recorder.phase = "backward"
                loss.backward()
                del loss
                recorder.mark("optimizer")
                optimizer.step()
                del device_batch
            if validate is not None:
                recorder.mark("val")
                module.eval()
                if policy is not None:
                    policy.caching = policy.caching and not inference_mode
                with torch.no_grad(), cuda:
                    validate(module, _copy_tensors(batch if val_batch is None else val_batch))
                module.train()
    except _CannotTrace as error:
        return Trace(recorder.close(), str(error), _op_names(recorder.ops, policy))
    finally:
        for handle in handles:
            handle.remove()
    return Trace(recorder.close(), ops=_op_names(recorder.ops, policy))


class _CannotTrace(Exception):
    """A fake tensor could not do what the step asked; the message says what and where."""


class _Sum(NamedTuple):
    """An ``add`` in backward: its allocation's place in the stream; its output's storage, its operand's."""

    at: int
    out_key: int
    first_key: int
    first_block: int


class _Recorder(TorchDispatchMode):
    """Records each new output storage as an allocation and its death as a free.

    With a ``device``, also what its kernels allocate for themselves: each thread's cuBLAS workspaces, kept,
    and reductions' staging buffers, freed as the kernel returns.
    """

    def __init__(self, device: Device | None = None) -> None:
        super().__init__()
        self.device = device
        self._handles: set[bool] = set()  # the threads with a cuBLAS handle: backward's (True), the other
        self.events: list[Event] = []
        self.phase = "setup"
        self.modules: list[str] = []  # the forwards running, innermost last
        self._state: dict[int, int] = {}  # id of a live storage object -> its block, _UNTRACKED or _HOST
        self._sizes: dict[int, int] = {}  # block -> bytes
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._next_block = 1
        self._closed = False
        self._sum: _Sum | None = None  # an add in backward, until it is known whether it sums in place
        self.ops: set[Any] = set()  # the ops run
        self._memo = MetaMemo()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        self._settle()
        self.ops.add(func)
        states = [self._known(tensor) for tensor in tensors_in((args, kwargs))]
        try:
            out = self._memo(func, args, kwargs)  # on meta tensors, a signature's kernel runs once
        except _UNTRACEABLE as error:
            raise _CannotTrace(f"cannot trace: {_op_name(func)} {self._where()}") from error
        if func in _FROM_DATA:  # a tensor made from Python data (fake: a new one; real: the same)
            for tensor in tensors_in((args, out)):
                self._see(tensor, host=True)
            return out
        host = bool(states) and all(state == _HOST for state in states)
        if func is _EMBEDDING_BACKWARD and self.device is not None and not host:
            self._scratch(_embedding_recipes(args, kwargs), EMBEDDING_BACKWARD_ORDER, out)
        for tensor in tensors_in(out):
            self._see(tensor, host=host)
        if func is _ADD and self.phase == "backward" and not torch.is_grad_enabled():
            self._sum = self._gradient_sum(args, kwargs, out)
        if self.device is not None and not host:
            if func in _REDUCTIONS:
                self._scratch(_reduction_scratch(self.device, args, kwargs))
            elif func in _MATMULS:
                self._workspaces()
        return out

    def _gradient_sum(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> _Sum | None:
        """An ``add`` in backward that may be autograd summing two gradients of one tensor.

        On the GPU the engine adds the second gradient into the first where it holds the only reference
        to the first and to its storage; under a dispatch mode every tensor counts as a subclass, and the sum
        is a new tensor. :meth:`_settle` decides, once it is known whether the first operand's storage died
        with the sum. Not told apart: an ``add`` in a backward formula or a custom ``Function``'s backward
        whose first operand dies with it (rare: the trace then has one buffer fewer there).
        """
        if len(args) != 2 or kwargs.get("alpha", 1) != 1 or not all(isinstance(a, Tensor) for a in args):
            return None
        first, second = args
        if not isinstance(out, Tensor) or not first.shape == second.shape == out.shape:
            return None
        if first.dtype != out.dtype or first.stride() != out.stride() or first.storage_offset() != 0:
            return None
        storage, made = _storage(first), _storage(out)
        if storage is None or made is None or storage.nbytes() != made.nbytes():
            return None
        # a view shares its storage with its base (a transposed weight's gradient), and one gradient given to
        # both inputs of an op is both operands: the engine sums those out of place
        if first._is_view() or storage is _storage(second):
            return None
        block = self._state.get(id(storage), _UNTRACKED)
        last = self.events[-1] if self.events else None
        fresh = last is not None and last.action == "alloc" and self._state.get(id(made)) == last.block
        if block <= 0 or not fresh:
            return None
        return _Sum(len(self.events) - 1, id(made), id(storage), block)

    def _settle(self) -> None:
        """A gradient sum whose first operand died before anything else ran: the GPU's in-place sum.

        The sum's allocation and the operand's free leave the stream; the sum lives in the operand's block.
        """
        pending, self._sum = self._sum, None
        if pending is None or pending.first_key in self._state:
            return
        later = self.events[pending.at + 1 :]
        if any(event.action != "free" for event in later):
            return
        block = self.events[pending.at].block
        del self.events[pending.at :]
        for event in later:
            if event.block == pending.first_block:
                continue
            if event.block == block:
                event = dataclasses.replace(event, block=pending.first_block)
            self.events.append(event)
        if block in self._sizes:  # the sum is alive: in the operand's block
            self._sizes[pending.first_block] = self._sizes.pop(block)
            self._state[pending.out_key] = pending.first_block

    def _workspaces(self) -> None:
        """The first matrix multiply of the forward's thread, or of autograd's: its handle's workspaces."""
        backward = self.phase == "backward"
        if backward in self._handles:
            return
        self._handles.add(backward)
        assert self.device is not None
        for size in self.device.backward_workspaces if backward else self.device.forward_workspaces:
            self.events.append(Event("alloc", block=self._next_block, size=size))  # kept: never freed
            self._next_block += 1

    def _scratch(
        self, recipes: tuple[tuple[int, ...], ...], order: Iterable[str] | None = None, out: Any = None
    ) -> None:
        """A kernel's buffers: by default allocated in turn once its output is, freed in reverse at its end.

        An ``order`` says otherwise (``EMBEDDING_BACKWARD_ORDER``): ``"+k"`` allocates ``recipes[k]``,
        ``"-k"`` frees it, ``"out"`` is the kernel's output.

        A buffer the kernel does not need at this size is a request of 0 bytes (the allocator is not asked),
        so that the streams of all batch sizes hold the same events.
        """
        if order is None:
            order = [f"+{k}" for k in range(len(recipes))] + [f"-{k}" for k in reversed(range(len(recipes)))]
        made: dict[int, Event] = {}
        for step in order:
            if step == "out":
                self._see(out, host=False)
            elif step.startswith("+"):
                recipe = recipes[int(step)]
                made[int(step)] = event = Event(
                    "alloc", block=self._next_block, size=scratch_bytes(recipe), kernel=recipe
                )
                self.events.append(event)
                self._next_block += 1
            else:
                self.events.append(dataclasses.replace(made[-int(step)], action="free"))

    def follow(self, module: nn.Module) -> list[Any]:
        """Hooks that keep :attr:`modules` the path of the forward running (for ``cannot_trace``)."""
        handles = []
        for name, child in module.named_modules():
            label = f"`{name}` ({type(child).__name__})" if name else f"the module ({type(child).__name__})"
            handles.append(child.register_forward_pre_hook(partial(self._enter, label)))
            handles.append(child.register_forward_hook(self._leave, always_call=True))
        return handles

    def _enter(self, label: str, _module: nn.Module, _args: Any) -> None:
        self.modules.append(label)

    def _leave(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        self.modules.pop()

    def register(self, tensors: Iterable[Tensor], host: bool) -> None:
        """Count tensors that exist before the steps (parameters, buffers, optimizer state) as allocated."""
        for tensor in tensors:
            self._see(tensor, host=host)

    def mark(self, label: str) -> None:
        self._settle()
        self.phase = {"train": "the step function", "optimizer": "optimizer.step", "val": "validate"}[label]
        self.events.append(Event("mark", label=label))

    def close(self) -> list[Event]:
        """Stop recording (frees after the trace, of the copies, are not part of it); the events."""
        self._settle()
        self._closed = True
        return self.events

    def _where(self) -> str:
        return f"at {self.modules[-1]}" if self.modules else f"in {self.phase}"

    def _known(self, tensor: Tensor) -> int | None:
        """An input's state; a storage never seen (made outside the trace) is noted as untracked."""
        storage = _storage(tensor)
        if storage is None:
            return None
        state = self._state.get(id(storage))
        if state is None:
            state = self._track(storage, _UNTRACKED)
        return state

    def _see(self, tensor: Tensor, host: bool) -> None:
        storage = _storage(tensor)
        if storage is None:
            return
        if id(storage) in self._state:
            if host and self._state[id(storage)] == _UNTRACKED:
                self._state[id(storage)] = _HOST
            return
        size = storage.nbytes()
        if host or size == 0:
            self._track(storage, _HOST if host else _UNTRACKED)
            return
        block = self._track(storage, self._next_block)
        self._next_block += 1
        self._sizes[block] = size
        self.events.append(Event("alloc", block=block, size=size))

    def _track(self, storage: torch.UntypedStorage, state: int) -> int:
        key = id(storage)
        self._state[key] = state
        self._refs[key] = weakref.ref(storage, lambda _ref: self._died(key))
        return state

    def _died(self, key: int) -> None:
        self._refs.pop(key, None)
        block = self._state.pop(key, _UNTRACKED)
        if block > 0 and not self._closed:
            self.events.append(Event("free", block=block, size=self._sizes.pop(block)))


class _CudaPolicy(TorchFunctionMode):
    """What CUDA does that CPU does not, in a forward: autocast's lists, fused attention, dropout's mask.

    A GPU named in a call becomes the CPU, the trace's stand-in for it (a fake CUDA tensor would abort a
    CPU-only torch): ``x.cuda()`` and ``x.to("cuda")`` are then the no-ops they are on a tensor on the GPU.
    """

    def __init__(
        self,
        autocast_dtype: torch.dtype | None,
        device: Device | None = None,
        caching: bool = True,
        stand_in: str = "cpu",
    ) -> None:
        super().__init__()
        self.autocast_dtype = autocast_dtype
        self.stand_in = stand_in  # the device of the copies: "cpu" (fake tensors) or "meta"
        self.cudnn = device is not None and device.attention == "cudnn"  # else FlashAttention's memory
        self._casts: dict[int, tuple[Tensor, Tensor]] = {}  # autocast's cache: id(weight) -> weight, cast
        self.caching = caching  # off where autocast keeps no casts (cache_enabled=False, inference mode)
        self.kernels: set[str] = set()  # the fused attention kernels taken, by name
        self._forward_done = False  # a module's forward after the step's: checkpointing recomputes it
        self._reentered: list[bool] = []  # per module forward running: whether it entered the policy again

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        name = getattr(func, "__name__", "")
        to = self.stand_in
        args = tuple(_on_stand_in(arg, name == "to", to) for arg in args)
        kwargs = {key: _on_stand_in(value, key == "device", to) for key, value in (kwargs or {}).items()}
        if name == "cuda" and args and isinstance(args[0], Tensor):
            return args[0]
        if name in _COMPOSITES:
            return self._composite(func, args, kwargs)
        if self.autocast_dtype is not None and name in _AUTOCAST:
            args, kwargs = self._autocast(_AUTOCAST[name], args, kwargs)
        if name == "scaled_dot_product_attention":
            return _attention(func, args, kwargs, self.cudnn, self.kernels)
        if name == "dropout":
            return _dropout(func, args, kwargs)
        if name == "cross_entropy" and self.autocast_dtype is not None:
            return _cross_entropy(func, args, kwargs)
        return func(*args, **kwargs)

    def _composite(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run a Python function of ``torch.nn.functional`` with its calls of that module through the policy.

        A handler runs with the mode off, so the calls inside ``F.multi_head_attention_forward``
        (``linear``, ``scaled_dot_product_attention``, ``dropout``, ``softmax``) would take CPU's kernels:
        while it runs, those names in its module resolve to this policy's handling of them.
        """
        namespace = func.__globals__
        saved = {name: namespace[name] for name in _ROUTED if callable(namespace.get(name))}

        def route(original: Any) -> Any:
            return lambda *a, **k: self.__torch_function__(original, (), a, k)

        namespace.update({name: route(original) for name, original in saved.items()})
        try:
            return func(*args, **kwargs)
        finally:
            namespace.update(saved)

    def __enter__(self) -> _CudaPolicy:
        self._forward_done = False
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self._casts.clear()  # as autocast's cache is, on leaving its region
        super().__exit__(*exc)

    def forward_done(self) -> None:
        """The step's forward is over; a module's forward from now on is recomputed by checkpointing."""
        self._forward_done = True

    def follow(self, module: nn.Module) -> list[Any]:
        """Hooks that enter the policy again for a forward recomputed in backward (activation checkpointing).

        The autograd engine runs backward without its caller's function modes; checkpointing runs forwards
        again there, in autocast's state of the forward (with a cache of its own), and they must see what the
        forward saw (CUDA's dropout, attention and casts), or their tensors' metadata differ.
        """
        handles = []
        for child in module.modules():
            handles.append(child.register_forward_pre_hook(self._module_begins))
            handles.append(child.register_forward_hook(self._module_ends, always_call=True))
        return handles

    def _module_begins(self, _module: nn.Module, _args: Any) -> None:
        again = self._forward_done and not any(self._reentered)
        self._reentered.append(again)
        if again:
            super().__enter__()

    def _module_ends(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        if self._reentered.pop():
            self.__exit__(None, None, None)

    def _autocast(
        self, policy: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        floating = [tensor for tensor in tensors_in((args, kwargs)) if tensor.is_floating_point()]
        if not floating:
            return args, kwargs
        if policy == _FP32_DTYPE:
            has_dtype = "dtype" in kwargs or any(isinstance(arg, torch.dtype) for arg in args)
            if floating[0].dtype in _HALF and not has_dtype:
                kwargs = {**kwargs, "dtype": torch.float32}
            return args, kwargs
        if policy == _PROMOTE:
            target = floating[0].dtype
            for tensor in floating[1:]:
                target = torch.promote_types(target, tensor.dtype)
        else:
            target = self.autocast_dtype if policy == _LOWER else torch.float32  # type: ignore[assignment]

        def cast(value: Any) -> Any:
            if isinstance(value, (list, tuple)):
                return type(value)(cast(item) for item in value)
            if isinstance(value, Tensor) and _casts_to(value, policy, target):
                return self._cast(value, target)
            return value

        # last argument first, as CUDA's autocast evaluates its casts (C++ arguments, built with GCC)
        cast_kwargs = {key: cast(kwargs[key]) for key in reversed(kwargs)}
        cast_args = [cast(arg) for arg in reversed(args)][::-1]
        return tuple(cast_args), {key: cast_kwargs[key] for key in kwargs}

    def _cast(self, tensor: Tensor, dtype: torch.dtype) -> Tensor:
        """``tensor.to(dtype)``; a float32 weight's cast made once in the region, as autocast caches it."""
        cacheable = dtype == self.autocast_dtype and tensor.dtype == torch.float32
        if not (cacheable and self.caching and tensor.requires_grad and tensor.is_leaf):
            return tensor.to(dtype)
        cached = self._casts.get(id(tensor))
        if cached is None:
            cached = self._casts[id(tensor)] = (tensor, tensor.to(dtype))
        return cached[1]


def _cross_entropy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``F.cross_entropy`` under CUDA's autocast: not a listed op, it runs as its parts there.

    ``cross_entropy_loss`` calls ``log_softmax(input, dim, input.dtype)``: with its dtype given, autocast
    leaves it in half precision; then ``nll_loss`` (listed float32) casts those log-probabilities to float32.
    Class-index targets without label smoothing; otherwise the logits cast to float32.
    """
    bound = inspect.signature(F.cross_entropy).bind(*args, **kwargs)
    bound.apply_defaults()
    given = bound.arguments
    logits, target = given["input"], given["target"]
    if not isinstance(logits, Tensor) or logits.dtype not in _HALF:
        return func(*args, **kwargs)
    if target.is_floating_point() or given["label_smoothing"] != 0.0:
        given["input"] = logits.float()
        return func(*bound.args, **bound.kwargs)
    log_probs = F.log_softmax(logits, 0 if logits.dim() == 1 else 1, dtype=logits.dtype)
    weight = given["weight"]
    weight = weight.float() if isinstance(weight, Tensor) and weight.dtype in _HALF else weight
    return F.nll_loss(
        log_probs.float(),
        target,
        weight,
        given["size_average"],
        given["ignore_index"],
        given["reduce"],
        given["reduction"],
    )


def _casts_to(tensor: Tensor, policy: str, target: torch.dtype) -> bool:
    """Whether autocast casts an argument (floating; not float64, except to promote; to float32 if half)."""
    if not tensor.is_floating_point() or tensor.dtype == target:
        return False
    if policy == _FP32:
        return tensor.dtype in _HALF
    return policy == _PROMOTE or tensor.dtype != torch.float64


def _on_stand_in(value: Any, names_device: bool, stand_in: str = "cpu") -> Any:
    """A GPU device named in a call, as ``stand_in``; a string only where it names a device.

    On meta tensors the CPU is a GPU too: ``x.cpu()`` there would copy out of a meta tensor.
    """
    kept = ("cpu", "meta") if stand_in == "cpu" else ("meta",)
    if isinstance(value, torch.device) and value.type not in kept:
        return torch.device(stand_in)
    if names_device and isinstance(value, str) and value.split(":")[0] not in kept:
        try:
            torch.device(value)
        except RuntimeError:
            return value
        return stand_in
    return value


def _attention(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    cudnn: bool = False,
    taken: set[str] | None = None,
) -> Any:
    """``F.scaled_dot_product_attention`` with the memory of the fused kernel CUDA would pick.

    Half precision without a mask: cuDNN's attention (``cudnn``) or FlashAttention; otherwise the
    memory-efficient kernel. The kernel's name goes into ``taken``.
    """
    query, key, value = (
        args[i] if len(args) > i else kwargs[name] for i, name in enumerate(("query", "key", "value"))
    )
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    shapes_fit = query.dim() == key.dim() == value.dim() == 4
    if not shapes_fit or query.dtype == torch.float64 or (isinstance(mask, Tensor) and mask.requires_grad):
        return func(*args, **kwargs)
    head_dim = query.shape[-1]
    flash = (
        query.dtype in _HALF
        and mask is None
        and head_dim <= 256
        and head_dim % 8 == 0
        and value.shape[-1] == head_dim
    )
    if isinstance(mask, Tensor):  # a boolean mask becomes a bias; its rows are padded to 16 elements
        bias = mask if mask.is_floating_point() else torch.empty_like(mask, dtype=query.dtype)
        if bias.shape[-1] % 16:
            padded = bias.new_empty((*bias.shape[:-1], _round_up(bias.shape[-1], 16)))
            bias = padded[..., : bias.shape[-1]]
        mask = bias
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    kernel = ("cudnn" if cudnn else "flash") if flash else "efficient"
    if taken is not None:
        taken.add(f"scaled_dot_product_attention ({kernel})")
    return _FusedAttention.apply(query, key, value, mask, kernel, needs_grad)


class _FusedAttention(torch.autograd.Function):
    """The buffers of cuDNN's, FlashAttention's or the memory-efficient attention on CUDA; no values.

    cuDNN's (on the H100, torch 2.11, as its allocator history shows): the RNG seed and offset (8 bytes
    each), the output, its float32 statistics; in the backward one workspace of FlashAttention's two buffers'
    bytes.
    """

    @staticmethod
    def forward(
        ctx: Any,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        bias: Tensor | None,
        kernel: str,
        needs_grad: bool,
    ) -> Tensor:
        batch, heads, length, _ = query.shape
        rng = [query.new_empty((), dtype=torch.int64) for _ in range(2)] if kernel == "cudnn" else []
        # the kernels write (batch, length, heads, dim) and return it transposed
        out = query.new_empty((batch, length, heads, value.shape[-1])).transpose(1, 2)
        logsumexp = None
        if kernel == "flash" or needs_grad:  # cuDNN's and the efficient kernel's only for a backward
            rows = length if kernel != "efficient" else _round_up(length, 32)
            logsumexp = query.new_empty((batch, heads, rows), dtype=torch.float32)
        ctx.kernel = kernel
        ctx.save_for_backward(query, key, value, bias, out, logsumexp, *rng)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        query, key, value = ctx.saved_tensors[:3]
        if ctx.kernel == "efficient":
            grads = [_like_transposed(tensor) for tensor in (query, key, value)]
        else:  # flash_api.cpp's mha_bwd: softmax_d, dq_accum (GQA: dk, dv expanded)
            # each gradient empty_like its input (a contiguous key's is then copied by a view's backward)
            grads = [torch.empty_like(tensor) for tensor in (query, key, value)]
            batch, heads, length, dim = query.shape
            rows = _round_up(length, 128)
            softmax_d = (batch, heads, rows)
            accum = (batch, rows, heads, _round_up(dim, 32 if dim <= 128 else 64))
            if ctx.kernel == "cudnn":  # one workspace of both
                size = 4 * (math.prod(softmax_d) + math.prod(accum)) + _CUDNN_EXTRA
                workspace = query.new_empty(size, dtype=torch.uint8)
                del workspace
            else:
                buffers = [query.new_empty(shape, dtype=torch.float32) for shape in (softmax_d, accum)]
                del buffers
            expanded = []
            if key.shape[1] != heads:
                expanded = [query.new_empty((batch, key.shape[2], heads, dim)) for _ in range(2)]
            del expanded
        return (*grads, None, None, None)


def _dropout(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Dropout as CUDA runs it: ``native_dropout``, whose mask is one byte an element."""
    names = ("input", "p", "training", "inplace")  # F.dropout's; torch.dropout's are (input, p, train)
    bound = {**dict(zip(names, args, strict=False)), **kwargs}
    training = bound.get("training", bound.get("train", True))
    p = bound.get("p", 0.5)
    tensor = bound.get("input")
    if bound.get("inplace", False) or not training or not 0 < p < 1 or not isinstance(tensor, Tensor):
        return func(*args, **kwargs)
    return _Dropout.apply(tensor, p)


class _Dropout(torch.autograd.Function):
    """CUDA's ``native_dropout``: its mask (one byte an element) made before its output; no values."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, p: float) -> Tensor:
        mask = torch.empty_like(tensor, dtype=torch.bool)
        out = torch.empty_like(tensor)
        ctx.save_for_backward(mask)
        ctx.scale = 1 / (1 - p)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (mask,) = ctx.saved_tensors
        return torch.ops.aten.native_dropout_backward(grad, mask, ctx.scale), None


def _reduction_scratch(
    device: Device, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[int, ...], ...]:
    """The recipes of ``sum``/``mean``'s staging buffer and semaphores over ``dim`` (all where none)."""
    tensor = args[0]
    if not isinstance(tensor, Tensor) or tensor.dim() == 0:
        return ()
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    rank = tensor.dim()
    if dims is None or (not isinstance(dims, int) and len(dims) == 0):
        reduced = tuple(range(rank))
    else:
        reduced = tuple(sorted({d % rank for d in ([dims] if isinstance(dims, int) else dims)}))
    out_dtype = kwargs.get("dtype") or tensor.dtype
    wide = torch.float64 in (tensor.dtype, out_dtype) or not out_dtype.is_floating_point
    return reduce_recipes(tuple(tensor.shape), tensor.stride(), reduced, 8 if wide else 4, device)


def _embedding_recipes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
    """The buffers of ``embedding_dense_backward(grad, indices, num_weights, ...)``."""
    grad, indices, embeddings = args[0], args[1], args[2]
    sum_bytes = 4 if grad.dtype in _HALF else grad.element_size()
    return embedding_recipes(
        indices.numel(), embeddings, grad.shape[-1], indices.element_size(), sum_bytes,
        not indices.is_contiguous(),
    )  # fmt: skip


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _like_transposed(tensor: Tensor) -> Tensor:
    """A (batch, heads, length, dim) tensor laid out (batch, length, heads, dim), as the kernels make it."""
    batch, heads, length, dim = tensor.shape
    return tensor.new_empty((batch, length, heads, dim)).transpose(1, 2)


def _fake_module(module: nn.Module, mode: Any, stand_in: str = "cpu") -> tuple[nn.Module, dict[int, Tensor]]:
    """A copy of ``module`` on fake CPU (or meta) tensors; the copies by id of the parameters and buffers.

    Its attributes and their containers' items (hooks' dictionaries) are copied if tensors (as fakes, not
    counted: an attribute is not moved to the device), modules or containers, and shared otherwise (a config,
    a trainer, a hook): a deep copy would reach far.
    """
    fakes: dict[int, Tensor] = {}
    memo: dict[int, Any] = {}
    containers = (nn.Module, dict, list, tuple, set)
    with mode:
        for tensor in (*module.parameters(), *module.buffers()):
            fakes[id(tensor)] = memo[id(tensor)] = _fake_like(tensor, stand_in)
        for child in module.modules():
            for value in vars(child).values():
                items = value.values() if isinstance(value, dict) else value
                for item in items if isinstance(value, (dict, list, tuple, set)) else [value]:
                    if isinstance(item, Tensor) and id(item) not in memo:
                        memo[id(item)] = _fake_like(item, stand_in)
                    elif not isinstance(item, (Tensor, *containers)):
                        memo[id(item)] = item
    return copy.deepcopy(module, memo), fakes  # outside the mode: a real tensor further down is copied as is


def _fake_optimizer(
    make: MakeOptimizer | Optimizer,
    module: nn.Module,
    fakes: dict[int, Tensor],
    mode: Any,
    stand_in: str = "cpu",
) -> Optimizer:
    """The optimizer of the fake module, its ``foreach`` left to torch set as CUDA would."""
    if isinstance(make, Optimizer):
        # 0-d state (the step counters) is read: the optimizer computes with its value
        numbers = {
            id(value): value.item()
            for values in make.state.values()
            for value in values.values()
            if isinstance(value, Tensor) and value.dim() == 0 and value.device.type != "meta"
        }
        with mode:
            for param in (p for group in make.param_groups for p in group["params"] if id(p) not in fakes):
                fakes[id(param)] = _fake_like(param, stand_in)  # a parameter outside the module
            groups = [
                {**group, "params": [fakes[id(p)] for p in group["params"]]} for group in make.param_groups
            ]
            state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
            for group, fake_group in zip(make.param_groups, groups, strict=True):
                for param, fake in zip(group["params"], fake_group["params"], strict=True):
                    if param in make.state:
                        items = make.state[param].items()
                        state[fake] = {k: _fake_state(v, numbers, stand_in) for k, v in items}
        optimizer = type(make).__new__(type(make))
        optimizer.__setstate__({"defaults": dict(make.defaults), "state": state, "param_groups": groups})
    else:
        with mode:
            optimizer = make(module.parameters())
    for group in optimizer.param_groups:
        if (
            "foreach" in group
            and group["foreach"] is None
            and not group.get("fused")
            and not group.get("differentiable")
        ):
            group["foreach"] = True
    return optimizer


def _fake_state(value: Any, numbers: dict[int, Any], stand_in: str = "cpu") -> Any:
    if not isinstance(value, Tensor):
        return copy.deepcopy(value)
    if id(value) in numbers:
        return torch.tensor(numbers[id(value)], dtype=value.dtype)  # made from data: a host constant
    return _fake_like(value, stand_in)


def _fake_like(tensor: Tensor, stand_in: str = "cpu") -> Tensor:
    fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=stand_in)
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(fake, requires_grad=tensor.requires_grad)
    return fake.requires_grad_(tensor.requires_grad)


def _fake_data(data: Any, stand_in: str = "cpu") -> Any:
    return _map_tensors(data, partial(_fake_like, stand_in=stand_in))


def _copy_tensors(data: Any) -> Any:
    """The batch as the step gets it: a copy on the device, allocated when the step starts."""
    return _map_tensors(data, lambda tensor: tensor.clone())


def _map_tensors(data: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(data, Tensor):
        return fn(data)
    if isinstance(data, Mapping):
        return type(data)({key: _map_tensors(value, fn) for key, value in data.items()})  # type: ignore[call-arg]
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_map_tensors(value, fn) for value in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_map_tensors(value, fn) for value in data)
    if dataclasses.is_dataclass(data) and not isinstance(data, type):  # a batch as a dataclass instance
        fields = [f.name for f in dataclasses.fields(data) if f.init]
        changes = {name: _map_tensors(getattr(data, name), fn) for name in fields}
        return dataclasses.replace(data, **changes)
    return data


def _optimizer_state(optimizer: Optimizer) -> Iterator[Tensor]:
    for group in optimizer.param_groups:
        for param in group["params"]:
            for value in optimizer.state.get(param, {}).values():
                if isinstance(value, Tensor):
                    yield value


def _loss(output: Any) -> Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor):
        raise TypeError(
            f"`trace_training(step=...)` returned {type(output).__name__}. Expected the loss: a tensor, or "
            "a mapping with one under 'loss'."
        )
    return loss


def _storage(tensor: Tensor) -> torch.UntypedStorage | None:
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested: no one storage
        return None


def _op_names(ops: Iterable[Any], policy: _CudaPolicy | None) -> frozenset[str]:
    """The ops' names, and the fused attention kernels the policy took."""
    return frozenset(_op_name(op) for op in ops) | (policy.kernels if policy is not None else frozenset())


def _op_name(func: Any) -> str:
    return str(func).removesuffix(".default")


def _check_callables(make_optimizer: object, step: object, validate: object) -> None:
    if not (isinstance(make_optimizer, Optimizer) or callable(make_optimizer)):
        raise TypeError(
            f"`trace_training(make_optimizer={make_optimizer!r})` is not valid. Expected an optimizer or a "
            "callable that builds one from parameters."
        )
    if not callable(step):
        raise TypeError(
            f"`trace_training(step={step!r})` is not valid. Expected a callable (module, batch)."
        )
    if validate is not None and not callable(validate):
        raise TypeError(
            f"`trace_training(validate={validate!r})` is not valid. Expected a callable (module, batch) or "
            "None."
        )
