"""Replacing an attribute of an object for a while, and putting back exactly what was there.

Where Lightning has no hook (``AutoMicrobatch`` wraps the module's ``training_step``, ``log`` and ``backward`` and
the optimization loop's ``run``), the attribute is replaced on the instance. :class:`Patches` keeps the originals in
itself, not on the patched object, and ``undo`` restores the instance's own ``__dict__`` entry (or its absence), so
the class attribute shows through again. Each replacement is a wrapper that knows what it replaced: installing over
a replacement left by an earlier, never-undone patch (a crash before its clean-up ran) replaces that one and keeps
its original, so wrappers never call each other in a loop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_MISSING = object()


class Patches:
    """The patches one owner installed; ``undo`` removes them all, in reverse order."""

    def __init__(self) -> None:
        self._saved: dict[tuple[int, str], tuple[object, object, Callable[..., Any]]] = {}

    def __bool__(self) -> bool:
        return bool(self._saved)

    def install(self, owner: object, name: str, replacement: Callable[..., Any], keep_signature: bool = False) -> None:
        """Make ``owner.<name>`` call ``replacement``; a second install of the same name is ignored.

        ``keep_signature`` shows the original's name and signature on the wrapper (Lightning reads a
        ``training_step``'s parameters to decide what to pass).
        """
        key = (id(owner), name)
        if key in self._saved:
            return
        own = vars(owner).get(name, _MISSING)
        previous: object = getattr(own, "_gpumem_previous", own)  # a leftover patch: keep what it replaced
        original: Callable[..., Any] = getattr(own, "_gpumem_original", None) or getattr(owner, name)

        def patched(*args: Any, **kwargs: Any) -> Any:
            return replacement(*args, **kwargs)

        if keep_signature:
            patched = functools.wraps(original)(patched)
        patched._gpumem_original = original  # type: ignore[attr-defined]
        patched._gpumem_previous = previous  # type: ignore[attr-defined]
        self._saved[key] = (owner, previous, original)
        setattr(owner, name, patched)

    def original(self, owner: object, name: str) -> Callable[..., Any]:
        """What ``owner.<name>`` was before :meth:`install`."""
        return self._saved[(id(owner), name)][2]

    def undo(self) -> None:
        """Put back every patched attribute as it was (removed again where the instance had none of its own)."""
        for (_, name), (owner, previous, _) in reversed(list(self._saved.items())):
            if previous is _MISSING:
                vars(owner).pop(name, None)
            else:
                setattr(owner, name, previous)
        self._saved.clear()
