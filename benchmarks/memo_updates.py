"""The meta trace with and without the optimizers' updates skipped by ``MetaMemo`` (``_hw/meta_memo.py``), on a CPU.

    PYTHONPATH=. python3 benchmarks/memo_updates.py --models gpt,hf-gpt2,gpt124 --rounds 8 \
        --json benchmarks/results/memo-updates-cpu.json

Per workload (``benchmarks/_tuner_models.py``, as ``BatchSizeTuner(start="trace")`` traces: two bf16 steps and a
validation step on meta tensors), after a trace at size 2 to warm the caches: the trace at size 3 with the memo as
it is (``skipped``: an update is never asked) and with the memo before (``asked``: an update's meta kernel asked
once per signature, each trace), alternating, ``--rounds`` of each; the median seconds and whether the events are
the same.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _tuner_models as M
from traced_plan import tracer

import lightning_gpumem._hw.meta_memo as memo_module

SKIPPED = memo_module.MetaMemo.__call__


def asked(self: Any, func: Any, args: Any, kwargs: Any) -> Any:
    """``MetaMemo.__call__`` before the updates were skipped: their kernels asked on a miss."""
    if not self._may_remember(func) or "out" in kwargs:
        return func(*args, **kwargs)
    update = self._updates(func)
    try:
        key = (
            func,
            torch.get_default_dtype(),
            memo_module._key(args, not update),
            memo_module._key(kwargs, not update),
        )
    except memo_module._Unkeyable:
        return func(*args, **kwargs)
    known = self._known.get(key)
    if known is not None and known is not memo_module._BYPASS:
        self.hits += 1
        return memo_module._remake(known)
    out = func(*args, **kwargs)
    if known is None:
        try:
            self._known[key] = memo_module._VOID if update else memo_module._recipe(out, args, kwargs)
        except Exception:
            self._known[key] = memo_module._BYPASS
    return out


def measure(name: str, rounds: int) -> dict[str, Any]:
    w = M.workload(name, False)
    torch.manual_seed(0)
    trace_at = tracer(w, M.build_model(w), steps=2, meta_first=True)
    trace_at(2)
    seconds: dict[str, list[float]] = {"skipped": [], "asked": []}
    events: dict[str, Any] = {}
    ways = [("skipped", SKIPPED), ("asked", asked)]
    for index in range(rounds):
        for label, call in ways if index % 2 == 0 else ways[::-1]:
            memo_module.MetaMemo.__call__ = call  # type: ignore[method-assign]
            start = time.perf_counter()
            events[label] = trace_at(3).events
            seconds[label].append(time.perf_counter() - start)
    memo_module.MetaMemo.__call__ = SKIPPED  # type: ignore[method-assign]
    out = {"model": name, **{k: round(statistics.median(v), 3) for k, v in seconds.items()}}
    return out | {"events_equal": events["skipped"] == events["asked"], "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--models", default="gpt,hf-gpt2,gpt124")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results = []
    for name in args.models.split(","):
        results.append(measure(name, args.rounds))
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"cores": len(__import__("os").sched_getaffinity(0)), "results": results}, indent=1)
            + "\n"
        )
    return 0 if all(r["events_equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
