"""The trace against a real GPU (`pytest -m gpu`): the same steps on CUDA, their allocator's peaks.

The trace runs on fake CPU tensors with CUDA's behaviour applied (``_hw/trace.py``); here the very same steps run
on the GPU, and the replay of the trace through the allocator model (``tuning/sources/allocator.py``) must give the
peak of live tensors the GPU's allocator counted, and a reserved peak near the GPU's. Both sides count from a clean
allocator, the cuBLAS workspaces given back: the trace asks for them where the first matrix multiplies of the
forward's and of the backward's thread create them, and for the reductions' staging buffers (``_core/kernels.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_gpumem._core.kernels import Device
from lightning_gpumem._hw.allocator import start_clean
from lightning_gpumem._hw.probe import MemoryProbe
from lightning_gpumem._hw.trace import record_training, trace_training
from lightning_gpumem.tuning.sources.allocator import replay

pytestmark = pytest.mark.gpu

VOCAB, SEQ = 8192, 256


class Tiny(nn.Module):
    """Token embedding, two pre-norm encoder layers with dropout, a vocabulary head: a small language model."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 512)
        layer = nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(512, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def _loss(module: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = module(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _real_peaks(module: nn.Module, tokens: torch.Tensor, autocast: bool) -> tuple[int, int]:
    """Peak allocated and reserved of the steps on the GPU, counted from before the module was moved there."""
    torch.cuda.synchronize()
    start_clean(MemoryProbe(torch.device("cuda"), nvml=False, host=False))  # no cuBLAS workspace, no cache
    base_allocated, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    module = module.cuda()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)  # foreach: the default on CUDA

    def step(m: nn.Module, data: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return _loss(m, data)

    record_training(module, optimizer, step, tokens.cuda(), validate=step)
    torch.cuda.synchronize()
    peaks = (
        torch.cuda.max_memory_allocated() - base_allocated,
        torch.cuda.max_memory_reserved() - base_reserved,
    )
    del module, optimizer
    torch.cuda.empty_cache()
    return peaks


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-mixed"])
@pytest.mark.parametrize("batch", [4, 16])
def test_the_traced_peaks_are_the_gpus(batch, autocast):
    torch.manual_seed(0)
    cpu = Tiny()
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1))
    trace = trace_training(
        copy.deepcopy(cpu),
        lambda ps: torch.optim.AdamW(ps, lr=1e-4),
        _loss,
        tokens,
        validate=_loss,
        autocast_dtype=torch.bfloat16 if autocast else None,
        device=Device(
            torch.cuda.get_device_properties(0).multi_processor_count,
            torch.cuda.get_device_properties(0).max_threads_per_multi_processor,
        ),
    )
    assert trace.cannot_trace is None
    traced = replay(trace.events)
    allocated, reserved = _real_peaks(cpu, tokens, autocast)
    print(
        f"\nbatch {batch}, {'bf16-mixed' if autocast else 'fp32'}: allocated traced {traced.peak_allocated}"
        f" GPU {allocated} ({traced.peak_allocated / allocated - 1:+.2%}); reserved traced"
        f" {traced.peak_reserved} GPU {reserved} ({traced.peak_reserved / reserved - 1:+.2%})"
    )
    assert abs(traced.peak_allocated / allocated - 1) < 0.02
    assert abs(traced.peak_reserved / reserved - 1) < 0.10
