"""What AutoMicrobatch costs when nothing runs out of memory, and what a split step costs.

    PYTHONPATH=. python3 benchmarks/microbatch_overhead.py --json benchmarks/results/microbatch-overhead.json
    python benchmarks/microbatch_overhead.py --quick      # CPU smoke run

Four configurations of one fit each per round, the order rotated every round: ``none`` (no callback),
``AutoMicrobatch`` (never splits: the throughput cost of its wrappers), ``split2`` (AutoMicrobatch held at 2
micro-batches: the cost of a split step) and ``grown_back`` (AutoMicrobatch that starts at 2 micro-batches and grows
back to 1 within the warm-up: the speed of the steps after growing back). A fit whose split at the end is not the
configuration's stops the benchmark. A fit runs ``--warmup`` untimed steps, then ``--steps`` timed ones; the
clock is read at the first timed batch's start (a callback first in the list) and the last one's end (a callback
last in the list), with ``torch.cuda.synchronize()`` at both on a GPU (``_harness.StepWindow``). Reported: median
steps/s over rounds and the median of the per-round ratios to ``none``. The model is the example's small causal
transformer (``examples/auto_microbatch.py``) on batches of equal length, AdamW, bf16-mixed on a GPU and 32-bit on a
CPU, no logger.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `_harness` next to this file
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import _harness as H
import auto_microbatch as example

from lightning_gpumem import AutoMicrobatch
from lightning_gpumem.microbatch.split import MicrobatchPolicy

CONFIGS = ("none", "AutoMicrobatch", "split2", "grown_back")


class EqualBatches(Dataset):
    def __init__(self, steps: int, batch: int, seq: int) -> None:
        self.steps, self.batch, self.seq = steps, batch, seq

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.randint(
            0, example.VOCAB, (self.batch, self.seq + 1), generator=torch.Generator().manual_seed(index)
        )


class Model(example.TinyLM):
    def __init__(self, data: EqualBatches) -> None:
        super().__init__()
        self.data = data

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=None)


class Split(pl.Callback):
    """Start the fit at ``k`` micro-batches (after AutoMicrobatch's ``setup``, which starts every fit unsplit)."""

    def __init__(self, callback: AutoMicrobatch, k: int, grow_after: int) -> None:
        self.callback, self.k, self.grow_after = callback, k, grow_after

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.callback.policy = MicrobatchPolicy(self.grow_after, k=self.k)


def timed_fit(config: str, args: argparse.Namespace, gpu: bool) -> float:
    data = EqualBatches(args.warmup + args.steps, args.batch, args.seq)
    window = H.StepWindow(args.warmup, args.warmup + args.steps - 1, cuda=gpu)
    start, end = window.callbacks()
    callbacks: list[pl.Callback] = [start]
    callback = None
    if config != "none":
        callback = AutoMicrobatch(grow_after=10**9)
        callbacks.append(callback)
        if config == "split2":
            callbacks.append(Split(callback, 2, grow_after=10**9))  # held at 2
        elif config == "grown_back":
            callbacks.append(
                Split(callback, 2, grow_after=max(1, args.warmup // 2))
            )  # back to 1 in the warm-up
    trainer = pl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        max_steps=args.warmup + args.steps,
        precision="bf16-mixed" if gpu else "32-true",
        callbacks=[*callbacks, end],
        **H.QUIET_TRAINER,
    )
    trainer.fit(Model(data))
    expected = {"split2": 2}.get(config, 1)
    if callback is not None and (callback.microbatches, callback.oom_recoveries) != (expected, 0):
        raise RuntimeError(f"{config}: ended at {callback.microbatches} micro-batches, expected {expected}")
    rate = window.steps_per_second()
    if rate is None:
        raise RuntimeError(
            f"{config}: the fit ran {window.ended} batches, expected {args.warmup + args.steps}"
        )
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument(
        "--quick", action="store_true", help="2 rounds of 15 steps, small batches (CPU smoke run)"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup, args.batch, args.seq = 2, 15, 3, 8, 32
    if min(args.rounds, args.steps, args.batch, args.seq) < 1 or args.warmup < 2 or args.batch < 2:
        parser.error(
            "--rounds, --steps and --seq must be positive, --batch and --warmup at least 2 (grown_back)"
        )
    warnings.filterwarnings("ignore")
    gpu = torch.cuda.is_available()
    timed_fit("none", args, gpu)  # warm the process up
    rounds = H.interleaved_rounds(CONFIGS, args.rounds, lambda config: timed_fit(config, args, gpu))
    results = {
        config: {
            "steps_per_s": statistics.median(r[config] for r in rounds),
            "ratio_vs_none": statistics.median(r[config] / r["none"] for r in rounds),
            "rounds": [r[config] for r in rounds],
        }
        for config in CONFIGS
    }
    print("| config | median steps/s | ratio vs none |\n| --- | --- | --- |")
    for config, r in results.items():
        print(f"| {config} | {r['steps_per_s']:.2f} | {r['ratio_vs_none']:.4f} |")
    if args.json:
        meta = {
            "command": " ".join(sys.argv),
            "device": torch.cuda.get_device_name() if gpu else platform.processor() or "cpu",
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "settings": {k: v for k, v in vars(args).items() if k != "json"},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
        print(f"Wrote {args.json}")


if __name__ == "__main__":
    main()
