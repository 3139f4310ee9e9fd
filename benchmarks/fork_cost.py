"""What a fork of this process costs as its resident memory grows: the tuner's forked traces and check pay it.

``BatchSizeTuner(start="trace")`` forks the process for its two traces and, for the 16-size check below the
size found, up to 8 more copies (``tuning/traced_start.py``). A fork copies the page tables of the process's
anonymous memory, so its cost grows with what the process holds. This times, with 0, 1 and 4 GiB of CPU tensors
resident, the parent's side of one fork (``Forked(...)`` returning), one round trip (a child returning 1), and
``forked_map`` of 15 trivial items over 8 children::

    python benchmarks/fork_cost.py --json benchmarks/results/fork-cost-cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from lightning_gpumem._core.forked import Forked, forked_map


def measure(gib: float, repeats: int) -> dict[str, float]:
    held = torch.ones(int(gib * 2**30) // 4) if gib else None  # touched: resident
    parent, round_trip, mapped = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        child = Forked(lambda: 1)
        parent.append(time.perf_counter() - start)
        child.result(30.0)
        round_trip.append(time.perf_counter() - start)
        start = time.perf_counter()
        forked_map(lambda item: item, list(range(15)), workers=8, timeout=30.0)
        mapped.append(time.perf_counter() - start)
    del held
    return {
        "resident_gib": gib,
        "fork_parent_seconds": round(statistics.median(parent), 4),
        "fork_round_trip_seconds": round(statistics.median(round_trip), 4),
        "forked_map_8_workers_seconds": round(statistics.median(mapped), 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", default="0,1,4")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = [measure(float(gib), args.repeats) for gib in args.gib.split(",")]
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
