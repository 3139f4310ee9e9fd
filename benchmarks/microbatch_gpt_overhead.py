"""What AutoMicrobatch costs when it never splits, on a GPU-bound model: a 253.5M-parameter GPT in bf16.

    PYTHONPATH=. python3 benchmarks/microbatch_gpt_overhead.py --json microbatch-gpt-overhead.json   # ~2 min, H200
    PYTHONPATH=. python3 benchmarks/microbatch_gpt_overhead.py --profile    # torch.profiler of a few steps per arm
    PYTHONPATH=. python3 benchmarks/microbatch_gpt_overhead.py --quick      # CPU smoke run: a tiny GPT

**Model.** The GPT decoder of ``benchmarks/_tuner_models.py`` (plain PyTorch: pre-norm blocks, causal
``F.scaled_dot_product_attention``, GELU MLP, output head tied to the token embedding) at d_model 1024, 16 layers,
16 heads, vocabulary 50257 and context 512: 253.5M parameters, 201.5M without the embeddings (both printed). It trains
with a Lightning ``Trainer`` (``precision="bf16-mixed"`` on a GPU, ``"32-true"`` on a CPU), AdamW (lr 3e-4, weight
decay 0.1), next-token cross-entropy logged with ``self.log("loss", loss)``, batches of 16 x 512 random tokens from
an in-memory ``TensorDataset``, a ``CSVLogger`` in a temporary folder with ``log_every_n_steps=--log-every`` (10),
no validation, checkpoints, progress bar or model summary.

**Arms.** ``none`` (no callback), ``AutoMicrobatch`` (``AutoMicrobatch()``; nothing runs out of memory, so it never
splits, which each fit checks) and ``MemoryMonitor`` (``MemoryMonitor()``, for scale).

**Protocol.** One untimed fit warms the process up (CUDA libraries, kernels, the allocator). Then ``--rounds`` (7)
rounds of one fresh ``Trainer.fit`` per arm, the order rotated by one arm each round, all in this process. Every fit
builds the model anew with ``torch.manual_seed(0)`` (on the device: identical weights, no host-side
initialisation), runs ``--warmup`` (5) untimed steps and then ``--steps`` (30) timed ones; the clock
(``_harness.StepWindow``) is read at the start of the first timed batch (a callback first in the list) and at the
end of the last one (a callback last in the list), with ``torch.cuda.synchronize()`` right before each read and at no
other point, so the measurement adds no sync to the steps. Between fits: ``gc.collect()`` and
``torch.cuda.empty_cache()``. Reported per arm: the median ms/step and tokens/s over rounds, and the median over
rounds of the per-round ratio ``ms/step of none / ms/step of the arm`` (>= 0.99: it costs less than 1%), with every
round's value. ``--json PATH`` writes every number with the version stamps.

**Profile** (``--profile``, instead of the rounds). For ``AutoMicrobatch`` and then ``none``: one fit of
``--warmup`` + 1 + ``--profile-steps`` (5) steps under ``torch.profiler`` (CPU and CUDA activities,
``record_shapes=False``, ``with_stack=False``; the profiler's schedule records the last ``--profile-steps`` steps,
after one profiler warm-up step), then:

1. the top 25 ops by self CPU time (``key_averages().table(sort_by="self_cpu_time_total")``);
2. Python-level time per Lightning action: every hook and loop stage Lightning profiles
   (``[Callback]AutoMicrobatch.on_train_batch_start``, ``run_training_batch``, ``[LightningModule]...``, ...),
   timed by a ``Profiler`` passed to the Trainer, inclusive and self (without the nested actions), per step; the
   same actions are ``record_function`` ranges, so they also appear in table 1;
3. a second fit of the same length with ``cProfile`` on over the same steps: the top 25 Python functions by their
   own time (what AutoMicrobatch's wrappers cost shows here by name).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import platform
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.profilers import Profiler
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `_harness` and `_tuner_models` next to this file
import _harness as H
import _tuner_models as M

from lightning_gpumem import AutoMicrobatch, MemoryMonitor

ARMS = ("none", "AutoMicrobatch", "MemoryMonitor")
FULL = {"vocab": 50257, "seq_len": 512, "d_model": 1024, "layers": 16, "heads": 16, "batch": 16}
QUICK = {"vocab": 256, "seq_len": 32, "d_model": 64, "layers": 2, "heads": 4, "batch": 4}
TOP = 25  # rows of each profile table


# ---------------------------------------------------------------------------------------------------- settings
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--rounds", type=int, help="interleaved rounds of one fit per arm (default 7, quick 2)"
    )
    parser.add_argument("--steps", type=int, help="timed steps per fit (default 30, quick 8)")
    parser.add_argument(
        "--warmup", type=int, help="untimed steps at the start of every fit (default 5, quick 2)"
    )
    parser.add_argument(
        "--log-every", type=int, default=10, help="the Trainer's log_every_n_steps (default 10)"
    )
    parser.add_argument(
        "--device", choices=("auto", "cuda", "cpu"), default="auto", help="default: cuda if available"
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny GPT, few steps: a smoke run (CPU is fine)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="profile a few steps per arm instead of the rounds"
    )
    parser.add_argument(
        "--profile-steps", type=int, default=5, help="steps recorded by --profile (default 5)"
    )
    parser.add_argument("--json", type=Path, help="write every number, with version stamps, to this file")
    args = parser.parse_args(argv)
    defaults = (
        {"rounds": 2, "steps": 8, "warmup": 2} if args.quick else {"rounds": 7, "steps": 30, "warmup": 5}
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if min(args.rounds, args.steps, args.log_every, args.profile_steps) < 1 or args.warmup < 0:
        parser.error(
            "--rounds, --steps, --log-every and --profile-steps must be positive, --warmup non-negative"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def workload(args: argparse.Namespace) -> tuple[M.Workload, int]:
    """The GPT (full or ``--quick``) as a ``_tuner_models`` workload, and the batch size."""
    size = dict(QUICK if args.quick else FULL)
    batch = size.pop("batch")
    samples = batch * (
        args.warmup + max(args.steps, args.profile_steps + 1)
    )  # no fit crosses an epoch boundary
    return M.Workload("gpt", "gpt", samples, search_upper=batch, **size), batch


def parameter_counts(w: M.Workload) -> dict[str, int]:
    """Parameters of the GPT (tied head counted once) and those outside the token and position embeddings."""
    with torch.device("meta"):
        net = M.build_model(w)
    total = M.count_parameters(net)
    return {
        "parameters": total,
        "non_embedding_parameters": total - net.tok.weight.numel() - net.pos.weight.numel(),
    }


# ---------------------------------------------------------------------------------------------------- model, fit
class GPTModule(pl.LightningModule):
    """The workload's GPT as a LightningModule: next-token cross-entropy, logged every step, AdamW."""

    def __init__(self, w: M.Workload, data: TensorDataset, batch: int, device: torch.device) -> None:
        super().__init__()
        self.w, self.data, self.batch = w, data, batch
        torch.manual_seed(0)  # every fit starts from the same weights
        with torch.device(device):  # initialised where it trains: fast, and the same for every arm
            self.net = M.build_model(w)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = M.compute_loss(self.w, self.net, batch)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return M.make_optimizer(self.net)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch, shuffle=False, drop_last=True, num_workers=0)


