"""MemoryPlanner's predictions against measured peaks, and how long a plan takes.

Run it from the repository root on one CUDA GPU (``bash benchmarks/gpu_session.sh plan``)::

    PYTHONPATH=. python3 benchmarks/plan.py --models gpt124,gpt,resnet,vit,encoder,gpt-ckpt --json out.json
    PYTHONPATH=. python3 benchmarks/plan.py --models gpt124 --expandable     # PYTORCH_CUDA_ALLOC_CONF set first
    PYTHONPATH=. python3 benchmarks/plan.py --quick                          # CPU smoke run of the pipeline

For each workload of ``benchmarks/_tuner_models.py`` (``bf16-mixed``, AdamW, the Lightning module of
``benchmarks/tuner.py``), in fresh processes:

1. **Plan.** ``Trainer.fit`` with ``MemoryPlanner(budgets=[48, 24, 12 GiB], validate=True, stop=True)``: the probes,
   the plan, and each budget's largest size run in a trial under that budget's cap. Reported: the probes, the line,
   the seconds of the probes alone (``plan_seconds``: the plan before any validation) and with the validation
   trials, each budget's largest size and whether it ran, and the predicted live (allocated) and reserved peaks at
   three sizes: a quarter, half and 80% of the 48 GiB budget's largest size.
2. **Measure.** At each of those sizes, in a process of its own (no cap), the fit the planner plans: 3 training
   steps and one validation batch at that size set by hand (``tuner.py``'s ``fixed`` worker); its peak allocated
   and reserved bytes are the truth.

Output: a Markdown table (workload | probes | plan s | predicted / measured allocated and reserved at each size,
with the relative error) and, per budget, the largest size and whether it was validated; ``--json`` writes every
number. Relative error is (predicted - measured) / measured: negative is an under-estimate.

``--quick`` runs on the CPU with the tiny models: no memory is measured there, so the planner says it cannot plan
and the pipeline (processes, JSON, table) is what is exercised.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H
import _tuner_models as M
import tuner as T

GIB = H.GIB
BUDGETS_GIB = (48, 24, 12)
FRACTIONS = (0.25, 0.5, 0.8)  # of the 48 GiB budget's largest size: the sizes measured


def plan_worker(args: argparse.Namespace) -> int:
    """The planner on one workload in a fresh process; prints its plan as JSON."""
    result: dict[str, Any] = {"model": args.model, "status": "error", "error": None}
    try:
        warnings.filterwarnings(
            "ignore", message=r".*(num_workers|does not have many workers|LightningModule\.log).*"
        )
        import lightning.pytorch as pl

        from lightning_gpumem import MemoryPlanner

        quick = args.quick or not torch.cuda.is_available()
        module_cls, _, _ = T._lightning_classes()
        w = M.workload(args.model, quick)
        pl.seed_everything(0, verbose=False)
        model = module_cls(w)
        planner = MemoryPlanner(budgets=[b * GIB for b in BUDGETS_GIB], validate=True, stop=True)
        with tempfile.TemporaryDirectory(prefix="plan_bench_") as root:
            trainer = pl.Trainer(
                accelerator="cpu" if quick else "gpu",
                devices=1,
                precision="32-true" if quick else "bf16-mixed",
                max_steps=3,
                limit_val_batches=1,
                callbacks=[planner],
                default_root_dir=root,
                **H.QUIET_TRAINER,
            )
            start = time.perf_counter()
            trainer.fit(model)
            result["fit_seconds"] = time.perf_counter() - start
        plan = planner.plan
        result["status"] = "ok" if plan is not None else "no_plan"
        result["plan_seconds"] = planner.probe_seconds
        result["seconds_with_validation"] = planner.seconds
        if plan is not None:
            result["verdict"] = plan.verdict
            result["probes"] = [
                {"size": p.size, "train": p.train_bytes, "val": p.val_bytes, "reserved": p.reserved_bytes}
                for p in plan.probes
            ]
            result["lines"] = [{"intercept": line.intercept, "slope": line.slope} for line in plan.lines]
            result["growth"], result["outside"] = plan.growth, plan.outside
            result["budgets"] = [
                {"budget": p.budget, "limit": p.limit, "largest": p.largest, "validated": p.validated}
                for p in planner.predictions
            ]
            largest = planner.predictions[0].largest
            sizes = sorted({max(1, round(f * largest)) for f in FRACTIONS}) if largest else []
            result["predicted"] = [
                {"size": b, "allocated": plan.need(b), "reserved": plan.reserved(b), "band": plan.band(b)}
                for b in sizes
            ]
    except Exception as error:
        result["error"] = H.describe_error(error)
    H.emit(result)
    return 0


def measure(model: str, size: int, env: dict[str, str], timeout: float, quick: bool) -> H.Worker:
    """Start the fit at ``size`` by hand in a fresh process (no cap): 3 steps and one validation batch."""
    argv = [sys.executable, str(Path(T.__file__).resolve()), "--finder-worker", "fixed", "--model", model]
    argv += [
        "--batch-size",
        str(size),
        "--budget-bytes",
        str(10**15),
        "--fit-steps",
        "3",
        "--fit-val-batches",
        "1",
    ]
    argv += ["--headroom", "0", "--steps", "3", *(["--quick"] if quick else [])]
    return H.Worker(argv, f"measure_{model}_{size}", env)


def _error(predicted: float, measured: int | None) -> float | None:
    return None if not measured else (predicted - measured) / measured


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = H.worker_env()
    if args.expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    report: dict[str, Any] = {
        "settings": vars(args),
        "versions": H.versions(("lightning", "timm")),
        "workloads": {},
    }
    if torch.cuda.is_available() and not args.quick:
        report["device"] = torch.cuda.get_device_name(0)
    for model in [m for m in args.models.split(",") if m]:
        argv = [sys.executable, str(Path(__file__).resolve()), "--plan-worker", "--model", model]
        planned = H.run_worker(
            [*argv, *(["--quick"] if args.quick else [])], args.timeout, f"plan_{model}", env
        )
        entry = planned.result() or {"status": "crashed", "error": planned.failure()}
        entry["process_seconds"] = planned.seconds
        report["workloads"][model] = entry
        H.log(
            f"{model}: plan {entry.get('status')} in {entry.get('plan_seconds')} s ({entry.get('error') or ''})"
        )
        pending = list(entry.get("predicted", []))
        done_workers: list[tuple[dict[str, Any], H.Worker]] = []
        while pending:  # at most `parallel` at once: three 48 GiB-plan fits together need a 139 GiB card
            batch, pending = pending[: args.parallel], pending[args.parallel :]
            workers = [(p, measure(model, p["size"], env, args.timeout, args.quick)) for p in batch]
            deadline = time.perf_counter() + args.timeout
            for _, worker in workers:
                worker.wait(deadline)
            done_workers += workers
        for predicted, worker in done_workers:
            done = worker.result() or {}
            fit = done.get("fit") or {}
            predicted["measured_allocated"] = fit.get("peak_allocated")
            predicted["measured_reserved"] = fit.get("peak_reserved")
            predicted["measure_status"] = done.get("status", "crashed")
            predicted["allocated_error"] = _error(predicted["allocated"], fit.get("peak_allocated"))
            predicted["reserved_error"] = _error(predicted["reserved"], fit.get("peak_reserved"))
            H.log(f"{model}: at {predicted['size']}: {_cell(predicted)}")
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
    report["summary"] = summary(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """Median and p95 of the absolute relative errors, and the under-estimate rates, over every measured size."""
    out: dict[str, Any] = {}
    for kind in ("allocated", "reserved"):
        errors = [
            p[f"{kind}_error"]
            for entry in report["workloads"].values()
            for p in entry.get("predicted", [])
            if p.get(f"{kind}_error") is not None
        ]
        if errors:
            absolute = sorted(abs(e) for e in errors)
            out[kind] = {
                "n": len(errors),
                "median_abs": statistics.median(absolute),
                "p95_abs": absolute[min(len(absolute) - 1, round(0.95 * (len(absolute) - 1)))],
                "under_rate": sum(e < 0 for e in errors) / len(errors),
            }
    return out


def _cell(p: dict[str, Any]) -> str:
    def pair(kind: str) -> str:
        measured, error = p.get(f"measured_{kind}"), p.get(f"{kind}_error")
        if measured is None or error is None:
            return f"{p[kind] / GIB:.2f} / -"
        return f"{p[kind] / GIB:.2f} / {measured / GIB:.2f} ({error:+.1%})"

    return f"allocated {pair('allocated')}, reserved {pair('reserved')}"


def table(report: dict[str, Any]) -> str:
    lines = [
        "| workload | probes | plan s (with validation) | size | allocated GiB: predicted / measured | reserved GiB:"
        " predicted / measured | largest at 48 / 24 / 12 GiB (v: validated) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model, entry in report["workloads"].items():
        probes = ",".join(str(p["size"]) for p in entry.get("probes", [])) or "-"
        seconds = entry.get("plan_seconds")
        plan_s = (
            "-" if seconds is None else f"{seconds:.1f} ({entry.get('seconds_with_validation') or 0:.1f})"
        )
        budgets = " / ".join(
            f"{b['largest']}{' v' if b['validated'] else ''}" for b in entry.get("budgets", [])
        ) or str(entry.get("status"))
        rows = entry.get("predicted") or [{}]
        for i, p in enumerate(rows):
            cells = [model, probes, plan_s] if i == 0 else ["", "", ""]
            if p:
                alloc, reserved = _cell(p).split(", reserved ")
                cells += [str(p["size"]), alloc.removeprefix("allocated "), reserved]
            else:
                cells += ["-", "-", "-"]
            cells.append(budgets if i == 0 else "")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--models", default="gpt124,gpt,resnet,vit,encoder,gpt-ckpt")
    parser.add_argument(
        "--expandable", action="store_true", help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )
    parser.add_argument("--timeout", type=float, default=150.0)
    parser.add_argument(
        "--parallel",
        type=int,
        default=None,
        help="measuring fits at once (default: 3 on a card of 120 GiB or more)",
    )
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--plan-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plan_worker:
        return plan_worker(args)
    if args.parallel is None:
        big = torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory >= 120 * GIB
        args.parallel = 3 if big or args.quick else 1
    report = run(args)
    print(table(report))
    print("\nsummary: " + json.dumps(report["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
