"""Text for a terminal or a page: control and format characters and undecodable bytes shown escaped.

A run's name is a directory's name, and a directory's name may hold any byte but ``/`` and NUL.
"""

from __future__ import annotations

import unicodedata

_BYTE_LOW, _BYTE_HIGH = 0xDC80, 0xDCFF  # `surrogateescape` keeps byte b as U+DC00 + b (b >= 0x80)


def printable(text: str) -> str:
    r"""``text`` with its control, format and line-breaking characters escaped.

    They are written as ``\xNN``, ``\uNNNN``, ``\UNNNNNNNN``.

    Escaped: every character of Unicode category C* and the line and paragraph separators (Zl, Zp). Escape
    sequences, newlines, tabs, bidirectional overrides and undecodable bytes of a file name reach the
    terminal as text, so a name can neither move the cursor nor forge a row of the table. An undecodable byte
    (``os.fsdecode`` keeps byte ``0xff`` as the lone surrogate ``U+DCFF``) is written as the byte, ``\xff``;
    the result has no surrogates left, so it encodes as UTF-8.

    Example:
        >>> printable("run\x1b[2J\nforged")
        'run\\x1b[2J\\x0aforged'
        >>> printable("run-\udcff\udcfe")  # os.fsdecode(b"run-\xff\xfe")
        'run-\\xff\\xfe'
        >>> printable("\udce6\udc97\udca5")  # os.fsdecode(b"\xe6\x97\xa5") under a C locale: UTF-8 after all
        '日'
    """
    # the common case: nothing to escape (`isprintable` is false for all C*, Zl and Zp)
    if text.isprintable():
        return text
    # bytes a non-UTF-8 locale left undecoded: as UTF-8
    if any("\udc80" <= char <= "\udcff" for char in text):
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "surrogateescape")
    return "".join(escape(char) if _hidden(unicodedata.category(char)) else char for char in text)


def _hidden(category: str) -> bool:
    return category[0] == "C" or category in ("Zl", "Zp")


def escape(char: str) -> str:
    r"""A character as ``\xNN``, ``\uNNNN`` or ``\UNNNNNNNN``; an undecodable byte (a surrogate) as the byte.

    Example:
        >>> escape("\x1b"), escape("\udcff"), escape("\u202e"), escape("\U0001f980")
        ('\\x1b', '\\xff', '\\u202e', '\\U0001f980')
    """
    code = ord(char)
    # a byte that did not decode, kept by `surrogateescape`: shown as the byte
    if _BYTE_LOW <= code <= _BYTE_HIGH:
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
