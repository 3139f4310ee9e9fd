"""Overhead of ``lightning_gpumem.MemoryMonitor`` next to Lightning's ``DeviceStatsMonitor``.

Run it on the machine you care about (a GPU is picked when there is one, else the CPU)::

    python benchmarks/monitor_overhead.py --json out.json   # full run, a few minutes on one GPU
    python benchmarks/monitor_overhead.py --quick           # tiny smoke run, CPU is fine

Three measurements, printed as Markdown tables (``--json PATH`` also writes every number, raw samples included):

1. **Readers.** Microseconds per call of each way to read the allocator (``torch.cuda.memory_stats``,
   ``torch.accelerator.memory_stats``, ``torch.cuda.memory_stats_as_nested_dict``, the peak reset) and of
   ``MemoryProbe``'s reads: every call is timed on its own with ``time.perf_counter_ns`` after a warm-up, the
   readers taking turns in a few interleaved blocks of calls; the median, mean and 90th percentile are reported.
   The CUDA readers need CUDA; on a CPU run only the probe rows are measured (they read host memory only) so that
   the code path is exercised.
2. **Hook cost per batch.** A real ``Trainer.fit`` with ``log_every_n_steps=10``; the callback instance's
   ``on_train_batch_start`` and ``on_train_batch_end`` are replaced by timing wrappers that call the original.
   A batch is a *logging* batch when ``(fit_loop.epoch_loop._batches_that_stepped + 1) % 10 == 0`` at batch start,
   Lightning's own rule, applied to every callback alike. Start + end hook time is summed per batch, the warm-up
   batches are dropped, and median and mean are reported for non-logging and logging batches. No
   ``torch.cuda.synchronize`` is inserted: this is host-side time, as the training loop experiences it (a hook that
   synchronizes on its own includes the wait for the GPU). A plain ``Callback()`` row gives the floor of the
   measurement (wrapper and hook dispatch).
3. **End-to-end throughput.** ``log_every_n_steps=1`` (the worst case for a monitor) and three configurations:
   ``none``, ``DeviceStatsMonitor``, ``MemoryMonitor``. Each round runs one fit per configuration, the order rotated
   every round so drift hits all alike. A fit runs ``warmup + steps`` optimizer steps; the clock starts at
   ``on_train_batch_start`` of batch ``warmup`` (a callback placed before the monitor) and stops at
   ``on_train_batch_end`` of the last batch (a callback placed after it), with ``torch.cuda.synchronize()`` at both
   points on CUDA. Reported: median steps/s and ms/step over rounds, and the median over rounds of the per-round
   ratio to ``none`` (and of the per-round difference in ms/step). One untimed fit warms the process up first.

Every fit uses the same model (a small GPT: token embedding, causal ``nn.TransformerEncoder``, AdamW, ``bf16-mixed``
on CUDA and 32-bit on CPU) trained on random tokens from an in-memory ``TensorDataset`` (``num_workers=0``); it calls
``self.log("loss", loss)`` every step, like a real model. All fits log to a ``CSVLogger`` in a temporary directory,
without checkpointing, progress bar, model summary or validation.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, DeviceStatsMonitor
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `_harness` next to this file
import _harness as H

import lightning_gpumem
from lightning_gpumem import MemoryMonitor
from lightning_gpumem._hw.probe import MemoryProbe

MICRO_BLOCKS = 5  # part 1: interleaved blocks of calls per reader
HOOK_LOG_EVERY = 10  # log_every_n_steps of part 2
CONFIGS = ("none", "DeviceStatsMonitor", "MemoryMonitor")  # part 3


# ---------------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Settings:
    """Everything a run depends on; printed and written to the JSON."""

    device: str
    quick: bool
    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch_size: int
    rounds: int
    warmup: int
    steps: int
    hook_steps: int
    micro_calls: int
    micro_warmup: int

    @property
    def precision(self) -> str:
        return "bf16-mixed" if self.device == "cuda" else "32-true"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny model and few steps: a smoke test (CPU is fine)"
    )
    parser.add_argument(
        "--rounds", type=int, help="part 3: rounds of the interleaved fits (default 5, quick 2)"
    )
    parser.add_argument("--steps", type=int, help="part 3: timed steps per fit (default 200, quick 15)")
    parser.add_argument(
        "--warmup", type=int, help="untimed steps at the start of every fit (default 20, quick 3)"
    )
    parser.add_argument("--hook-steps", type=int, help="part 2: batches per fit (default 420, quick 40)")
    parser.add_argument("--json", type=Path, help="write all numbers (raw samples included) to this file")
    parser.add_argument(
        "--device", choices=("auto", "cuda", "cpu"), default="auto", help="default: cuda if available"
    )
    args = parser.parse_args(argv)
    for name in ("rounds", "steps", "warmup", "hook_steps"):
        value = getattr(args, name)
        if value is not None and (value < 1 if name != "warmup" else value < 0):
            parser.error(
                f"--{name.replace('_', '-')} must be {'positive' if name != 'warmup' else 'non-negative'}"
            )
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    return args


def make_settings(args: argparse.Namespace) -> Settings:
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        model = {"vocab": 1024, "d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 32, "batch_size": 8}
        counts = {
            "rounds": 2,
            "warmup": 3,
            "steps": 15,
            "hook_steps": 40,
            "micro_calls": 200,
            "micro_warmup": 20,
        }
    else:
        model = {
            "vocab": 8192,
            "d_model": 512,
            "n_layers": 4,
            "n_heads": 8,
            "seq_len": 256,
            "batch_size": 32,
        }
        counts = {
            "rounds": 5,
            "warmup": 20,
            "steps": 200,
            "hook_steps": 420,
            "micro_calls": 2000,
            "micro_warmup": 200,
        }
    for name in ("rounds", "warmup", "steps", "hook_steps"):
        if getattr(args, name) is not None:
            counts[name] = getattr(args, name)
    return Settings(device=device, quick=args.quick, **model, **counts)


# ---------------------------------------------------------------------------------------------------- model, data
class TinyGPT(pl.LightningModule):
    """GPT-style language model: token + position embedding, causal pre-norm Transformer blocks, a linear head."""

    def __init__(self, vocab: int, d_model: int, n_layers: int, n_heads: int, seq_len: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(1, seq_len, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model,
            n_heads,
            dim_feedforward=4 * d_model,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer(
            "causal_mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:, :length]
        x = self.blocks(x, mask=self.causal_mask[:length, :length], is_causal=True)
        return self.head(self.norm(x))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


def make_model(s: Settings) -> TinyGPT:
    torch.manual_seed(0)  # every fit starts from the same weights
    return TinyGPT(s.vocab, s.d_model, s.n_layers, s.n_heads, s.seq_len)


def make_dataset(s: Settings) -> TensorDataset:
    """Random tokens on the host: enough batches that no fit crosses an epoch boundary."""
    batches = max(s.hook_steps, s.warmup + s.steps)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(s.vocab, (batches * s.batch_size, s.seq_len + 1), generator=generator)
    return TensorDataset(tokens)


def fit(
    s: Settings, data: TensorDataset, callbacks: list[Callback], max_steps: int, log_every: int, log_dir: str
) -> None:
    trainer = pl.Trainer(
        accelerator=s.device,
        devices=1,
        precision=s.precision,  # type: ignore[arg-type]
        max_steps=max_steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=log_every,
        logger=CSVLogger(log_dir, name="fit"),
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=log_dir,
    )
    loader = DataLoader(data, batch_size=s.batch_size, shuffle=False, num_workers=0, drop_last=True)
    trainer.fit(make_model(s), train_dataloaders=loader)


def make_callback(name: str) -> Callback | None:
    if name == "none":
        return None
    if name == "Callback":
        return Callback()
    if name == "DeviceStatsMonitor":
        return DeviceStatsMonitor()
    if name == "MemoryMonitor":
        return MemoryMonitor()
    if name == "MemoryMonitor(detect_leaks=False)":
        return MemoryMonitor(detect_leaks=False)
    raise ValueError(name)


# ---------------------------------------------------------------------------------------------------- statistics
def _us(ns: float) -> float:
    return ns / 1000.0


def summarize_ns(samples: list[int]) -> dict[str, float | int | None]:
    """Median, mean and 90th percentile in microseconds (``None`` without samples)."""
    if not samples:
        return {"n": 0, "median_us": None, "mean_us": None, "p90_us": None}
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {
        "n": len(samples),
        "median_us": _us(statistics.median(ordered)),
        "mean_us": _us(statistics.fmean(ordered)),
        "p90_us": _us(p90),
    }


def fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- part 1
def time_calls(fn: Callable[[], Any], calls: int, warmup: int) -> list[int]:
    """Nanoseconds of each of ``calls`` calls of ``fn``, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    clock = time.perf_counter_ns
    samples = []
    for _ in range(calls):
        start = clock()
        fn()
        samples.append(clock() - start)
    return samples


