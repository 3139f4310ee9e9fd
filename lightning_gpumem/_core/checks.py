"""Argument checks shared by the callbacks.

Their messages name the class, the argument, the value and what was expected.
"""

from __future__ import annotations

import math
import numbers
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


def require_int(owner: str, name: str, value: object, minimum: int, maximum: int | None = None) -> None:
    """Raise ``ValueError`` unless ``value`` is an integer >= ``minimum`` (and <= ``maximum`` where given).

    >>> require_int("X", "steps", 3, 1)
    >>> require_int("X", "steps", 0, 1)
    Traceback (most recent call last):
    ValueError: `X(steps=0)` is not valid. Expected an integer >= 1.
    >>> require_int("X", "ranks", 2**70, 1, maximum=2**20)
    Traceback (most recent call last):
    ValueError: `X(ranks=1180591620717411303424)` is not valid. Expected an integer from 1 to 1048576.
    """
    if not is_int_at_least(value, minimum) or (
        maximum is not None and value > maximum  # type: ignore[operator]
    ):
        expected = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise ValueError(
            f"`{owner}({name}={value!r})` is not valid. Expected an integer {expected}{_python_int(value)}."
        )


def _python_int(value: object) -> str:
    """What to add where ``value`` is an integer of another type than ``int`` (numpy's, a 0-d tensor)."""
    if isinstance(value, int) or as_integer(value) is None:
        return ""
    return f" (a Python `int`: pass `int({value!r})`)"


