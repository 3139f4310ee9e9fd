"""The 236M GPT of ``benchmarks/tuner.py``, traced: what the tests hold against its recorded GPU runs."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_gpumem._hw.trace import Trace, trace_training

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def gpt_tracer(*, steps: int = 3, validate: bool = False) -> Callable[[int], Trace]:
    """``trace_at(batch_size)``: the GPT's bf16 training steps (and validation) traced at a size.

    The model is built on the meta device: the trace needs its shapes only.
    """
    sys.path.insert(0, str(BENCHMARKS))
    import _tuner_models as M

    workload = M.workload("gpt", False)
    with torch.device("meta"):
        model = M.build_model(workload)
    data = M.build_dataset(workload)

    def trace_at(size: int) -> Trace:
        return trace_training(
            model,
            M.make_optimizer(model),
            lambda m, b: M.compute_loss(workload, m, b),
            M.first_batch(workload, data, size),
            steps=steps,
            validate=(lambda m, b: M.compute_loss(workload, m, b, validation=True)) if validate else None,
            autocast_dtype=torch.bfloat16,
        )

    return trace_at
