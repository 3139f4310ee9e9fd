"""The traced plan on a CPU against the truth measured on a GPU: the largest batch size under a cap, and the peaks.

Runs on any machine (no GPU): each workload of ``benchmarks/tuner.py`` (``_tuner_models.py``: the same model, data,
loss, AdamW and bf16 autocast as its Lightning runs) is traced on fake tensors (``lightning_gpumem/_hw/trace.py``,
three training steps and a validation step, Lightning's order) and replayed through the allocator model
(``tuning/sources/allocator.py``), the last step repeated until the layout settles (``tuning/sources/steps.py``);
the one search finds the largest size whose replay fits each cap. The truth is read from a ``benchmarks/tuner.py
--true-max fit`` JSON measured on a GPU under the same cap: the largest size whose fit (4 steps, or 50 in the
12 GiB files) and validation batch ran in a fresh process, and the peaks measured there, against the replay at that
size under that cap::

    python benchmarks/traced_plan.py --models gpt,gpt-longval --caps 24 \\
        --truth benchmarks/results/tuner-42a-h100.json,benchmarks/results/tuner-42c-h100.json \\
        --json benchmarks/results/traced-plan-cpu.json

Several caps and several truth files at once: a truth counts for the cell of its own cap (the file's
``budget_gib``); of two truths for one workload and cap, the later file's. A workload that cannot be traced (or
whose trace raises) gets ``cannot_trace`` (or ``error``) in place of its cells, and the others run on.

A cap is what the allocator may reserve (``set_per_process_memory_fraction``, as the GPU runs set it): the memory
outside PyTorch is not subtracted. ``--margin`` is the fraction of the cap left free (by default the planner's:
1% where the step ran an op outside ``MEASURED_OPS``, else 0; 0 to see the replay's own answer). ``--quick``: the
tiny workloads, for CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _tuner_models as M

from lightning_gpumem._hw.trace import Trace, trace_training
from lightning_gpumem.tuning.sources.traced import CannotTrace, TracedSource, largest_traced, trace_margin

GIB = 2**30


def tracer(
    w: M.Workload, model: torch.nn.Module, steps: int = 3, lightning: bool = True, meta_first: bool = False
) -> Any:
    """``trace_at(size)``: ``steps`` bf16 training steps of ``w`` and a validation step, traced at a size.

    ``lightning``: autocast as Lightning 2.6's ``bf16-mixed`` runs it, whatever Lightning is installed (the
    truths' Lightning: no cache of the weights' casts) and validation as a Lightning fit runs it (the gradients freed first by
    ``on_validation_model_zero_grad``, under ``torch.inference_mode()``); else as a plain loop does (under
    ``torch.no_grad()``, the gradients kept), as ``allocator_fidelity.py`` records it. ``meta_first``: as
    ``BatchSizeTuner(start="trace")`` traces (meta tensors first, ``trace_training``'s).
    """
    dataset, val_dataset = M.build_dataset(w), M.build_val_dataset(w)

    def validate(m: torch.nn.Module, b: Any) -> Any:
        if lightning:
            m.zero_grad(set_to_none=True)
        return M.compute_loss(w, m, b, validation=True)

    def trace_at(size: int) -> Trace:
        return trace_training(
            model,
            M.make_optimizer(model),
            lambda m, b: M.compute_loss(w, m, b),
            M.first_batch(w, dataset, size),
            steps=steps,
            validate=validate,
            val_batch=M.first_batch(w, val_dataset, size),
            autocast_dtype=torch.bfloat16,
            inference_mode=lightning,
            autocast_cache=not lightning,  # Lightning 2.6's bf16-mixed, as the truths ran: no cache
            meta_first=meta_first,
        )

    return trace_at


def truths(paths: list[str]) -> dict[str, dict[float, dict[str, Any]]]:
    """workload -> cap in GiB -> its truth."""
    found: dict[str, dict[float, dict[str, Any]]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        budget = data["settings"].get("budget_gib")
        for name, workload in data["workloads"].items():
            true = workload.get("true_max") or {}
            # settled only: an exact edge, or the search's bound reached (a lower bound, marked so)
            if true.get("true_max") is None or true.get("status") not in ("exact", "upper_bound"):
                continue
            probes = {p["batch_size"]: p for p in true.get("probes", [])}
            found.setdefault(name, {})[float(budget)] = {
                "cap_gib": budget,
                "true_max": true["true_max"],
                "at_bound": true["status"] == "upper_bound",
                "peaks": probes.get(true["true_max"]),
                "device": data.get("device"),
                "file": path,
            }
    return found


def search_caps(
    source: TracedSource,
    w: M.Workload,
    caps: list[float],
    margin: float | None,
    known: dict[float, dict[str, Any]],
) -> list[dict[str, Any]]:
    if margin is None:  # the planner's: from what the step runs (a trace at the search's first size tells)
        source.under(None)(2)
        margin = trace_margin(source)
    cells = []
    for cap in caps:
        limit = int(cap * GIB)
        capped = int((1.0 - margin) * limit)
        found = largest_traced(source, capped, init_val=2, upper=w.search_upper, tolerance=0.01)
        cell: dict[str, Any] = {
            "cap_gib": cap,
            "largest": found.batch_size,
            "traced_sizes": len(source.traces),
        }
        truth = known.get(cap)
        if truth is not None:
            cell["true_max"] = truth["true_max"]
            cell["true_max_at_bound"] = truth["at_bound"]  # the true max is at least this
            cell["ratio"] = round(found.batch_size / truth["true_max"], 4) if found.batch_size else None
            cell["truth"] = f"{truth['file']} ({(truth['device'] or {}).get('name')})"
        cells.append(cell)
    return cells


def run(
    name: str,
    caps: list[float],
    margin: float | None,
    known: dict[float, dict[str, Any]],
    quick: bool,
    synthesise: bool = True,
) -> dict[str, Any]:
    wall = time.perf_counter()
    # --quick's tiny workloads simulate OOMs for the tuner's CPU runs; a trace never runs out of memory
    w = dataclasses.replace(M.workload(name, quick), simulated_oom_above=None, simulated_val_oom_above=None)
    torch.manual_seed(0)
    model = M.build_model(w)
    source = TracedSource(tracer(w, model), synthesise=synthesise)
    start = time.perf_counter()
    entry: dict[str, Any] = {"model": name, "describe": M.describe(w)}
    try:
        cells = search_caps(source, w, caps, margin, known)
        # as plan_by_trace: a made stream that is not its trace: all traced again
        while not source.confirm():
            cells = search_caps(source, w, caps, margin, known)
    # CannotTrace, or the step's own error: say it, and go on to the next workload
    except Exception as error:
        key = "cannot_trace" if isinstance(error, CannotTrace) else "error"
        entry[key] = str(error) if key == "cannot_trace" else f"{type(error).__name__}: {error}"
        entry["sizes_traced"] = len(source.traced)
        entry["wall_seconds"] = round(time.perf_counter() - wall, 2)
        return entry
    seconds = time.perf_counter() - start
    entry.update(
        {
            "cells": cells,
            "plan_seconds": round(seconds, 2),
            "synthesised": synthesise,
            "sizes_traced": len(source.traced),
            "sizes_made": len(source.affine.synthesised),
            "margin": trace_margin(source) if margin is None else margin,
            "unmeasured_ops": sorted(source.unmeasured),
        }
    )

    for cell in cells:  # each cap's truth: its peaks against the replay at its size under the same cap
        truth = known.get(cell["cap_gib"])
        if truth is None or not truth.get("peaks"):
            continue
        size = truth["true_max"]
        replayed = source.under(int(cell["cap_gib"] * GIB)).replay(size)
        real = truth["peaks"]
        cell["peaks_at_true_max"] = {
            "size": size,
            "fits_under_cap": replayed.fits,
            "real_reserved": real["peak_reserved"],
            "traced_reserved": replayed.peak_reserved,
            "reserved_error": round(replayed.peak_reserved / real["peak_reserved"] - 1, 4),
            "real_allocated": real["peak_allocated"],
            "traced_allocated": replayed.peak_allocated,
            "allocated_error": round(replayed.peak_allocated / real["peak_allocated"] - 1, 4),
        }
    entry["wall_seconds"] = round(time.perf_counter() - wall, 2)
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt,gpt-longval")
    parser.add_argument("--caps", default="24", help="GiB, comma-separated")
    parser.add_argument("--margin", type=float, default=None, help="default: the planner's (see above)")
    parser.add_argument(
        "--truth", default="", help="benchmarks/tuner.py JSONs with --true-max fit, comma-separated"
    )
    parser.add_argument("--json", default="")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--no-synthesis",
        action="store_true",
        help="trace every size the searches ask for (no streams made from three traced sizes)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    known = truths([p for p in args.truth.split(",") if p])
    caps = [float(c) for c in args.caps.split(",")]
    report = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "margin": args.margin,
        "synthesis": not args.no_synthesis,
        "workloads": [],
    }
    for name in args.models.split(","):
        entry = run(name, caps, args.margin, known.get(name, {}), args.quick, not args.no_synthesis)
        report["workloads"].append(entry)
        print(json.dumps(entry), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
