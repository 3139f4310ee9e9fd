"""Both Lightning namespaces: ``lightning.pytorch`` (the ``lightning`` package) and ``pytorch_lightning``.

Each Trainer accepts only callbacks that are instances of its own namespace's ``Callback``, and its loggers
and strategies are its own namespace's classes. So the callbacks here derive from both ``Callback`` classes
(both are plain classes of no-op hooks), and type checks on Lightning objects accept either namespace's class
(:func:`either`). Where ``pytorch_lightning`` is not installed, only ``lightning.pytorch`` is used.
"""

from __future__ import annotations

import functools
import importlib
import warnings
import weakref
from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING

from lightning.pytorch.callbacks.callback import Callback as _Callback

if TYPE_CHECKING:
    Callback = _Callback
else:
    try:
        from pytorch_lightning.callbacks.callback import Callback as _OldCallback
    except ImportError:  # only the `lightning` package
        _bases: tuple[type, ...] = (_Callback,)
    else:
        _bases = (_Callback, _OldCallback)

    class Callback(*_bases):
        """A callback that ``lightning.pytorch`` and ``pytorch_lightning`` Trainers both accept.

        Each subclass's ``on_exception`` is wrapped so that it never raises: Lightning calls the callbacks'
        ``on_exception`` one after another and then re-raises the user's error, so an error from one of them
        would replace the user's error and keep the callbacks after it (``OnExceptionCheckpoint``, another
        callback's clean-up) from running. What it raises is reported in one warning instead.
        """

        def __init_subclass__(cls, **kwargs: object) -> None:
            super().__init_subclass__(**kwargs)
            hook = cls.__dict__.get("on_exception")
            if callable(hook) and hook not in _NEVER_RAISE:
                cls.on_exception = never_raises(hook)


_NEVER_RAISE: weakref.WeakSet[Callable[..., None]] = weakref.WeakSet()  # hooks wrapped already: not twice


def never_raises(hook: Callable[..., None]) -> Callable[..., None]:
    """``hook(self, trainer, pl_module, exception)`` that warns of its own error instead of raising it."""

    @functools.wraps(hook)
    def on_exception(self: object, trainer: object, pl_module: object, exception: BaseException) -> None:
        try:
            hook(self, trainer, pl_module, exception)
        except Exception as error:  # the user's `exception` must stay the one they see
            warnings.warn(  # on every rank: each rank's own failure
                f"{type(self).__name__}.on_exception failed ({error!r}) while handling"
                f" {type(exception).__name__}; the original error is raised unchanged.",
                stacklevel=2,
            )

    _NEVER_RAISE.add(on_exception)
    return on_exception


@cache
def either(module: str, name: str) -> tuple[type, ...]:
    """``lightning.pytorch.<module>.<name>`` and ``pytorch_lightning.<module>.<name>``, those that exist."""
    found = []
    for package in ("lightning.pytorch", "pytorch_lightning"):
        try:
            found.append(getattr(importlib.import_module(f"{package}.{module}"), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)
