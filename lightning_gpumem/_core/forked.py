"""Work done in forked copies of this process while it goes on with its own.

Why: tracing a training step on fake tensors is seconds of Python, which a thread cannot run beside the
tuner's first real trial (the GIL), and replaying many sizes is the same. A forked child starts in
milliseconds with every object of its parent as it was at the fork (copy on write), runs on another core and
sends its result back pickled through a pipe.

Only on Linux (:func:`can_fork`; macOS's system libraries are not safe to use after a fork). A child must
not use CUDA (a forked child cannot: its work here is on fake tensors and in Python). A child that raises,
dies, or has not answered by the timeout raises :class:`ChildFailed` naming why (:func:`forked_map`: gives
``None``, and the caller does the work itself); a child not waited for is killed and reaped by
:meth:`Forked.close`. Pure: stdlib only.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import select
import signal
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_CHUNK = 1 << 20


def can_fork() -> bool:
    """Whether work can go to forked children here: Linux, with ``os.fork``."""
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


class ChildFailed(Exception):
    """A forked child gave no result: the reason (its error, its death, its silence)."""


class Forked(Generic[T]):
    """``work()`` run in a forked child from now on; :meth:`result` waits for its value.

    Example:
        >>> child = Forked(lambda: sum(range(10)))
        >>> child.result(timeout=60.0)
        45
    """

    def __init__(self, work: Callable[[], T]) -> None:
        if not can_fork():
            raise OSError(f"no fork on {sys.platform}")
        read, write = os.pipe()
        try:
            pid = _fork()
        except BaseException:  # no child: no pipe either
            os.close(read)
            os.close(write)
            raise
        if pid == 0:  # the child: never returns into the parent's code
            try:
                os.close(read)
                _run_child(work, write)
            finally:
                os._exit(1)
        os.close(write)
        self._pid: int | None = pid
        self._read: int | None = read

    def result(self, timeout: float) -> T:
        """The child's value, waited for up to ``timeout`` s.

        Raises:
            ChildFailed: the child raised (its error named), died, or did not answer in time.
        """
        if self._read is None:
            raise ChildFailed("the child was closed before its result was read")
        deadline = time.monotonic() + timeout
        chunks: list[bytes] = []
        poller = select.poll()
        poller.register(self._read, select.POLLIN | select.POLLHUP)
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ChildFailed(f"no answer within {timeout:.0f} s")
                if not poller.poll(left * 1000):  # poll: select cannot wait on a descriptor above 1023
                    continue
                chunk = os.read(self._read, _CHUNK)
                if not chunk:
                    break
                chunks.append(chunk)
            status = self._reap()
            try:
                ok, value = pickle.loads(b"".join(chunks))
            except Exception as error:  # the child died before it wrote
                raise ChildFailed(f"the child ended with status {status} and no result") from error
            if not ok:
                raise ChildFailed(value)
            return value
        finally:
            self.close()

    def close(self) -> None:
        """Stop waiting: the child, if still running, is killed and reaped."""
        if self._read is not None:
            os.close(self._read)
            self._read = None
        if self._pid is not None:
            with contextlib.suppress(ProcessLookupError):  # it has ended
                os.kill(self._pid, signal.SIGKILL)
            self._reap()

    def _reap(self) -> int | None:
        if self._pid is None:
            return None
        try:
            _, status = os.waitpid(self._pid, 0)
        except ChildProcessError:  # reaped elsewhere
            status = -1
        self._pid = None
        return status

    def __del__(self) -> None:
        if getattr(self, "_pid", None) is not None or getattr(self, "_read", None) is not None:
            self.close()


def forked_map(
    function: Callable[[T], R], items: Sequence[T], *, workers: int, timeout: float
) -> list[R] | None:
    """``[function(item) for item in items]``, the items shared among up to ``workers`` forked children.

    ``None`` where it cannot be done so (no fork here, fewer than two workers or items, a child that failed):
    the caller then maps them itself.

    Example:
        >>> forked_map(abs, [-1, 2, -3], workers=2, timeout=60.0)
        [1, 2, 3]
    """
    if min(workers, len(items)) < 2 or not can_fork():
        return None
    return ForkedMap(function, items, workers=workers).result(timeout)


class ForkedMap(Generic[R]):
    """``[function(item) for item in items]`` started now in up to ``workers`` forked children (one or more).

    :meth:`result` waits for it; :meth:`close` stops the children not waited for.

    Example:
        >>> mapped = ForkedMap(abs, [-1, 2, -3], workers=1)
        >>> mapped.result(timeout=60.0)
        [1, 2, 3]
    """

    def __init__(self, function: Callable[[T], R], items: Sequence[T], *, workers: int) -> None:
        self._count = len(items)
        self._workers = max(1, min(workers, len(items)))
        self._children: list[Forked[list[R]]] | None = []
        try:
            for i in range(self._workers):
                self._children.append(Forked(_mapping(function, list(items[i :: self._workers]))))
        except Exception:  # no fork here or now (OSError): no result, none left running
            self.close()

    def result(self, timeout: float) -> list[R] | None:
        """The mapped items; ``None`` where a child could not start, failed or did not answer in time."""
        children = self._children
        if children is None:
            return None
        deadline = time.monotonic() + timeout
        try:
            results = [child.result(max(0.0, deadline - time.monotonic())) for child in children]
        except ChildFailed:
            return None
        finally:
            self.close()
        mapped: list[Any] = [None] * self._count
        for i, done in enumerate(results):
            mapped[i :: self._workers] = done
        return mapped

    def close(self) -> None:
        """Stop the children (killed and reaped where still running); :meth:`result` is then ``None``."""
        for child in self._children or ():
            child.close()
        self._children = None


# signals whose handlers (a trainer's: SIGTERM, SLURM's SIGUSR1) must not run in a child: held during the
# fork, then the child's are the system's default
_HELD = frozenset(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name)
)


def _fork() -> int:
    """``os.fork()``, the signals held until each side is ready; the child's handlers back to the default.

    Where the child cannot set its handlers (a fork from another thread than the main one), it keeps the
    signals held: its parent stops it with SIGKILL. The parent's objects are frozen for the fork
    (``gc.freeze``, unless the program froze some itself): a collection in the child then leaves their memory
    pages shared.
    """
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    pid = -1
    try:
        with warnings.catch_warnings():  # 3.12+ warns where the parent has threads: the child runs no CUDA
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    finally:
        if pid != 0:  # the parent, forked or not
            if freeze:
                gc.unfreeze()
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
    if pid != 0:
        return pid
    try:  # the child
        for number in _HELD:
            signal.signal(number, signal.SIG_DFL)
    except (ValueError, OSError):  # not the main thread: the parent's handlers are kept, so the signals held
        return 0
    signal.pthread_sigmask(signal.SIG_SETMASK, held)
    return 0


def _mapping(function: Callable[[T], R], share: list[T]) -> Callable[[], list[R]]:
    return lambda: [function(item) for item in share]


def _run_child(work: Callable[[], Any], write: int) -> None:
    code = 1
    try:
        try:
            payload = pickle.dumps((True, work()), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as error:
            payload = pickle.dumps((False, f"{type(error).__name__}: {error}"))
        with os.fdopen(write, "wb") as pipe:
            pipe.write(payload)
        code = 0
    finally:
        os._exit(code)
