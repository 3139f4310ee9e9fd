"""The callbacks under DDP on two GPUs: agreement across ranks, conformance, per-rank metrics, FSDP.

Run it from the repository root on a machine with two CUDA GPUs (NCCL), or on the CPU with ``--cpu`` (two gloo
ranks, ``accelerator="cpu"``, out-of-memory errors simulated) to prove the logic::

    python benchmarks/ddp2.py --json benchmarks/results/ddp2.json            # 2 GPUs
    python benchmarks/ddp2.py --cpu --json /tmp/ddp2.json                     # CPU dry run (about 2 minutes)
    python benchmarks/ddp2.py --cases tuner,monitor --time-limit 600

Every case is a ``Trainer(strategy=DDPStrategy(timeout=...), devices=2)`` fit launched by Lightning itself: this
script starts one *worker* per case (``--worker CASE``, its own process group, killed past its share of
``--time-limit``), the worker is Lightning's main process (rank 0) and Lightning launches rank 1 by running the
same command line again. Each rank writes what it saw to ``CASE.rank<N>.json`` in a temporary folder; this process
reads both, runs the checks and prints a Markdown table (PASS / FAIL / SKIP per check; INFO lines are numbers
without a verdict), and ``--json`` writes everything. A crash or a hang in one case costs that case only. Exit
status: the number of failed checks (at most 125).

Cases (models in ``benchmarks/_ddp2_models.py``: a GPT-style decoder, about 25M parameters on a GPU, bf16-mixed;
a tiny one and 32-bit on the CPU):

1. ``tuner``: ``BatchSizeTuner`` with rank 1 under a ``MemoryBudget`` of ``--rank1-budget`` (a fraction of the
   device, default 0.6) and rank 0 uncapped (``--cpu``: rank 0 "runs out of memory" above 40 samples, rank 1 above
   24). Checks: both ranks chose one size (their files and an ``all_gather``), a trial ran out of memory on rank 1,
   and the tuned fit equals a fit with the size set by hand (weights' SHA-256, optimizer step count,
   ``global_step``; seeded, ``deterministic=True`` on GPUs), and the ranks' weights are equal.
2. ``microbatch``: ``AutoMicrobatch`` where rank 1's batch at step 3 has 4x the samples. On GPUs rank 1 is capped
   at ``P(B) + 2 (P(2B) - P(B))`` (reserved peaks of a plain step at the batch ``B`` and ``2B``, measured on the
   rank's own GPU first), so the long batch runs out of memory and its halves fit; ``--cpu``: rank 1 raises above
   ``2B``. Checks: the same split per step on both ranks, the long step split, equal weights across ranks, weights
   within tolerance (bf16: 2e-2 relative to the update, fp32: 1e-5) of the same fit with room and no callback
   (SGD with momentum, linear in the gradient), and the fit ended (the collective timeout stops a hang). Then
   steps/s with ``AutoMicrobatch`` that never splits against plain DDP (interleaved rounds; a check of >= 0.9 on
   GPUs, informational on the CPU).
3. ``monitor``: ``MemoryMonitor`` (every step) with rank 1 holding an extra buffer (1 GiB on its GPU; ``--cpu``:
   512 MiB of host memory) and, on GPUs, ``EmptyCacheOnThreshold(threshold=0.5 GiB of the device,
   relative_to="device")``, which only rank 1 crosses. Read back from a ``CSVLogger``: the ``_max``/``_min`` keys
   exist as documented, ``_max`` is rank 1's (the buffer above ``_min``), the plain key is rank 0's, and the
   per-rank ``gpumem/cache_releases_rank<r>`` keys say rank 1 released and rank 0 did not. On the CPU the CUDA keys
   are skipped and the host-RSS keys are checked instead.
4. ``planner``: ``MemoryPlanner(budgets=["24GiB", "16GiB"], stop=True)`` with rank 1 holding 2 GiB outside PyTorch
   (``cuMemAlloc`` through the driver API, which the caching allocator does not see but NVML does; where that
   fails, a PyTorch tensor, and the result says so). Recorded per rank: the probes, the memory outside PyTorch and
   the predictions. Checks: both ranks planned and stopped before step 1, the probes (the peaks the planner agrees
   across ranks) are equal, rank 1 measured its outside memory, and the predictions are equal across ranks.
   ``--cpu``: the planner has no allocator to measure and plans nothing; ``stop=True`` still ends the fit before
   step 1 on both ranks.
5. ``fsdp``: ``FSDPStrategy`` with ``MemoryMonitor`` (``fsdp-monitor``) and with ``BatchSizeTuner`` (``fsdp-tuner``),
   each in its own worker: the fit either works or stops with an error that names the callback or the strategy
   (not a crash deep inside). ``--cpu``: Lightning refuses FSDP without a GPU (skipped, with its message).

The header gives the versions, the GPUs and NCCL's version (read in a subprocess, so that this process holds no
CUDA context on GPU 0 while the cases run).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
import hashlib
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `_harness` and `_ddp2_models` next to this file
import _harness as H

CASES = ("tuner", "microbatch", "monitor", "planner", "fsdp")
WORKERS = {"fsdp": ("fsdp-monitor", "fsdp-tuner")}  # a case run as several workers
SEED = 7
LONG_STEP = 3  # the step where rank 1's batch is long (microbatch)
GIB = H.GIB
MIB = H.MIB


# ==================================================================================================== worker side
def local_rank() -> int:
    """This process's rank: Lightning's launcher sets ``LOCAL_RANK`` in the processes it starts (one node)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def write_part(out: Path, name: str, data: dict[str, Any]) -> None:
    """This rank's part, ``NAME.rank<N>.json`` (written whole, then renamed: a reader never sees half of it)."""
    path = out / f"{name}.rank{local_rank()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def make_trainer(args: argparse.Namespace, strategy: Any = None, **overrides: Any) -> Any:
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import DDPStrategy

    options: dict[str, Any] = {
        "accelerator": "cpu" if args.cpu else "gpu",
        "devices": 2,
        "strategy": strategy or DDPStrategy(timeout=timedelta(seconds=args.collective_timeout)),
        "precision": "32-true" if args.cpu else "bf16-mixed",
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        **H.QUIET_TRAINER,
    }
    options.update(overrides)
    return Trainer(**options)


