"""Cost of leak detection's bookkeeping (``LeakDetector``) per training batch, without the allocator read.

    python benchmarks/leak_detector.py --json benchmarks/results/leak-detector-cpu.json

Feeds the detector as ``MemoryMonitor`` does (a sample whenever ``wants(step)``) for ``--steps`` steps of a healthy
run (allocated memory flat, or varying by up to 80 MiB at random as with batches of varying shapes), of a 4 MiB/step
leak, and of a 1 MiB/step leak that starts after the healthy ``--steps`` (run for 1000 more), timing every ``add``
with ``time.perf_counter_ns``. Reported: samples taken, the mean and maximum ``add`` time per training batch (the sum
over the run divided by the steps), and the step at which a leak was flagged. The allocator read each sample needs
comes on top (see docs/benchmarks.md for its cost on an H200). CPU only; the numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_gpumem._leaks import LeakDetector

MIB = 2**20
GIB = 2**30


def run(values: list[int], rounds: int) -> dict[str, float]:
    """Time ``add`` over ``values`` (one per step), ``rounds`` times; the round with the lowest total counts."""
    best: dict[str, float] = {}
    for _ in range(rounds):
        detector, times, flagged = LeakDetector(), [], None
        for step, value in enumerate(values):
            if detector.wants(step):
                start = time.perf_counter_ns()
                verdict = detector.add(step, value)
                times.append(time.perf_counter_ns() - start)
                if verdict is not None and flagged is None:
                    flagged = step
        total_us = sum(times) / 1e3
        if not best or total_us < best["total_us"]:
            best = {
                "samples": len(times),
                "total_us": total_us,
                "mean_us_per_batch": total_us / len(values),
                "median_us_per_add": statistics.median(times) / 1e3,
                "max_us_per_add": max(times) / 1e3,
                "flagged_at_step": -1 if flagged is None else flagged,
            }
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    if args.steps < 100 or args.rounds < 1:
        parser.error("--steps must be at least 100 and --rounds at least 1")
    rng = random.Random(0)
    workloads = {
        "flat": [GIB] * args.steps,
        "varying_shapes_0_80_mib": [GIB + int(rng.uniform(0, 80 * MIB)) for _ in range(args.steps)],
        "leak_4_mib_per_step": [GIB + 4 * MIB * s for s in range(args.steps)],
        "late_leak_1_mib_per_step": [GIB] * args.steps + [GIB + MIB * s for s in range(1000)],
    }
    results = {name: run(values, args.rounds) for name, values in workloads.items()}
    late = results["late_leak_1_mib_per_step"]
    late["leak_starts_at_step"] = args.steps
    late["flagged_steps_after_start"] = late["flagged_at_step"] - args.steps if late["flagged_at_step"] >= 0 else -1
    print("| workload | samples | mean µs per batch | median µs per add | max µs per add | flagged at step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        print(
            f"| {name} | {r['samples']} | {r['mean_us_per_batch']:.2f} | {r['median_us_per_add']:.2f} |"
            f" {r['max_us_per_add']:.1f} | {r['flagged_at_step']} |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"command": " ".join(sys.argv), "python": platform.python_version(), "machine": platform.processor()}
        args.json.write_text(json.dumps({"meta": meta, "steps": args.steps, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