def make_arm(arm: str) -> Callback | None:
    if arm == "none":
        return None
    if arm == "AutoMicrobatch":
        return AutoMicrobatch()
    if arm == "MemoryMonitor":
        return MemoryMonitor()
    raise ValueError(arm)


def fit(
    args: argparse.Namespace,
    setup: tuple[M.Workload, TensorDataset, int],
    arm: str,
    steps: int,
    log_dir: str,
    extra_first: list[Callback] | None = None,
    extra_last: list[Callback] | None = None,
    profiler: Profiler | None = None,
) -> None:
    """One fresh fit of ``--warmup`` + ``steps`` steps, the arm's callback between ``extra_first`` and ``extra_last``.

    An AutoMicrobatch that split fails the benchmark. Everything the fit held is freed before it returns.
    """
    w, data, batch = setup
    device = torch.device(args.device)
    callback = make_arm(arm)
    trainer = pl.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        precision="bf16-mixed" if device.type == "cuda" else "32-true",
        max_steps=args.warmup + steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=args.log_every,
        logger=CSVLogger(log_dir, name="fit"),
        callbacks=[*(extra_first or []), *([callback] if callback is not None else []), *(extra_last or [])],
        profiler=profiler,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=log_dir,
    )
    trainer.fit(GPTModule(w, data, batch, device))
    if isinstance(callback, AutoMicrobatch) and (callback.microbatches, callback.oom_recoveries) != (1, 0):
        raise RuntimeError(
            f"AutoMicrobatch split ({callback.microbatches} micro-batches, {callback.oom_recoveries} OOMs recovered):"
            " this benchmark measures it when it never splits"
        )
    del trainer, callback  # the callbacks hold the trainer, which holds the model and the optimizer
    release(device)