def weights(module: Any) -> Any:
    import torch

    return torch.cat([p.detach().float().cpu().flatten() for p in module.parameters()])


def fit_state(trainer: Any, module: Any) -> dict[str, Any]:
    """What a fit left: the weights' SHA-256 and sum, the optimizer's step count, ``global_step``."""
    flat = weights(module)
    steps = None
    with contextlib.suppress(Exception):
        state = trainer.optimizers[0].state
        first = next(iter(state.values()), {})
        steps = int(first["step"]) if "step" in first else None
    return {
        "sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
        "sum": float(flat.double().sum()),
        "optimizer_steps": steps,
        "global_step": int(trainer.global_step),
    }


def gathered_ints(trainer: Any, value: int) -> list[int] | None:
    """``value`` of every rank through the strategy's own ``all_gather`` (``None`` if that failed)."""
    import torch

    try:
        tensor = torch.tensor([value], device=trainer.strategy.root_device)
        return [int(v) for v in trainer.strategy.all_gather(tensor).flatten().tolist()]
    except Exception:
        return None


def rank1_budget(args: argparse.Namespace) -> list[Any]:
    """Rank 1's ``MemoryBudget`` (GPU only; rank 0 uncapped): callbacks are built per process."""
    from lightning_gpumem import MemoryBudget

    return [MemoryBudget(args.rank1_budget)] if not args.cpu and local_rank() == 1 else []


def case_tuner(args: argparse.Namespace, out: Path) -> None:
    import _ddp2_models as M
    from lightning.pytorch import seed_everything

    from lightning_gpumem import BatchSizeTuner

    config = M.CPU_GPT if args.cpu else M.GPU_GPT
    n = 512 if args.cpu else 16384
    oom = {0: 40, 1: 24} if args.cpu else None
    part: dict[str, Any] = {"rank": local_rank(), "budget": None if args.cpu else args.rank1_budget}

    seed_everything(SEED)
    tuner = BatchSizeTuner(max_val=n if args.cpu else None)  # on a CPU the tuner searches only when asked
    model = M.TinyGPT(config, batch_size=2, n=n, oom_above=oom)
    trainer = make_trainer(
        args, max_steps=5, callbacks=[*rank1_budget(args), tuner], deterministic=not args.cpu
    )
    start = time.perf_counter()
    trainer.fit(model)
    chosen = int(tuner.optimal_batch_size) if tuner.optimal_batch_size is not None else -1
    part.update(
        chosen=chosen,
        gathered=gathered_ints(trainer, chosen),
        trials=[[t.batch_size, bool(t.fits)] for t in tuner.trials],
        tuned=fit_state(trainer, model),
        tuned_seconds=time.perf_counter() - start,
    )
    write_part(out, "tuner", part)

    seed_everything(SEED)
    model = M.TinyGPT(config, batch_size=chosen, n=n, oom_above=oom)
    trainer = make_trainer(args, max_steps=5, callbacks=rank1_budget(args), deterministic=not args.cpu)
    trainer.fit(model)
    part["by_hand"] = fit_state(trainer, model)
    write_part(out, "tuner", part)


