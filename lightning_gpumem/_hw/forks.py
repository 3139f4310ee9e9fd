"""Whether a forked child of this process can run a backward pass, and tracing in such a child.

torch's autograd engine refuses in a child forked after this process started the engine's device threads,
which its first backward pass does on a machine with a GPU ("Unable to handle autograd's threading in
combination with fork-based multiprocessing"): a tuner whose process has trained before (an earlier fit, a
warm-up step) cannot trace in a fork. A forked child tries one backward pass on a CPU tensor (milliseconds).

A forked child cannot use CUDA either ("CUDA error: initialization error"), and torch asks it things where
it is available: the optimizers' ``step`` checks whether the current stream is capturing a CUDA graph. The
trace needs no GPU (fake CPU tensors, CUDA's behaviour applied by hand, as on a CPU-only torch):
:func:`without_cuda` runs it with CUDA taken as absent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from lightning_gpumem._core.forked import ChildFailed, Forked, can_fork

T = TypeVar("T")

_refused: list[bool] = []  # once refused, always: the engine's threads run for the life of the process


def backward_forks(timeout: float = 30.0) -> bool:
    """Whether a child forked now can run a backward pass (``False`` where the process cannot fork).

    >>> backward_forks() in (True, False)
    True
    """
    if _refused or not can_fork():
        return False
    try:
        return Forked(_backward).result(timeout)
    except ChildFailed:
        _refused.append(True)
        return False
    except Exception:  # no fork possible now (OSError: no memory or processes left)
        return False


def _backward() -> bool:
    tensor = torch.ones(2, requires_grad=True)
    (tensor * 2).sum().backward()
    return tensor.grad is not None


def without_cuda(work: Callable[[], T]) -> T:
    """``work()`` with ``torch.cuda.is_available()`` false from now on (a forked child: it exits after)."""
    torch.cuda.is_available = _absent
    return work()


def _absent() -> bool:
    return False