def require_fraction(owner: str, name: str, value: object, none_ok: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a real number in [0, 1) (or, with ``none_ok``, ``None``).

    Any real number type is taken (``float(value)`` is what it means): a numpy float, a 0-d tensor; not a
    ``bool``.

    >>> require_fraction("X", "margin", 0.2)
    >>> require_fraction("X", "margin", None, none_ok=True)
    >>> require_fraction("X", "margin", 1.0, none_ok=True)
    Traceback (most recent call last):
    ValueError: `X(margin=1.0)` is not valid. Expected None or a number in [0, 1).
    """
    if none_ok and value is None:
        return
    number = as_real(value)  # any real number (a numpy float, a 0-d tensor): callers keep `float(value)`
    if number is None or not 0 <= number < 1:  # NaN fails too
        expected = "None or a number in [0, 1)" if none_ok else "a number in [0, 1)"
        raise ValueError(f"`{owner}({name}={value!r})` is not valid. Expected {expected}.")


def require_length_fn(owner: str, value: object) -> None:
    """Raise ``TypeError`` unless ``value`` is ``None``, a function or a non-empty key (a length field).

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


def require_number(
    owner: str, name: str, value: object, minimum: float, unit: str, above: bool = False
) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite number >= ``minimum`` (> with ``above``).

    ``unit`` is what the number counts, for the message.

    >>> require_number("X", "every_s", 0.5, 0, "seconds")
    >>> require_number("X", "mib", 0, 0, "MiB", above=True)
    Traceback (most recent call last):
    ValueError: `X(mib=0)` is not valid. Expected a finite number of MiB > 0.
    """
    if not is_finite_number(value) or (
        value <= minimum if above else value < minimum  # type: ignore[operator]
    ):
        sign = ">" if above else ">="
        raise ValueError(
            f"`{owner}({name}={value!r})` is not valid. Expected a finite number of {unit} {sign}"
            f" {minimum:g}."
        )


def is_finite_number(value: object) -> bool:
    """Whether ``value`` is an ``int`` or ``float`` (not a ``bool``), finite and one a float can hold.

    >>> is_finite_number(2.5), is_finite_number(float("nan"))
    (True, False)
    >>> is_finite_number(10**400), is_finite_number(True)
    (False, False)
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond the range of a float
        return False


def plain_scalar(value: object) -> object:
    """The Python number a numpy scalar, a 0-d array or a 0-d tensor holds (its ``item()``), else ``value``.

    Duck-typed (``ndim == 0`` and ``item()``): this module imports neither numpy nor torch.
    """
    if getattr(value, "ndim", None) != 0:  # Python numbers have no `ndim`
        return value
    item = getattr(value, "item", None)
    if not callable(item):
        return value
    try:
        return item()
    except Exception:  # an `item` that is not numpy's or torch's: the value as it is
        return value


def as_integer(value: object) -> int | None:
    """``value`` as an ``int`` where it is an integer of any type (not a ``bool`` of any), else ``None``.

    Python and numpy integers and 0-d integer arrays and tensors count; floats, even whole ones, do not.

    >>> as_integer(3), as_integer(True), as_integer(3.0), as_integer("3"), as_integer(10**400) == 10**400
    (3, None, None, None, True)
    """
    if type(value) is int:  # the common cases first, fast (a million lengths)
        return value
    if type(value) is float or not _numeric_dtype(value):
        return None
    number = plain_scalar(value)
    if isinstance(number, bool) or not isinstance(number, numbers.Integral):
        return None
    return int(number)


def _numeric_dtype(value: object) -> bool:
    """Not a numpy time delta or date (integers to ``numbers``), complex number or text.

    The letters are numpy's ``dtype.kind``.
    """
    kind = getattr(getattr(value, "dtype", None), "kind", None)  # numpy's; a tensor's dtype has none
    return not isinstance(kind, str) or kind in "iufb"


def as_real(value: object) -> float | None:
    """``value`` as a ``float`` where it is a real number of any type (not a ``bool``), else ``None``.

    NaN and infinities are returned as they are, and an integer beyond a float's range as an infinity.

    >>> as_real(3), as_real(0.5), as_real(True), as_real("1"), as_real(-(10**400)), as_real(1 + 2j)
    (3.0, 0.5, None, None, -inf, None)
    """
    number = plain_scalar(value)
    if isinstance(number, bool) or not isinstance(number, numbers.Real) or not _numeric_dtype(value):
        return None
    try:
        return float(number)
    except OverflowError:  # an int (or a Fraction) beyond the range of a float
        return math.inf if number > 0 else -math.inf  # type: ignore[operator]
    except (TypeError, ValueError):  # a Real that will not be a float after all
        return None


def as_whole_number(value: object) -> int | None:
    """``value`` as an ``int`` where it is a whole number of any numeric type (not a ``bool``), or ``None``.

    An integer of any type (:func:`as_integer`), or a finite real number equal to a whole number (``3.0``, a
    numpy ``float64(3.0)``, a 0-d float tensor); not NaN, an infinity or ``3.7``.

    >>> as_whole_number(3), as_whole_number(3.0), as_whole_number(3.7), as_whole_number(float("nan"))
    (3, 3, None, None)
    """
    integer = as_integer(value)
    if integer is not None:
        return integer
    number = value if type(value) is float else as_real(value)  # a float, the common case, fast
    if number is None or not math.isfinite(number) or not number.is_integer():
        return None
    return int(number)


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a long list, a number of 400 digits) for a message.

    >>> shown(list(range(100)), limit=20)
    '[0, 1, 2, 3, 4, 5...'
    """
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def require_size(owner: str, name: str, value: object, unit_bytes: int, unit: str) -> None:
    """Raise ``ValueError`` unless ``value``, a size in ``unit`` (``unit_bytes`` bytes), is 1 to 2**64 bytes.

    A size that rounds to 0 bytes means nothing, and one beyond 2**64 bytes (16 EiB) is larger than any
    device.

    >>> require_size("X", "mib", 32.0, 2**20, "MiB")
    >>> require_size("X", "mib", 1e-300, 2**20, "MiB")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: `X(mib=1e-300)` is not valid. Expected a finite number of MiB from 9.54e-07 (1 byte) to ...
    """
    if not is_finite_number(value) or not 1 <= value * unit_bytes <= MAX_BYTES:  # type: ignore[operator]
        raise ValueError(
            f"`{owner}({name}={value!r})` is not valid. Expected a finite number of {unit} from"
            f" {1 / unit_bytes:.3g} (1 byte) to {MAX_BYTES / unit_bytes:.3g} (2**64 bytes)."
        )


def is_collection(value: object) -> TypeGuard[Iterable[object]]:
    """Whether ``value`` is a finite collection: sized and iterable, and not a ``str``, ``bytes`` or mapping.

    Any such collection counts (list, tuple, set, ``range``, a numpy array, an OmegaConf ``ListConfig``); an
    iterator without a length (``itertools.count()``, a generator) does not, as it may never end.

    >>> is_collection(("a", "b")), is_collection(range(10**12))
    (True, True)
    >>> is_collection("ab"), is_collection(iter("ab"))
    (False, False)
    """
    if (
        not isinstance(value, Sized)
        or not isinstance(value, Iterable)
        or isinstance(value, (str, bytes, Mapping))
    ):
        return False
    try:
        len(value)
    except TypeError:  # a 0-d numpy array says it is sized, and has no length
        return False
    return True


def require_trainer(owner: str, trainer: object) -> None:
    """Raise ``TypeError`` unless ``trainer`` is a Lightning ``Trainer``, of either namespace.

    The namespaces: ``lightning.pytorch`` and ``pytorch_lightning``. The callbacks read the Trainer's loops,
    loggers and settings; Lightning Fabric's ``fabric.call(hook, ...)`` passes whatever the caller gives, a
    ``Fabric`` usually. Neither namespace is imported here: a ``Trainer`` of one is an instance of a class
    from a module already loaded.

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
        f"{owner} needs a Lightning `Trainer`; it got `{type(trainer).__name__}`. Its hooks read the"
        " Trainer's loops, loggers and settings: use it in `Trainer(callbacks=[...])` (lightning.pytorch or"
        " pytorch_lightning); Lightning Fabric's `Fabric(callbacks=...)` is not supported (a `MemoryProbe`"
        " reads memory under Fabric: `MemoryProbe(fabric.device).read()`)."
    )


def require_int_or_none(
    owner: str, name: str, value: object, minimum: int, none_means: str, maximum: int | None = None
) -> None:
    """Raise ``ValueError`` unless ``value`` is ``None`` or an integer >= ``minimum``.

    And <= ``maximum``, where one is given. ``none_means``: what None does.

    >>> require_int_or_none("X", "every", None, 1, "use the Trainer's")
    >>> require_int_or_none("X", "every", 0, 1, "use the Trainer's")
    Traceback (most recent call last):
    ValueError: `X(every=0)` is not valid. Expected an integer >= 1, or None to use the Trainer's.
    """
    if value is None:
        return
    if not is_int_at_least(value, minimum) or (
        maximum is not None and value > maximum  # type: ignore[operator]
    ):
        expected = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise ValueError(
            f"`{owner}({name}={value!r})` is not valid. Expected an integer {expected}{_python_int(value)},"
            f" or None to {none_means}."
        )
