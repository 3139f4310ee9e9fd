"""Time the report's event-file reader against TensorBoard's ``EventAccumulator`` on one file of 32,000 scalars.

    python benchmarks/report_reader.py --json benchmarks/results/report-reader-cpu.json

Writes one TensorBoard event file with torch's ``SummaryWriter`` (as Lightning's ``TensorBoardLogger`` does: one
event per scalar), ``--tags`` ``gpumem/`` tags x ``--steps`` steps (16 x 2000 = 32,000 scalars by default), then reads
it back with both readers and checks that they give the same ``(step, value)`` points:

- ours: ``lightning_gpumem.report._events.read_scalars(path)`` (the file read, CRC-32C checked, scalars decoded);
- TensorBoard's: ``EventAccumulator(path, size_guidance={"scalars": 0}).Reload()`` (every scalar kept) and
  ``Scalars(tag)`` for every tag, as ``tests/report/test_report.py`` compares them.

Two timings per reader. Warm: in this process, imports done and one read dropped, ``--rounds`` reads each,
interleaved; the median and the fastest. Cold: a fresh interpreter per read (``--cold-rounds`` each), timed inside it
from before the reader's import to the end of the read, as a ``gpumem report`` run meets it (the interpreter's own
start-up not counted); the median. CPU only; the numbers depend on the machine. ``--quick``: 3,200 scalars, two
rounds, one cold round (a smoke test).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

READERS = ("ours", "event_accumulator")

# What a fresh interpreter runs for a cold read: {path} is the event file; prints seconds and the scalars read.
_COLD = {
    "ours": """
import sys, time
start = time.perf_counter()
from lightning_gpumem.report._events import read_scalars
count = sum(map(len, read_scalars(sys.argv[1]).values()))
print(time.perf_counter() - start, count)
""",
    "event_accumulator": """
import sys, time
start = time.perf_counter()
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
accumulator = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
accumulator.Reload()
count = sum(len(accumulator.Scalars(tag)) for tag in accumulator.Tags()["scalars"])
print(time.perf_counter() - start, count)
""",
}


def write_events(directory: Path, tags: int, steps: int) -> Path:
    """One event file of ``tags`` x ``steps`` scalars (memory-like values), written as Lightning's logger writes."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(directory))
    names = [f"gpumem/bench_{i:02d}_gib" for i in range(tags)]
    for step in range(steps):
        for i, name in enumerate(names):
            writer.add_scalar(name, 1.0 + i * 0.25 + (step % 97) / 97, step)
    writer.close()
    (path,) = directory.glob("events.out.tfevents.*")
    return path


def read_ours(path: Path) -> dict[str, list[tuple[int, float]]]:
    from lightning_gpumem.report._events import read_scalars

    return read_scalars(path)


def read_tensorboard(path: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


def warm(path: Path, rounds: int) -> dict[str, dict[str, float]]:
    """Seconds per read in this process, readers interleaved; the first read of each dropped."""
    readers = {"ours": read_ours, "event_accumulator": read_tensorboard}
    times: dict[str, list[float]] = {name: [] for name in READERS}
    for name in READERS:
        readers[name](path)  # imports and first-touch costs
    for _ in range(rounds):
        for name in READERS:
            start = time.perf_counter()
            readers[name](path)
            times[name].append(time.perf_counter() - start)
    return {
        name: {"median_s": statistics.median(values), "min_s": min(values), "rounds_s": values}
        for name, values in times.items()
    }


def cold(path: Path, rounds: int, scalars: int) -> dict[str, dict[str, float]]:
    """Seconds per read in a fresh interpreter (the reader's import included), readers interleaved."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    times: dict[str, list[float]] = {name: [] for name in READERS}
    for _ in range(rounds):
        for name in READERS:
            result = subprocess.run(
                [sys.executable, "-c", _COLD[name], str(path)],
                capture_output=True,
                text=True,
                env=env,
                check=True,
                timeout=600,
            )
            seconds, count = result.stdout.split()
            if int(count) != scalars:
                raise RuntimeError(f"{name} read {count} scalars in a fresh process, expected {scalars}")
            times[name].append(float(seconds))
    return {
        name: {"median_s": statistics.median(values), "rounds_s": values} for name, values in times.items()
    }


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            model = next(
                (line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), ""
            )
    except OSError:
        model = ""
    return f"{model or platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tags", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=9, help="warm reads per reader")
    parser.add_argument("--cold-rounds", type=int, default=5, help="fresh-interpreter reads per reader")
    parser.add_argument("--quick", action="store_true", help="3,200 scalars, 2 rounds, 1 cold round")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds, args.cold_rounds = args.steps // 10, 2, 1
    if min(args.tags, args.steps, args.rounds, args.cold_rounds) < 1:
        parser.error("--tags, --steps, --rounds and --cold-rounds must be at least 1")
    scalars = args.tags * args.steps
    with tempfile.TemporaryDirectory() as tmp:
        path = write_events(Path(tmp), args.tags, args.steps)
        ours, theirs = read_ours(path), read_tensorboard(path)
        if sum(map(len, ours.values())) != scalars or ours.keys() != theirs.keys():
            raise RuntimeError("the readers disagree on what the file holds")
        for (
            tag,
            points,
        ) in theirs.items():  # TensorBoard keeps float32 values as Python floats: equal, not close
            if ours[tag] != points:
                raise RuntimeError(f"the readers disagree on {tag}")
        file_bytes = path.stat().st_size
        load_before = os.getloadavg()[
            0
        ]  # other work on the machine slows both readers: recorded beside the times
        warm_times = warm(path, args.rounds)
        cold_times = cold(path, args.cold_rounds, scalars)
        load_after = os.getloadavg()[0]
    print(f"{scalars} scalars ({args.tags} tags x {args.steps} steps), {file_bytes} bytes; {_cpu()}")
    print(f"1-minute load average {load_before:.2f} before, {load_after:.2f} after")
    print("| reader | warm median s | warm fastest s | cold median s (import + read) |")
    print("| --- | --- | --- | --- |")
    for name in READERS:
        w, c = warm_times[name], cold_times[name]
        print(f"| {name} | {w['median_s']:.3f} | {w['min_s']:.3f} | {c['median_s']:.3f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta: dict[str, Any] = {
            "command": " ".join(["python", *sys.argv]),
            "date": time.strftime("%Y-%m-%d"),
            "python": platform.python_version(),
            "cpu": _cpu(),
            "tensorboard": _version("tensorboard"),
            "torch": _version("torch"),
            "protobuf": _version("protobuf"),
            "load_average_1min": [round(load_before, 2), round(load_after, 2)],
        }
        report = {
            "meta": meta,
            "scalars": scalars,
            "tags": args.tags,
            "steps": args.steps,
            "file_bytes": file_bytes,
            "same_values": True,
            "warm": warm_times,
            "cold": cold_times,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
