"""The search on synthetic memory curves, against the previous version's searches: trials, near-limit trials, sizes.

Pure and CPU only (no Trainer, no CUDA): each search runs on the 40 random curves of
``tests/tuning/test_search.py`` (fixed memory, plateaus, validation lines, allocator jumps of up to 13% near the cap;
every answer known exactly), in this process for the current package and in a subprocess for the previous one
(``--previous DIR``, a directory holding an older ``lightning_gpumem/``, imported as ``benchmarks/tuner.py`` does)::

    PYTHONPATH=. python benchmarks/search_curves.py --previous out/previous --json benchmarks/results/search-curves-cpu.json

Per search and tolerance: trials in all, the most trials on one curve, the most near-limit trials on one curve (an
OOM or a size needing over 80% of the cap: the costly ones), the smallest fraction of the true maximum found, and
whether any size found was above it.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

GIB, MIB = 2**30, 2**20
SEEDS = range(40)


def curves() -> list[tuple[Any, Any, Any, int]]:
    """``(live, val, reserved, cap)`` of each seed, as the random-curve test draws them."""
    out = []
    for seed in SEEDS:
        rng = random.Random(seed)
        cap = rng.choice([12, 24, 48]) * GIB
        fixed, per = rng.uniform(0.5, 8) * GIB, rng.uniform(2, 400) * MIB
        plateau = rng.choice([0, rng.uniform(1, 4) * GIB])
        jump, at = rng.choice([1.0, 1.03, 1.08, 1.13]), rng.uniform(0.6, 0.95)
        val_per = rng.choice([None, per * rng.uniform(0.3, 2.5)])

        def live(b: int, fixed: float = fixed, plateau: float = plateau, per: float = per) -> float:
            return max(fixed + plateau, fixed + per * b)

        val = None if val_per is None else (lambda b, f=fixed, v=val_per: f * 0.5 + v * b)

        def reserved(
            b: int, live: Any = live, val: Any = val, jump: float = jump, at: float = at, cap: int = cap
        ):
            need = max(live(b), val(b) if val else 0)
            return need * (jump if need > at * cap else 1.0)

        out.append((live, val, reserved, cap))
    return out


def measure(search_names: list[str], tolerances: list[float]) -> dict[str, Any]:
    """Every search named (attributes of ``lightning_gpumem.tuning.search``) at each tolerance, on every curve."""
    import lightning_gpumem
    import lightning_gpumem.tuning.search as S

    results: dict[str, Any] = {"package_file": lightning_gpumem.__file__, "searches": {}}
    for name in search_names:
        search = getattr(S, name)
        for tolerance in tolerances:
            trials, most, near_most, worst, above = 0, 0, 0, 1.0, 0
            for live, val, reserved, cap in curves():
                truth = max((b for b in range(1, 20000) if reserved(b) <= cap), default=None)
                if truth is None:
                    continue

                def run(
                    b: int, live: Any = live, val: Any = val, reserved: Any = reserved, cap: int = cap
                ) -> Any:
                    fits = reserved(b) <= cap
                    need = max(live(b), val(b) if val else 0)
                    return S.Trial(
                        b, fits, peak_bytes=int(reserved(b)) if fits else None,
                        allocated_bytes=int(need) if fits else None, train_peak_bytes=int(live(b)) if fits else None,
                        val_peak_bytes=int(val(b)) if fits and val else None,
                    )  # fmt: skip

                result = search(run, upper=20000, limit_bytes=cap, tolerance=tolerance)
                near = [t for t in result.trials if (t.allocated_bytes or cap) > 0.8 * cap]
                trials, most, near_most = (
                    trials + len(result.trials),
                    max(most, len(result.trials)),
                    max(near_most, len(near)),
                )
                found = result.batch_size or 0
                worst, above = min(worst, found / truth), above + (found > truth)
            results["searches"][f"{name}@{tolerance}"] = {
                "trials": trials, "most_trials": most, "most_near_limit": near_most,
                "smallest_fraction_of_truth": round(worst, 4), "above_truth": above,
            }  # fmt: skip
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--previous", help="a directory holding the previous version's lightning_gpumem/")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tolerances = [0.01, 0.02]
    if args.worker:  # the previous version, in this fresh process
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import tuner  # its import of the previous package wins over an editable install

        tuner._use_previous_package(args.previous)
        print(json.dumps(measure(["search_batch_size", "search_by_plan"], tolerances)))
        return 0
    report = {"current": measure(["search_batch_size"], tolerances)}
    if args.previous:
        worker = [sys.executable, __file__, "--worker", "--previous", args.previous]
        report["previous"] = json.loads(
            subprocess.run(worker, check=True, capture_output=True, text=True).stdout
        )
    for version, found in report.items():
        for name, figures in found["searches"].items():
            print(f"{version:8} {name:26} {figures}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
