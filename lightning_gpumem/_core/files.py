"""Writing the callbacks' files: checked directories, whole files or none, no other run's file replaced.

Pure (stdlib only). A file is written to a temporary name beside its target and renamed over it, so a full
disk or a crash leaves no truncated file under the final name. A name already taken (another run writing to
the same ``dirpath``) gets a ``-v1``, ``-v2``... suffix, as Lightning's ``ModelCheckpoint`` names its files.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

NAME_MAX = 255  # bytes in one path component on Linux, macOS and Windows file systems


def check_dirpath(owner: str, value: object) -> Path | None:
    """The directory ``value`` names, ``~`` expanded; refuses what can never be a directory.

    Raises ``TypeError`` unless ``value`` is ``None``, a ``str`` or an ``os.PathLike``, and ``ValueError``
    for a blank name, a NUL byte, a component longer than :data:`NAME_MAX` bytes, an existing file, or a path
    under a file.

    >>> check_dirpath("X", "~/logs") == Path.home() / "logs"
    True
    >>> check_dirpath("X", " ")
    Traceback (most recent call last):
    ValueError: `X(dirpath=' ')` is not valid. Expected a directory path; got a blank name.
    """
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"`{owner}(dirpath={value!r})` is not valid. Expected None or a directory path (str or"
            " os.PathLike)."
        )
    text = os.fspath(value)
    if not isinstance(text, str):  # a PathLike of bytes
        raise TypeError(f"`{owner}(dirpath={value!r})` is not valid. Expected a path of str, not of bytes.")

    def refuse(why: str) -> ValueError:
        return ValueError(f"`{owner}(dirpath={value!r})` is not valid. Expected a directory path; {why}.")

    if not text.strip():
        raise refuse("got a blank name")
    if "\0" in text:
        raise refuse("it holds a NUL byte")
    path = Path(text).expanduser()
    for part in path.parts:
        if len(part.encode("utf-8", "surrogateescape")) > NAME_MAX:
            raise refuse(f"the name {part[:20]!r}... is longer than {NAME_MAX} bytes")
    for ancestor in (path, *path.parents):
        if ancestor.exists():
            if not ancestor.is_dir():
                raise refuse(
                    f"`{ancestor}` is an existing file" + ("" if ancestor == path else ", not a directory")
                )
            break
    return path


def prepare_dir(owner: str, path: Path) -> None:
    """Create ``path`` and check that a file can be written in it (``OSError``'s message says why not).

    Raises:
        ValueError: naming ``owner``'s ``dirpath`` when the directory cannot be created or written to.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise ValueError(
            f"`{owner}(dirpath={str(path)!r})` cannot be written to ({error.strerror or error}). Pass a"
            " directory this process can create and write files in."
        ) from error


def unique_path(path: Path) -> Path:
    """``path``, or the first of ``<stem>-v1<suffix>``, ``<stem>-v2<suffix>``... that does not exist yet.

    >>> unique_path(Path("/nonexistent/x.csv"))
    PosixPath('/nonexistent/x.csv')
    """
    candidate, version = path, 0
    while candidate.exists() or candidate.is_symlink():
        version += 1
        candidate = path.with_name(f"{path.stem}-v{version}{path.suffix}")
    return candidate


def write_atomic(path: str | os.PathLike[str], data: bytes | str | Callable[[BinaryIO], object]) -> Path:
    """Write ``data`` to ``path`` whole, through a temporary file in the same directory renamed over it.

    ``data`` is bytes, text (UTF-8) or a function that writes to the open binary file. The new file has the
    mode of the one it replaces, or the umask's for a new one (not the temporary file's 0600). On any error
    the temporary file is removed and the error raised: ``path`` is then as it was.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(os.stat(out).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    handle, temporary = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            if callable(data):
                data(file)
            else:
                file.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(temporary, mode)
        os.replace(temporary, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return out
