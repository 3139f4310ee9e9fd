"""Where does a ``BatchSizeTuner`` search spend its time? Wall time of each stage, the GPU synchronised around each.

    PYTHONPATH=. python3 benchmarks/profile_tuner.py --model gpt --budget-gib 12     # one CUDA GPU
    PYTHONPATH=. python3 benchmarks/profile_tuner.py --finder trace --model hf-gpt2 --budget-gib 24 --headroom 0.02
    PYTHONPATH=. python3 benchmarks/profile_tuner.py --quick                         # CPU smoke run

It runs ``benchmarks/tuner.py``'s finder worker for ``BatchSizeTuner`` in this process (search, then the following
fit), with the tuner's internal stages wrapped in timers: the session's entry (state snapshot) and exit (restore),
each trial's preparation, run, and clean start, the release after the search, and ``start="trace"``'s stages
(``--finder trace``). Prints one JSON object: the search's seconds, the seconds, calls and first start (seconds after
the first stage's) of each stage, and the worker's own result; ``--json PATH`` also writes it.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H
import tuner as bench

from lightning_gpumem._hw import allocator as allocator_module
from lightning_gpumem._hw import host_copy as _host_copy
from lightning_gpumem.tuning import traced_start as _traced
from lightning_gpumem.tuning.trials import bench as bench_module
from lightning_gpumem.tuning.trials import measure as measure_module
from lightning_gpumem.tuning.trials import model_state as _state
from lightning_gpumem.tuning.trials import session as _session

STAGES = [  # (owner, attribute, label)
    (_session.TrialSession, "__enter__", "session enter (snapshot)"),
    (_state.ModelState, "__init__", "  of which: state snapshot"),
    (_host_copy, "touch_pages", "    of which: the host buffer's pages touched"),
    (_session.TrialSession, "__exit__", "session exit (restore, apply)"),
    (_state.ModelState, "restore", "  of which: state restore"),
    (_session.TrialSession, "prepare", "trial prepare"),
    (_state.ModelState, "reset_for_trial", "  of which: optimizer reset"),
    (allocator_module, "start_clean", "clean start (workspaces, empty_cache)"),
    (_session.TrialSession, "run", "trial run (fit loop)"),
    (measure_module, "release_to", "release (before each trial)"),
    (bench_module, "release_to", "release (after the search)"),
    (measure_module, "gather_named", "peak agreement"),
    (_traced.TracedStart, "__init__", "trace: start (before the trials)"),
    (_traced, "traced_source", "  of which: the first batches, the tracer"),
    (_traced, "backward_forks", "  of which: the fork check"),
    (_traced.TracedStart, "_fork", "  of which: the traces' forks"),
    (_traced.TracedStart, "_local", "trace: the guess (the wait for the traces included)"),
    (_traced.TracedStart, "_join", "  of which: the wait for the traces"),
    (_traced.TracedStart, "_later", "  of which: the check's forks (beside the guess's trial)"),
    (_traced.TracedStart, "_settle", "trace: the wait for the check (after the guess's trial)"),
]


# Python's garbage collections: seconds and count per generation, over the whole run
GC: dict[str, list[float]] = {str(generation): [0.0, 0] for generation in range(3)}
_gc_started: list[float] = []


def _gc_watch(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _gc_started[:] = [time.perf_counter()]
    elif _gc_started:
        entry = GC[str(info.get("generation"))]
        entry[0] += time.perf_counter() - _gc_started[0]
        entry[1] += 1


def gc_seconds() -> float:
    """The seconds spent in garbage collections so far."""
    return sum(seconds for seconds, _ in GC.values())


def instrument(
    seconds: dict[str, float],
    calls: dict[str, int],
    firsts: dict[str, float] | None = None,
    collected: dict[str, float] | None = None,
) -> None:
    """Wrap every stage of ``STAGES`` with a synchronised timer adding into ``seconds`` and ``calls``.

    ``firsts``: each stage's first start (``time.perf_counter()``); ``collected``: each stage's seconds in
    garbage collections.
    """
    for owner, name, label in STAGES:
        original = getattr(owner, name, None)
        if original is None:  # a stage of another version of the package
            continue

        def timed(*args: Any, _original: Any = original, _label: str = label, **kwargs: Any) -> Any:
            H.synchronize(torch.cuda.is_available())
            start = time.perf_counter()
            collecting = gc_seconds()
            if firsts is not None:
                firsts.setdefault(_label, start)
            try:
                return _original(*args, **kwargs)
            finally:
                H.synchronize(torch.cuda.is_available())
                seconds[_label] += time.perf_counter() - start
                calls[_label] += 1
                if collected is not None:
                    collected[_label] = collected.get(_label, 0.0) + gc_seconds() - collecting

        setattr(owner, name, timed)


def watch_releases(releases: list[dict[str, Any]]) -> None:
    """Record, for each ``release_to(probe, baseline)``, the bytes allocated above ``baseline`` before and after it."""
    original = bench_module.release_to

    def release(probe: Any, baseline: int | None, *args: Any, **kwargs: Any) -> Any:
        before = probe.allocated_bytes()
        floor = original(probe, baseline, *args, **kwargs)
        after = probe.allocated_bytes()
        if baseline is not None and before is not None and after is not None:
            releases.append({"excess_before": before - baseline, "excess_after": after - baseline})
        return floor

    bench_module.release_to = release


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", default="gpt", help="workload (gpt, gpt-longval, resnet)")
    parser.add_argument("--budget-gib", type=float, default=12.0, help="memory budget in GiB")
    parser.add_argument("--headroom", default="0.05", help="BatchSizeTuner's headroom")
    parser.add_argument("--finder", default="default", help="tuner.py's finder: default, trace, ...")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, simulated OOMs")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    worker_args = bench._parse(
        ["--finder-worker", args.finder, "--model", args.model, "--headroom", args.headroom]
        + ["--budget-bytes", str(int(args.budget_gib * bench.GIB))]
        + (["--quick"] if args.quick else [])
    )
    seconds: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    releases: list[dict[str, Any]] = []
    watch_releases(releases)
    firsts: dict[str, float] = {}
    collected: dict[str, float] = {}
    instrument(seconds, calls, firsts, collected)
    gc.callbacks.append(_gc_watch)
    results: list[dict[str, Any]] = []
    emit = H.emit  # the worker's RESULT line, taken here instead of printed
    H.emit = results.append  # type: ignore[assignment]
    try:
        bench.finder_worker(worker_args)
    finally:
        H.emit = emit
    worker = results[0] if results else {}
    out = {
        "model": args.model,
        "budget_gib": args.budget_gib,
        "headroom": float(args.headroom),
        "search_seconds": worker.get("search_seconds"),
        "trial_seconds": [t["seconds"] for t in worker.get("tuner_trials") or []],
        "releases": releases,
        "gc": {generation: {"seconds": round(t, 4), "count": n} for generation, (t, n) in GC.items()},
        "gc_objects": len(gc.get_objects()),
        "stages": {
            label: {
                "seconds": round(seconds[label], 4),
                "calls": calls[label],
                "first_start": round(firsts[label] - min(firsts.values()), 4) if label in firsts else None,
                "gc_seconds": round(collected.get(label, 0.0), 4),
            }
            for _, _, label in STAGES
        },
        "worker": worker,
    }
    print(json.dumps({k: v for k, v in out.items() if k != "worker"}, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if worker.get("status") == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
