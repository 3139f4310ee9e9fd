"""How exactly the caching allocator's model replays the real one, case by case, on the GPU and anywhere.

The model: ``lightning_gpumem/tuning/sources/allocator.py``. Usage::

    PYTHONPATH=. python3 benchmarks/allocator_fidelity.py --out DIR    # CUDA machine: record, compare
    PYTHONPATH=. python3 benchmarks/allocator_fidelity.py --check DIR  # anywhere, no torch: replay, compare

``--out``: three small models (an MLP, a 2-layer ``nn.TransformerEncoder``, a small conv net), each at two
batch sizes and in both allocator modes (the default, and ``expandable_segments:True`` in
``PYTORCH_CUDA_ALLOC_CONF``, which must be set before torch loads: every case runs in a fresh subprocess),
train 2 steps (forward, backward, AdamW step, ``zero_grad``) with the allocator's history recorded
(``torch.cuda.memory._record_memory_history``). Then each model's larger batch runs again in both modes under
a cap (``set_per_process_memory_fraction``) halfway between that run's peak allocated and peak reserved, so
that cached segments are given back and retried (or the step runs out of memory). Each case's trace
(``_snapshot()["device_traces"]``) becomes an allocation stream: ``alloc`` -> ``alloc``, ``free_completed``
-> ``free`` (when the block is back in the cache; ``free_requested`` is skipped), each alloc a fresh block
id. Phases are marked where the worker called ``_snapshot()`` (a ``snapshot`` entry in the trace) after
``reset_peak_memory_stats()``: ``setup``, ``forward``, ``backward``, ``optimizer``. The stream, the real
counters (``memory_stats()``) and each phase's real peaks go to ``DIR/<model>-b<batch>-<mode>.json.gz``
(``-capped`` before ``.json.gz`` for a capped case; a few KB to tens of KB each); then the comparison below
is printed and saved as ``DIR/summary.json``.

``--check``: replays each saved stream (the cap and mode it ran with) and prints, per case, the real and the
replayed peak reserved, peak allocated, peak requested, segments (``segment.all.peak``; the default mode
only: torch counts no segments for expandable ones), device allocations and frees (``num_device_alloc``,
``num_device_free``: ``cudaMalloc`` and ``cudaFree`` calls, or page maps and unmaps), retries, OOMs, and
whether every phase's peaks match. Exit status 1 when a case's peak reserved differs. ``--addresses``: where
the streams of ``cudaMalloc`` segments place their segments: ``model`` (the model's own, the default),
``recorded`` (the addresses the driver gave them, ``segment_addresses``: what is left differs for another
reason than where a segment lies), ``increasing`` or ``decreasing`` (each segment above, or below, all before
it).

The size of a trace's ``alloc`` entry is the size requested (the allocator records ``orig_size``; if a torch
version recorded the rounded block size instead, the replay is the same: ``round_size`` is idempotent, only
the requested peak would read higher).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
# model -> its two batch sizes; "lm", "lm-bf16": tests/tuning/sources/test_traced_gpu.py's Tiny, fp32 and bf16 autocast
MODELS = {"mlp": (64, 512), "transformer": (8, 32), "conv": (16, 128), "lm": (4, 16), "lm-bf16": (4, 16)}
MODES = ("native", "expandable")
STEPS = 2  # training steps of a case; --steps (for the GPTs) sets GPUMEM_FIDELITY_STEPS for the workers
MAX_ENTRIES = 2_000_000  # the history's ring buffer; a case that fills it is reported as truncated
WORKER_TIMEOUT_S = 600


# ------------------------------------------------------------------------------------------------ on the GPU
def record(
    out: Path,
    gpt: list[int] | None = None,
    cap_gib: float = 24.0,
    models: list[str] | None = None,
    modes: list[str] | None = None,
    gpt_workload: str = "gpt",
) -> int:
    """Run every case in its own process, then compare; the exit status of :func:`check`.

    ``gpt``: instead of the small models, ``benchmarks/tuner.py``'s 236M GPT at these batch sizes under a cap
    of ``cap_gib`` (the default allocator, bf16 autocast, two training steps and a validation step in the order
    of ``trace_training``): the real streams the traced plan is measured against; ``gpt_workload``:
    ``"gpt-longval"`` for its 4096-token validation, ``"hf-gpt2"`` for the Hugging Face GPT-2. ``models``, ``modes``: only these of ``MODELS`` and
    ``MODES``.
    """
    chosen = {name: MODELS[name] for name in models or MODELS}
    modes = modes or list(MODES)
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    if gpt:
        for batch in gpt:
            failed += not _spawn(out, gpt_workload, batch, "native", int(cap_gib * 2**30))
        return check(out) or (1 if failed else 0)
    for model, batches in chosen.items():
        for batch in batches:
            for mode in modes:
                failed += not _spawn(out, model, batch, mode, None)
    for model, batches in chosen.items():
        for mode in modes:
            path = out / f"{_name(model, batches[-1], mode, capped=False)}.json.gz"
            if not path.exists():
                continue
            real = _load(path)["real"]
            limit = (real["peak_allocated"] + real["peak_reserved"]) // 2
            limit = min(limit, real["peak_reserved"] - 2 * MIB)  # below the peak, so the cap bites
            failed += not _spawn(out, model, batches[-1], mode, limit)
    status = check(out)
    return status or (1 if failed else 0)


def _spawn(out: Path, model: str, batch: int, mode: str, limit: int | None) -> bool:
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if mode == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        model,
        str(batch),
        mode,
        "--out",
        str(out),
    ]
    if limit is not None:
        argv += ["--limit", str(limit)]
    name = _name(model, batch, mode, capped=limit is not None)
    print(f"recording {name} ...", file=sys.stderr, flush=True)
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"  {name}: timed out after {WORKER_TIMEOUT_S} s", file=sys.stderr)
        return False
    if done.returncode != 0:
        print(f"  {name}: exit {done.returncode}\n{done.stderr[-3000:]}", file=sys.stderr)
        return False
    return True


def worker(model_name: str, batch: int, mode: str, limit: int | None, out: Path) -> None:
    """One case in this fresh process: train with the history on, write the stream and the real counters."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("allocator_fidelity.py --out needs a CUDA device (use --check DIR on a CPU)")
    torch.cuda.init()
    allowed = None
    if limit is not None:
        total = torch.cuda.mem_get_info()[1]
        fraction = min(1.0, limit / total)
        torch.cuda.set_per_process_memory_fraction(fraction)
        allowed = int(fraction * total)  # as the allocator computes it: size_t(fraction * double(total))
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(
        enabled="all", context=None, stacks="python", max_entries=MAX_ENTRIES
    )
    labels: list[str] = []
    phases: dict[str, list[int]] = {}
    state: dict[str, str | None] = {"phase": None}

    def end_phase() -> None:
        phase = state["phase"]
        if phase is None:
            return
        stats = torch.cuda.memory_stats()
        now = [
            stats.get(f"{key}.all.peak", 0)
            for key in ("allocated_bytes", "reserved_bytes", "requested_bytes")
        ]
        now.append(stats.get("segment.all.peak", 0))
        old = phases.get(phase, [0, 0, 0, 0])
        phases[phase] = [max(a, b) for a, b in zip(old, now, strict=True)]

    def mark(label: str) -> None:
        end_phase()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._snapshot()  # leaves a "snapshot" entry in the trace: where the phase begins
        labels.append(label)
        state["phase"] = label

    torch.manual_seed(0)
    oom = False
    try:
        large = model_name.startswith(("gpt", "hf-"))  # benchmarks/tuner.py's workloads
        lightning = large and os.environ.get("GPUMEM_FIDELITY_LIGHTNING") == "1"
        case = _lightning_case if lightning else _gpt_case if large else _small_case
        case(torch, model_name, batch, mark)
    except RuntimeError as error:  # torch.OutOfMemoryError, also when autograd re-raises it from backward
        if "out of memory" not in str(error):
            raise
        oom = True
    end_phase()
    stats = torch.cuda.memory_stats()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    events, about = _to_stream(trace, labels)
    about["truncated"] = len(trace) >= MAX_ENTRIES
    real = {
        "peak_allocated": max(p[0] for p in phases.values()),
        "peak_reserved": max(p[1] for p in phases.values()),
        "peak_requested": max(p[2] for p in phases.values()),
        "max_segments": max(p[3] for p in phases.values()),
        "device_allocs": stats.get("num_device_alloc"),
        "device_frees": stats.get("num_device_free"),
        "retries": stats.get("num_alloc_retries"),
        "ooms": stats.get("num_ooms"),
    }
    data = {
        "case": _name(model_name, batch, mode, capped=limit is not None),
        "model": model_name,
        "batch": batch,
        "expandable": mode == "expandable",
        "limit_bytes": allowed,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "oom": oom,
        "steps": int(os.environ.get("GPUMEM_FIDELITY_STEPS", STEPS)) if large else STEPS,
        "lightning": lightning,
        "real": real,
        "real_phase_peaks": {label: p[:2] for label, p in phases.items()},
        "trace": about,
        "events": events,
    }
    path = out / f"{data['case']}.json.gz"
    with gzip.open(path, "wt", encoding="utf-8") as file:
        json.dump(data, file, separators=(",", ":"))
    print(f"{path}: {len(events)} events, {path.stat().st_size // 1024} KiB", file=sys.stderr)


