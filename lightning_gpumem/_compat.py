"""Both Lightning namespaces: ``lightning.pytorch`` (the ``lightning`` package) and ``pytorch_lightning``.

Each Trainer accepts only callbacks that are instances of its own namespace's ``Callback``, and its loggers and
strategies are its own namespace's classes. So the callbacks here derive from both ``Callback`` classes (both are
plain classes of no-op hooks), and type checks on Lightning objects accept either namespace's class
(:func:`either`). Where ``pytorch_lightning`` is not installed, only ``lightning.pytorch`` is used.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import TYPE_CHECKING

from lightning.pytorch.callbacks.callback import Callback as _Callback

if TYPE_CHECKING:
    Callback = _Callback
else:
    try:
        from pytorch_lightning.callbacks.callback import Callback as _OldCallback
    except ImportError:  # only the `lightning` package
        Callback = _Callback
    else:

        class Callback(_Callback, _OldCallback):
            """A callback that ``lightning.pytorch`` and ``pytorch_lightning`` Trainers both accept."""


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
