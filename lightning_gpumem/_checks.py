"""Argument checks shared by the callbacks: messages name the class, the argument, the value and what was expected."""

from __future__ import annotations

import math
import os


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
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number or (value <= minimum if above else value < minimum):  # type: ignore[operator]
        sign = ">" if above else ">="
        raise ValueError(
            f"`{owner}({name}={value!r})` is not valid. Expected a finite number of {unit} {sign} {minimum:g}."
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
