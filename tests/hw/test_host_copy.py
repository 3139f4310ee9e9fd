"""Host copies of device tensors in one buffer, its pages touched in parallel first (``_hw/host_copy.py``)."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_gpumem._hw import host_copy
from lightning_gpumem._hw.host_copy import PAGE, host_copies, touch_pages


def _tensors(device: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [
        torch.randn(3, 5, device=device),
        torch.randint(0, 100, (7,), device=device, dtype=torch.int64),
        torch.randn(4, 4, device=device, dtype=torch.bfloat16),
        torch.rand(9, device=device) > 0.5,
        torch.randn(2, 3, device=device).t(),  # strided: copied on its own, strides kept
        torch.randn(0, 4, device=device),
        torch.tensor(2.5, device=device),
        torch.randn(3, device=device, requires_grad=True),
    ]


def _check(tensors: list[torch.Tensor], copies: list[torch.Tensor]) -> None:
    assert len(copies) == len(tensors)
    for tensor, copy in zip(tensors, copies, strict=True):
        assert copy.device.type == "cpu"
        assert copy.dtype == tensor.dtype
        assert copy.shape == tensor.shape
        assert torch.equal(copy, tensor.detach().cpu())
        assert not copy.requires_grad
        if not tensor.is_contiguous():
            assert copy.stride() == tensor.stride()


def test_copies_in_one_buffer_equal_their_tensors_and_own_their_slices(monkeypatch):
    # the CPU stands in for a device: the buffer path is the one under test
    monkeypatch.setattr(host_copy, "_sliceable", lambda t: t.is_contiguous() and t.numel() > 0)
    tensors = _tensors("cpu")
    copies = host_copies(tensors, min_bytes=0)
    _check(tensors, copies)
    sliced = [copy for tensor, copy in zip(tensors, copies, strict=True) if host_copy._sliceable(tensor)]
    bases = {copy.untyped_storage().data_ptr() for copy in sliced}
    assert len(sliced) == 6
    assert len(bases) == 1
    starts = sorted(copy.data_ptr() for copy in sliced)
    assert all(start % host_copy.ALIGN == starts[0] % host_copy.ALIGN for start in starts)
    for copy in sliced:  # writing one copy leaves the others as they were
        copy.zero_() if copy.dtype != torch.bool else copy.fill_(False)
    assert torch.equal(copies[1], torch.zeros(7, dtype=torch.int64))
    assert not torch.equal(tensors[1], copies[1])  # a copy, not the tensor


def test_below_the_threshold_or_on_the_cpu_each_tensor_is_copied_on_its_own():
    tensors = _tensors("cpu")
    copies = host_copies(tensors, min_bytes=0)  # CPU tensors: never sliced
    _check(tensors, copies)
    assert all(
        copy.data_ptr() != tensor.data_ptr() for tensor, copy in zip(tensors, copies) if tensor.numel()
    )
    assert len({copy.untyped_storage().data_ptr() for copy in copies if copy.numel()}) == 7


@pytest.mark.parametrize("threads", [1, 3, 8])
@pytest.mark.parametrize("size", [1, PAGE - 1, PAGE, 5 * PAGE + 17, 64 * PAGE])
def test_touching_pages_writes_one_byte_of_every_page_from_the_threads_asked(monkeypatch, size, threads):
    buffer = torch.full((size,), 7, dtype=torch.uint8)
    used: set[int] = set()
    chunks: list[int] = []
    zero = torch.Tensor.zero_

    def counting(tensor: torch.Tensor) -> torch.Tensor:
        used.add(threading.get_ident())
        chunks.append(tensor.numel())
        return zero(tensor)

    monkeypatch.setattr(torch.Tensor, "zero_", counting)
    touch_pages(buffer, threads=threads)
    written = (buffer == 0).nonzero().flatten().tolist()
    assert {offset // PAGE for offset in written} == set(range(-(-size // PAGE)))
    assert len(written) <= -(-size // PAGE) + threads  # a byte a page (a chunk's start may share one)
    assert len(used) <= threads
    assert len(chunks) == min(threads, -(-size // PAGE))  # as many chunks as threads, pages allowing


def test_the_threads_are_the_cpus_the_process_may_use_at_most_eight(monkeypatch):
    monkeypatch.setattr(host_copy, "_cpus", lambda: 32)
    sizes: list[int] = []
    original = host_copy.ThreadPoolExecutor

    def pool(workers: int) -> object:
        sizes.append(workers)
        return original(workers)

    monkeypatch.setattr(host_copy, "ThreadPoolExecutor", pool)
    touch_pages(torch.empty(64 * PAGE, dtype=torch.uint8))
    assert sizes == [host_copy.MAX_THREADS]


@pytest.mark.gpu
def test_device_tensors_copy_into_one_host_buffer_with_their_values():
    tensors = _tensors("cuda")
    copies = host_copies(tensors, min_bytes=0)
    _check(tensors, copies)
    sliced = [c for t, c in zip(tensors, copies, strict=True) if t.is_contiguous() and t.numel()]
    assert len({copy.untyped_storage().data_ptr() for copy in sliced}) == 1
    big = torch.randn(64 * 2**20 // 4 + 3, device="cuda")  # over the threshold: the buffer path by default
    (copy,) = host_copies([big])
    assert torch.equal(copy, big.cpu())
