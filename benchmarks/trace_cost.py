"""Where a trace's time goes: the traced step against the same step on meta tensors, on a CPU.

``BatchSizeTuner(start="trace")`` traces two sizes, two training steps and a validation step each, before its
first trial (``docs/benchmarks.md``, "Starting from a trace"); this measures one such trace per workload
(``benchmarks/traced_plan.py``'s tracer, at size 4, after one at size 2 to warm the caches) and, as a floor, the
same steps on meta tensors with no dispatch mode and no recording: PyTorch's meta kernels and the model's own
Python, what any trace on shapes alone pays (bf16 autocast on the CPU, AdamW with ``foreach``)::

    python benchmarks/trace_cost.py --models gpt,gpt-longval,hf-gpt2 --json benchmarks/results/trace-cost-cpu.json

With ``--guess`` it times, instead, what that tuner does on the CPU around its trials (``tuning/traced_start.py``),
in a fresh model: the two sizes traced one after the other and, as the tuner does, each in a forked child at once
(the same events, checked; meta tensors first, as the tuner traces), then ``traced_guess`` under 24 GiB less the CUDA context, calibrated by a first trial at
size 2 whose reserved peak is its replay's plus 10 MiB (the search on the replays under the shifted limit), and the
16-size check below the size found in forked children beside the guess's trial (a 0.5 s sleep here)::

    python benchmarks/trace_cost.py --guess --models gpt,hf-gpt2 --json benchmarks/results/trace-guess-forked-cpu.json
    # trace-guess-cpu.json: 25c9669's (its search before the first trial, then the calibrated one)

With ``--meta``: the package's trace on meta tensors alone (``trace_training``'s ``meta_first`` without its
fallback to fake tensors, patched for this process only), against the trace on fake tensors: seconds at size
4 (after one at size 2: each way's caches warm), whether the events are the same at 2, 8 and 32, and the replays'
peaks there (repeated until steady, no cap)::

    python benchmarks/trace_cost.py --meta --models gpt,gpt-longval,hf-gpt2,gpt124,encoder,gpt-ckpt \
        --json benchmarks/results/trace-meta-cpu.json
    # --models resnet,vit in the vision venv: benchmarks/results/trace-meta-cpu-vision.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import lightning_gpumem._hw.trace as trace_module
from lightning_gpumem._core.forked import Forked, ForkedMap, cores
from lightning_gpumem._core.units import GIB
from lightning_gpumem.tuning.sources.affine import AffineStreams
from lightning_gpumem.tuning.sources.steps import replay_steady
from lightning_gpumem.tuning.sources.traced import CONTEXT_BYTES, TracedSource, traced_guess
from lightning_gpumem.tuning.traced_start import beside_workers, traced_sizes

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _tuner_models as M
from traced_plan import tracer


def meta_steps(w: M.Workload, size: int, steps: int) -> float:
    """Seconds of ``steps`` training steps and a validation step on meta tensors, nothing recorded."""
    with torch.device("meta"):
        model = M.build_model(w)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)  # CUDA's default path
    batch = [t.to("meta") for t in M.first_batch(w, M.build_dataset(w), size)]
    val_batch = [t.to("meta") for t in M.first_batch(w, M.build_val_dataset(w), size)]
    start = time.perf_counter()
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = M.compute_loss(w, model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.zero_grad(set_to_none=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        M.compute_loss(w, model, val_batch, validation=True)
    return time.perf_counter() - start


def measure(name: str, steps: int) -> dict[str, Any]:
    w = M.workload(name, False)
    with torch.device("meta"):  # the trace needs the shapes only
        model = M.build_model(w)
    trace_at = tracer(w, model, steps=steps)
    trace_at(2)
    start = time.perf_counter()
    trace = trace_at(4)
    traced = time.perf_counter() - start
    meta_steps(w, 2, steps)
    floor = meta_steps(w, 4, steps)
    return {
        "model": name,
        "steps": steps,
        "events": len(trace.events),
        "trace_seconds": round(traced, 3),
        "meta_seconds": round(floor, 3),
        "trace_over_meta": round(traced / floor, 2),
    }


SIZES = (2, 8, 32)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """The package's trace with its copies on the meta device and no fake mode, and no fallback to fake ones."""
    original = trace_module._trace_copies

    def meta_only(*args: Any, stand_in: str, **kwargs: Any) -> Any:
        return original(*args, stand_in="meta", **kwargs)

    trace_module._trace_copies = meta_only  # type: ignore[assignment]
    try:
        yield
    finally:
        trace_module._trace_copies = original


