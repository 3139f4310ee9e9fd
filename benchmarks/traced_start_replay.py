"""``BatchSizeTuner(start="trace")`` replayed on recorded GPU trials: its trials, and its time estimated.

No GPU: each workload of ``benchmarks/tuner.py`` is traced here as the tuner traces it with ``start="trace"``
(two sizes, two training steps each, Lightning's validation; ``benchmarks/traced_plan.py``'s tracer) and its
guess (``tuning/sources/traced.py: traced_guess``) is calibrated by the first trial the default search ran on
the GPU. The search and the headroom then run as the tuner runs them, on the trials recorded there
(``--trials``: a ``benchmarks/tuner.py`` JSON, the default finder's ``tuner_trials``); a size not recorded
fits where it is at most the true largest size (``--truth``: ``--true-max fit`` JSONs), with its peak on the
line of the nearest recorded ones and the seconds of the nearest recorded trial (such trials are counted in
``estimated``). The time is an estimate: the tracing measured here, plus the recorded trials' seconds, plus
the default search's time outside its trials (process, loaders, the trial bench)::

    python benchmarks/traced_start_replay.py --models gpt,gpt-longval,hf-gpt2 \\
        --json benchmarks/results/traced-start-replay-cpu.json
    # resnet,vit in the vision venv: --json benchmarks/results/traced-start-replay-cpu-vision.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _tuner_models as M
from traced_plan import tracer

from lightning_gpumem.tuning.search import leave_headroom, search_batch_size
from lightning_gpumem.tuning.search.headroom import TUNER_TOLERANCE
from lightning_gpumem.tuning.search.model import Trial
from lightning_gpumem.tuning.sources.affine import AffineStreams
from lightning_gpumem.tuning.sources.traced import TracedSource, traced_guess
from lightning_gpumem.tuning.tune import MAX_TRIALS

RESULTS = Path(__file__).resolve().parent / "results"
TRIALS = RESULTS / "tuner-42-all-h100.json"
TRUTHS = [RESULTS / f"tuner-42{part}-h100.json" for part in "abc"]


def recorded_source(trials: list[dict[str, Any]], true_max: int, estimated: set[int]) -> Any:
    """``run(size) -> Trial`` from the recorded trials; other sizes fit up to ``true_max``."""
    by_size = {t["batch_size"]: t for t in trials}
    ran = sorted((t["batch_size"], t["peak_bytes"]) for t in trials if t["fits"])

    def run(size: int) -> Trial:
        if size in by_size:
            t = by_size[size]
            return Trial(
                size, fits=t["fits"], peak_bytes=t["peak_bytes"], seconds=t["seconds"], samples=size
            )
        estimated.add(size)
        nearest = min(by_size.values(), key=lambda t: abs(t["batch_size"] - size))
        if size > true_max:
            return Trial(size, fits=False, seconds=nearest["seconds"], samples=size)
        below = [p for p in ran if p[0] <= size] or ran[:1]
        above = [p for p in ran if p[0] >= size] or ran[-1:]
        (a, pa), (b, pb) = below[-1], above[0]
        peak = pa if a == b else pa + (pb - pa) * (size - a) // (b - a)
        return Trial(size, fits=True, peak_bytes=peak, seconds=nearest["seconds"], samples=size)

    return run


def replay(
    name: str, recorded: dict[str, Any], true_max: int, budget: int, headroom: float
) -> dict[str, Any]:
    """The traced start on ``name``'s recorded trials: its trials and the estimated time."""
    w = M.workload(name, False)
    with torch.device("meta"):  # the trace needs the shapes only
        model = M.build_model(w)
    finders = recorded["finders"]
    default = finders["default"]
    start = time.perf_counter()
    source = TracedSource(tracer(w, model, steps=2), affine=AffineStreams(checked=False))
    guess = traced_guess(source, budget, upper=16384, init_val=2, headroom=headroom)
    first = default["tuner_trials"][0]
    guessed = guess(Trial(first["batch_size"], fits=True, peak_bytes=first["peak_bytes"]))
    trace_seconds = time.perf_counter() - start
    largest = traced_guess(source, budget, upper=16384, init_val=2)(  # the same, without the headroom
        Trial(first["batch_size"], fits=True, peak_bytes=first["peak_bytes"])
    )
    estimated: set[int] = set()
    run = recorded_source(default["tuner_trials"], true_max, estimated)
    result = search_batch_size(
        run,
        init_val=2,
        upper=16384,
        limit_bytes=budget,
        max_trials=MAX_TRIALS,
        tolerance=TUNER_TOLERANCE,
        guess=lambda trial: guessed,
    )
    result = leave_headroom(run, result, headroom, budget, MAX_TRIALS)
    outside = default["search_seconds"] - sum(t["seconds"] for t in default["tuner_trials"])
    seconds = trace_seconds + sum(t.seconds for t in result.trials) + outside
    binsearch = finders.get("binsearch", {}).get("search_seconds")
    return {
        "model": name,
        "true_max": true_max,
        "guess": None if largest is None else largest.size,
        "guess_kept": None if guessed is None or not guessed.kept else guessed.size,
        "batch_size": result.batch_size,
        "trials": [(t.batch_size, t.fits) for t in result.trials],
        "estimated": sorted(estimated),
        "trace_seconds": round(trace_seconds, 2),
        "seconds": round(seconds, 2),
        "default": {"seconds": round(default["search_seconds"], 2), "trials": len(default["tuner_trials"])},
        "binsearch_seconds": None if binsearch is None else round(binsearch, 2),
        "vs_binsearch": None if not binsearch else round(seconds / binsearch, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="gpt,gpt-longval,hf-gpt2")
    parser.add_argument("--trials", default=str(TRIALS))
    parser.add_argument("--truth", default=",".join(str(p) for p in TRUTHS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    data = json.loads(Path(args.trials).read_text())
    truths = {}
    for path in args.truth.split(","):
        for name, w in json.loads(Path(path).read_text())["workloads"].items():
            truths[name] = (w.get("true_max") or {}).get("true_max")
    budget, headroom = data["settings"]["budget_bytes"], float(data["settings"]["headroom"])
    rows = []
    for name in args.models.split(","):
        row = replay(name, data["workloads"][name], truths[name], budget, headroom)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        report = {"torch": torch.__version__, "threads": 2, "trials": args.trials, "workloads": rows}
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