def _small_case(torch: Any, model_name: str, batch: int, mark: Any) -> None:
    """A small model: two training steps (forward, backward, AdamW step, ``zero_grad``)."""
    mark("setup")
    net, inputs, target, loss_fn = _build(torch, model_name, batch)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    for _ in range(STEPS):
        mark("forward")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=model_name == "lm-bf16"):
            loss = loss_fn(net(inputs), target)
        mark("backward")
        loss.backward()
        mark("optimizer")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del loss
    torch.cuda.synchronize()


def _gpt_case(torch: Any, model_name: str, batch: int, mark: Any) -> None:
    """The tuner benchmark's GPT: two training steps and a validation step, as ``trace_training`` orders them."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _tuner_models as M

    w = M.workload(model_name, False)
    steps = int(os.environ.get("GPUMEM_FIDELITY_STEPS", STEPS))
    mark("setup")
    net = M.build_model(w).cuda()
    optimizer = M.make_optimizer(net)
    cpu_batch = M.first_batch(w, M.build_dataset(w), batch)
    val_batch = M.first_batch(w, M.build_val_dataset(w), batch)
    for _ in range(steps):
        mark("forward")
        gpu_batch = [t.cuda() for t in cpu_batch]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = M.compute_loss(w, net, gpu_batch)
        optimizer.zero_grad(set_to_none=True)
        mark("backward")
        loss.backward()
        mark("optimizer")
        optimizer.step()
        del loss, gpu_batch
    mark("validation")
    net.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        gpu_batch = [t.cuda() for t in val_batch]
        M.compute_loss(w, net, gpu_batch, validation=True)
    del gpu_batch
    torch.cuda.synchronize()


def _lightning_case(torch: Any, model_name: str, batch: int, mark: Any, quick: bool = False) -> None:
    """The tuner benchmark's fit at a fixed size, as its true-max candidates run it (``benchmarks/tuner.py``):
    ``--steps`` training steps on shuffled batches and one validation batch, ``bf16-mixed``; the marks from
    Lightning's hooks (``quick``: the CPU smoke test's tiny workload, 32-bit)."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _harness as H
    import _tuner_models as M
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from tuner import _lightning_classes

    steps = int(os.environ.get("GPUMEM_FIDELITY_STEPS", STEPS))
    module_cls, _, _ = _lightning_classes(tuner=False)
    w = M.workload(model_name, quick)
    pl.seed_everything(0, verbose=False)
    mark("setup")
    model = module_cls(w)
    model.batch_size = batch

    class Marks(Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            mark("forward")

        def on_before_backward(self, *args: Any) -> None:
            mark("backward")

        def on_before_optimizer_step(self, *args: Any) -> None:
            mark("optimizer")

        def on_validation_start(self, *args: Any) -> None:
            mark("validation")

    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="fidelity_fit_") as root:
        trainer = pl.Trainer(
            accelerator="gpu" if cuda else "cpu",
            devices=1,
            precision="bf16-mixed" if cuda else "32-true",
            max_steps=steps,
            val_check_interval=steps,
            check_val_every_n_epoch=None,
            limit_val_batches=1,
            num_sanity_val_steps=0,
            callbacks=[Marks()],
            default_root_dir=root,
            **H.QUIET_TRAINER,
        )
        trainer.fit(model)
    if cuda:
        torch.cuda.synchronize()


