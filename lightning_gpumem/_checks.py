"""Argument checks shared by the callbacks: messages name the class, the argument, the value and what was expected."""

from __future__ import annotations


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