def case_microbatch(args: argparse.Namespace, out: Path) -> None:
    import _ddp2_models as M
    import torch
    from lightning.pytorch import Callback, seed_everything

    from lightning_gpumem import AutoMicrobatch, MemoryBudget

    rank = local_rank()
    config = M.CPU_GPT if args.cpu else M.GPU_GPT
    batch = 8 if args.cpu else 96
    steps = 8
    part: dict[str, Any] = {"rank": rank, "batch": batch, "long_batch": 4 * batch, "long_step": LONG_STEP}
    budget: list[Any] = []
    oom: dict[int, int] | None = None
    if args.cpu:
        oom = {1: 2 * batch}  # the long batch (4B) fails, its halves (2B) fit
    else:
        device = torch.device("cuda", rank)
        p1, p2 = M.calibrate(config, batch, device)
        cap = p1 + 2 * (p2 - p1)
        part.update(calibration={"peak_B": p1, "peak_2B": p2, "cap": cap})
        if rank == 1:
            budget = [MemoryBudget(int(cap))]

    def data(long_step: int | None, n_steps: int) -> M.RankBatches:
        return M.RankBatches(rank, n_steps, batch, config.seq, config.vocab, long_step)

    class Splits(Callback):
        def __init__(self, auto: AutoMicrobatch) -> None:
            self.auto, self.history = auto, []

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, b: Any, batch_idx: int
        ) -> None:
            self.history.append(self.auto.microbatches)

    def fit(
        callbacks: list[Any], long_step: int | None, model_oom: dict[int, int] | None, n_steps: int
    ) -> Any:
        seed_everything(SEED)
        model = M.TinyGPT(config, oom_above=model_oom, optimizer="sgd", batches=data(long_step, n_steps))
        trainer = make_trainer(args, max_steps=n_steps, callbacks=callbacks, use_distributed_sampler=False)
        start = time.perf_counter()
        trainer.fit(model)
        return trainer, model, time.perf_counter() - start

    seed_everything(SEED)
    initial = weights(M.TinyGPT(config))
    trainer, reference, _ = fit(
        [], LONG_STEP, None, steps
    )  # with room: no budget, no callback, nothing splits
    reference_weights = weights(reference)
    auto = AutoMicrobatch()
    splits = Splits(auto)
    trainer, model, seconds = fit([*budget, auto, splits], LONG_STEP, oom, steps)
    split_weights = weights(model)
    update = float((reference_weights - initial).norm())
    part.update(
        splits=splits.history,
        recoveries=int(auto.oom_recoveries),
        global_step=int(trainer.global_step),
        steps=steps,
        seconds=seconds,
        sha256=hashlib.sha256(split_weights.numpy().tobytes()).hexdigest(),
        max_abs_diff=float((split_weights - reference_weights).abs().max()),
        rel_diff=float((split_weights - reference_weights).norm()) / max(update, 1e-30),
    )
    write_part(out, "microbatch", part)

    warmup, timed, rounds = (2, 6, 1) if args.cpu else (5, 40, 3)

    def rate(config_name: str) -> float:
        window = H.StepWindow(warmup, warmup + timed - 1, cuda=not args.cpu)
        first, last = window.callbacks()
        middle = [AutoMicrobatch()] if config_name == "AutoMicrobatch" else []
        fit([first, *middle, last], None, None, warmup + timed)
        return window.steps_per_second() or float("nan")

    rate("none")  # warm the processes up (kernels, allocator, gloo/NCCL buffers)
    per_round = H.interleaved_rounds(("none", "AutoMicrobatch"), rounds, rate)
    part["throughput"] = {
        "rounds": per_round,
        "ratio": sorted(r["AutoMicrobatch"] / r["none"] for r in per_round)[len(per_round) // 2],
    }
    write_part(out, "microbatch", part)


def read_csv_metrics(path: Path) -> dict[str, list[float]]:
    """Every column of a ``CSVLogger``'s ``metrics.csv``, its non-empty values in order."""
    columns: dict[str, list[float]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value not in (None, ""):
                    columns.setdefault(key, []).append(float(value))
    return columns


def case_monitor(args: argparse.Namespace, out: Path) -> None:
    import _ddp2_models as M
    import torch
    from lightning.pytorch.loggers import CSVLogger

    from lightning_gpumem import EmptyCacheOnThreshold, MemoryMonitor

    rank = local_rank()
    part: dict[str, Any] = {"rank": rank}
    if rank == 1:  # held for the whole fit
        # a touched (resident) host buffer on the CPU, a GPU one otherwise
        buffer = (
            torch.ones(512 * MIB // 4) if args.cpu else torch.ones(GIB // 4, device=torch.device("cuda", 1))
        )
        part["buffer_bytes"] = buffer.numel() * buffer.element_size()
    callbacks: list[Any] = [MemoryMonitor(log_every_n_steps=1, nvml_host_interval_s=0)]
    if not args.cpu:
        total = torch.cuda.get_device_properties(rank).total_memory
        callbacks.append(
            EmptyCacheOnThreshold(threshold=0.5 * GIB / total, relative_to="device", min_steps_between=1)
        )
    model = M.TinyGPT(M.CPU_GPT if args.cpu else M.SMALL_GPU_GPT, batch_size=8, n=256)
    log_dir = out / "monitor_logs"
    trainer = make_trainer(
        args,
        max_steps=6,
        callbacks=callbacks,
        logger=CSVLogger(log_dir, name="", version=0),
        log_every_n_steps=1,
    )
    trainer.fit(model)
    part["global_step"] = int(trainer.global_step)
    if trainer.is_global_zero:
        metrics = log_dir / "version_0" / "metrics.csv"
        part["metrics"] = read_csv_metrics(metrics) if metrics.exists() else None
    write_part(out, "monitor", part)


def outside_allocation(nbytes: int, device: Any) -> tuple[Callable[[], None], str]:
    """Take ``nbytes`` on ``device`` outside PyTorch's caching allocator (CUDA driver API); ``(free, how)``."""
    import torch

    torch.cuda.set_device(device)
    torch.zeros(1, device=device)  # the primary context, current on this thread
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        pointer = ctypes.c_uint64()
        status = driver.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(nbytes))
        if status != 0:
            raise RuntimeError(f"cuMemAlloc_v2 returned {status}")
        return (lambda: driver.cuMemFree_v2(pointer)), "cuMemAlloc (outside the caching allocator)"
    except Exception as error:
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return (
            lambda: tensor.numel()
        ), f"PyTorch tensor (counts as PyTorch memory: {H.describe_error(error)})"


def case_planner(args: argparse.Namespace, out: Path) -> None:
    import dataclasses

    import _ddp2_models as M
    import torch

    from lightning_gpumem import MemoryPlanner

    rank = local_rank()
    part: dict[str, Any] = {"rank": rank}
    release: Callable[[], None] | None = None
    if not args.cpu and rank == 1:
        release, part["outside_how"] = outside_allocation(2 * GIB, torch.device("cuda", 1))
    planner = MemoryPlanner(budgets=["24GiB", "16GiB"], stop=True)
    model = M.TinyGPT(M.CPU_GPT if args.cpu else M.GPU_GPT, batch_size=8 if args.cpu else 32, n=4096)
    trainer = make_trainer(args, max_steps=2, callbacks=[planner])
    trainer.fit(model)
    plan = planner.plan
    part.update(
        global_step=int(trainer.global_step),
        planned=plan is not None,
        probes=[dataclasses.asdict(p) for p in plan.probes] if plan is not None else None,
        verdict=str(plan.verdict) if plan is not None else None,
        outside=plan.outside if plan is not None else None,
        predictions=[dataclasses.asdict(p) for p in planner.predictions],
        seconds=planner.seconds,
    )
    if release is not None:
        release()
    write_part(out, "planner", part)


def case_fsdp(args: argparse.Namespace, out: Path, which: str) -> None:
    import _ddp2_models as M

    from lightning_gpumem import BatchSizeTuner, MemoryMonitor

    part: dict[str, Any] = {"rank": local_rank(), "callback": which}
    callback = MemoryMonitor(log_every_n_steps=1) if which == "MemoryMonitor" else BatchSizeTuner()
    try:
        from lightning.pytorch.strategies import FSDPStrategy

        strategy = FSDPStrategy(
            timeout=timedelta(seconds=args.collective_timeout), auto_wrap_policy={M.Block}
        )
        trainer = make_trainer(args, strategy=strategy, max_steps=3, callbacks=[callback])
    except Exception as error:
        part.update(outcome="not_available", message=H.describe_error(error))
        write_part(out, f"fsdp-{'monitor' if which == 'MemoryMonitor' else 'tuner'}", part)
        return
    model = M.TinyGPT(M.CPU_GPT if args.cpu else M.SMALL_GPU_GPT, batch_size=2, n=2048)
    try:
        trainer.fit(model)
        part.update(outcome="works", global_step=int(trainer.global_step))
        if which == "BatchSizeTuner":
            part["chosen"] = tuner_size = int(callback.optimal_batch_size or -1)  # type: ignore[attr-defined]
            part["gathered"] = gathered_ints(trainer, tuner_size)
    except Exception as error:
        part.update(
            outcome="refused",
            error_type=type(error).__name__,
            message=str(error)[:1000],
            where=traceback.extract_tb(error.__traceback__)[-1].filename if error.__traceback__ else None,
        )
    write_part(out, f"fsdp-{'monitor' if which == 'MemoryMonitor' else 'tuner'}", part)


def close_process_group() -> None:
    """Barrier, then destroy the group before exit (gloo threads left to interpreter shutdown abort the process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.barrier()
        dist.destroy_process_group()


def worker(args: argparse.Namespace) -> None:
    """One case on this rank; rank 1 is this same command, started by Lightning's launcher."""
    H.quiet_lightning()
    out = Path(args.dir)
    name = args.worker
    try:
        if name == "tuner":
            case_tuner(args, out)
        elif name == "microbatch":
            case_microbatch(args, out)
        elif name == "monitor":
            case_monitor(args, out)
        elif name == "planner":
            case_planner(args, out)
        elif name == "fsdp-monitor":
            case_fsdp(args, out, "MemoryMonitor")
        elif name == "fsdp-tuner":
            case_fsdp(args, out, "BatchSizeTuner")
        else:
            raise ValueError(f"unknown worker {name!r}")
    except BaseException as error:
        error_file = out / f"{name}.rank{local_rank()}.error"
        error_file.write_text(H.describe_error(error) + "\n" + traceback.format_exc()[-4000:])
        close_process_group()
        sys.exit(
            0 if local_rank() else 1
        )  # rank 1 exits 0: a failed child makes Lightning kill rank 0 at once
    close_process_group()


def info(args: argparse.Namespace) -> None:
    """Versions, GPUs and NCCL's version, as one ``RESULT`` line (run in a subprocess: no CUDA context here)."""
    import torch

    result: dict[str, Any] = {"versions": H.versions(), "cpu": args.cpu}
    if torch.cuda.is_available():
        result["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        result["cuda"] = torch.version.cuda
        with contextlib.suppress(Exception):
            result["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    H.emit(result)


# ==================================================================================================== checks
class Checks:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, case: str, name: str, status: str, detail: Any = "") -> None:
        self.rows.append({"case": case, "check": name, "status": status, "detail": str(detail)[:600]})

    def check(self, case: str, name: str, ok: bool, detail: Any = "") -> None:
        self.add(case, name, "PASS" if ok else "FAIL", detail)

    def skip(self, case: str, name: str, reason: str) -> None:
        self.add(case, name, "SKIP", reason)

    def info(self, case: str, name: str, detail: Any) -> None:
        self.add(case, name, "INFO", detail)

    @property
    def failures(self) -> int:
        return sum(row["status"] == "FAIL" for row in self.rows)


def both(parts: dict[int, Any], key: str) -> tuple[Any, Any]:
    return parts[0].get(key), parts[1].get(key)


def check_tuner(c: Checks, parts: dict[int, Any], cpu: bool) -> None:
    case = "tuner"
    chosen = both(parts, "chosen")
    c.check(
        case,
        "both ranks chose one batch size",
        chosen[0] == chosen[1] and chosen[0] > 0,
        f"rank 0, 1: {chosen}",
    )
    gathered = both(parts, "gathered")
    c.check(
        case,
        "all_gather of the size agrees on both ranks",
        gathered[0] == gathered[1] and gathered[0] is not None and len(set(gathered[0])) == 1,
        f"{gathered}",
    )
    ooms = [sum(not fits for _, fits in parts[r].get("trials", [])) for r in (0, 1)]
    c.check(
        case,
        "a trial ran out of memory on rank 1 (tuning was bounded)",
        ooms[1] > 0,
        f"OOM trials per rank: {ooms}",
    )
    if cpu:
        c.check(case, "the size fits rank 1's limit (24)", 0 < chosen[1] <= 24, chosen[1])
    for r in (0, 1):
        tuned, by_hand = parts[r].get("tuned"), parts[r].get("by_hand")
        if not tuned or not by_hand:
            c.check(case, f"rank {r}: tuned fit == fit by hand", False, "a fit did not finish")
            continue
        for what in ("sha256", "optimizer_steps", "global_step"):
            c.check(
                case,
                f"rank {r}: tuned fit == fit by hand ({what})",
                tuned[what] == by_hand[what],
                f"{str(tuned[what])[:16]} vs {str(by_hand[what])[:16]}",
            )
    t0, t1 = (parts[r].get("tuned") or {} for r in (0, 1))
    c.check(case, "weights equal across ranks", t0.get("sha256") == t1.get("sha256"), "tuned fit")
    c.info(case, "tuned fit seconds (rank 0)", f"{parts[0].get('tuned_seconds', float('nan')):.1f}")


def check_microbatch(c: Checks, parts: dict[int, Any], cpu: bool) -> None:
    case = "microbatch"
    splits = both(parts, "splits")
    c.check(
        case, "same micro-batches per step on both ranks", splits[0] == splits[1], f"rank 0, 1: {splits}"
    )
    c.check(
        case,
        f"the long step ({LONG_STEP}) ran split on both ranks",
        all(s is not None and len(s) > LONG_STEP and s[LONG_STEP] >= 2 for s in splits),
        f"splits at step {LONG_STEP}: {[s[LONG_STEP] if s and len(s) > LONG_STEP else None for s in splits]}",
    )
    c.info(case, "OOMs recovered per rank", list(both(parts, "recoveries")))
    steps = both(parts, "global_step")
    c.check(
        case, "the fit ended on both ranks (no hang)", all(s == parts[0]["steps"] for s in steps), f"{steps}"
    )
    c.check(
        case, "weights equal across ranks", parts[0].get("sha256") == parts[1].get("sha256"), "split fit"
    )
    tolerance = 1e-5 if cpu else 2e-2
    rel = both(parts, "rel_diff")
    c.check(
        case,
        f"weights within {tolerance:g} of the fit with room (relative to the update)",
        all(r is not None and r <= tolerance for r in rel),
        f"relative diff per rank {rel}, max abs {list(both(parts, 'max_abs_diff'))}",
    )
    if not cpu:
        c.info(case, "rank 1 cap (calibration)", parts[1].get("calibration"))
    throughput = parts[0].get("throughput")
    if throughput is None:
        c.check(case, "throughput measured", False, "no throughput")
    elif cpu:
        c.info(
            case, "steps/s AutoMicrobatch (never splitting) / plain DDP", f"{throughput['ratio']:.3f} (CPU)"
        )
    else:
        c.check(
            case,
            "steps/s AutoMicrobatch (never splitting) / plain DDP >= 0.9",
            throughput["ratio"] >= 0.9,
            f"{throughput['ratio']:.3f}; rounds {throughput['rounds']}",
        )


def check_monitor(c: Checks, parts: dict[int, Any], cpu: bool) -> None:
    case = "monitor"
    metrics = parts[0].get("metrics")
    if not metrics:
        c.check(case, "metrics.csv written", False, "no metrics.csv")
        return
    logged = sorted(k for k in metrics if k.startswith("gpumem/"))
    c.info(case, "gpumem keys logged", ", ".join(logged))
    held = parts[1].get("buffer_bytes", 0) / GIB

    def spread(key: str, name: str, spread_checked: bool = True) -> None:
        """``key``, ``_max`` and ``_min`` exist; ``_max`` is rank 1's (the buffer above ``_min``), plain is rank 0's."""
        names = [key, key + "_max", key + "_min"]
        missing = [k for k in names if k not in metrics]
        c.check(
            case, f"{name}: plain, _max, _min logged", not missing, f"missing {missing}" if missing else ""
        )
        if missing or not spread_checked:
            return
        plain, high, low = (max(metrics[k]) for k in names)
        c.check(
            case,
            f"{name}: _max is rank 1's (>= _min + {0.8 * held:.2f} GiB)",
            high - low >= 0.8 * held,
            f"max {high:.3f}, min {low:.3f} GiB",
        )
        c.check(
            case,
            f"{name}: plain key is rank 0's (== _min)",
            abs(plain - low) < 0.1 * held,
            f"plain {plain:.3f}",
        )

    spread(
        "gpumem/host_rss_gib", "host RSS", spread_checked=cpu
    )  # rank 1's buffer is in host memory on the CPU
    if cpu:
        for what in ("train_peak_allocated", "train_peak_reserved", "per-rank cache_releases"):
            c.skip(case, f"{what} keys", "skipped on CPU: no CUDA memory to measure")
        return
    spread("gpumem/train_peak_allocated_gib", "train peak allocated")
    spread("gpumem/train_peak_reserved_gib", "train peak reserved")
    for key in ("gpumem/nvml_process_gib_max", "gpumem/nvml_process_gib_min"):
        c.check(case, f"{key} logged", key in metrics)
    releases = [metrics.get(f"gpumem/cache_releases_rank{r}") for r in (0, 1)]
    c.check(
        case,
        "cache_releases_rank1 > 0 and cache_releases_rank0 == 0 (the per-rank keys name the right rank)",
        releases[0] is not None
        and releases[1] is not None
        and max(releases[0]) == 0
        and max(releases[1]) > 0,
        f"rank0 {releases[0] and max(releases[0])}, rank1 {releases[1] and max(releases[1])}",
    )


def check_planner(c: Checks, parts: dict[int, Any], cpu: bool) -> None:
    case = "planner"
    planned = both(parts, "planned")
    if cpu:
        steps = both(parts, "global_step")
        c.check(
            case, "stop=True ended the fit before step 1 on both ranks (no plan on a CPU)", steps == (0, 0)
        )
        c.skip(
            case, "plan equal on both ranks", f"skipped on CPU: no allocator to measure (planned: {planned})"
        )
        return
    c.check(case, "both ranks planned", all(planned), f"{planned}")
    steps = both(parts, "global_step")
    c.check(case, "stop=True ended the fit before step 1", steps == (0, 0), f"global_step {steps}")
    c.info(case, "rank 1's outside memory", parts[1].get("outside_how"))
    outside = both(parts, "outside")
    c.info(
        case,
        "memory outside PyTorch per rank (GiB)",
        [None if o is None else round(o / GIB, 3) for o in outside],
    )
    c.check(
        case,
        "rank 1 measured its 2 GiB outside PyTorch",
        None not in outside and outside[1] - outside[0] >= 1.5 * GIB,
        f"{outside}",
    )
    probes = both(parts, "probes")
    c.check(case, "probes equal across ranks (agreed peaks)", probes[0] == probes[1], f"{probes}")
    predictions = both(parts, "predictions")
    c.check(case, "predictions equal across ranks", predictions[0] == predictions[1], f"{predictions}")


def check_fsdp(c: Checks, name: str, parts: dict[int, Any], cpu: bool) -> None:
    if parts[0].get("outcome") == "not_available":
        c.skip(name, "works or refuses clearly", f"Lightning refuses FSDP here: {parts[0].get('message')}")
        return
    outcomes = both(parts, "outcome")
    c.check(name, "same outcome on both ranks", outcomes[0] == outcomes[1], f"{outcomes}")
    callback = parts[0]["callback"]
    if outcomes[0] == "works":
        c.info(name, "outcome", f"works (global_step {parts[0].get('global_step')})")
        if callback == "BatchSizeTuner":
            c.check(name, "both ranks chose one size", both(parts, "chosen")[0] == both(parts, "chosen")[1])
        return
    message = parts[0].get("message") or ""
    c.info(
        name,
        "outcome",
        f"refused: {parts[0].get('error_type')}: {message[:300]} (raised in {parts[0].get('where')})",
    )
    c.check(
        name,
        "the error names the callback or the strategy",
        any(word in message for word in (callback, "FSDP", "FullyShardedDataParallel")),
        message[:200],
    )


CHECKS: dict[str, Callable[[Checks, dict[int, Any], bool], None]] = {
    "tuner": check_tuner,
    "microbatch": check_microbatch,
    "monitor": check_monitor,
    "planner": check_planner,
}


def parts_of(out: Path, name: str, wait_s: float) -> tuple[dict[int, Any], dict[int, str]]:
    """Both ranks' parts (waiting up to ``wait_s`` for rank 1's), and the error each rank recorded."""
    deadline = time.perf_counter() + wait_s
    parts: dict[int, Any] = {}
    errors: dict[int, str] = {}
    for rank in (0, 1):
        path, error = out / f"{name}.rank{rank}.json", out / f"{name}.rank{rank}.error"
        if rank == 1 and parts.get(0, {}).get("outcome") == "not_available":
            break  # Lightning refused the Trainer: rank 1 was never launched
        while rank == 1 and not path.exists() and not error.exists() and time.perf_counter() < deadline:
            time.sleep(0.2)
        if error.exists():
            errors[rank] = error.read_text()
        if path.exists():
            parts[rank] = json.loads(path.read_text())
    return parts, errors


def orchestrate(args: argparse.Namespace) -> int:
    import tempfile

    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(cases) - set(CASES)
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; expected some of {CASES}")
    deadline = time.perf_counter() + args.time_limit
    out = Path(tempfile.mkdtemp(prefix="gpumem-ddp2-"))
    flags = [*(["--cpu"] if args.cpu else []), "--collective-timeout", str(args.collective_timeout)]
    flags += ["--rank1-budget", str(args.rank1_budget)]
    env = H.worker_env()
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before any CUDA call
    env.setdefault("PYTHONWARNINGS", "ignore")

    probe = H.run_worker([sys.executable, __file__, "--info", *flags], timeout=120, name="info", env=env)
    header = probe.result() or {"error": probe.failure()}
    print(
        "# lightning_gpumem under DDP, 2 ranks"
        + (" (CPU dry run: gloo, simulated OOMs)" if args.cpu else "")
    )
    print()
    for key, value in header.get("versions", {}).items():
        print(f"- {key}: {value}")
    if args.cpu:
        print("- devices: 2 CPU processes (gloo)")
    else:
        print(f"- GPUs: {header.get('gpus')}; CUDA {header.get('cuda')}; NCCL {header.get('nccl')}")
    if "error" in header:
        print(f"- info probe failed: {header['error']}")
    print(f"- command: {' '.join(sys.argv)}")
    print()

    checks = Checks()
    runs: dict[str, Any] = {}
    for case in cases:
        for name in WORKERS.get(case, (case,)):
            left = deadline - time.perf_counter()
            if left < 15:
                checks.skip(name, "ran", f"--time-limit {args.time_limit:g} s spent")
                continue
            H.log(f"{name}: starting (up to {left:.0f} s)")
            argv = [sys.executable, __file__, "--worker", name, "--dir", str(out), *flags]
            worker_run = H.Worker(argv, name=name, env=env, workdir=out)
            worker_run.wait(time.perf_counter() + min(left, args.case_timeout))
            parts, errors = parts_of(out, name, wait_s=10)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(worker_run.proc.pid, signal.SIGKILL)  # rank 1 is in the worker's process group
            runs[name] = {
                "seconds": round(worker_run.seconds, 1),
                "rc": worker_run.rc,
                "timed_out": worker_run.timed_out,
                "ranks": parts,
                "errors": errors,
            }
            H.log(f"{name}: done in {worker_run.seconds:.1f} s (rc {worker_run.rc})")
            launched = parts.get(0, {}).get("outcome") != "not_available"
            complete = 0 in parts and (1 in parts or not launched) and not errors
            detail = "; ".join(f"rank {r}: {e.splitlines()[0]}" for r, e in errors.items())
            if not complete and not errors:
                detail = f"{'timeout' if worker_run.timed_out else f'rc {worker_run.rc}'}: {worker_run.stderr[-400:]}"
            checks.check(name, "ran on both ranks", complete, detail or f"{worker_run.seconds:.1f} s")
            if not complete:
                continue
            try:
                if name in CHECKS:
                    CHECKS[name](checks, parts, args.cpu)
                else:
                    check_fsdp(checks, name, parts, args.cpu)
            except Exception as error:  # a part without what its check reads: a failure, not a crash here
                checks.check(
                    name, "the ranks' parts hold what the checks read", False, H.describe_error(error)
                )

    print("| case | check | result | detail |\n| --- | --- | --- | --- |")
    for row in checks.rows:
        detail = row["detail"].replace("|", "\\|").replace("\n", " ")
        print(f"| {row['case']} | {row['check']} | {row['status']} | {detail} |")
    counts = {s: sum(r["status"] == s for r in checks.rows) for s in ("PASS", "FAIL", "SKIP", "INFO")}
    print(
        f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped ({counts['INFO']} info rows)"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        document = {"meta": {**header, "command": " ".join(sys.argv)}, "checks": checks.rows, "runs": runs}
        args.json.write_text(json.dumps(document, indent=2, default=str) + "\n")
        print(f"Wrote {args.json} (worker logs in {out})")
    return min(checks.failures, 125)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--cpu", action="store_true", help="2 CPU ranks (gloo), simulated OOMs: a dry run")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {','.join(CASES)}")
    parser.add_argument("--time-limit", type=float, default=1500.0, help="seconds for all cases together")
    parser.add_argument("--case-timeout", type=float, default=600.0, help="seconds for one case's worker")
    parser.add_argument(
        "--collective-timeout", type=float, default=None, help="DDP/FSDP timeout (s); 60 CPU, 180 GPU"
    )
    parser.add_argument(
        "--rank1-budget", type=float, default=0.6, help="rank 1's MemoryBudget, a device fraction"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--info", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.collective_timeout is None:
        args.collective_timeout = 60.0 if args.cpu else 180.0
    if args.info:
        info(args)
    elif args.worker:
        worker(args)
    else:
        sys.exit(orchestrate(args))


if __name__ == "__main__":
    main()