def reader_candidates(s: Settings) -> list[tuple[str, Callable[[], Any] | None, str]]:
    """``(name, function or None if skipped, note)`` for every reader to time."""
    device = torch.device(s.device, 0) if s.device == "cuda" else torch.device("cpu")
    on_cuda = device.type == "cuda"
    no_cuda = "skipped: no CUDA"
    accelerator = getattr(torch, "accelerator", None)
    has_accel_stats = accelerator is not None and hasattr(accelerator, "memory_stats")

    rows: list[tuple[str, Callable[[], Any] | None, str]] = [("(empty call: timer floor)", lambda: None, "")]
    rows.append(
        ("torch.cuda.memory_stats(dev)", (lambda: torch.cuda.memory_stats(device)) if on_cuda else None, "")
    )
    if not has_accel_stats:
        rows.append(("torch.accelerator.memory_stats(idx)", None, "skipped: not in this torch"))
    else:
        rows.append(
            (
                "torch.accelerator.memory_stats(idx)",
                (lambda: accelerator.memory_stats(device.index)) if on_cuda else None,
                "",
            )
        )
    rows.append(
        (
            "torch.cuda.memory_stats_as_nested_dict(dev)",
            (lambda: torch.cuda.memory_stats_as_nested_dict(device)) if on_cuda else None,
            "",
        )
    )
    rows.append(
        (
            "torch.cuda.reset_peak_memory_stats(dev)",
            (lambda: torch.cuda.reset_peak_memory_stats(device)) if on_cuda else None,
            "",
        )
    )
    rows = [(name, fn, note or (no_cuda if fn is None else "")) for name, fn, note in rows]

    probe = MemoryProbe(device, nvml=True, host=True)
    sample = probe.read(nvml=True, host=True)
    probe_note = "" if on_cuda else "cpu: no allocator, host fields only"
    nvml_note = probe_note or (
        "" if sample.nvml_total_bytes is not None else "NVML unavailable: no NVML read"
    )
    if on_cuda and sample.nvml_total_bytes is not None and sample.nvml_process_bytes is None:
        nvml_note = "NVML process list lacks this pid (container?)"
    rows += [
        ("MemoryProbe.reset_peaks()", probe.reset_peaks, probe_note),
        ("MemoryProbe.read_peaks()", probe.read_peaks, probe_note),
        ("MemoryProbe.read(nvml=False, host=False)", lambda: probe.read(nvml=False, host=False), probe_note),
        ("MemoryProbe.read(nvml=False, host=True)", lambda: probe.read(nvml=False, host=True), probe_note),
        ("MemoryProbe.read(nvml=True, host=False)", lambda: probe.read(nvml=True, host=False), nvml_note),
        ("MemoryProbe.read(nvml=True, host=True)", lambda: probe.read(nvml=True, host=True), nvml_note),
    ]
    return rows


