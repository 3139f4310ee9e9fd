"""Two training processes on one GPU: ``EmptyCacheOnThreshold`` lets the second one in.

Run it from the repository root on one CUDA GPU (about a minute on an H200; every subprocess has a timeout)::

    PYTHONPATH=. python3 benchmarks/colocated.py --json colocated.json   # F = 12 GiB, spike 6 GiB, B needs 7 GiB
    PYTHONPATH=. python3 benchmarks/colocated.py --free-gib 20 --spike-gib 10 --b-need-gib 12
    PYTHONPATH=. python3 benchmarks/colocated.py --quick                  # CPU smoke run of the whole pipeline

**Setting.** A *holder* process reads the free GPU memory (``torch.cuda.mem_get_info()``), allocates all but ``F``
(``--free-gib``, default 12 GiB) as one tensor and sleeps until killed. A and B share ``F``, CUDA contexts included.

* **A** trains with Lightning (``Trainer(accelerator="gpu", devices=1, max_steps=--steps)``, 32-bit, no logger, no
  checkpoints) an MLP of four 4096x4096 linear layers with AdamW on random batches of 512 drawn on the GPU: a steady
  footprint of about 1.5 GiB. Validation (2 batches) runs after half the steps and at the end; each validation batch
  also allocates a temporary ``--spike-gib`` tensor (default 6 GiB), fills and sums it. The caching allocator keeps
  that memory reserved afterwards, where no other process can use it. A runs under ``MemoryBudget(F)``.
* **B** (plain PyTorch) starts together with A, creates its CUDA context, waits for A's signal file, then allocates
  ``--b-need-gib`` (default 7 GiB) as one tensor and runs a few matmuls. It reports ``ok`` or ``OOM`` (with the free
  device memory it saw just before), frees everything and writes a *done* file.

Two scenarios, each with a fresh holder, A and B: *without*, where A's callbacks are ``MemoryBudget(F)`` and the
signal callback, so A's cache keeps the spike and B runs out of memory; and *with*, where ``EmptyCacheOnThreshold(
threshold=0.5)`` sits between them: after validation A's reserved memory is above half the budget (it is not in
steady training), the callback empties A's cache and B fits. The signal callback is last in A's list, so its
``on_validation_end`` runs after ``EmptyCacheOnThreshold``'s: at the end of A's first validation it records A's
reserved memory, writes the signal file, then waits (at most half of ``--timeout``) for B's done file before A
trains on. So B allocates while A is alive and holds what the callback left, and B has freed its memory before A's
second validation spikes again.

**Throughput cost.** Two callbacks, first and last but one in A's list (``_harness.StepWindow``), time the training
steps before the first validation, without the first 20 (warm-up): from the start of step 21 to the end of step
``--steps / 2``, ``torch.cuda.synchronize()`` and ``time.perf_counter()`` at both ends. B is only waiting then, so
the two scenarios differ by the callback alone: ``cost = 1 - (steps/s with) / (steps/s without)``. Two runs differ by
noise at the 1% level, so the *with* run also times each call of the callback's ``on_train_batch_end`` during the fit
after the warm-up (a subclass wraps it in ``perf_counter``): µs per batch and its fraction of A's mean step time; and
2000 calls of the unwrapped hook in a tight loop after the fit.

**Output.** A Markdown table and the two cost lines on stdout, progress on stderr, every number in ``--json PATH``.
Every subprocess runs in its own process group under ``--timeout`` (default 120 s), killed on timeout; the holder is
killed at the end of its scenario. ``--log-dir`` keeps the subprocesses' output.

``--quick`` runs the pipeline on the CPU without a holder: a 2 x 64 MLP, batch 32, 60 steps, a 16 MiB spike, B
allocates 8 MiB. The callbacks only warn on a CPU, nothing runs out of memory; memory numbers are "n/a".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `_harness` next to this file
import _harness as H

GIB, MIB = H.GIB, H.MIB
SCENARIOS = ("without", "with")
WARMUP_STEPS = 20  # training steps left out of the steps/s measurement
LOOP_CALLS = 2000  # calls of the hook in the tight loop after the fit
MODEL = {"gpu": (4096, 4, 512), "quick": (64, 2, 32)}  # width, hidden layers, batch size


# ---------------------------------------------------------------------------------------------------- workers
def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically, so that a process polling for the file never reads half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data), "utf-8")
    os.replace(tmp, path)


def _wait_for(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def holder_worker(args: argparse.Namespace) -> int:
    """Allocates all but ``F`` of the free device memory, says so in the ready file, and sleeps until killed."""
    ready = Path(args.ready_file)
    try:
        free, total = torch.cuda.mem_get_info()  # after this process's own CUDA context
        if free <= args.free_bytes:
            raise RuntimeError(
                f"only {free / GIB:.1f} GiB free, not more than F = {args.free_bytes / GIB:.1f} GiB"
            )
        block = torch.empty(free - args.free_bytes, dtype=torch.uint8, device="cuda")
        info = {"device": torch.cuda.get_device_name(), "total_bytes": total, "free_before_bytes": free}
        info.update(held_bytes=block.numel(), free_after_bytes=torch.cuda.mem_get_info()[0])
    except Exception as error:
        _write_json(ready, {"error": H.describe_error(error)})
        return 1
    _write_json(ready, info)
    while True:  # the orchestrator kills the process group
        time.sleep(60)


def _b_work(device: torch.device, nbytes: int) -> None:
    """B's job; its tensors are freed when it returns or raises."""
    block = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    a = torch.randn((2048, 2048) if device.type == "cuda" else (256, 256), device=device)
    for _ in range(5):
        a = torch.tanh(a @ a)
    float(a.sum() + block[-1])  # waits for the GPU


