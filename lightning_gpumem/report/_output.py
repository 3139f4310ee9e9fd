"""Writing the report's files: never over an input or half, over a file it did not write only with ``force``.

The report marks what it writes: the HTML page carries :data:`HTML_MARK`, the PNG a ``Software`` text chunk
of :data:`PNG_SOFTWARE`; an existing file whose first :data:`HEAD_BYTES` hold the mark is taken as one the
report wrote and may be replaced. A file is written under a temporary name in its directory and renamed over
the target (``os.replace``), so the target holds the old file or the whole new one, never a cut one.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from lightning_gpumem.report._reading import kind_of
from lightning_gpumem.report._text import printable
from lightning_gpumem.report.runs import ReportError

HTML_MARK = "<!-- written by gpumem report -->"
PNG_SOFTWARE = "gpumem report"
PNG_MARK = b"tEXtSoftware\x00" + PNG_SOFTWARE.encode()  # the PNG text chunk `savefig(metadata=...)` writes
HEAD_BYTES = 4096


def check_output(
    option: str, value: str | os.PathLike[str], mark: bytes, inputs: Iterable[Path] = (), force: bool = False
) -> Path:
    """Where ``value`` may be written, or :class:`ReportError` naming ``option`` and why it may not.

    Refused always: an input of the report (``inputs``, compared after resolving symbolic links, and as the
    same file for hard links), or an existing file that is not a regular file (a FIFO, a device). Refused
    without ``force``: a symbolic link (``force`` writes its target), or an existing file whose head lacks
    ``mark`` (:data:`HTML_MARK` or :data:`PNG_MARK`, encoded).

    Returns:
        The path to write: ``value`` with its symbolic links resolved.
    """
    path = Path(value)
    target = Path(os.path.realpath(path))
    shown = f"{option} {printable(str(value))!r}"
    for source in inputs:
        if Path(os.path.realpath(source)) == target or _same_file(source, target):
            raise ReportError(
                f"{shown}: is an input of this report ({printable(str(source))!r}); expected a new file name"
                " (--force never overwrites an input)."
            )
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as error:
        raise ReportError(
            f"{shown}: cannot be checked ({error.strerror or error}); expected a file name."
        ) from None
    if mode is not None and not stat.S_ISREG(mode):
        raise ReportError(
            f"{shown}: is not a regular file ({kind_of(mode)}); expected the name of a regular file."
        )
    if force:
        return target
    if path.is_symlink():
        raise ReportError(
            f"{shown}: is a symbolic link (to {printable(str(target))!r}); expected a file name that is not"
            " a link, or pass --force to write the link's target."
        )
    if mode is not None and not _holds(target, mark):
        raise ReportError(
            f"{shown}: exists and was not written by gpumem report; expected a new file name, or pass"
            " --force to overwrite it."
        )
    return target


def _holds(path: Path, mark: bytes) -> bool:
    """Whether the head of the regular file ``path`` holds ``mark``: the report wrote it."""
    try:
        with path.open("rb") as handle:
            return mark in handle.read(HEAD_BYTES)
    except OSError:
        return False


def _same_file(source: Path, target: Path) -> bool:
    try:
        return os.path.samefile(source, target)
    except OSError:
        return False