def release(device: torch.device) -> None:
    """Free what the last fit left (reference cycles included) and empty the CUDA cache: each fit starts alike."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed_fit(
    args: argparse.Namespace, setup: tuple[M.Workload, TensorDataset, int], arm: str, log_dir: str
) -> float:
    """Milliseconds per step over the ``--steps`` timed steps of one fresh fit."""
    window = H.StepWindow(args.warmup, args.warmup + args.steps - 1, cuda=args.device == "cuda")
    start, end = window.callbacks()
    fit(args, setup, arm, args.steps, log_dir, extra_first=[start], extra_last=[end])
    seconds = window.seconds()
    if seconds is None:
        raise RuntimeError(f"{arm}: the fit ran {window.ended} batches, expected {args.warmup + args.steps}")
    return 1000.0 * seconds / window.steps


# ---------------------------------------------------------------------------------------------------- rounds
def run_rounds(
    args: argparse.Namespace, setup: tuple[M.Workload, TensorDataset, int], log_dir: str
) -> dict[str, Any]:
    began = time.perf_counter()
    warm = timed_fit(args, setup, "none", log_dir)  # process warm-up, discarded
    H.log(f"warm-up fit (none, discarded): {warm:.2f} ms/step")
    per_round = H.interleaved_rounds(
        ARMS,
        args.rounds,
        lambda arm: timed_fit(args, setup, arm, log_dir),
        progress=lambda line: H.log(line + " ms"),
    )
    tokens = setup[2] * setup[0].seq_len
    results: dict[str, Any] = {}
    for arm in ARMS:
        ms = [r[arm] for r in per_round]
        ratios = [r["none"] / r[arm] for r in per_round]
        results[arm] = {
            "ms_per_step": ms,
            "median_ms_per_step": statistics.median(ms),
            "min_ms_per_step": min(ms),
            "max_ms_per_step": max(ms),
            "median_tokens_per_s": tokens * 1000.0 / statistics.median(ms),
            "ratio_vs_none": ratios,  # ms/step of none / ms/step of the arm, per round
            "median_ratio_vs_none": statistics.median(ratios),
            "cost_below_1_percent": statistics.median(ratios) >= 0.99,
        }
    rounds = [{"order": list(r), "ms_per_step": dict(r)} for r in per_round]
    return {
        "warmup_fit_ms_per_step": warm,
        "results": results,
        "rounds": rounds,
        "seconds": time.perf_counter() - began,
    }


def print_rounds(report: dict[str, Any], args: argparse.Namespace) -> None:
    sync = ", `torch.cuda.synchronize()` at the window's two ends only" if args.device == "cuda" else ""
    print(
        f"{args.rounds} rounds x {len(ARMS)} arms, order rotated each round; per fit {args.warmup} warm-up +"
        f" {args.steps} timed steps{sync}. Ratio = ms/step of none / ms/step of the arm, median of the per-round"
        " ratios (>= 0.99: costs < 1%).\n"
    )
    print("| arm | median ms/step | ms/step range | median tokens/s | ratio vs none | per-round ratios |")
    print("| --- | --- | --- | --- | --- | --- |")
    for arm, r in report["results"].items():
        per_round = ", ".join(f"{x:.4f}" for x in r["ratio_vs_none"])
        print(
            f"| {arm} | {r['median_ms_per_step']:.2f} | {r['min_ms_per_step']:.2f} - {r['max_ms_per_step']:.2f} |"
            f" {r['median_tokens_per_s']:,.0f} | {r['median_ratio_vs_none']:.4f} | {per_round} |"
        )
    print()
    for arm in ARMS[1:]:
        ratio = report["results"][arm]["median_ratio_vs_none"]
        verdict = "costs < 1%" if ratio >= 0.99 else f"costs {1 - ratio:.1%}"
        print(f"{arm}: median ratio {ratio:.4f} ({verdict})")


# ---------------------------------------------------------------------------------------------------- profile
class ActionTimes(Profiler):
    """Lightning's profiled actions (hooks, loop stages): inclusive and self wall time while ``active``.

    Each action is also a ``torch.profiler.record_function`` range, so it shows in the torch profiler's table.
    """

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.stack: list[list[Any]] = []  # [name, start, nested seconds, counted, record_function]
        self.total: dict[str, float] = defaultdict(float)
        self.self_time: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def start(self, action_name: str) -> None:
        scope = torch.profiler.record_function(action_name)
        scope.__enter__()
        self.stack.append([action_name, time.perf_counter(), 0.0, self.active, scope])

    def stop(self, action_name: str) -> None:
        if not self.stack or self.stack[-1][0] != action_name:
            return  # not started through `start` (not expected)
        name, began, nested, counted, scope = self.stack.pop()
        scope.__exit__(None, None, None)
        seconds = time.perf_counter() - began
        if self.stack:
            self.stack[-1][2] += seconds
        if counted:
            self.total[name] += seconds
            self.self_time[name] += seconds - nested
            self.calls[name] += 1

    def table(self, steps: int, rows: int = TOP) -> str:
        names = [
            name for name in self.self_time if "StepMarks" not in name
        ]  # the profiler's own step, not ours
        names = sorted(names, key=self.self_time.get, reverse=True)[:rows]  # type: ignore[arg-type]
        lines = [
            "| Lightning action | calls/step | self ms/step | total ms/step |",
            "| --- | --- | --- | --- |",
        ]
        for name in names:
            lines.append(
                f"| `{name}` | {self.calls[name] / steps:g} | {1e3 * self.self_time[name] / steps:.3f} |"
                f" {1e3 * self.total[name] / steps:.3f} |"
            )
        return "\n".join(lines)


class StepMarks(Callback):
    """Last in the callback list: ``on_step(batches ended)`` at the end of every training batch."""

    def __init__(self, on_step: Any) -> None:
        self.on_step, self.ended = on_step, 0

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.ended += 1
        self.on_step(self.ended)


def profile_arm(
    args: argparse.Namespace, setup: tuple[M.Workload, TensorDataset, int], arm: str, log_dir: str
) -> dict[str, Any]:
    """Tables 1-3 of the docstring for one arm."""
    cuda = args.device == "cuda"
    first, steps = args.warmup + 1, args.profile_steps  # one untimed step more: the profiler's own warm-up
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if cuda else []
    )
    schedule = torch.profiler.schedule(wait=first - 1, warmup=1, active=steps, repeat=1)
    actions = ActionTimes()
    window = H.StepWindow(first, first + steps - 1, cuda=cuda)
    start, end = window.callbacks()
    with torch.profiler.profile(
        activities=activities, schedule=schedule, record_shapes=False, with_stack=False
    ) as prof:

        def on_step(ended: int) -> None:  # after batch `ended - 1`: the next step is profiler step `ended`
            prof.step()
            actions.active = first <= ended < first + steps

        fit(
            args,
            setup,
            arm,
            first - args.warmup + steps,
            log_dir,
            [start],
            [end, StepMarks(on_step)],
            actions,
        )
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=TOP)

    profiler = cProfile.Profile()

    def on_step_cprofile(ended: int) -> None:
        if ended == first:
            profiler.enable()
        elif ended == first + steps:
            profiler.disable()

    fit(args, setup, arm, first - args.warmup + steps, log_dir, extra_last=[StepMarks(on_step_cprofile)])
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(TOP)
    seconds = window.seconds()
    return {
        "ms_per_step": None if seconds is None else 1000.0 * seconds / steps,
        "ops": ops,
        "actions": actions.table(steps),
        "python": text.getvalue().strip(),
    }


def run_profile(
    args: argparse.Namespace, setup: tuple[M.Workload, TensorDataset, int], log_dir: str
) -> None:
    fit(args, setup, "none", 1, log_dir)  # process warm-up, discarded
    for arm in ("AutoMicrobatch", "none"):
        H.log(f"profiling {arm}")
        r = profile_arm(args, setup, arm, log_dir)
        ms = "n/a" if r["ms_per_step"] is None else f"{r['ms_per_step']:.2f}"
        print(
            f"## Profile: {arm} ({args.profile_steps} steps after {args.warmup + 1} untimed; {ms} ms/step profiled)\n"
        )
        print(f"### {arm}: top {TOP} ops by self CPU time (torch.profiler)\n")
        print(r["ops"] + "\n")
        print(f"### {arm}: Python-level time per Lightning action (self = without nested actions)\n")
        print(r["actions"] + "\n")
        print(
            f"### {arm}: top {TOP} Python functions by own time (cProfile, a second fit, the same steps)\n"
        )
        print(r["python"] + "\n", flush=True)


# ---------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    H.quiet_lightning()
    if args.device == "cuda":
        torch.set_float32_matmul_precision("high")
    w, batch = workload(args)
    counts = parameter_counts(w)
    data = M.build_dataset(w)
    setup = (w, data, batch)
    cuda = args.device == "cuda"
    device_name = (
        torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine() or "cpu"
    )
    precision = "bf16-mixed" if cuda else "32-true"
    stamps = H.versions()
    print("# AutoMicrobatch on a GPU-bound GPT, never splitting\n")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in stamps.items()))
    print(
        f"device: {device_name} ({args.device}), precision {precision}"
        + (" (--quick)" if args.quick else "")
    )
    print(
        f"model: GPT d_model={w.d_model} layers={w.layers} heads={w.heads} vocab={w.vocab} context={w.seq_len},"
        f" {counts['parameters']:,} parameters ({counts['non_embedding_parameters']:,} without embeddings);"
        f" batch {batch} x {w.seq_len} tokens, AdamW, log_every_n_steps={args.log_every}",
        flush=True,
    )
    if args.quick:
        print("quick mode: a tiny GPT, a smoke run; the numbers are not meaningful")
    print()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpumem-mb-gpt-") as log_dir:
        if args.profile:
            run_profile(args, setup, log_dir)
            H.log(f"done in {time.perf_counter() - began:.1f} s")
            return 0
        report = run_rounds(args, setup, log_dir)
    print_rounds(report, args)
    wall = time.perf_counter() - began
    print(f"\nTotal time: {wall:.1f} s")
    if args.json is not None:
        meta = {
            "command": " ".join(sys.argv),
            "versions": stamps,
            "device": device_name,
            "precision": precision,
            "settings": {
                k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"
            },
            "model": {
                "description": M.describe(w),
                **counts,
                "batch_size": batch,
                "tokens_per_step": batch * w.seq_len,
            },
            "wall_s": wall,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, **report}, indent=2) + "\n")
        print(f"Wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