def measure_meta(name: str) -> dict[str, Any]:
    w = M.workload(name, False)
    with torch.device("meta"):
        model = M.build_model(w)
    trace_at = tracer(w, model, steps=2)  # as the tuner traces: two steps, Lightning's validation
    row: dict[str, Any] = {"model": name}
    traces = {}
    for label, context in (("fake", contextlib.nullcontext), ("meta", on_meta)):
        with context():
            trace_at(2)
            start = time.perf_counter()
            trace_at(4)
            row[f"{label}_seconds"] = round(time.perf_counter() - start, 3)
            traces[label] = {size: trace_at(size) for size in SIZES}
    row["meta_over_fake"] = round(row["meta_seconds"] / row["fake_seconds"], 2)
    row["cannot_trace"] = traces["meta"][SIZES[0]].cannot_trace
    row["events_equal"] = all(traces["fake"][s].events == traces["meta"][s].events for s in SIZES)
    row["events"] = {label: len(traces[label][SIZES[0]].events) for label in traces}
    row["peaks"] = {}
    for size in SIZES:
        peaks = {}
        for label in traces:
            replayed, _ = replay_steady(traces[label][size].events)
            peaks[label] = (replayed.peak_reserved, replayed.peak_allocated)
        row["peaks"][size] = {
            "reserved": peaks["fake"][0],
            "reserved_meta_error": round(peaks["meta"][0] / peaks["fake"][0] - 1, 5),
            "allocated": peaks["fake"][1],
            "allocated_meta_error": round(peaks["meta"][1] / peaks["fake"][1] - 1, 5),
        }
    return row


FORK_SECONDS = 0.07  # a fork of a CUDA process holding a model (benchmarks/fork_cost.py: ~20 ms a GiB)
TRIAL_SECONDS = 0.5  # the guess's trial on the H100 (docs/benchmarks.md)


def measure_guess(name: str) -> dict[str, Any]:
    """Seconds of what ``start="trace"`` does on the CPU: the two sizes traced, then the calibrated guess.

    The two sizes (2 and 5, ``traced_sizes``) one after the other here, then each in a forked child at once
    (``TracedStart``'s way; the wall time until both are back); then the guess after a first trial at size 2
    whose reserved peak is its replay's plus 10 MiB (the replays searched under the shifted limit); the check
    below in forked children as ``TracedStart`` starts it beside the guess's trial (a sleep of
    ``TRIAL_SECONDS`` here), and the wait for it after that trial.
    """
    w = M.workload(name, False)
    with torch.device("meta"):
        model = M.build_model(w)
    # as the tuner traces: two steps, Lightning's validation, meta tensors first
    trace_at = tracer(w, model, steps=2, meta_first=True)
    sizes = traced_sizes(2, w.search_upper)
    start = time.perf_counter()
    here = {size: trace_at(size) for size in sizes}
    sequential = time.perf_counter() - start
    start = time.perf_counter()
    children = {size: Forked(functools.partial(trace_at, size)) for size in sizes}
    forked = {size: child.result(600.0) for size, child in children.items()}
    parallel = time.perf_counter() - start
    assert all(forked[size].events == here[size].events for size in sizes)
    source = TracedSource(trace_at, affine=AffineStreams(checked=False))  # the tuner's: two traced sizes
    for size, trace in forked.items():
        source.add(size, trace)
    replays: list[int] = []
    waited: list[float] = []

    def later(run: Any, asked: Any, replay_seconds: float) -> Any:  # as TracedStart's: forked children
        replays.extend(asked)
        workers = beside_workers(len(asked), replay_seconds, FORK_SECONDS, TRIAL_SECONDS, cores())
        mapped = ForkedMap(run, asked, workers=workers) if cores() > 1 else None

        def wait() -> list[Any]:
            begun = time.perf_counter()
            replayed = mapped.result(600.0) if mapped is not None else None
            done = replayed if replayed is not None else [run(size) for size in asked]
            waited.append(time.perf_counter() - begun)
            return done

        return wait

    guess = traced_guess(
        source, 24 * GIB - CONTEXT_BYTES, upper=w.search_upper, init_val=2, headroom=0.02, later=later
    )
    start = time.perf_counter()
    replayed = source.under(None)(2)
    first = dataclasses.replace(replayed, peak_bytes=(replayed.peak_bytes or 0) + 10 * 2**20)
    guessed = guess(first)
    calibrate = time.perf_counter() - start
    time.sleep(TRIAL_SECONDS)  # the guess's trial, on the GPU
    settled = guessed.settle() if guessed is not None and guessed.settle is not None else guessed
    return {
        "model": name,
        "sizes_traced": sizes,
        "cores": cores(),
        "trace_sequential_seconds": round(sequential, 3),
        "trace_forked_seconds": round(parallel, 3),
        "guess_seconds": round(calibrate, 3),
        "sizes_checked_below": len(replays),
        "check_waited_after_trial_seconds": round(sum(waited), 3),
        "guess": None if guessed is None else guessed.size,
        "settled": None if settled is None else settled.size,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="gpt,gpt-longval,hf-gpt2")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--guess", action="store_true", help="time traced_guess and its calibration instead")
    parser.add_argument(
        "--meta", action="store_true", help="the trace on meta tensors against the package's"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    rows = []
    for name in args.models.split(","):
        if args.meta:
            rows.append(measure_meta(name))
        else:
            rows.append(measure_guess(name) if args.guess else measure(name, args.steps))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        report = {"torch": torch.__version__, "threads": 2, "workloads": rows}
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