def _build(torch: Any, name: str, batch: int) -> tuple[Any, Any, Any, Any]:
    """The model on the GPU, a batch of inputs and targets, the loss function."""
    nn = torch.nn
    device = "cuda"
    if name == "mlp":
        net = nn.Sequential(
            nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 1024)
        )
        inputs = torch.randn(batch, 1024, device=device)
        return net.to(device), inputs, torch.randn(batch, 1024, device=device), nn.functional.mse_loss
    if name == "transformer":
        layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.1, batch_first=True)
        net = nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(256, 256))
        inputs = torch.randn(batch, 128, 256, device=device)
        return net.to(device), inputs, torch.randn(batch, 128, 256, device=device), nn.functional.mse_loss
    if name == "conv":
        net = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(64, 128, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(128, 10),
        )
        inputs = torch.randn(batch, 3, 64, 64, device=device)
        target = torch.randint(0, 10, (batch,), device=device)
        return net.to(device), inputs, target, nn.functional.cross_entropy
    if name in ("lm", "lm-bf16"):
        vocab = 8192
        layer = nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.1, batch_first=True, norm_first=True)
        net = nn.Sequential(
            nn.Embedding(vocab, 512),
            nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
            nn.Linear(512, vocab),
        )
        tokens = torch.randint(0, vocab, (batch, 257), device=device)

        def lm_loss(logits: Any, target: Any) -> Any:
            return nn.functional.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

        return net.to(device), tokens[:, :-1], tokens[:, 1:], lm_loss
    raise ValueError(f"`--worker {name}` is not valid. Expected one of {sorted(MODELS)}.")


