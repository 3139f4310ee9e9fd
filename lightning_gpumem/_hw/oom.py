"""Recognising an out-of-memory error: by exception type first, by message for backends without a type."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# Messages of OOMs raised as plain RuntimeError (older torch, cuBLAS/cuDNN workspaces, MPS, XPU, ROCm, host).
_OOM_MESSAGES = (
    # CUDA, HIP, XPU: "CUDA out of memory", "HIP out of memory", "CUDA error: out of memory"
    "out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous"
    " input.",
    "MPS backend out of memory",
    "DefaultCPUAllocator: can't allocate memory",
)


class NotOutOfMemoryError(RuntimeError):
    """An error of this package whose message speaks of running out of memory but that is not itself an OOM.

    (``AutoMicrobatch`` stopping every rank because another one ran out of memory, say.) :func:`is_oom_error`
    never takes it for one, so no callback tries to recover or snapshot it as an OOM.
    """


def _oom_types() -> tuple[type[BaseException], ...]:
    candidates = (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
    return tuple(t for t in candidates if isinstance(t, type))


def is_oom_error(error: BaseException) -> bool:
    """Whether ``error`` is an out-of-memory error of any backend.

    >>> is_oom_error(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    True
    >>> is_oom_error(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
    True
    >>> is_oom_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    False
    >>> is_oom_error(NotOutOfMemoryError("another rank ran out of memory"))
    False
    """
    if isinstance(error, NotOutOfMemoryError):
        return False
    if isinstance(error, _oom_types()):
        return True
    if isinstance(error, RuntimeError):
        message = str(error)
        return any(text in message for text in _OOM_MESSAGES)
    return False


_expected = 0  # nesting depth of `expecting_oom()` blocks


@contextlib.contextmanager
def expecting_oom() -> Iterator[None]:
    """Mark a block whose out-of-memory errors are part of the plan (the batch-size search), not failures.

    >>> with expecting_oom():
    ...     oom_expected()
    True
    >>> oom_expected()
    False
    """
    global _expected
    _expected += 1
    try:
        yield
    finally:
        _expected -= 1


def oom_expected() -> bool:
    """Whether an :func:`expecting_oom` block is running."""
    return _expected > 0
