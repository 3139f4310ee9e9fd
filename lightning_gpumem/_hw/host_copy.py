"""Copies of device tensors in host memory, made in one buffer whose pages are touched in parallel first.

Why: copying a model's weights to new host memory is mostly the kernel giving the process its pages, one
fault per 4 KiB page as the copy first writes them (on an H100 host, 0.94 GB of weights: 0.76 s into new
memory, 0.09 s into memory written before; ``benchmarks/snapshot_cost.py``). One buffer for all the
copies, its pages touched by several threads at once (a strided write, one byte a page, in ``zero_``, which
releases the GIL), turns the faults' serial cost into a parallel one; the copies then write pages the
process already has. No page-locked memory: pinning the same bytes took longer than the faults it avoids.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from lightning_gpumem._core.forked import cores

PAGE = 4096
# slices of the buffer start at multiples of this (any dtype's size divides it)
ALIGN = 64
# below this many bytes the copies are made one by one: a few faults are cheaper than the threads
MIN_BYTES = 64 * 2**20
# the most threads touching pages: more contend for the process's memory map
MAX_THREADS = 8
# the most pages one thread touches in one call: more, and ``zero_`` would start threads of its own inside it
# (ATen splits a loop over more than 32,768 elements among its intra-op threads)
PIECE_PAGES = 2**14


def host_copies(tensors: Sequence[torch.Tensor], min_bytes: int | None = None) -> list[torch.Tensor]:
    """A copy in host memory of each of ``tensors``, equal in dtype, shape and values, detached.

    The contiguous tensors off the CPU, where they add up to ``min_bytes`` or more, are copied into slices
    of one buffer whose pages are touched in parallel first; any other tensor (on the CPU, strided, or of
    a dtype a byte buffer cannot be viewed as) gets ``tensor.to("cpu", copy=True)``, strides kept.
    ``None``: :data:`MIN_BYTES`.
    """
    if min_bytes is None:
        min_bytes = MIN_BYTES
    sliced = [index for index, tensor in enumerate(tensors) if _sliceable(tensor)]
    offsets, total = _layout([tensors[index] for index in sliced])
    copies: list[torch.Tensor | None] = [None] * len(tensors)
    if total >= min_bytes:
        buffer = torch.empty(total, dtype=torch.uint8, device="cpu")  # whatever the default device
        touch_pages(buffer)
        for index, offset in zip(sliced, offsets, strict=True):
            tensor = tensors[index].detach()
            view = buffer[offset : offset + _nbytes(tensor)].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            copies[index] = view
    return [
        copy if copy is not None else tensor.detach().to("cpu", copy=True)
        for tensor, copy in zip(tensors, copies, strict=True)
    ]


def touch_pages(buffer: torch.Tensor, threads: int | None = None) -> None:
    """Write one byte of every page of the 1-D byte ``buffer``, from up to ``threads`` threads at once.

    ``None``: the CPUs this process may run on, at most :data:`MAX_THREADS`. The pages are shared out in
    pieces of at most :data:`PIECE_PAGES`; the buffer's last byte is written too (its start need not be a
    page's).
    """
    if threads is None:
        threads = min(MAX_THREADS, cores())
    if buffer.numel() == 0:
        return
    share = -(-buffer.numel() // max(1, threads))  # each thread's bytes, whole pages
    step = min(PIECE_PAGES * PAGE, max(PAGE, -(-share // PAGE) * PAGE))
    pieces = [buffer[start : start + step] for start in range(0, buffer.numel(), step)]
    workers = min(len(pieces), max(1, threads))
    if workers <= 1:  # no thread started for one
        for piece in pieces:
            piece[::PAGE].zero_()
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda piece: piece[::PAGE].zero_(), pieces))
    buffer[-1:].zero_()


def plain(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is its storage's elements as they lie.

    A dense tensor, no subclass, nothing nested, no conjugate or negative bit.
    """
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.layout == torch.strided
        and not tensor.is_nested
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def _sliceable(tensor: torch.Tensor) -> bool:
    return (
        plain(tensor)
        and tensor.device.type not in ("cpu", "meta")
        and tensor.is_contiguous()
        and not tensor.dtype.is_complex
        and not tensor.is_quantized
        and tensor.element_size() <= ALIGN
        and tensor.numel() > 0
    )


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _layout(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    offsets = []
    total = 0
    for tensor in tensors:
        offsets.append(total)
        total += -(-_nbytes(tensor) // ALIGN) * ALIGN
    return offsets, total
