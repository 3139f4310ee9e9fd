"""What OOMSnapshot's allocation history costs: training steps per second with and without it (GPU only).

    PYTHONPATH=. python3 benchmarks/history_overhead.py --json history.json

A 4-layer GPT-style decoder (d_model 512, seq 256, batch 32, bf16-mixed, AdamW; the model of
``benchmarks/monitor_overhead.py``) trains ``--steps`` steps in plain PyTorch, alternately with
what ``OOMSnapshot`` turns on (``_record_memory_history(context="alloc", stacks="python", max_entries=100_000)``),
with PyTorch's default recording (``context="all", stacks="all"``: C++ stacks too, which ``OOMSnapshot`` does not
use) and without history, ``--rounds`` times each, interleaved; the first ``--warmup`` steps of each run are not
timed. The table gives the median steps/s of each and the ratio to no history, and the cost of one ``_snapshot()``
plus pickling it (what an OOM or ``at_steps`` pays once) with each setting.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True, norm_first=True)
    model = torch.nn.TransformerEncoder(layer, 4).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


MODES = {
    "off": None,
    "on (`OOMSnapshot`: Python stacks)": {"context": "alloc", "stacks": "python"},
    "on (PyTorch's default: Python and C++ stacks)": {"context": "all", "stacks": "all"},
}


def _start(mode: str) -> bool:
    settings = MODES[mode]
    if settings is None:
        return False
    torch.cuda.memory._record_memory_history(max_entries=100_000, **settings)  # type: ignore[arg-type]
    return True


def _run(steps: int, warmup: int, mode: str) -> float:
    model, optimizer = _model()
    x = torch.randn(32, 256, 512, device="cuda")
    history = _start(mode)
    window = H.StepWindow(warmup, warmup + steps - 1, cuda=True)
    try:
        for _ in range(steps + warmup):
            window.batch_started()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            window.batch_ended()
        return window.steps_per_second()
    finally:
        if history:
            torch.cuda.memory._record_memory_history(enabled=None)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("history_overhead.py needs a CUDA GPU: allocation history is a CUDA allocator feature.")
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            rates[mode].append(_run(args.steps, args.warmup, mode))
    dumps: dict[str, dict[str, float]] = {}
    for mode in list(MODES)[1:]:
        _start(mode)
        _run(20, 0, "off")
        start = time.perf_counter()
        size = len(pickle.dumps(torch.cuda.memory._snapshot()))
        dumps[mode] = {"seconds": time.perf_counter() - start, "bytes": size}
        torch.cuda.memory._record_memory_history(enabled=None)
    off = statistics.median(rates["off"])
    print("| history | steps/s (median) | ratio | snapshot + pickle |\n|---|---|---|---|")
    for mode, values in rates.items():
        rate = statistics.median(values)
        dump = dumps.get(mode)
        cost = f"{dump['seconds'] * 1e3:.0f} ms, {dump['bytes'] / 2**20:.1f} MiB" if dump else "-"
        print(f"| {mode} | {rate:.1f} | {rate / off:.2f} | {cost} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rates": rates, "snapshots": dumps}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
