"""Argument checks shared by the callbacks: messages name the class, the argument, the value and what was expected."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable, Mapping, Sized
from typing import TypeGuard

from lightning_gpumem._core.units import MAX_BYTES


def require_flags(owner: str, **flags: object) -> None:
    """Raise ``TypeError`` for the first flag that is not a ``bool``.

    >>> require_flags("X", verbose=True)
    >>> require_flags("X", verbose="yes")
    Traceback (most recent call last):
    TypeError: `X(verbose='yes')` is not valid. Expected True or False.
    """
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"`{owner}({name}={value!r})` is not valid. Expected True or False.")


def is_int_at_least(value: object, minimum: int) -> bool:
    """Whether ``value`` is an ``int`` (not a ``bool``) of at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def require_int(owner: str, name: str, value: object, minimum: int) -> None:
    """Raise ``ValueError`` unless ``value`` is an integer >= ``minimum``.

    >>> require_int("X", "steps", 3, 1)
    >>> require_int("X", "steps", 0, 1)
    Traceback (most recent call last):
    ValueError: `X(steps=0)` is not valid. Expected an integer >= 1.
    """
    if not is_int_at_least(value, minimum):
        raise ValueError(f"`{owner}({name}={value!r})` is not valid. Expected an integer >= {minimum}.")


