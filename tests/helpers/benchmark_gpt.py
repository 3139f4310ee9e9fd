"""The 236M GPT of ``benchmarks/tuner.py``, traced: what the tests hold against its recorded GPU runs."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_gpumem._hw.trace import Trace

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def gpt_tracer(steps: int = 3, lightning: bool = True, workload: str = "gpt") -> Callable[[int], Trace]:
    """``trace_at(batch_size)``: a GPT ``workload``'s bf16 training steps and validation, as
    ``benchmarks/traced_plan.py`` traces them (``lightning``: validation as a Lightning fit runs it); the model is
    built on the meta device (the trace needs its shapes only)."""
    sys.path.insert(0, str(BENCHMARKS))
    import _tuner_models as M
    from traced_plan import tracer

    w = M.workload(workload, False)
    with torch.device("meta"):
        model = M.build_model(w)
    return tracer(w, model, steps, lightning)
