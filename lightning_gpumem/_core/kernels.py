"""Memory that CUDA kernels ask of the caching allocator for themselves, worked out from shapes alone.

A trace on fake tensors sees every tensor an op returns, not the scratch buffers a kernel allocates while it
runs and frees when it ends. Where such a buffer is large and its size follows from the op's shapes and the
device, it is computed here, so the trace can ask for it in its place.

Reductions (``sum``, ``mean`` over some dimensions: the bias gradients of every ``nn.Linear`` sum the output
gradient over all its tokens) run ATen's ``Reduce.cuh`` kernel. Where the reduced extent is long and the
outputs few, the kernel splits each output's inputs across thread blocks (``ctas_per_output``) and stages
the partial results in a global buffer of ``accumulator bytes x outputs x ctas_per_output`` (times the block
width and the output vector size when the reduced dimensions are not the fastest moving ones), with one
``int`` semaphore per block column. ``ctas_per_output`` grows with the number of multiprocessors, so the
buffer depends on the card: 132 MiB for each bias gradient of a 236M GPT at 20,480 tokens on an H100.
:func:`reduce_buffers` follows ``setReduceConfig`` of ``Reduce.cuh``.

Matrix multiplies: the first on a thread creates its cuBLAS handle's workspaces through the allocator and
keeps them; autograd runs the backward on a thread of its own, with its own handle. On an H100 with torch
2.11 the recorded allocator histories (``benchmarks/results/allocator-streams-h100``) show 32 MiB and 1 MiB
after the forward's first matrix multiply, and 32 MiB after the backward's (32 MiB is torch's default cuBLAS
workspace on Hopper).

Embedding backward (``embedding_dense_backward`` over more than 3,072 indices): the indices sorted with their
positions (CUB's radix sort, whose temporary storage holds a second copy of both), the segments of equal
indices found, and a float32 partial sum per run of up to 10 indices: ``(indices / 10 + min(indices,
embeddings)) x embedding width`` floats, 144 MiB for a 32,768-token vocabulary of width 1,024 at 40,448
tokens. :data:`EMBEDDING_BACKWARD_ORDER` and :func:`embedding_buffer` follow ``Embedding.cu`` and
``EmbeddingBackwardKernel.cu`` as the H100's allocator histories record them (two sizes; CUB's scan and
unique temporaries, under 2 KiB, approximately).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MIB = 1 << 20
MAX_THREADS = 512  # ReduceConfig's threads per block
WARP = 32
MIN_VALUES_PER_THREAD = 16
MAX_VALUES_PER_THREAD = 256
INPUT_VEC_SIZE = 4  # vt0: values each thread loads at once


@dataclass(frozen=True)
class Device:
    """What a kernel's launch configuration reads of the card.

    Attributes:
        multiprocessors: streaming multiprocessors (``multi_processor_count``).
        threads_per_multiprocessor: ``max_threads_per_multi_processor``.
        forward_workspaces: what the first matrix multiply of the forward's thread allocates and keeps (the
            cuBLAS and cuBLASLt workspaces of its handle), in bytes, in order.
        backward_workspaces: the same for the backward's thread (autograd's own, with a handle of its own).
        attention: the fused attention torch runs there for half precision without a mask: ``"cudnn"``
            (cuDNN's, as on the H100 with torch 2.11: two 8-byte RNG tensors and the output's statistics in
            the forward, one workspace in the backward) or ``"flash"`` (FlashAttention's: the statistics,
            and two buffers in the backward).
    """

    multiprocessors: int = 132
    threads_per_multiprocessor: int = 2048
    forward_workspaces: tuple[int, ...] = (32 * MIB, MIB)
    backward_workspaces: tuple[int, ...] = (32 * MIB,)
    attention: str = "cudnn"


H100 = Device()
"""The H100 SXM (and the H200): the default, the largest multiprocessor count of the common cards."""


# torch's default cuBLAS workspace before Hopper (CublasHandlePool.cpp, ":4096:2:16:8"); Hopper's is 32 MiB
PRE_HOPPER_WORKSPACE = 4096 * 1024 * 2 + 16 * 1024 * 8


def device_for(major: int, multiprocessors: int, threads_per_multiprocessor: int) -> Device:
    """The :class:`Device` of a card from its CUDA properties (``torch.cuda.get_device_properties``).

    Hopper and later (``major >= 9``) as measured on the H100; before it, torch's default cuBLAS workspace
    there (8 MiB and 128 KiB, from torch's source, not measured) and FlashAttention.

    >>> device_for(9, 132, 2048) == H100
    True
    >>> device_for(8, 108, 2048).forward_workspaces[0], device_for(8, 108, 2048).attention
    (8519680, 'flash')
    """
    if major >= 9:
        return Device(multiprocessors, threads_per_multiprocessor)
    return Device(
        multiprocessors,
        threads_per_multiprocessor,
        forward_workspaces=(PRE_HOPPER_WORKSPACE, MIB),
        backward_workspaces=(PRE_HOPPER_WORKSPACE,),
        attention="flash",
    )


def reduce_buffers(
    shape: Sequence[int],
    strides: Sequence[int],
    dims: Sequence[int],
    accumulator_bytes: int,
    device: Device = H100,
) -> tuple[int, int]:
    """The staging buffer and the semaphores (bytes; ``(0, 0)``: none) of a reduction over ``dims``.

    Args:
        shape: the input's sizes.
        strides: the input's strides, in elements.
        dims: the dimensions reduced (non-negative, distinct).
        accumulator_bytes: the bytes of the kernel's accumulator (4 for ``sum`` of float, half or bfloat16).
        device: the card.

    >>> tokens = 40 * 512  # a bias gradient: (tokens, features) summed over the tokens, bfloat16
    >>> [reduce_buffers((tokens, n), (n, 1), (0,), 4)[0] // 2**20 for n in (1024, 4096)]
    [132, 132]
    >>> reduce_buffers((8 * 512, 3072), (3072, 1), (0,), 4)[0] // 2**20
    96
    >>> reduce_buffers((64, 10), (10, 1), (0,), 4)  # too short to split across blocks
    (0, 0)
    """
    pairs = list(enumerate(zip(shape, strides, strict=True)))
    kept = [(size, stride) for d, (size, stride) in pairs if d not in dims]
    reduced = [(size, stride) for d, (size, stride) in pairs if d in dims]
    kept = [(size, stride) for size, stride in kept if size != 1]
    reduced = [(size, stride) for size, stride in reduced if size != 1]
    outputs, inputs = _product(kept), _product(reduced)
    if not reduced or outputs == 0 or inputs == 0:
        return 0, 0
    reduced_groups, kept_groups = _coalesce(reduced), _coalesce(kept)
    fastest_reduced = not kept_groups or min(map(_stride, reduced_groups)) < min(map(_stride, kept_groups))
    vec = 1
    if fastest_reduced:
        dim0, dim1 = min(reduced_groups, key=_stride)[0], outputs
        if _stride(min(reduced_groups, key=_stride)) == 1 and dim0 > 128 and len(reduced_groups) == 1:
            dim0 //= INPUT_VEC_SIZE  # vectorised along the input
    else:
        fastest = min(kept_groups, key=_stride)
        dim0, dim1 = fastest[0], inputs
        if fastest[1] == 1:  # vectorised along the output: 4, 2 or 1 outputs a thread
            others = [stride for size, stride in reduced_groups + kept_groups if (size, stride) != fastest]
            vec = 4
            while vec > 1 and (dim0 % vec or any(stride % vec for stride in others)):
                vec //= 2
            dim0 //= vec
    width, height = _block(dim0, dim1, MAX_THREADS // vec)
    step_input = step_output = 1
    if fastest_reduced:
        step_input *= width
    else:
        step_output *= width
    split_warps = _div_up(inputs, step_input) >= min(height * 16, MAX_VALUES_PER_THREAD)
    if split_warps:
        step_input *= height
    else:
        step_output *= height
    values = _div_up(inputs, step_input)
    target_grid = device.multiprocessors * (device.threads_per_multiprocessor // (width * height))
    grid = _div_up(outputs // vec, step_output)
    if not (split_warps and values >= MAX_VALUES_PER_THREAD and grid <= target_grid):
        return 0, 0
    ctas = max(
        min(_div_up(target_grid, grid), _div_up(values, MIN_VALUES_PER_THREAD)),
        _div_up(values, MAX_VALUES_PER_THREAD),
    )
    if ctas <= 1:
        return 0, 0
    buffer = accumulator_bytes * outputs * ctas * (1 if fastest_reduced else width * vec)
    return buffer, 4 * grid


def reduce_recipes(
    shape: Sequence[int],
    strides: Sequence[int],
    dims: Sequence[int],
    accumulator_bytes: int,
    device: Device = H100,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The recipes of :func:`reduce_buffers`' two buffers, for :func:`scratch_bytes` (integers only).

    Each is ``(part, accumulator bytes, multiprocessors, threads per multiprocessor, rank, *shape, *strides,
    *reduced)``, ``part`` 0 for the staging buffer and 1 for the semaphores, ``reduced`` 1 for each dimension
    reduced: every field is fixed or grows with the batch, so a recipe at any batch size is the recipes at
    two sizes extended, as ``tuning/sources/affine.py`` extends a stream's sizes.

    >>> buffer, semaphores = reduce_recipes((20480, 1024), (1024, 1), (0,), 4)
    >>> scratch_bytes(buffer) // 2**20, scratch_bytes(semaphores)
    (132, 32)
    """
    head = (accumulator_bytes, device.multiprocessors, device.threads_per_multiprocessor, len(shape))
    body = (*shape, *strides, *(int(d in dims) for d in range(len(shape))))
    return (0, *head, *body), (1, *head, *body)


# The ops whose memory the trace (``_hw/trace.py``) gives as the H100 allocated it, request for request,
# in the allocator histories of benchmarks/results/allocator-streams-h100 (the 236M GPT, with 4096-token
# validation and with activation checkpointing, HF GPT-2 medium: bf16-mixed, AdamW, torch 2.11), by their
# names in a trace; a trace of these alone needs no margin for memory it cannot see (``sources/traced.py``)
_MEASURED = """aten._foreach_add_.Scalar aten._foreach_add_.Tensor aten._foreach_addcdiv_.ScalarList
    aten._foreach_addcmul_.Scalar aten._foreach_div_.ScalarList aten._foreach_lerp_.Scalar
    aten._foreach_mul_.Scalar aten._foreach_sqrt aten._local_scalar_dense aten._log_softmax
    aten._log_softmax_backward_data aten._to_copy aten._unsafe_view aten.add.Tensor aten.addmm aten.alias
    aten.arange aten.cat aten.clone aten.detach aten.embedding aten.embedding_dense_backward aten.empty_like
    aten.gelu aten.gelu_backward aten.lift_fresh aten.mm aten.mul.Scalar aten.mul.Tensor
    aten.native_dropout_backward aten.native_layer_norm aten.native_layer_norm_backward aten.new_empty
    aten.nll_loss_backward aten.nll_loss_forward aten.ones_like aten.permute aten.pow.Tensor_Scalar
    aten.slice.Tensor aten.split.Tensor aten.stack aten.sum.dim_IntList aten.t aten.tanh aten.tanh_backward
    aten.transpose.int aten.unbind.int aten.unsqueeze aten.view aten.zeros aten.zeros_like prim.device
    profiler._record_function_enter_new profiler._record_function_exit._RecordFunction"""
MEASURED_OPS = frozenset(_MEASURED.split()) | {"scaled_dot_product_attention (cudnn)"}


def scratch_bytes(recipe: Sequence[int]) -> int:
    """The bytes a recipe of :func:`reduce_recipes` or :func:`embedding_recipes` asks for."""
    if recipe[0] >= EMBEDDING_PART:
        return embedding_buffer(recipe[0] - EMBEDDING_PART, *recipe[1:])
    part, accumulator, processors, threads, rank = recipe[:5]
    shape, strides, reduced = recipe[5 : 5 + rank], recipe[5 + rank : 5 + 2 * rank], recipe[5 + 2 * rank :]
    dims = [d for d in range(rank) if reduced[d]]
    return reduce_buffers(shape, strides, dims, accumulator, Device(processors, threads))[part]


EMBEDDING_PART = 2  # a recipe's first field: 0 and 1 are a reduction's buffers, 2 on the embedding's
EMBEDDING_SMALL = 3072  # indices up to which (without scale_grad_by_freq) one kernel writes the gradient
EMBEDDING_ROWS = 10  # NROWS_PER_THREAD: indices a partial sum covers at most
_SORT_TILE = 4864  # items a tile of CUB's one-sweep radix sort holds (256 threads x 19; H100 histories)
# When ``embedding_dense_backward``'s buffers are allocated (``+k``) and freed (``-k``) around its output
# (``out``), ``k`` numbering :func:`embedding_buffer`'s buffers: the indices made contiguous (0), sorted (1),
# their positions (2) from a range (3) by a radix sort (4); the output; the segment starts (5), their count
# (6), the unique indices (7) by CUB's ``unique_by_key`` (8); the partial sums per segment (9) and their
# starts (10) by a scan (11), their count (12) and starts (13); the float32 partial sums (14).
EMBEDDING_BACKWARD_ORDER: tuple[str, ...] = (
    *("+0", "+1", "+2", "+3", "+4", "-4", "-3", "out", "+5", "+6", "+7", "+8", "-8", "-7", "+9", "+10"),
    *("+11", "-11", "+12", "+13", "+14", "-14", "-13", "-12", "-10", "-9", "-6", "-5", "-2", "-1", "-0"),
)


def embedding_recipes(
    indices: int, embeddings: int, width: int, index_bytes: int, sum_bytes: int, copied: bool
) -> tuple[tuple[int, ...], ...]:
    """The recipes of ``embedding_dense_backward``'s 15 buffers, for :func:`scratch_bytes`.

    Numbered as in ``EMBEDDING_BACKWARD_ORDER``.

    Args:
        indices: the indices looked up (``indices.numel()``).
        embeddings: the rows of the weight (``num_weights``).
        width: the weight's row length.
        index_bytes: the bytes of an index (8 for ``torch.long``).
        sum_bytes: the bytes of a partial sum (4 for half and bfloat16 gradients, else the gradient's).
        copied: whether the kernel copies the indices to make them contiguous.
    """
    fields = (indices, embeddings, width, index_bytes, sum_bytes, int(copied))
    return tuple((EMBEDDING_PART + k, *fields) for k in range(15))


def embedding_buffer(
    k: int, indices: int, embeddings: int, width: int, index_bytes: int, sum_bytes: int, copied: int
) -> int:
    """The bytes of buffer ``k`` (see :data:`EMBEDDING_BACKWARD_ORDER`); 0 where the kernel makes none.

    >>> [embedding_buffer(k, 79 * 512, 32768, 1024, 8, 4, 1) for k in (0, 4, 9, 13, 14)]
    [323584, 673279, 262144, 294496, 150781952]
    >>> embedding_buffer(14, 3072, 32768, 1024, 8, 4, 1)  # few indices: no buffers
    0
    """
    if indices <= EMBEDDING_SMALL:
        return 0
    segments = min(indices, embeddings)
    partials = indices // EMBEDDING_ROWS + segments
    column = indices * index_bytes
    sizes = {
        0: column if copied else 0,
        # keys and values again (256-byte aligned), one-sweep's look-back per tile, 8 passes' histograms of
        # 256 bins, a counter, and CUB's 255 bytes of alignment slack
        4: 2 * _round_to(column, 256) + 1024 * _div_up(indices, _SORT_TILE) + index_bytes * 2048 + 256 + 255,
        6: 8,
        8: 1279,  # measured from 6,656 to 40,448 indices
        9: segments * index_bytes,
        10: segments * index_bytes,
        11: 1279 + 256 * (segments // 16384),  # 6,656, 20,480 and 32,768 segments measured
        12: 8,
        13: partials * index_bytes,
        14: partials * width * sum_bytes,
    }
    return sizes.get(k, column)


def _round_to(value: int, multiple: int) -> int:
    return _div_up(value, multiple) * multiple


def _block(dim0: int, dim1: int, max_threads: int) -> tuple[int, int]:
    """``set_block_dimension``: the block's width and height."""
    pow0 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    pow1 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    width = min(pow0, WARP)
    height = min(pow1, max_threads // width)
    width = min(pow0, max_threads // height)
    return width, height


def _coalesce(dims: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Dimensions merged where one continues the other in memory, as TensorIterator merges them."""
    merged: list[tuple[int, int]] = []
    for size, stride in sorted(dims, key=_stride):
        if merged and merged[-1][0] * merged[-1][1] == stride:
            merged[-1] = (merged[-1][0] * size, merged[-1][1])
        else:
            merged.append((size, stride))
    return merged


def _stride(dim: tuple[int, int]) -> int:
    return dim[1]


def _product(dims: list[tuple[int, int]]) -> int:
    result = 1
    for size, _ in dims:
        result *= size
    return result


def _last_pow2(n: int) -> int:
    return max(1, 1 << (max(n, 1).bit_length() - 1))


def _div_up(a: int, b: int) -> int:
    return -(-a // b)