def require_fraction(owner: str, name: str, value: object, none_ok: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a number in [0, 1) (or, with ``none_ok``, ``None``).

    >>> require_fraction("X", "margin", 0.2)
    >>> require_fraction("X", "margin", None, none_ok=True)
    >>> require_fraction("X", "margin", 1.0, none_ok=True)
    Traceback (most recent call last):
    ValueError: `X(margin=1.0)` is not valid. Expected None or a number in [0, 1).
    """
    if none_ok and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:  # NaN fails too
        expected = "None or a number in [0, 1)" if none_ok else "a number in [0, 1)"
        raise ValueError(f"`{owner}({name}={value!r})` is not valid. Expected {expected}.")


def require_length_fn(owner: str, value: object) -> None:
    """Raise ``TypeError`` unless ``value`` is ``None``, a function or a non-empty key (a sample's length field).

    >>> require_length_fn("X", "input_ids")
    >>> require_length_fn("X", 5)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    TypeError: `X(length_fn=5)` is not valid. Expected None, a function of a sample returning its length, ...
    """
    if not (value is None or callable(value) or (isinstance(value, str) and value)):
        raise TypeError(
            f"`{owner}(length_fn={value!r})` is not valid. Expected None, a function of a sample"
            " returning its length, or the key of a sample's length field (a non-empty string)."
        )


def require_dirpath(owner: str, value: object) -> None:
    """Raise ``TypeError`` unless ``value`` is ``None``, a non-empty ``str`` or an ``os.PathLike``.

    >>> require_dirpath("X", "logs")
    >>> require_dirpath("X", 5)
    Traceback (most recent call last):
    TypeError: `X(dirpath=5)` is not valid. Expected None or a directory path (str or os.PathLike).
    """
    if value is None or (isinstance(value, str) and value) or isinstance(value, os.PathLike):
        return
    raise TypeError(
        f"`{owner}(dirpath={value!r})` is not valid. Expected None or a directory path (str or os.PathLike)."
    )


def require_number(owner: str, name: str, value: object, minimum: float, unit: str, above: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite number >= ``minimum`` (> with ``above``), in ``unit``.

    >>> require_number("X", "every_s", 0.5, 0, "seconds")
    >>> require_number("X", "mib", 0, 0, "MiB", above=True)
    Traceback (most recent call last):
    ValueError: `X(mib=0)` is not valid. Expected a finite number of MiB > 0.
    """
    if not is_finite_number(value) or (value <= minimum if above else value < minimum):  # type: ignore[operator]
        sign = ">" if above else ">="
        raise ValueError(
            f"`{owner}({name}={value!r})` is not valid. Expected a finite number of {unit} {sign} {minimum:g}."
        )


def is_finite_number(value: object) -> bool:
    """Whether ``value`` is an ``int`` or ``float`` (not a ``bool``) that a float can hold and that is finite.

    >>> is_finite_number(2.5), is_finite_number(float("nan")), is_finite_number(10**400), is_finite_number(True)
    (True, False, False, False)
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond the range of a float
        return False


def require_size(owner: str, name: str, value: object, unit_bytes: int, unit: str) -> None:
    """Raise ``ValueError`` unless ``value``, a size in ``unit`` (``unit_bytes`` bytes), is 1 byte to 2**64 bytes.

    A size that rounds to 0 bytes means nothing, and one beyond 2**64 bytes (16 EiB) is larger than any device.

    >>> require_size("X", "mib", 32.0, 2**20, "MiB")
    >>> require_size("X", "mib", 1e-300, 2**20, "MiB")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: `X(mib=1e-300)` is not valid. Expected a finite number of MiB from 9.54e-07 (1 byte) to ...
    """
    if not is_finite_number(value) or not 1 <= value * unit_bytes <= MAX_BYTES:  # type: ignore[operator]
        raise ValueError(
            f"`{owner}({name}={value!r})` is not valid. Expected a finite number of {unit} from {1 / unit_bytes:.3g}"
            f" (1 byte) to {MAX_BYTES / unit_bytes:.3g} (2**64 bytes)."
        )


def is_collection(value: object) -> TypeGuard[Iterable[object]]:
    """Whether ``value`` is a finite collection: sized and iterable, and not a ``str``, ``bytes`` or mapping.

    Any such collection counts (list, tuple, set, ``range``, a numpy array, an OmegaConf ``ListConfig``); an iterator
    without a length (``itertools.count()``, a generator) does not, as it may never end.

    >>> is_collection(("a", "b")), is_collection(range(10**12)), is_collection("ab"), is_collection(iter("ab"))
    (True, True, False, False)
    """
    if not isinstance(value, Sized) or not isinstance(value, Iterable) or isinstance(value, (str, bytes, Mapping)):
        return False
    try:
        len(value)
    except TypeError:  # a 0-d numpy array says it is sized, and has no length
        return False
    return True


def require_trainer(owner: str, trainer: object) -> None:
    """Raise ``TypeError`` unless ``trainer`` is a Lightning ``Trainer`` (``lightning.pytorch``, ``pytorch_lightning``).

    The callbacks read the Trainer's loops, loggers and settings; Lightning Fabric's ``fabric.call(hook, ...)``
    passes whatever the caller gives, a ``Fabric`` usually. Neither namespace is imported here: a ``Trainer`` of
    one is an instance of a class from a module already loaded.

    >>> require_trainer("X", object())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    TypeError: X needs a Lightning `Trainer`; it got `object`. ...
    """
    for package in ("lightning.pytorch", "pytorch_lightning"):
        module = sys.modules.get(package)
        trainer_class = getattr(module, "Trainer", None)
        if isinstance(trainer_class, type) and isinstance(trainer, trainer_class):
            return
    raise TypeError(
        f"{owner} needs a Lightning `Trainer`; it got `{type(trainer).__name__}`. Its hooks read the Trainer's"
        f" loops, loggers and settings: use it in `Trainer(callbacks=[...])` (lightning.pytorch or"
        f" pytorch_lightning); Lightning Fabric's `Fabric(callbacks=...)` is not supported (a `MemoryProbe` reads"
        f" memory under Fabric: `MemoryProbe(fabric.device).read()`)."
    )


def require_int_or_none(owner: str, name: str, value: object, minimum: int, none_means: str) -> None:
    """Raise ``ValueError`` unless ``value`` is ``None`` or an integer >= ``minimum`` (``none_means``: what None does).

    >>> require_int_or_none("X", "every", None, 1, "use the Trainer's")
    >>> require_int_or_none("X", "every", 0, 1, "use the Trainer's")
    Traceback (most recent call last):
    ValueError: `X(every=0)` is not valid. Expected an integer >= 1, or None to use the Trainer's.
    """
    if value is not None and not is_int_at_least(value, minimum):
        raise ValueError(
            f"`{owner}({name}={value!r})` is not valid. Expected an integer >= {minimum}, or None to {none_means}."
        )