def _to_stream(trace: list[dict[str, Any]], labels: list[str]) -> tuple[list[list[Any]], dict[str, Any]]:
    """The trace as a compact stream: ``["a", block, size, stream, address]``, ``["f", block]``, ``["m", label]``.

    And the device's side: ``["s", address, size]`` where a segment was allocated (or pages mapped), ``["u",
    address, size]`` where it was freed (or unmapped); the replay reads only ``a``, ``f`` and ``m``.

    Streams are numbered in the order they appear (the default stream, 0, stays 0). Also returns what the
    trace says on its own: entries, frees of blocks allocated before recording (unmatched), marks found, and
    the peak of reserved from its segment entries.
    """
    live: dict[int, int] = {}
    streams = {0: 0}
    pending = iter(labels)
    events: list[list[Any]] = []
    block = unmatched = marks = reserved = peak_reserved = 0
    for entry in trace:
        action = entry["action"]
        if action == "alloc":
            block += 1
            live[entry["addr"]] = block
            stream = streams.setdefault(entry.get("stream", 0), len(streams))
            events.append(["a", block, entry["size"], stream, entry["addr"]])
        elif action == "free_completed":
            freed = live.pop(entry["addr"], None)
            if freed is None:
                unmatched += 1
            else:
                events.append(["f", freed])
        elif action == "snapshot":
            label = next(pending, None)
            if label is not None:
                events.append(["m", label])
                marks += 1
        elif action in ("segment_alloc", "segment_map"):
            events.append(["s", entry["addr"], entry["size"]])
            reserved += entry["size"]
            peak_reserved = max(peak_reserved, reserved)
        elif action in ("segment_free", "segment_unmap"):
            events.append(["u", entry["addr"], entry["size"]])
            reserved -= entry["size"]
        elif action == "oom":  # a request refused (its size rounded); the caller may have caught it
            events.append(["o", entry["size"], streams.setdefault(entry.get("stream", 0), len(streams))])
    about = {
        "entries": len(trace),
        "unmatched_frees": unmatched,
        "marks": f"{marks}/{len(labels)}",
        "peak_reserved": peak_reserved,
    }
    return events, about


