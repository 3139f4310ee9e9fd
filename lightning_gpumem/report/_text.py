"""Text for a terminal: control and format characters (a run's name is a directory's name) shown escaped."""

from __future__ import annotations

import unicodedata


def printable(text: str) -> str:
    r"""``text`` with its control, format and line-breaking characters written as ``\xNN``, ``\uNNNN``, ``\UNNNNNNNN``.

    Escaped: every character of Unicode category C* and the line and paragraph separators (Zl, Zp). Escape
    sequences, newlines, tabs, bidirectional overrides and undecodable bytes of a file name (``os.fsdecode``'s
    surrogates) reach the terminal as text, so a name can neither move the cursor nor forge a row of the table.

    Example:
        >>> printable("run\x1b[2J\nforged")
        'run\\x1b[2J\\x0aforged'
    """
    if text.isprintable():  # the common case: nothing to escape (`isprintable` is false for all C*, Zl and Zp)
        return text
    return "".join(_escape(char) if _hidden(unicodedata.category(char)) else char for char in text)


def _hidden(category: str) -> bool:
    return category[0] == "C" or category in ("Zl", "Zp")


def _escape(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
