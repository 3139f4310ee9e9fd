"""A workload's trace against a recorded allocator history of the same steps: peaks, and the sizes that differ.

Usage (anywhere; the stream from ``benchmarks/allocator_fidelity.py --out DIR --gpt SIZE --gpt-workload NAME``,
which records two training steps (``--steps``) and a validation step as a plain loop runs them, or as the tuner
benchmark's Lightning fit does with ``--lightning``)::

    python benchmarks/trace_vs_history.py benchmarks/results/allocator-streams-h100/hf-gpt2-b13-native-capped.json.gz

Prints the recorded peaks, the replay of the recorded stream, the replay of the trace of the same steps
(``tests/helpers/benchmark_gpt.py``'s ``gpt_tracer``, two steps, validation as a plain loop runs it) under the
stream's cap and without one, and the request sizes one side makes more often than the other (size: count).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
STEPS = 2  # allocator_fidelity.py's, where a stream does not say


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "stream", type=Path, help="a <workload>-b<size>-*.json.gz of allocator_fidelity.py --gpt"
    )
    parser.add_argument("--top", type=int, default=8, help="sizes to print on each side")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    from benchmarks.allocator_fidelity import replayable
    from lightning_gpumem._core.alloc_events import Event
    from lightning_gpumem.tuning.sources.allocator import replay
    from tests.helpers.benchmark_gpt import gpt_tracer

    with gzip.open(args.stream, "rt", encoding="utf-8") as file:
        data = json.load(file)
    events, real = replayable(Event, data)
    recorded = replay(events, limit_bytes=data["limit_bytes"])
    steps = data.get("steps", STEPS)
    lightning = bool(
        data.get("lightning")
    )  # allocator_fidelity.py --lightning: a fit's own batches and order
    trace = gpt_tracer(steps=steps, lightning=lightning, workload=data["model"])(data["batch"]).events
    capped, free = replay(trace, limit_bytes=data["limit_bytes"]), replay(trace)
    print(f"{data['case']} ({data['device']}, torch {data['torch']}), cap {data['limit_bytes']}")
    print(f"recorded: reserved {real['peak_reserved']}, allocated {real['peak_allocated']}")
    print(f"its stream replayed: reserved {recorded.peak_reserved}, fits {recorded.fits}")
    print(
        f"the trace replayed: under the cap fits {capped.fits}, reserved {capped.peak_reserved}"
        f" ({capped.peak_reserved / recorded.peak_reserved - 1:+.2%} of the stream's replay);"
        f" without it reserved {free.peak_reserved}"
        f" ({free.peak_reserved / real['peak_reserved'] - 1:+.2%}), allocated {free.peak_allocated}"
        f" ({free.peak_allocated / real['peak_allocated'] - 1:+.2%})"
    )
    sizes = [Counter(e.size for e in side if e.action == "alloc") for side in (events, trace)]
    for name, more in (("recorded", sizes[0] - sizes[1]), ("traced", sizes[1] - sizes[0])):
        largest = sorted(more.items(), key=lambda item: -item[0] * item[1])[: args.top]
        print(f"requested more often {name}: " + ", ".join(f"{size}: {count}" for size, count in largest))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