# ------------------------------------------------------------------------------------------------ anywhere
COLUMNS = (
    "peak_reserved",
    "peak_allocated",
    "peak_requested",
    "max_segments",
    "device_allocs",
    "device_frees",
)
COUNTS = ("retries", "ooms")


def check(directory: Path, addresses: str = "model") -> int:
    """Replay the streams saved in ``directory`` against their real runs; 1 if a peak reserved differs.

    ``addresses``: where each stream of ``cudaMalloc`` segments puts its segments (``--addresses``).
    """
    sys.path.insert(0, str(REPO_ROOT))
    from lightning_gpumem._core.alloc_events import Event
    from lightning_gpumem.tuning.sources.allocator import replay

    paths = sorted(directory.glob("*.json.gz"))
    if not paths:
        print(f"no *.json.gz streams in {directory}", file=sys.stderr)
        return 1
    rows = []
    for path in paths:
        data = _load(path)
        events, real = replayable(Event, data)
        given = None if data["expandable"] else placed(data, addresses)
        result = replay(
            events,
            limit_bytes=data["limit_bytes"],
            expandable_segments=data["expandable"],
            addresses=given,
        )
        row: dict[str, Any] = {"case": data["case"], "events": len(events), "torch": data["torch"]}
        for key in (*COLUMNS, *COUNTS):
            model_value = getattr(result, key)
            real_value = None if key == "max_segments" and data["expandable"] else real.get(key)
            row[key] = [real_value, model_value]
        real_phases = {label: tuple(peaks) for label, peaks in data["real_phase_peaks"].items()}
        row["phases_match"] = real_phases == result.phase_peaks
        row["phases"] = {
            label: [list(peaks), list(result.phase_peaks.get(label, (None, None)))]
            for label, peaks in real_phases.items()
        }
        row["trace"] = data["trace"]
        rows.append(row)
    _print(rows)
    (directory / "summary.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 0 if all(row["peak_reserved"][0] == row["peak_reserved"][1] for row in rows) else 1


def segment_addresses(data: dict[str, Any]) -> list[int]:
    """A saved case's segment addresses, in the order the driver gave them (``AllocatorModel(addresses=)``)."""
    return [item[1] for item in data["events"] if item[0] == "s"]


def placed(data: dict[str, Any], addresses: str) -> list[int] | None:
    """The segment addresses ``--addresses`` names for a saved case (``None``: the model's own)."""
    if addresses == "model":
        return None
    if addresses == "recorded":
        return segment_addresses(data)
    sizes = [item[2] for item in data["events"] if item[0] == "s"]
    start, sign = (1 << 40, 1) if addresses == "increasing" else (1 << 44, -1)
    out = []
    for size in sizes:
        if sign < 0:
            start -= size
        out.append(start)
        if sign > 0:
            start += size
    return out


def replayable(event_type: Any, data: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """A saved case's stream as events to replay, and its real counters as the replay can match them.

    A refused request (``o``) that ended the steps becomes the alloc it was (the replay must refuse it too);
    one the caller caught and went on from (cuDNN asks for workspaces it can do without) is left out, and the
    real retries and OOMs are counted without it (each such request made one retry and one OOM).
    """
    items = data["events"]
    refused = [at for at, item in enumerate(items) if item[0] == "o"]
    fatal = refused[-1] if data["oom"] and refused else None
    block = 1 + max((item[1] for item in items if item[0] == "a"), default=0)
    events = [
        event_type("alloc", block, item[1], item[2]) if at == fatal else _event(event_type, item)
        for at, item in enumerate(items)
        if item[0] in "afm" or at == fatal
    ]
    caught = len(refused) - (fatal is not None)
    real = dict(data["real"])
    if refused:
        real["retries"] -= caught
        real["ooms"] -= caught
    return events, real


def _event(event_type: Any, item: list[Any]) -> Any:
    if item[0] == "a":
        return event_type("alloc", item[1], item[2], item[3])
    if item[0] == "f":
        return event_type("free", item[1])
    return event_type("mark", label=item[1])


def _print(rows: list[dict[str, Any]]) -> None:
    def cell(pair: list[Any], mib: bool) -> str:
        real, model = pair
        if real is None:
            return f"- / {model / MIB:.1f}" if mib else f"- / {model}"
        mark = "" if real == model else " *"
        return f"{real / MIB:.1f} / {model / MIB:.1f}{mark}" if mib else f"{real} / {model}{mark}"

    header = ["case", "events", *COLUMNS, *COUNTS, "phases"]
    lines = [header]
    for row in rows:
        lines.append(
            [
                row["case"],
                str(row["events"]),
                *(cell(row[key], mib=key.startswith("peak")) for key in COLUMNS),
                *(cell(row[key], mib=False) for key in COUNTS),
                "same" if row["phases_match"] else "differ *",
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    print("real / replayed (peaks in MiB; * where they differ)")
    for line in lines:
        print("  ".join(text.ljust(width) for text, width in zip(line, widths, strict=True)))
    torches = sorted({row["torch"] for row in rows})
    print(
        f"torch {', '.join(torches)}; {len(rows)} cases, peak reserved exact in "
        f"{sum(row['peak_reserved'][0] == row['peak_reserved'][1] for row in rows)}"
    )


def _name(model: str, batch: int, mode: str, *, capped: bool) -> str:
    return f"{model}-b{batch}-{mode}" + ("-capped" if capped else "")


def _load(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt", encoding="utf-8") as file:
        return json.load(file)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, metavar="DIR", help="record every case on this GPU into DIR, compare"
    )
    parser.add_argument(
        "--check", type=Path, metavar="DIR", help="replay the streams saved in DIR, compare (no GPU)"
    )
    parser.add_argument(
        "--addresses",
        default="model",
        choices=("model", "recorded", "increasing", "decreasing"),
        help="with --check: where the segments lie (the model's own, the driver's, or all up or down)",
    )
    parser.add_argument("--gpt", default="", help="batch sizes: the 236M GPT's real streams under --cap-gib")
    parser.add_argument(
        "--gpt-workload",
        default="gpt",
        choices=("gpt", "gpt-longval", "hf-gpt2", "gpt-ckpt"),
        help="the workload of --gpt (benchmarks/tuner.py's)",
    )
    parser.add_argument("--cap-gib", type=float, default=24.0)
    parser.add_argument(
        "--lightning",
        action="store_true",
        help="each --gpt case as benchmarks/tuner.py's true-max fit runs it (Lightning, shuffled batches, bf16-mixed)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=STEPS,
        help="training steps of each --gpt case (the replay of a step"
        " after the second meets a layout the first two do not show)",
    )
    parser.add_argument(
        "--models", default="", help=f"comma-separated, of {','.join(MODELS)} (default: all)"
    )
    parser.add_argument("--modes", default="", help="comma-separated, of native,expandable (default: both)")
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "BATCH", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker and args.out is not None:
        model, batch, mode = args.worker
        worker(model, int(batch), mode, args.limit, args.out)
        return 0
    if args.check is not None and args.out is None:
        return check(args.check, args.addresses)
    if args.out is not None and not args.worker:
        sizes = [int(text) for text in args.gpt.split(",") if text]
        models = [name for name in args.models.split(",") if name]
        modes = [mode for mode in args.modes.split(",") if mode]
        unknown = sorted({*models} - {*MODELS} | {*modes} - {*MODES})
        if unknown:
            parser.error(f"unknown models or modes: {unknown}")
        os.environ["GPUMEM_FIDELITY_STEPS"] = str(args.steps)
        os.environ["GPUMEM_FIDELITY_LIGHTNING"] = "1" if args.lightning else "0"
        return record(args.out, sizes, args.cap_gib, models, modes, args.gpt_workload)
    parser.error("give one of --out DIR (on a CUDA machine) or --check DIR")
    return 2


if __name__ == "__main__":
    sys.exit(main())
