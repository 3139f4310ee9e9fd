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
    assert len(written) <= -(-size // PAGE) + 1  # a byte a page, and the last one
    assert written[-1] == size - 1  # the buffer's start need not be a page's: its last byte is written
    assert len(used) <= threads
    # as many pieces as threads, pages allowing (and the last byte's write)
    assert len(chunks) == min(threads, -(-size // PAGE)) + 1


def test_the_threads_are_the_cpus_the_process_may_use_at_most_eight(monkeypatch):
    monkeypatch.setattr(host_copy, "cores", lambda: 32)
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


def test_a_thread_touches_pieces_small_enough_that_zero_starts_no_threads_of_its_own(monkeypatch):
    assert host_copy.PIECE_PAGES <= 32768  # ATen's grain size: a piece's strided write runs in one thread
    monkeypatch.setattr(host_copy, "PIECE_PAGES", 4)
    buffer = torch.full((4 * 10 * PAGE,), 7, dtype=torch.uint8)
    pieces: list[int] = []
    zero = torch.Tensor.zero_

    def counting(tensor: torch.Tensor) -> torch.Tensor:
        pieces.append(tensor.numel())
        return zero(tensor)

    monkeypatch.setattr(torch.Tensor, "zero_", counting)
    touch_pages(buffer, threads=2)
    assert pieces[:-1] == [4] * 10  # ten pieces of four pages, from two threads
    assert int((buffer[::PAGE] == 0).sum()) == 40


def test_the_buffer_is_in_host_memory_whatever_the_default_device(monkeypatch):
    monkeypatch.setattr(host_copy, "_sliceable", lambda t: t.is_contiguous() and t.numel() > 0)
    tensors = [torch.arange(6.0), torch.ones(3, dtype=torch.int32)]
    with torch.device("meta"):  # as `torch.set_default_device("cuda")` would put it on the GPU
        copies = host_copies(tensors, min_bytes=0)
    assert [copy.device.type for copy in copies] == ["cpu", "cpu"]
    assert torch.equal(copies[0], tensors[0])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_conjugate_negative_and_nested_tensors_are_copied_on_their_own_as_they_are():
    base = torch.randn(4, dtype=torch.complex64)
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    tensors = [base, base.conj(), torch._neg_view(base), nested]
    assert not any(host_copy._sliceable(tensor) for tensor in tensors)
    copies = host_copies(tensors, min_bytes=0)
    assert torch.equal(copies[1].resolve_conj(), base.conj().resolve_conj())
    assert torch.equal(copies[2].resolve_neg(), -base)
    assert copies[3].is_nested