def run_readers(s: Settings) -> list[dict[str, Any]]:
    """Time every reader in ``MICRO_BLOCKS`` interleaved blocks, so that a slow spell of the machine hits all alike."""
    # On CUDA, a live allocator holding a few blocks, as during training.
    sizes = (1, 3, 17, 64) if s.device == "cuda" else ()
    keep = [torch.empty(n * 1024 * 1024, dtype=torch.uint8, device=s.device) for n in sizes]
    candidates = reader_candidates(s)
    rows: dict[str, dict[str, Any]] = {
        name: {"reader": name, "note": note, "samples_ns": []} for name, _, note in candidates
    }
    live = {name: fn for name, fn, _ in candidates if fn is not None}
    per_block = max(1, s.micro_calls // MICRO_BLOCKS)
    for block in range(MICRO_BLOCKS):
        for name, fn in list(live.items()):
            try:
                rows[name]["samples_ns"] += time_calls(fn, per_block, s.micro_warmup if block == 0 else 0)
            except Exception as err:  # report and go on: one missing API must not stop the benchmark
                rows[name]["note"] = f"failed: {err!r}"[:100]
                rows[name]["samples_ns"] = []
                del live[name]
    del keep
    for row in rows.values():
        row.update(summarize_ns(row["samples_ns"]))
    return list(rows.values())


def print_readers(results: list[dict[str, Any]], s: Settings) -> None:
    print(
        f"## 1. Memory readers (µs per call; {s.micro_calls} calls each after {s.micro_warmup} warm-up calls,"
        f" in {MICRO_BLOCKS} interleaved blocks)\n"
    )
    rows = [
        [f"`{r['reader']}`", fmt(r["median_us"], 2), fmt(r["mean_us"], 2), fmt(r["p90_us"], 2), r["note"]]
        for r in results
    ]
    print(markdown_table(["Reader", "median µs", "mean µs", "p90 µs", "Note"], rows))
    print()


# ---------------------------------------------------------------------------------------------------- part 2
class HookTimes:
    """Host time of a callback's ``on_train_batch_start`` + ``on_train_batch_end``, per batch."""

    def __init__(self, every_n: int) -> None:
        self.every_n = every_n
        self.batches: list[dict[str, Any]] = []  # {"logging": bool, "start_ns": int, "end_ns": int}

    def wrap(self, callback: Callback) -> None:
        """Replace the instance's two hooks with timing wrappers that call the originals."""
        original_start = callback.on_train_batch_start
        original_end = callback.on_train_batch_end
        clock = time.perf_counter_ns

        def on_train_batch_start(trainer: pl.Trainer, *args: Any, **kwargs: Any) -> Any:
            # Private, as Lightning's own `should_update_logs`: the step loggers use for this batch.
            logging_batch = (trainer.fit_loop.epoch_loop._batches_that_stepped + 1) % self.every_n == 0
            start = clock()
            out = original_start(trainer, *args, **kwargs)
            elapsed = clock() - start
            self.batches.append({"logging": logging_batch, "start_ns": elapsed, "end_ns": 0})
            return out

        def on_train_batch_end(trainer: pl.Trainer, *args: Any, **kwargs: Any) -> Any:
            start = clock()
            out = original_end(trainer, *args, **kwargs)
            elapsed = clock() - start
            self.batches[-1]["end_ns"] = elapsed
            return out

        callback.on_train_batch_start = on_train_batch_start  # type: ignore[method-assign]
        callback.on_train_batch_end = on_train_batch_end  # type: ignore[method-assign]

    def summary(self, skip: int) -> dict[str, Any]:
        kept = self.batches[skip:]
        totals = {
            kind: [b["start_ns"] + b["end_ns"] for b in kept if b["logging"] is (kind == "logging")]
            for kind in ("non_logging", "logging")
        }
        every_batch = [b["start_ns"] + b["end_ns"] for b in kept]
        return {
            "batches": len(self.batches),
            "skipped_warmup_batches": min(skip, len(self.batches)),
            "non_logging": summarize_ns(totals["non_logging"]),
            "logging": summarize_ns(totals["logging"]),
            "amortized_mean_us": _us(statistics.fmean(every_batch)) if every_batch else None,
            "raw": self.batches,
        }


def run_hooks(s: Settings, data: TensorDataset, log_dir: str) -> dict[str, Any]:
    results = {}
    for name in ("Callback", "DeviceStatsMonitor", "MemoryMonitor", "MemoryMonitor(detect_leaks=False)"):
        callback = make_callback(name)
        assert callback is not None
        times = HookTimes(HOOK_LOG_EVERY)
        times.wrap(callback)
        fit(s, data, [callback], max_steps=s.hook_steps, log_every=HOOK_LOG_EVERY, log_dir=log_dir)
        results[name] = times.summary(skip=s.warmup)
    return results


def print_hooks(results: dict[str, Any], s: Settings) -> None:
    no_sync = (
        " No `torch.cuda.synchronize()` is inserted: host-side cost as the loop sees it."
        if s.device == "cuda"
        else ""
    )
    print(
        f"## 2. Hook cost per training batch (µs, `on_train_batch_start` + `on_train_batch_end`, host time)\n\n"
        f"`log_every_n_steps={HOOK_LOG_EVERY}`, {s.hook_steps} batches per fit, the first {s.warmup} dropped.{no_sync}"
        " `Callback` (no-op hooks) is the floor of the measurement.\n"
    )
    rows = []
    for name, r in results.items():
        quiet, loud = r["non_logging"], r["logging"]
        rows.append(
            [
                f"`{name}`",
                str(quiet["n"]),
                fmt(quiet["median_us"], 2),
                fmt(quiet["mean_us"], 2),
                str(loud["n"]),
                fmt(loud["median_us"]),
                fmt(loud["mean_us"]),
                fmt(r["amortized_mean_us"], 2),
            ]
        )
    header = [
        "Callback",
        "non-log n",
        "median µs",
        "mean µs",
        "log n",
        "median µs",
        "mean µs",
        "mean µs/batch (all)",
    ]
    print(markdown_table(header, rows))
    print()


# ---------------------------------------------------------------------------------------------------- part 3
def timed_fit(s: Settings, data: TensorDataset, config: str, log_dir: str, steps: int) -> float:
    """Steps per second over ``steps`` steps after ``s.warmup`` untimed ones, with ``log_every_n_steps=1``."""
    window = H.StepWindow(first=s.warmup, last=s.warmup + steps - 1, cuda=s.device == "cuda")
    monitor = make_callback(config)
    start, end = window.callbacks()  # first and last in the list: every hook of the timed batches is inside
    callbacks = [start, *([monitor] if monitor is not None else []), end]
    fit(s, data, callbacks, max_steps=s.warmup + steps, log_every=1, log_dir=log_dir)
    rate = window.steps_per_second()
    if rate is None:
        raise RuntimeError(f"{config}: the fit ran {window.ended} batches, expected {s.warmup + steps}")
    return rate


def run_throughput(s: Settings, data: TensorDataset, log_dir: str) -> dict[str, Any]:
    timed_fit(s, data, "none", log_dir, steps=min(s.steps, 20))  # process warm-up, discarded
    per_round = H.interleaved_rounds(
        CONFIGS, s.rounds, lambda config: timed_fit(s, data, config, log_dir, s.steps)
    )

    results: dict[str, Any] = {"order": "rotated by one configuration per round", "configs": {}}
    for config in CONFIGS:
        rates = [r[config] for r in per_round]
        ratios = [r[config] / r["none"] for r in per_round]
        extra_ms = [1000.0 / r[config] - 1000.0 / r["none"] for r in per_round]
        median_rate = statistics.median(rates)
        results["configs"][config] = {
            "steps_per_s": rates,
            "median_steps_per_s": median_rate,
            "median_ms_per_step": 1000.0 / median_rate,
            "min_steps_per_s": min(rates),
            "max_steps_per_s": max(rates),
            "ratio_vs_none": ratios,
            "median_ratio_vs_none": statistics.median(ratios),
            "extra_ms_per_step_vs_none": extra_ms,
            "median_extra_ms_per_step_vs_none": statistics.median(extra_ms),
        }
    return results


def print_throughput(results: dict[str, Any], s: Settings) -> None:
    sync = " with `torch.cuda.synchronize()` at both ends" if s.device == "cuda" else ""
    print(
        f"## 3. End-to-end throughput (`log_every_n_steps=1`)\n\n"
        f"{s.rounds} rounds x {len(CONFIGS)} configurations, order rotated each round; per fit {s.steps} timed steps"
        f"{sync} after {s.warmup} warm-up steps. Ratio and extra ms: medians of the per-round values.\n"
    )
    rows = []
    for config, r in results["configs"].items():
        rows.append(
            [
                f"`{config}`",
                fmt(r["median_steps_per_s"], 2),
                fmt(r["median_ms_per_step"], 3),
                f"{fmt(r['min_steps_per_s'], 2)} - {fmt(r['max_steps_per_s'], 2)}",
                fmt(r["median_ratio_vs_none"], 4),
                fmt(r["median_extra_ms_per_step_vs_none"], 3),
            ]
        )
    header = [
        "Config",
        "median steps/s",
        "ms/step",
        "steps/s range",
        "ratio vs none",
        "extra ms/step vs none",
    ]
    print(markdown_table(header, rows))
    print()


# ---------------------------------------------------------------------------------------------------- main
def environment(s: Settings) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "lightning_gpumem": lightning_gpumem.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": s.device,
        "device_name": platform.processor() or platform.machine() or "cpu",
    }
    if s.device == "cuda":
        env["device_name"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
        env["total_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 1024**3, 1)
    return env


def print_header(env: dict[str, Any], s: Settings) -> None:
    print("# lightning-gpumem monitor overhead\n")
    device = env["device_name"] + (
        f", {env['total_memory_gib']} GiB, CUDA {env['cuda']}" if s.device == "cuda" else ""
    )
    print(
        f"- torch {env['torch']}, lightning {env['lightning']}, lightning-gpumem {env['lightning_gpumem']},"
        f" Python {env['python']}"
    )
    print(
        f"- device: `{s.device}` ({device}); {env['cpu_count']} CPUs, {env['torch_threads']} torch threads"
    )
    print(
        f"- model: GPT d_model={s.d_model}, layers={s.n_layers}, heads={s.n_heads}, vocab={s.vocab},"
        f" seq={s.seq_len}, batch={s.batch_size}, precision={s.precision}"
        + (" (--quick)" if s.quick else "")
    )
    print()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    H.quiet_lightning()
    s = make_settings(args)
    if s.device == "cuda":
        torch.set_float32_matmul_precision("high")
    env = environment(s)
    print_header(env, s)
    report: dict[str, Any] = {"environment": env, "settings": asdict(s)}
    began = time.perf_counter()

    report["readers"] = run_readers(s)
    print_readers(report["readers"], s)

    data = make_dataset(s)
    with tempfile.TemporaryDirectory(prefix="gpumem-bench-") as log_dir:
        report["hooks"] = run_hooks(s, data, log_dir)
        print_hooks(report["hooks"], s)
        report["throughput"] = run_throughput(s, data, log_dir)
        print_throughput(report["throughput"], s)

    report["wall_s"] = time.perf_counter() - began
    print(f"Total time: {report['wall_s']:.1f} s")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        print(f"Wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
