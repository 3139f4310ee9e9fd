"""The small language model of ``tests/tuning/sources/test_traced_gpu.py``: its real allocator streams, its trace.

Usage::

    PYTHONPATH=. python3 benchmarks/traced_lm_streams.py --out DIR    # CUDA machine: record (fp32, batch 4, 16)
    PYTHONPATH=. python3 benchmarks/traced_lm_streams.py --check DIR  # anywhere: the trace against the streams

``--out`` runs the test's steps on the GPU (``_real_peaks``: the module moved there from a clean allocator, three
AdamW steps and a validation step) with the allocator's history recorded, and writes ``DIR/tiny-b<batch>-fp32.json.gz``:
the stream (``benchmarks/allocator_fidelity.py``'s compact form) and the GPU's peaks. ``--check`` prints, per batch,
the GPU's reserved and allocated peaks, the replay of the recorded stream through the allocator model, and the
replay of the trace of the same steps on fake tensors (the H100's kernels); exit status 1 where the trace's reserved
peak is not the GPU's.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BATCHES = (4, 16)


def record(out: Path) -> None:
    import torch

    from benchmarks.allocator_fidelity import _to_stream
    from tests.tuning.sources.test_traced_gpu import SEQ, VOCAB, Tiny, _real_peaks

    out.mkdir(parents=True, exist_ok=True)
    for batch in BATCHES:
        torch.manual_seed(0)
        module = Tiny()
        tokens = torch.randint(0, VOCAB, (batch, SEQ + 1))
        torch.cuda.memory._record_memory_history(
            enabled="all", context=None, stacks="python", max_entries=200000
        )
        allocated, reserved = _real_peaks(module, tokens, False)
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        events, about = _to_stream(snapshot["device_traces"][torch.cuda.current_device()], [])
        data = {
            "batch": batch,
            "allocated": allocated,
            "reserved": reserved,
            "about": about,
            "events": events,
        }
        path = out / f"tiny-b{batch}-fp32.json.gz"
        with gzip.open(path, "wt", encoding="utf-8") as file:
            json.dump(data, file, separators=(",", ":"))
        print(f"{path}: batch {batch}, allocated {allocated}, reserved {reserved}, {len(events)} events")


def traced_peaks(batch: int) -> tuple[int, int]:
    """The replay of the test's trace at ``batch`` (fp32, the H100's kernels): peak reserved and allocated."""
    import torch

    from lightning_gpumem._core.kernels import H100
    from lightning_gpumem._hw.trace import trace_training
    from lightning_gpumem.tuning.sources.allocator import replay
    from tests.tuning.sources.test_traced_gpu import SEQ, VOCAB, Tiny, _loss

    torch.manual_seed(0)
    module = Tiny()
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1))
    optimizer = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
    trace = trace_training(copy.deepcopy(module), optimizer, _loss, tokens, validate=_loss, device=H100)
    result = replay(trace.events)
    return result.peak_reserved, result.peak_allocated


def check(directory: Path) -> int:
    from benchmarks.allocator_fidelity import _event
    from lightning_gpumem._core.alloc_events import Event
    from lightning_gpumem.tuning.sources.allocator import replay

    exact = True
    for batch in BATCHES:
        with gzip.open(directory / f"tiny-b{batch}-fp32.json.gz", "rt", encoding="utf-8") as file:
            data = json.load(file)
        stream = replay([_event(Event, item) for item in data["events"] if item[0] in "afm"])
        reserved, allocated = traced_peaks(batch)
        exact &= reserved == data["reserved"]
        print(
            f"batch {batch}: GPU reserved {data['reserved']}, allocated {data['allocated']}; its stream replayed:"
            f" reserved {stream.peak_reserved}; the trace replayed: reserved {reserved}"
            f" ({reserved / data['reserved'] - 1:+.2%}), allocated {allocated}"
            f" ({allocated / data['allocated'] - 1:+.2%})"
        )
    return 0 if exact else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--out", type=Path, help="record the streams here (a CUDA machine)")
    group.add_argument("--check", type=Path, help="compare the trace with the streams saved here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    if args.out is not None:
        record(args.out)
        return 0
    return check(args.check)


if __name__ == "__main__":
    raise SystemExit(main())
