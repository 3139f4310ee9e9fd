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

from lightning_gpumem._core.leaks import LeakDetector
from lightning_gpumem._pl.logging import steps_to_next_log

MIB = 2**20
GIB = 2**30


def run(values: list[int], rounds: int, log_every: int) -> dict[str, float]:
    """Time ``add`` over ``values`` (one per step), ``rounds`` times; the round with the lowest total counts."""
    best: dict[str, float] = {}
    for _ in range(rounds):
        detector, times, flagged, reads = LeakDetector(), [], None, 0
        for step, value in enumerate(values):
            next_log_in = steps_to_next_log(step, log_every) if log_every else None
            if (step + 1) % max(log_every, 1) == 0 and log_every:
                next_log_in = 0  # a logging step: the monitor has just read the allocator
            if detector.wants(step, next_log_in):
                reads += next_log_in != 0
                start = time.perf_counter_ns()
                verdict = detector.add(step, value, next_log_in)
                times.append(time.perf_counter_ns() - start)
                if verdict is not None and flagged is None:
                    flagged = step
        total_us = sum(times) / 1e3
        if not best or total_us < best["total_us"]:
            best = {
                "samples": len(times),
                "allocator_reads": reads,
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
    parser.add_argument(
        "--log-every",
        type=int,
        default=0,
        help="as log_every_n_steps=N: logging steps' samples are free (0: none)",
    )
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
    results = {name: run(values, args.rounds, args.log_every) for name, values in workloads.items()}
    late = results["late_leak_1_mib_per_step"]
    late["leak_starts_at_step"] = args.steps
    late["flagged_steps_after_start"] = (
        late["flagged_at_step"] - args.steps if late["flagged_at_step"] >= 0 else -1
    )
    print(
        "| workload | samples | reads | mean µs per batch | median µs per add | max µs per add | flagged at step |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        print(
            f"| {name} | {r['samples']} | {r['allocator_reads']} | {r['mean_us_per_batch']:.2f} |"
            f" {r['median_us_per_add']:.2f} |"
            f" {r['max_us_per_add']:.1f} | {r['flagged_at_step']} |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "command": " ".join(sys.argv),
            "python": platform.python_version(),
            "machine": platform.processor(),
        }
        report = {"meta": meta, "steps": args.steps, "log_every": args.log_every, "results": results}
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