def b_worker(args: argparse.Namespace) -> int:
    """Waits for A's signal, then allocates ``--b-need-gib`` and computes; reports ok or OOM."""
    result: dict[str, Any] = {"role": "B", "outcome": "error", "error": None, "free_before_bytes": None}
    try:
        device = torch.device("cpu") if args.quick else torch.device("cuda", 0)
        torch.zeros(1, device=device)  # the CUDA context now, not after A's signal
        if not _wait_for(Path(args.signal_file), args.wait):
            result["outcome"] = "no signal"
        else:
            if device.type == "cuda":
                result["free_before_bytes"] = torch.cuda.mem_get_info()[0]
            start = time.perf_counter()
            try:
                _b_work(device, args.b_need_bytes)
                result["outcome"] = "ok"
            except torch.OutOfMemoryError as error:
                result.update(outcome="OOM", error=H.describe_error(error))
            result["seconds"] = time.perf_counter() - start
            torch.cuda.empty_cache()  # a no-op without CUDA
    except Exception as error:
        result["error"] = H.describe_error(error)
    finally:
        _write_json(Path(args.done_file), {"outcome": result["outcome"]})
    H.emit(result)
    return 0


def _a_classes() -> tuple[type, type, type]:
    """A's LightningModule and callbacks; built on demand so that the holder and B never import Lightning."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from torch import nn
    from torch.utils.data import DataLoader

    from lightning_gpumem import EmptyCacheOnThreshold

    class SpikyMLP(pl.LightningModule):
        """An MLP on random data whose validation steps allocate and use a large temporary tensor."""

        def __init__(self, width: int, depth: int, batch_size: int, spike_bytes: int, steps: int) -> None:
            super().__init__()
            layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())]
            self.net = nn.Sequential(*layers, nn.Linear(width, 1))
            self.width, self.batch_size, self.spike_bytes, self.steps = width, batch_size, spike_bytes, steps

        def _loss(self) -> torch.Tensor:
            return self.net(torch.randn(self.batch_size, self.width, device=self.device)).square().mean()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self._loss()

        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            spike = torch.empty(self.spike_bytes // 4, device=self.device).fill_(1.0)
            total = spike.sum()
            del spike  # freed, but the caching allocator keeps it reserved
            return self._loss() + 0 * total

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(
                torch.arange(self.steps), batch_size=None
            )  # dummy batches; the data is drawn on the GPU

        def val_dataloader(self) -> DataLoader:
            return DataLoader(torch.arange(2), batch_size=None)

    class SignalB(Callback):
        """Last in the callbacks: after A's first validation, record A's memory, signal B, wait for B's done file."""

        def __init__(self, args: argparse.Namespace, cuda: bool, cache: Any) -> None:
            self.args, self.cuda, self.cache, self.info = args, cuda, cache, None

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            if self.info is not None or trainer.sanity_checking:
                return
            info: dict[str, Any] = {"step": trainer.global_step}
            if self.cuda:
                torch.cuda.synchronize()
                info.update(
                    reserved_bytes=torch.cuda.memory_reserved(),
                    allocated_bytes=torch.cuda.memory_allocated(),
                )
                info["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
            if self.cache is not None:
                info["releases"] = self.cache.releases
            _write_json(Path(self.args.signal_file), info)
            start = time.perf_counter()
            info["b_done"] = _wait_for(Path(self.args.done_file), self.args.wait)
            info["waited_seconds"] = time.perf_counter() - start
            self.info = info

    class TimedEmptyCache(EmptyCacheOnThreshold):
        """``EmptyCacheOnThreshold`` whose ``on_train_batch_end`` calls are timed one by one."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.hook_seconds: list[float] = []

        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            super().on_train_batch_end(*args, **kwargs)
            self.hook_seconds.append(time.perf_counter() - start)

    return SpikyMLP, SignalB, TimedEmptyCache


def _hook_cost(cache: Any, trainer: Any, module: Any) -> dict[str, Any]:
    """The timed hook calls of the fit after the warm-up, then ``LOOP_CALLS`` calls of the unwrapped hook."""
    times = cache.hook_seconds[WARMUP_STEPS:]
    cost: dict[str, Any] = {"hook_calls": len(times), "hook_us": None, "hook_median_us": None}
    if times:
        cost.update(hook_us=statistics.fmean(times) * 1e6, hook_median_us=statistics.median(times) * 1e6)
    hook, releases = super(type(cache), cache).on_train_batch_end, cache.releases
    try:
        start = time.perf_counter()
        for _ in range(LOOP_CALLS):
            hook(trainer, module, None, None, 0)
        cost["loop_us"] = (time.perf_counter() - start) / LOOP_CALLS * 1e6
    except Exception as error:
        cost["loop_error"] = H.describe_error(error)
    return {**cost, "loop_releases": cache.releases - releases}


def a_worker(args: argparse.Namespace) -> int:
    """A: the Lightning fit with the validation spike; reports memory after its first validation and its speed."""
    result: dict[str, Any] = {
        "role": "A",
        "scenario": args.scenario,
        "finished": False,
        "oom": False,
        "error": None,
    }
    try:
        warnings.filterwarnings("ignore", message=r".*(num_workers|does not have many workers).*")
        import lightning.pytorch as pl

        from lightning_gpumem import MemoryBudget

        module_cls, signal_cls, cache_cls = _a_classes()
        cuda, val_at = not args.quick, args.steps // 2
        pl.seed_everything(0, verbose=False)
        module = module_cls(*MODEL["quick" if args.quick else "gpu"], args.spike_bytes, args.steps)
        # The training steps after the warm-up up to the first validation (batches WARMUP_STEPS to val_at - 1).
        window = H.StepWindow(WARMUP_STEPS, val_at - 1, cuda=cuda)
        start, end = window.callbacks()
        cache = cache_cls(threshold=args.threshold) if args.scenario == "with" else None
        signal_cb = signal_cls(args, cuda, cache)
        callbacks = [
            start,
            MemoryBudget(args.free_bytes),
            *([cache] if cache is not None else []),
            end,
            signal_cb,
        ]
        with tempfile.TemporaryDirectory(prefix="colocated_") as root:
            trainer = pl.Trainer(
                accelerator="gpu" if cuda else "cpu",
                devices=1,
                max_steps=args.steps,
                val_check_interval=val_at,
                limit_val_batches=2,
                num_sanity_val_steps=0,
                callbacks=callbacks,
                default_root_dir=root,
                **H.QUIET_TRAINER,
            )
            try:
                trainer.fit(module)
                result["finished"] = trainer.global_step >= args.steps
            except Exception as error:
                result.update(oom=isinstance(error, torch.OutOfMemoryError), error=H.describe_error(error))
        result.update(steps=trainer.global_step, steps_per_second=window.steps_per_second())
        result["first_validation"] = signal_cb.info
        if cuda:
            result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        if cache is not None:
            result.update(releases=cache.releases, released_bytes=cache.released_bytes)
            result.update(release_seconds=cache.release_seconds, **_hook_cost(cache, trainer, module))
    except Exception as error:
        result["error"] = H.describe_error(error)
    H.emit(result)
    return 0


# ---------------------------------------------------------------------------------------------------- orchestration
def _finish(worker: H.Worker, deadline: float) -> dict[str, Any]:
    """Waits for ``worker`` until ``deadline`` (then kills it); its RESULT, or a record of why there is none."""
    worker.wait(deadline)
    result = worker.result()
    if result is None:
        result = {"error": worker.failure()}
    result.update(timed_out=worker.timed_out, wall_seconds=round(worker.seconds, 2))
    return result


def _wait_ready(path: Path, holder: H.Worker, seconds: float) -> dict[str, Any]:
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if path.exists():
            return json.loads(path.read_text("utf-8"))
        if holder.proc.poll() is not None:
            return {"error": f"holder exited with code {holder.proc.returncode}: ...{holder.stderr_tail()}"}
        time.sleep(0.05)
    return {"error": "holder: timeout"}


def run_scenario(
    args: argparse.Namespace, scenario: str, sizes: dict[str, int], root: Path
) -> dict[str, Any]:
    """A fresh holder, then A and B together; returns their results. Every process is gone when it returns."""
    workdir = root / scenario
    workdir.mkdir(parents=True, exist_ok=True)
    files = {name: workdir / f"{name}.json" for name in ("ready", "signal", "done")}
    for path in files.values():
        path.unlink(missing_ok=True)
    env = H.worker_env()
    base = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--scenario",
        scenario,
        "--steps",
        str(args.steps),
    ]
    base += ["--threshold", str(args.threshold), "--wait", str(args.timeout / 2)]
    base += [f"--{key.replace('_', '-')}={value}" for key, value in sizes.items()]
    base += [f"--{name}-file={path}" for name, path in files.items()] + (["--quick"] if args.quick else [])
    entry: dict[str, Any] = {"scenario": scenario}
    workers: list[H.Worker] = []
    try:
        if not args.quick:
            workers.append(H.Worker([*base, "--worker", "holder"], "holder", env, workdir))
            entry["holder"] = _wait_ready(files["ready"], workers[0], args.timeout)
            if "error" in entry["holder"]:
                H.log(f"{scenario}: {entry['holder']['error']}")
                return entry
            H.log(f"{scenario}: holder holds {entry['holder']['held_bytes'] / GIB:.1f} GiB")
        deadline = time.perf_counter() + args.timeout
        workers += [H.Worker([*base, "--worker", role], role, env, workdir) for role in ("A", "B")]
        entry["A"] = _finish(workers[-2], deadline)
        if not files["signal"].exists():  # A ended without signalling: B would wait in vain
            workers[-1].kill()
        entry["B"] = _finish(workers[-1], deadline)
        if not files["signal"].exists():
            entry["B"]["outcome"] = "not run (no signal from A)"
    finally:
        for worker in workers:
            worker.kill()
    sps = _fmt(entry["A"].get("steps_per_second"))
    H.log(f"{scenario}: A {_finished_cell(entry)} ({sps} steps/s before validation), B {_b_cell(entry)}")
    return entry


# ---------------------------------------------------------------------------------------------------- report
def _fmt(value: float | None, spec: str = ".1f", scale: float = 1.0, unit: str = "") -> str:
    return "n/a" if value is None else f"{value * scale:{spec}}{unit}"


def _finished_cell(entry: dict[str, Any]) -> str:
    a = entry.get("A")
    if a is None or a.get("finished"):
        return "not run" if a is None else "yes"
    return "**no** (" + ("OOM" if a.get("oom") else "timeout" if a.get("timed_out") else "error") + ")"


def _b_cell(entry: dict[str, Any]) -> str:
    b = entry.get("B")
    if b is None:
        return "not run"
    outcome = b.get("outcome") or ("timeout" if b.get("timed_out") else "error")
    free = b.get("free_before_bytes")
    return ("**OOM**" if outcome == "OOM" else outcome) + (
        "" if free is None else f" ({free / GIB:.1f} GiB free)"
    )


def _table(report: dict[str, Any]) -> str:
    threshold = report["settings"]["threshold"]
    labels = {
        "without": "without `EmptyCacheOnThreshold`",
        "with": f"`EmptyCacheOnThreshold(threshold={threshold})`",
    }
    lines = [
        "| scenario | A finished | A reserved after validation (GiB) | A cache releases | B outcome | A steps/s |",
        "|---|---|---|---|---|---|",
    ]
    for scenario, entry in report["scenarios"].items():
        a = entry.get("A") or {}
        reserved = (a.get("first_validation") or {}).get("reserved_bytes")
        cells = [
            _finished_cell(entry),
            _fmt(reserved, ".2f", 1 / GIB),
            str(a.get("releases", "-")),
            _b_cell(entry),
        ]
        lines.append(
            f"| {labels[scenario]} | " + " | ".join([*cells, _fmt(a.get("steps_per_second"))]) + " |"
        )
    return "\n".join(lines)


def _summary(report: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The two costs of the callback, as numbers and as the lines printed under the table."""
    a_with, a_without = ((report["scenarios"].get(s) or {}).get("A") or {} for s in ("with", "without"))
    with_sps, without_sps = a_with.get("steps_per_second"), a_without.get("steps_per_second")
    hook_us = a_with.get("hook_us")
    summary = {"throughput_cost": 1 - with_sps / without_sps if with_sps and without_sps else None}
    summary["hook_step_fraction"] = hook_us * 1e-6 * with_sps if with_sps and hook_us is not None else None
    lines = [
        f"throughput cost of the callback: {_fmt(summary['throughput_cost'], '.1%')}"
        f" ({_fmt(with_sps)} vs {_fmt(without_sps)} steps/s with vs without)",
        f"callback cost per training batch: {_fmt(hook_us, unit=' µs')} = {_fmt(summary['hook_step_fraction'], '.2%')}"
        f" of a step (mean over {a_with.get('hook_calls', 'n/a')} batches of the fit, median"
        f" {_fmt(a_with.get('hook_median_us'), unit=' µs')}; {LOOP_CALLS} calls after it:"
        f" {_fmt(a_with.get('loop_us'), unit=' µs')} each)",
    ]
    if a_with.get("released_bytes") is not None:
        lines.append(
            f"with: A released {a_with['released_bytes'] / GIB:.2f} GiB in {a_with['releases']} releases"
            f" ({a_with['release_seconds'] * 1e3:.1f} ms in total)"
        )
    return summary, lines


def orchestrate(args: argparse.Namespace) -> int:
    if args.steps is None:
        args.steps = 60 if args.quick else 400
    if args.steps // 2 < WARMUP_STEPS + 5:
        sys.exit(
            f"--steps must be at least {2 * (WARMUP_STEPS + 5)}: {WARMUP_STEPS} warm-up steps, then 5 timed"
        )
    if (
        not args.quick and not torch.cuda.is_available()
    ):  # no CUDA context here: the holder measures the memory
        sys.exit("No CUDA device: the benchmark needs one. Use --quick for a CPU smoke run.")
    scale = MIB if args.quick else GIB
    spike_gib, b_need_gib = (16, 8) if args.quick else (args.spike_gib, args.b_need_gib)
    sizes = {"free_bytes": int(args.free_gib * GIB), "spike_bytes": int(spike_gib * scale)}
    sizes["b_need_bytes"] = int(b_need_gib * scale)
    report: dict[str, Any] = {"settings": {**vars(args), **sizes}, "versions": H.versions(), "scenarios": {}}
    print("# Two processes on one GPU: `EmptyCacheOnThreshold` releases A's cache for B\n")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()))
    width, depth, batch = MODEL["quick" if args.quick else "gpu"]
    unit = "MiB" if args.quick else "GiB"
    print(
        f"A: MLP {depth} x {width}, batch {batch}, AdamW, {args.steps} steps, validation (2 batches, {spike_gib:g}"
        f" {unit} spike each) at steps {args.steps // 2} and {args.steps}; B allocates {b_need_gib:g} {unit}"
    )
    if args.quick:
        print("quick mode: CPU, no holder, tiny sizes, the callbacks only warn; numbers are not meaningful")
    with contextlib.ExitStack() as stack:
        root = (
            Path(args.log_dir) if args.log_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        )
        for scenario in SCENARIOS:
            H.log(f"{scenario}: starting")
            report["scenarios"][scenario] = run_scenario(args, scenario, sizes, root)
            report["summary"] = _summary(report)[0]
            if args.json:
                Path(args.json).write_text(json.dumps(report, indent=2), "utf-8")
    holder = next(
        (e["holder"] for e in report["scenarios"].values() if "held_bytes" in e.get("holder", {})), None
    )
    if holder is not None:
        print(
            f"GPU: {holder['device']} ({holder['total_bytes'] / GIB:.1f} GiB); F ="
            f" {holder['free_after_bytes'] / GIB:.1f} GiB free for A and B"
            f" (holder holds {holder['held_bytes'] / GIB:.1f} GiB)"
        )
    print()
    print(_table(report) + "\n")
    print("\n".join(_summary(report)[1]), flush=True)
    H.log(f"done in {time.perf_counter() - H.T0:.1f} s")
    return 0


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--free-gib", type=float, default=12.0, help="free GPU memory F that A and B share")
    parser.add_argument(
        "--spike-gib", type=float, default=6.0, help="A's temporary allocation per validation batch"
    )
    parser.add_argument("--b-need-gib", type=float, default=7.0, help="what B allocates and keeps")
    parser.add_argument("--threshold", type=float, default=0.5, help="EmptyCacheOnThreshold's threshold")
    parser.add_argument("--steps", type=int, help="A's training steps (default 400, 60 with --quick)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a subprocess is killed")
    parser.add_argument("--json", help="write every number to this file")
    parser.add_argument("--log-dir", help="keep each subprocess's stdout and stderr here")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: no holder, tiny sizes")
    # Internal: the worker subprocesses.
    parser.add_argument("--worker", choices=("holder", "A", "B"), help=argparse.SUPPRESS)
    parser.add_argument("--scenario", choices=SCENARIOS, help=argparse.SUPPRESS)
    parser.add_argument("--wait", type=float, default=60.0, help=argparse.SUPPRESS)
    for name in ("free-bytes", "spike-bytes", "b-need-bytes"):
        parser.add_argument(f"--{name}", type=int, help=argparse.SUPPRESS)
    for name in ("ready", "signal", "done"):
        parser.add_argument(f"--{name}-file", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    workers = {"holder": holder_worker, "A": a_worker, "B": b_worker}
    return workers[args.worker](args) if args.worker else orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
