"""Ops on meta tensors answered from memory: the output's shape, strides and dtype, once per signature.

Why: most of torch's meta kernels are Python (``torch._refs``, ``torch._meta_registrations``): a
``layer_norm`` takes about 1.5 ms, an ``addmm`` 0.5 ms, a ``mul`` 0.2 ms, where an empty meta tensor takes
0.03 ms. A training step repeats each signature many times (every layer, every step), so the trace on meta
tensors (``trace.py``) asks the kernel once and makes the same empty outputs after that.

A kernel on meta tensors sees metadata only: the same op with inputs of the same shapes, strides, dtypes,
offsets and conjugate/negative bits, the same other arguments and the same default dtype, gives outputs of
the same metadata (or raises the same error, never remembered). Remembered only where that can be redone by
hand: a builtin op, every tensor argument a strided meta tensor, outputs new strided tensors of their own (no
view, nothing in place; or nothing at all, for the optimizers' ``_foreach_*_``/``_fused_*_`` updates), no
``out=``, and no op whose output shape depends on values or that changes its input's metadata. torch's fake
tensors keep such a cache (``FakeTensorMode``'s dispatch cache) under the same rules.

The optimizers' updates are not asked at all: on meta tensors they do nothing a trace sees (no output; an
in-place elementwise op keeps its tensors' shapes; the version counters are bumped above this dispatch), and
their meta kernels loop over every parameter in Python (AdamW's first step: 12-28% of the trace of three
transformers on 2 cores, ``benchmarks/memo_updates.py``). What is lost is their check of the arguments: a
step whose update would raise on the GPU (a dtype it cannot cast to) traces as if it ran.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

_NOT_REMEMBERED = (
    torch.Tag.data_dependent_output,
    torch.Tag.dynamic_output_shape,
    torch.Tag.inplace_view,
)
_SCALARS = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)
# torch's names of the optimizers' in-place updates, which return nothing (their leading underscore left
# off): renamed, they are asked each time (slower, the same trace)
_UPDATES = ("foreach_", "fused_")
_PLAIN = (Tensor, torch.nn.Parameter)  # not a subclass whose ops may do more
_BYPASS = object()  # a signature whose outputs cannot be redone by hand
_VOID = ("void",)  # the recipe of an op that returns nothing


class _Unkeyable(Exception):
    """An argument the key cannot hold (a tensor off the meta device, an object)."""


class MetaMemo:
    """``memo(func, args, kwargs)``: ``func(*args, **kwargs)``, or the same outputs made from memory.

    Example:
        >>> memo = MetaMemo()
        >>> x = torch.empty(4, 8, device="meta")
        >>> a, b = memo(torch.ops.aten.mul.Tensor, (x, x), {}), memo(torch.ops.aten.mul.Tensor, (x, x), {})
        >>> a.shape == b.shape, a.untyped_storage() is b.untyped_storage(), memo.hits
        (True, False, 1)
    """

    def __init__(self) -> None:
        self._known: dict[tuple[Any, ...], Any] = {}
        self._ops: dict[Any, bool] = {}  # op -> whether it may be remembered at all
        self._update: dict[Any, bool] = {}  # op -> whether it is an optimizer's in-place update
        self.hits = 0

    def __call__(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._may_remember(func) or "out" in kwargs:
            return func(*args, **kwargs)
        update = self._updates(func)
        try:  # the default dtype: a factory's, an int tensor's true division or sigmoid
            key = (func, torch.get_default_dtype(), _key(args, not update), _key(kwargs, not update))
        except _Unkeyable:
            return func(*args, **kwargs)
        known = self._known.get(key)
        if known is not None and known is not _BYPASS:
            self.hits += 1
            return _remake(known)
        if update:  # it returns nothing and leaves its tensors' metadata as it was: no kernel to ask
            self._known[key] = _VOID
            return None
        out = func(*args, **kwargs)
        if known is None:
            try:
                self._known[key] = _recipe(out, args, kwargs)
            except Exception:  # outputs it cannot read (a sparse tensor's storage): asked each time
                self._known[key] = _BYPASS
        return out

    def _may_remember(self, func: Any) -> bool:
        allowed = self._ops.get(func)
        if allowed is None:
            tags = getattr(func, "tags", None)  # an OpOverload's; a higher-order op has none to go by
            allowed = self._ops[func] = (
                getattr(func, "namespace", None) == "aten"
                and tags is not None
                and not any(tag in tags for tag in _NOT_REMEMBERED)
            )
        return allowed

    def _updates(self, func: Any) -> bool:
        """An optimizer's in-place update (``_foreach_add_``, ``_fused_adamw_``): it returns nothing."""
        update = self._update.get(func)
        if update is None:
            name = func.name().split("::")[-1].split(".")[0]
            update = name.lstrip("_").startswith(_UPDATES) and name.endswith("_")
            self._update[func] = update
        return update


def _key(value: Any, values: bool = True) -> Any:
    """A hashable key of an argument's metadata; raises :class:`_Unkeyable` where it cannot have one.

    ``values=False``: floats by their type alone (an optimizer's update: its step sizes change each step).
    """
    if isinstance(value, Tensor):
        if value.device.type != "meta" or value.layout != torch.strided or type(value) not in _PLAIN:
            raise _Unkeyable
        shape, stride = tuple(value.shape), value.stride()
        return (Tensor, shape, stride, value.dtype, value.storage_offset(), value.is_conj(), value.is_neg())
    if isinstance(value, float) and not values:
        return float
    if value is None or isinstance(value, _SCALARS):
        return (type(value), value)  # 1, 1.0 and True apart
    if isinstance(value, (list, tuple)):
        return (list, tuple(_key(item, values) for item in value))
    if isinstance(value, dict):
        return (dict, tuple((name, _key(item, values)) for name, item in value.items()))
    raise _Unkeyable


def _recipe(out: Any, args: Any, kwargs: Any) -> Any:
    """What :func:`_remake` needs to make outputs like ``out``; :data:`_BYPASS` where it cannot."""
    if out is None or type(out) not in (list, tuple, Tensor) or (not isinstance(out, Tensor) and not out):
        return _BYPASS
    outputs = out if isinstance(out, (list, tuple)) else [out]
    inputs = {id(t.untyped_storage()) for t in tensors_in((args, kwargs))}
    made: list[Any] = []
    for tensor in outputs:
        if tensor is None:
            made.append(None)
            continue
        if (
            type(tensor) is not Tensor
            or tensor.device.type != "meta"
            or tensor.layout != torch.strided
            or tensor.is_conj()
            or tensor.is_neg()
        ):
            return _BYPASS
        storage = tensor.untyped_storage()
        shape, stride = tuple(tensor.shape), tensor.stride()
        fresh = torch.empty_strided(shape, stride, dtype=tensor.dtype, device="meta")
        if (
            id(storage) in inputs
            or tensor.storage_offset() != 0
            or storage.nbytes() != fresh.untyped_storage().nbytes()
        ):
            return _BYPASS
        inputs.add(id(storage))  # two outputs of one storage: the second is not fresh
        made.append((shape, stride, tensor.dtype))
    return (type(out), made) if isinstance(out, (list, tuple)) else ("one", made)


def _remake(recipe: Any) -> Any:
    kind = recipe[0]
    if kind == "void":
        return None
    made = [
        None if spec is None else torch.empty_strided(spec[0], spec[1], dtype=spec[2], device="meta")
        for spec in recipe[1]
    ]
    return made[0] if kind == "one" else kind(made)


def tensors_in(value: Any) -> Iterator[Tensor]:
    """The tensors in an op's arguments or outputs (tensors, lists and tuples of them, kwargs)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
