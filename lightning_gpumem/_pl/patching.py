"""The one way to replace a foreign object's attribute for a while; the arguments of ``LightningModule.log``.

Where Lightning has no hook (``AutoMicrobatch`` wraps the module's ``training_step``, ``log`` and
``backward`` and the optimization loop's ``run``; the tuner's trials silence the module's hooks and ``log``),
the attribute is replaced on the instance, by :func:`patched` (a ``with`` block) or :class:`Patches` (patches
that span hooks). Both keep what they replaced in this module, never on the patched object: undoing restores
the instance's own ``__dict__`` entry, or its absence, so the class attribute shows through again. A wrapper
is registered here with what it replaced: installing over a wrapper left by an earlier patch that was never
undone (a crash before its clean-up ran) replaces that one and keeps its original, so wrappers never call
each other in a loop.

``LightningModule.log`` is called with its arguments bound through its signature (:func:`log_arguments`,
:func:`with_log_argument`), not through a copy of its parameter order.
"""

from __future__ import annotations

import functools
import inspect
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_MISSING = object()
# wrapper installed by this module: (what the instance had of its own before it, the callable it wraps)
_WRAPPED: weakref.WeakKeyDictionary[Callable[..., Any], tuple[object, Callable[..., Any]]] = (
    weakref.WeakKeyDictionary()
)


def _install(
    owner: object, name: str, replacement: Callable[..., Any], keep_signature: bool, collapse: bool = True
) -> tuple[object, Callable[..., Any]]:
    """Make ``owner.<name>`` call ``replacement``.

    Returns:
        ``(the instance's own entry before, the original callable)``.
    """
    own = vars(owner).get(name, _MISSING)
    leftover = _WRAPPED.get(own) if collapse and isinstance(own, types.FunctionType) else None
    previous, original = leftover if leftover is not None else (own, getattr(owner, name))

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return replacement(*args, **kwargs)

    if keep_signature:  # Lightning reads a `training_step`'s parameters to decide what to pass
        wrapper = functools.wraps(original)(wrapper)
    _WRAPPED[wrapper] = (previous, original)
    setattr(owner, name, wrapper)
    return previous, original


def _restore(owner: object, name: str, previous: object) -> None:
    if previous is _MISSING:
        vars(owner).pop(name, None)
    else:
        setattr(owner, name, previous)


@contextmanager
def patched(
    owner: object, name: str, replacement: Callable[..., Any], keep_signature: bool = False
) -> Iterator[Callable[..., Any]]:
    """Within the block, ``owner.<name>`` calls ``replacement``; yields what it replaced, restored after.

    ``keep_signature`` shows the original's name and signature on the wrapper.
    """
    previous, original = _install(owner, name, replacement, keep_signature)
    try:
        yield original
    finally:
        _restore(owner, name, previous)


class Patches:
    """The patches one owner installed across hooks; ``undo`` removes them all, in reverse order."""

    def __init__(self, collapse_leftovers: bool = True) -> None:
        """``collapse_leftovers=False`` keeps a wrapper found in place (another owner's live patch) as is."""
        self._collapse = collapse_leftovers
        self._saved: dict[tuple[int, str], tuple[object, object, Callable[..., Any]]] = {}

    def __bool__(self) -> bool:
        return bool(self._saved)

    def install(
        self, owner: object, name: str, replacement: Callable[..., Any], keep_signature: bool = False
    ) -> None:
        """Make ``owner.<name>`` call ``replacement``, as :func:`patched` does.

        A second install of a name is ignored.
        """
        key = (id(owner), name)
        if key not in self._saved:
            previous, original = _install(owner, name, replacement, keep_signature, self._collapse)
            self._saved[key] = (owner, previous, original)

    def original(self, owner: object, name: str) -> Callable[..., Any]:
        """What ``owner.<name>`` was before :meth:`install`."""
        return self._saved[(id(owner), name)][2]

    def undo(self) -> None:
        """Put back every patched attribute as it was (removed where the instance had none of its own)."""
        for (_, name), (owner, previous, _) in reversed(list(self._saved.items())):
            _restore(owner, name, previous)
        self._saved.clear()


@functools.lru_cache(maxsize=1)
def _log_signature() -> inspect.Signature:
    """``LightningModule.log``'s own signature, less ``self`` (an override may take ``*args, **kwargs``)."""
    try:
        from lightning.pytorch import LightningModule
    except ImportError:  # pragma: no cover - only the `pytorch_lightning` package
        from pytorch_lightning import LightningModule  # type: ignore[assignment]
    signature = inspect.signature(LightningModule.log)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def log_parameters() -> list[str]:
    """The parameter names of ``LightningModule.log``, in order, less ``self``."""
    return list(_log_signature().parameters)


def log_arguments(log: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call ``log(*args, **kwargs)`` as keyword arguments, bound by ``LightningModule.log``'s signature.

    Raises:
        TypeError: if the arguments do not bind (the call itself would fail the same way).
    """
    signature = _log_signature()
    bound = signature.bind(*args, **kwargs)
    arguments: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise TypeError(f"{name}: positional arguments beyond {log!r}'s parameters")
        else:
            arguments[name] = value
    return arguments


def with_log_argument(
    log: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], name: str, value: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of the call ``log(*args, **kwargs)`` with its argument ``name`` set to ``value``.

    A call that does not bind to ``LightningModule.log``'s signature gets ``name`` as a keyword where no
    positional argument stands in its place, else in that position.
    """
    try:
        return (), {**log_arguments(log, args, kwargs), name: value}
    except TypeError:
        position = list(_log_signature().parameters).index(name)
        if len(args) > position:
            return (*args[:position], value, *args[position + 1 :]), kwargs
        return args, {**kwargs, name: value}
