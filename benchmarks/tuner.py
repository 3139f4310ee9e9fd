"""Batch-size finders under a memory budget: ``BatchSizeTuner`` next to Lightning's ``BatchSizeFinder``.

Run it from the repository root on one CUDA GPU (about 5-8 minutes on an H200; ``--time-limit`` bounds it)::

    PYTHONPATH=. python3 benchmarks/tuner.py     # gpt and resnet, 24 GiB budget; JSON in benchmarks/results/tuner.json
    PYTHONPATH=. python3 benchmarks/tuner.py --models gpt-longval --budget-gib 12 --headroom 0.05,0.02
    PYTHONPATH=. python3 benchmarks/tuner.py --quick                     # CPU smoke run of the whole pipeline
    PYTHONPATH=. python3 benchmarks/tuner.py --models gpt,hf-gpt2 --headroom 0.02 \
        --finders default,previous-predict,previous-search,binsearch --previous out/previous   # against a previous copy

Workloads (``benchmarks/_tuner_models.py``): a GPT-style decoder of about 235M parameters (d_model 1024, 16 layers,
vocabulary 32768, sequence 512) on random tokens (``gpt``; ``gpt-longval`` validates on sequences 8x longer, so
validation needs more memory than training), torchvision's ResNet-50 on random 224x224 images, Hugging Face
transformers' ``GPT2LMHeadModel`` with a GPT-2-medium config (``hf-gpt2``: about 355M parameters, random init,
sequence 512) and others (``gpt124``, ``gpt-ckpt``, ``encoder``, ``vit``); all ``bf16-mixed`` with AdamW. For each
workload and a budget ``B`` (``--budget-gib``, default 24 GiB):

1. **Finders** (``--finders``, default ``default,binsearch,power``). Each finder runs in a fresh subprocess whose
   allocator is capped at ``B`` with ``torch.cuda.set_per_process_memory_fraction(B / total)`` before anything is
   allocated, so the GPU behaves like a ``B`` card:

   * ``binsearch``, ``power``: Lightning's ``BatchSizeFinder(mode="binsearch")`` / ``(mode="power")``, defaults;
   * ``default``: ``lightning_gpumem.BatchSizeTuner(budget=B, headroom=H)`` without ``method`` (the package's
     default search);
   * ``predict``, ``ours``: the same with ``method="predict"`` / ``method="search"``, as in earlier results (a
     package that refuses the method reports the error);
   * ``previous-predict``, ``previous-search``: ``BatchSizeTuner(budget=B, headroom=H, method="predict"/"search")``
     of a previous copy of the package, ``--previous DIR/lightning_gpumem`` (default ``out/previous``). Before
     anything imports the package, the worker removes an editable install's import hooks (``sys.meta_path`` and
     ``sys.path_hooks`` entries whose type or repr mentions "editable": they would win over ``sys.path``), drops the
     repository root, the working directory and ``''`` from ``sys.path`` and puts ``DIR`` first; if the package it
     then imports is not under ``DIR``, the finder's status is ``error``;
   * ``trace``, ``previous-trace``: ``BatchSizeTuner(budget=B, headroom=H, start="trace")`` of this package / of the
     previous copy; ``previous-default``: the previous copy's ``BatchSizeTuner(budget=B, headroom=H)``, as ``default``.

   ``H`` is the first ``--headroom`` value (default 0.05); further values (``--headroom 0.05,0.02``) run the guiding
   tuner (the first of ``default``, ``predict``, ``ours``, ``previous-predict``, ``previous-search`` asked for; it
   runs first) again, once per value, each in its own process. Each finder's JSON names the package its process
   imported (``package_file``, ``package_version``; null for Lightning's finders, which do not import it) and the
   tuner's ``method`` attribute (``tuner_method``, where it has one); the report's ``packages`` gives the directory,
   ``__version__`` and a SHA-256 of the ``.py`` files of the current and of the previous package. The process
   runs ``Trainer.fit`` with the finder as its only callback: the finder searches in ``on_fit_start`` (*search s*
   is the wall time of that hook, CUDA synchronised), then the same fit continues at the size found for 50 training
   steps and a validation pass of 5 batches at step 50 (``val_check_interval=50, check_val_every_n_epoch=None,
   limit_val_batches=5``); an OOM there is caught and reported. Trials and OOMs are counted inside the
   LightningModule, because both finders replace the Trainer's callbacks while they search: the first training
   batch (``on_train_batch_start`` at ``batch_idx`` 0) opens a trial (every trial runs the fit loop from batch 0), a
   training step counts when its ``optimizer_step`` returns (that hook wraps forward, backward and the optimizer
   step), and an out-of-memory error raised through
   ``optimizer_step`` or ``validation_step`` marks the trial as an OOM before it is re-raised to the finder. For the
   tuner the table shows its own ``tuner.trials`` and ``tuner.result.num_ooms``; the module's count is kept in the
   JSON as a cross-check.
2. **True maximum** (searched after the finders, so that under ``--time-limit`` they run first). The largest batch
   size ``N`` whose fit runs without OOM in a fresh process capped at ``B``, while ``N + 1`` does not. By default
   (``--true-max fit``) each candidate is exactly the finders' following fit (same Trainer, 50 steps and the
   validation pass) with the batch size set by hand and no finder (``--finder-worker
   fixed``): the largest size the following fit can take, and so the size each finder should find. With ``--true-max
   plain`` a candidate is ``--steps`` (3) training steps and one validation step in plain PyTorch instead (faster to
   start; it does what Lightning's loop does: batch moved to the GPU per step, forward under
   ``torch.autocast(bfloat16)``, ``zero_grad(set_to_none=True)`` after the forward, ``backward``, ``optimizer.step()``,
   then gradients released, ``model.eval()`` and one validation batch under ``torch.inference_mode()``); on the GPT
   it passed at 40 where Lightning fits at 38 and 39 ran out of memory in their second step, so its maximum is not
   one Lightning reaches. Each candidate prints one JSON line: ok, OOM, peak reserved and allocated bytes. Up to
   ``--parallel`` candidates run at once on the one GPU (each capped at ``B``; fewer are used if
   ``parallel * (B + 1 GiB)`` would not fit the card). The search is k-ary over a bracket ``(lo, hi)`` (largest size
   that passed, smallest that failed): the first round is centred on the guiding tuner's answer ``g`` (``g``,
   ``g + 1``, the size where the line through its measured peaks meets ``B``, and a spread above; the workload's
   ``true_max_guide`` in the JSON; ``--guess model=size`` gives ``g`` instead, e.g. a traced plan's size with
   ``--finders ""``); later rounds put a few
   candidates next to the size the probes' own peaks predict and split the rest of the bracket evenly (geometrically
   while it spans more than 4x), until ``hi = lo + 1``. Where one candidate at a time fits the card (48 GiB on an
   80 GB one) and ``g`` is given, the search gallops from ``g`` (``g``, then steps of 1, 2, 4, ... away from it) and
   bisects the bracket found. A probe that times out or fails for another reason counts as
   a failure but marks the result *uncertain*; a size that passed above one that failed is reported as
   non-monotone.
3. **Output.** A Markdown table per workload on stdout (finder | batch size | fraction of true max | trials | OOMs |
   search s | N-step fit + val, N from ``--fit-steps``) and the line ``true max = N (k candidate processes,
   s seconds)``; progress lines on stderr; ``--json PATH`` writes every number (rewritten after each workload,
   so a cut-off run keeps what it had).

On a GPU, one process runs a plain training step of the first workload at batch size 1 before any finder: the
first process on a machine loads the CUDA libraries from disk, a cost that would otherwise fall on whichever finder
runs first.

Every subprocess runs under a timeout (``--timeout``, default 150 s) and in its own process group, which is killed
on timeout ("timeout" is reported instead of hanging); no new subprocess starts once ``--time-limit`` (default
500 s) is nearly spent. ``PYTHONPATH`` of the subprocesses gets the repository root prepended.

``--quick`` runs on the CPU with a tiny GPT (d_model 64, 2 layers, sequence 32, vocabulary 256), a tiny
``GPT2LMHeadModel`` for ``hf-gpt2`` (n_embd 64, 2 layers, 4 heads, vocabulary 256, sequence and n_positions 32; the
tiny GPT stands in, with a line on stderr, where ``import transformers`` fails) and a tiny CNN in place of ResNet-50
and ViT, without a memory cap. A CPU never runs out of memory, so every model raises ``torch.cuda.OutOfMemoryError``
in its loss above a fixed batch size (37 for the GPTs, 53 for the CNN), in the probes and in the finders' processes
alike, and the whole pipeline, tables included, is exercised; every tuner finder gets ``max_val=2**31`` there (on a
CPU the tuner keeps the batch size unless ``max_val`` is given). It trains in 32-bit (``precision="32-true"``,
autocast off in the probes), as bf16 on a CPU is several times slower.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import importlib
import importlib.util
import json
import math
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `_harness` and `_tuner_models` next to this file
import _harness as H
import _tuner_models as M

GIB = H.GIB
FINDERS = (
    "binsearch",
    "power",
    "ours",
    "predict",
    "previous-search",
    "previous-predict",
    "previous-default",
    "default",
    "previous-trace",
    "trace",
)  # table order
DEFAULT_FINDERS = ("default", "binsearch", "power")
# The BatchSizeTuner finders: the package they import ("current": the repository's; "previous": --previous DIR's) and
# the `method` they pass (None: not passed, the package's default). "ours" and "predict" keep the meaning they have in
# earlier JSON (method passed explicitly).
TUNER_FINDERS: dict[str, tuple[str, str | None]] = {
    "default": ("current", None),
    "predict": ("current", "predict"),
    "ours": ("current", "search"),
    "previous-predict": ("previous", "predict"),
    "previous-search": ("previous", "search"),
    "previous-default": ("previous", None),  # the previous copy's default: no `method`, no `start`
    "trace": ("current", None),  # BatchSizeTuner(start="trace"): the step traced first
    "previous-trace": ("previous", None),  # the same, of the previous copy
}
TRACED_FINDERS = ("trace", "previous-trace")
GUIDES = (
    "default",
    "predict",
    "ours",
    "previous-predict",
    "previous-search",
)  # the first one run guides the true max
FINDER_LABELS = {
    "binsearch": "Lightning `BatchSizeFinder(mode='binsearch')`",
    "power": "Lightning `BatchSizeFinder(mode='power')`",
}
CONTEXT_BYTES = GIB  # per-process CUDA context and slack, when deciding how many probes fit the card at once
MIN_START_SECONDS = 20.0  # do not start a subprocess with less time left than this


# ---------------------------------------------------------------------------------------------------- workers
def _setup_device(quick: bool, budget_bytes: int) -> torch.device:
    """The device of a worker process; on CUDA, cap the allocator at the budget before anything is allocated."""
    if quick or not torch.cuda.is_available():
        return torch.device("cpu")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), 0)
    return torch.device("cuda", 0)


def _autocast(device: torch.device) -> torch.autocast:
    """Lightning's ``bf16-mixed`` on CUDA; off on the CPU (``--quick`` runs 32-bit: CPU bf16 is slow)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _peaks(device: torch.device) -> dict[str, int | None]:
    if device.type != "cuda":
        return {"peak_reserved": None, "peak_allocated": None}
    return {
        "peak_reserved": torch.cuda.max_memory_reserved(device),
        "peak_allocated": torch.cuda.max_memory_allocated(device),
    }


def probe_worker(args: argparse.Namespace) -> int:
    """One true-maximum candidate: ``--steps`` training steps and one validation step at ``--batch-size``."""
    result: dict[str, Any] = {"batch_size": args.batch_size, "ok": False, "oom": False, "error": None}
    try:
        device = _setup_device(args.quick, args.budget_bytes)
        w = M.workload(args.model, args.quick)
        torch.manual_seed(0)
        model = M.build_model(w).to(device)
        optimizer = M.make_optimizer(model)
        cpu_batch = M.first_batch(w, M.build_dataset(w), args.batch_size)
        cpu_val_batch = M.first_batch(w, M.build_val_dataset(w), args.batch_size)
        start = time.perf_counter()
        try:
            model.train()
            for _ in range(args.steps):
                batch = [t.to(device) for t in cpu_batch]
                with _autocast(device):
                    loss = M.compute_loss(w, model, batch)
                optimizer.zero_grad(set_to_none=True)  # after the forward, as in Lightning's closure
                loss.backward()
                optimizer.step()
                del batch, loss
            optimizer.zero_grad(set_to_none=True)  # Lightning's `on_validation_model_zero_grad`
            model.eval()
            with torch.inference_mode(), _autocast(device):
                batch = [t.to(device) for t in cpu_val_batch]
                float(M.compute_loss(w, model, batch, validation=True))
                del batch
            H.synchronize(device)
            result["ok"] = True
        except Exception as error:
            if not M.is_oom(error):
                raise
            result["oom"] = True
        result["seconds"] = time.perf_counter() - start
        result.update(_peaks(device))
    except Exception as error:
        result["error"] = H.describe_error(error)
    H.emit(result)
    return 0


class _TimedSearch:
    """Mixed in before a finder class: times its ``on_fit_start`` (the search) and tells the module when it ends."""

    search_seconds: float | None = None
    search_started_at: float | None = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        pl_module.phase = "search"
        start = time.perf_counter()
        self.search_started_at = start - H.T0  # on the worker's clock, as its tuner_log lines
        super().on_fit_start(trainer, pl_module)  # type: ignore[misc]
        H.synchronize(pl_module.device)
        self.search_seconds = time.perf_counter() - start
        pl_module.start_fit()


def _fixed_size_callback(batch_size: int) -> Any:
    """Stands in for a finder in a true-max candidate: no search, the fit runs at the size given."""
    from lightning.pytorch.callbacks import Callback

    class FixedSize(Callback):
        search_seconds = 0.0
        optimal_batch_size = batch_size

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            pl_module.start_fit()

    return FixedSize()


def _is_editable_hook(hook: Any) -> bool:
    """Whether an import hook comes from an editable install (setuptools' ``__editable__`` finders and path hooks)."""
    names = (
        repr(hook),
        type(hook).__module__,
        getattr(hook, "__module__", None),
        getattr(hook, "__qualname__", None),
    )
    return any("editable" in str(name).lower() for name in names if name)


def _use_previous_package(directory: str) -> Path:
    """Import ``lightning_gpumem`` from ``directory`` (holding a ``lightning_gpumem/`` package); its ``__file__``.

    Call it before anything imports the package. It wins over an editable install of the current package (whose
    finder on ``sys.meta_path`` would answer first) and over the repository root that the orchestrator puts on
    ``PYTHONPATH``: the editable finders and path hooks are removed, the repository root, the working directory and
    ``''`` leave ``sys.path``, and ``directory`` goes first. Raises if the package then imported is not under it.
    """
    root = Path(directory).resolve()
    if not (root / "lightning_gpumem" / "__init__.py").is_file():
        raise RuntimeError(
            f"--previous {directory}: {root / 'lightning_gpumem' / '__init__.py'} does not exist"
        )
    if "lightning_gpumem" in sys.modules:
        already = getattr(sys.modules["lightning_gpumem"], "__file__", None)
        raise RuntimeError(
            f"--previous: lightning_gpumem was imported before it could be redirected (from {already})"
        )
    sys.meta_path[:] = [hook for hook in sys.meta_path if not _is_editable_hook(hook)]
    sys.path_hooks[:] = [hook for hook in sys.path_hooks if not _is_editable_hook(hook)]
    drop = {H.REPO_ROOT.resolve(), Path.cwd().resolve(), root}

    def keep(entry: str) -> bool:
        if entry in ("", ".") or "__editable__" in entry:
            return False
        try:
            return Path(entry).resolve() not in drop
        except OSError:
            return True

    sys.path[:] = [str(root), *(entry for entry in sys.path if keep(entry))]
    sys.path_importer_cache.clear()
    importlib.invalidate_caches()
    import lightning_gpumem

    imported = Path(lightning_gpumem.__file__ or "").resolve()
    if root not in imported.parents:
        raise RuntimeError(
            f"--previous {directory}: lightning_gpumem was imported from {imported}, not from {root}"
        )
    return imported


def _lightning_classes(tuner: bool = True) -> tuple[type, type, Any]:
    """The LightningModule and the two timed finders; built on demand so that probe workers never import Lightning.

    With ``tuner=False`` the third is ``None`` and ``lightning_gpumem`` is not imported (Lightning's finders and the
    fixed-size true-max candidates do not need it).
    """
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BatchSizeFinder
    from torch.utils.data import DataLoader

    class BenchModule(pl.LightningModule):
        """A workload as a LightningModule that records, per search trial, its batch size, steps and OOMs."""

        def __init__(self, w: M.Workload) -> None:
            super().__init__()
            self.w = w
            self.batch_size = 2
            self.net = M.build_model(w)
            self.dataset = M.build_dataset(w)
            self.val_dataset = M.build_val_dataset(w)
            self.phase = "setup"  # "search" during the finder's on_fit_start, then "fit"
            self.trials: list[dict[str, Any]] = []
            self.fit_steps = 0
            self.fit_val_batches = 0
            self.fit_started_at: float | None = None
            self.budget_fraction = 1.0  # set by the worker on CUDA
            self.fraction_after_search: float | None = None  # the allocator cap the finder left behind

        def start_fit(self) -> None:
            self.phase = "fit"
            if self.device.type == "cuda":
                getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
                self.fraction_after_search = None if getter is None else float(getter(self.device))
                # The fit runs under the budget whatever the finder left: the benchmark's premise is a budget-size card.
                torch.cuda.set_per_process_memory_fraction(self.budget_fraction, self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
            self.fit_started_at = time.perf_counter()

        def _trial(self) -> dict[str, Any]:
            if not self.trials:  # a step outside a fit-loop run (not expected): give it a trial of its own
                self._open_trial()
            return self.trials[-1]

        def _note(self, error: BaseException) -> None:
            if self.phase == "search" and M.is_oom(error):
                self._trial()["oom"] = True

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if (
                self.phase == "search" and batch_idx == 0
            ):  # every trial of both finders runs the loop from batch 0
                self._open_trial()

        def _open_trial(self) -> None:
            self.trials.append(
                {
                    "batch_size": self.batch_size,
                    "seen": None,
                    "train_steps": 0,
                    "val_batches": 0,
                    "oom": False,
                }
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.phase == "search":
                self._trial()["seen"] = M.batch_length(batch)
            loss = M.compute_loss(self.w, self.net, batch)
            self.log("train_loss", loss)
            return loss

        def optimizer_step(
            self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None
        ) -> None:
            try:  # the closure inside runs training_step, zero_grad and backward
                super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
            except Exception as error:
                self._note(error)
                raise
            if self.phase == "search":
                self._trial()["train_steps"] += 1
            elif self.phase == "fit":
                self.fit_steps += 1

        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            try:
                loss = M.compute_loss(self.w, self.net, batch, validation=True)
            except Exception as error:
                self._note(error)
                raise
            self.log("val_loss", loss)
            if self.phase == "search":
                self._trial()["val_batches"] += 1
            elif self.phase == "fit":
                self.fit_val_batches += 1
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return M.make_optimizer(self.net)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(
                self.dataset,
                batch_size=self.batch_size,
                shuffle=True,
                drop_last=True,
                num_workers=self.w.num_workers,
            )

        def val_dataloader(self) -> DataLoader:
            return DataLoader(
                self.val_dataset, batch_size=self.batch_size, shuffle=False, num_workers=self.w.num_workers
            )

    class TimedBatchSizeFinder(_TimedSearch, BatchSizeFinder):
        """Lightning's finder, timed."""

    if not tuner:
        return BenchModule, TimedBatchSizeFinder, None

    from lightning_gpumem import BatchSizeTuner

    class TimedBatchSizeTuner(_TimedSearch, BatchSizeTuner):
        """lightning_gpumem's tuner, timed."""

    return BenchModule, TimedBatchSizeFinder, TimedBatchSizeTuner


CPU_MAX_VAL = (
    2**31
)  # --quick: a bound above any dataset, so the tuner searches on a CPU (the simulated OOMs bound it)


def finder_worker(args: argparse.Namespace) -> int:
    """One finder in a fresh process: search in ``on_fit_start``, then the following fit at the size found."""
    result: dict[str, Any] = {
        "finder": args.finder_worker,
        "model": args.model,
        "status": "error",
        "error": None,
    }
    result.update(fit_steps=args.fit_steps, fit_val_batches=args.fit_val_batches)
    package, method = TUNER_FINDERS.get(args.finder_worker, ("current", None))
    result["tuner_log"] = _tuner_log_lines()
    try:
        if package == "previous":  # before anything imports lightning_gpumem
            _use_previous_package(args.previous)
        device = _setup_device(args.quick, args.budget_bytes)
        warnings.filterwarnings(
            "ignore", message=r".*(num_workers|does not have many workers|LightningModule\.log).*"
        )
        import lightning.pytorch as pl

        module_cls, finder_cls, tuner_cls = _lightning_classes(tuner=args.finder_worker in TUNER_FINDERS)
        w = M.workload(args.model, args.quick)
        pl.seed_everything(0, verbose=False)
        model = module_cls(w)
        if device.type == "cuda":
            model.budget_fraction = min(
                1.0, args.budget_bytes / torch.cuda.get_device_properties(device).total_memory
            )
        result["parameters"] = M.count_parameters(model.net)
        if args.finder_worker in TUNER_FINDERS:
            options: dict[str, Any] = (
                {} if method is None else {"method": method}
            )  # None: the package's default
            if args.finder_worker in TRACED_FINDERS:
                options["start"] = "trace"
            if device.type != "cuda":
                options["max_val"] = CPU_MAX_VAL  # on a CPU it searches only when asked
            callback = tuner_cls(budget=args.budget_bytes, headroom=float(args.headroom), **options)
            result["tuner_method"] = getattr(callback, "method", None)  # the method the tuner says it runs
        elif args.finder_worker == "fixed":  # a true-max candidate: no finder, the size set by hand
            model.batch_size = args.batch_size
            callback = _fixed_size_callback(args.batch_size)
        else:
            callback = finder_cls(mode=args.finder_worker)
        with tempfile.TemporaryDirectory(prefix="tuner_bench_") as root:
            trainer = pl.Trainer(
                accelerator="gpu" if device.type == "cuda" else "cpu",
                devices=1,
                precision="bf16-mixed" if device.type == "cuda" else "32-true",
                max_steps=args.fit_steps,
                val_check_interval=args.fit_steps,
                check_val_every_n_epoch=None,
                limit_val_batches=args.fit_val_batches,
                num_sanity_val_steps=0,
                callbacks=[callback],
                default_root_dir=root,
                **H.QUIET_TRAINER,
            )
            fit_error: BaseException | None = None
            try:
                trainer.fit(model)
            except Exception as error:
                fit_error = error
            _collect_finder_result(result, callback, model, device, fit_error)
    except Exception as error:
        result["error"] = H.describe_error(error)
    imported = sys.modules.get("lightning_gpumem")  # which copy of the package this process ran
    result["package_file"] = getattr(imported, "__file__", None)
    result["package_version"] = getattr(imported, "__version__", None)
    H.emit(result)
    return 0


def _tuner_log_lines() -> list[str]:
    """The tuners' info lines (``BatchSizeTuner: ...``: what it traced and guessed, in what time), as logged."""
    import logging

    lines: list[str] = []

    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("BatchSizeTuner"):
                lines.append(f"[{time.perf_counter() - H.T0:6.1f}s] {message}")

    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                 "pytorch_lightning.utilities.rank_zero", "lightning_utilities.core.rank_zero"):  # fmt: skip
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(Kept(logging.INFO))
    return lines


def _collect_finder_result(
    result: dict[str, Any], callback: Any, model: Any, device: torch.device, error: BaseException | None
) -> None:
    searched = callback.search_seconds is not None
    result["search_seconds"] = callback.search_seconds
    result["search_started_at"] = getattr(callback, "search_started_at", None)
    result["batch_size"] = callback.optimal_batch_size if searched else None
    result["module_trials"] = model.trials
    result["num_trials"] = len(model.trials)
    result["num_ooms"] = sum(t["oom"] for t in model.trials)
    if device.type == "cuda":
        result["allocator_num_ooms"] = int(torch.cuda.memory_stats(device).get("num_ooms", 0))
    if hasattr(callback, "result"):  # ours: its own account of the search
        tuner_result = callback.result
        result["tuner_trials"] = [
            {
                "batch_size": t.batch_size,
                "fits": t.fits,
                "peak_bytes": t.peak_bytes,
                "allocated_bytes": t.allocated_bytes,
                "train_peak_bytes": getattr(t, "train_peak_bytes", None),
                "val_peak_bytes": getattr(t, "val_peak_bytes", None),
                "retries": getattr(t, "retries", None),
                "seconds": round(t.seconds, 3),
            }
            for t in callback.trials
        ]
        result["tuner_reason"] = None if tuner_result is None else tuner_result.reason
        result["tuner_note"] = None if tuner_result is None else tuner_result.note
        result["tuner_budget_bytes"] = callback.budget_bytes
        if tuner_result is not None:
            result["num_trials"] = len(tuner_result.trials)
            result["num_ooms"] = tuner_result.num_ooms
    fit: dict[str, Any] = {"steps": model.fit_steps, "val_batches": model.fit_val_batches}
    if device.type == "cuda":
        fit["cap_fraction"] = model.budget_fraction
        fit["cap_fraction_left_by_finder"] = model.fraction_after_search
    if model.fit_started_at is not None:
        fit["seconds"] = time.perf_counter() - model.fit_started_at
        fit.update(_peaks(device))
    if error is None:
        result["status"] = "ok"
    elif not searched:
        result["status"] = "search_oom" if M.is_oom(error) else "search_error"
        result["error"] = H.describe_error(error)
    else:
        result["status"] = "ok"
        fit["oom"] = M.is_oom(error)
        fit["error"] = H.describe_error(error)
    result["fit"] = fit if searched else None


# ---------------------------------------------------------------------------------------------------- orchestration
class Runner:
    """Starts the worker subprocesses with the right environment, timeouts and time limit."""

    def __init__(self, args: argparse.Namespace, budget_bytes: int) -> None:
        self.args = args
        self.budget_bytes = budget_bytes
        self.deadline = H.T0 + args.time_limit
        self.env = H.worker_env()
        if args.expandable:  # before CUDA starts in each worker
            self.env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        self.log_dir = Path(args.log_dir) if args.log_dir else None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()

    def argv(self, model: str, *extra: str, headroom: float | None = None) -> list[str]:
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--model",
            model,
            "--budget-bytes",
            str(self.budget_bytes),
        ]
        argv += ["--steps", str(self.args.steps), "--fit-steps", str(self.args.fit_steps)]
        headroom = self.args.headrooms[0] if headroom is None else headroom
        argv += ["--fit-val-batches", str(self.args.fit_val_batches), "--headroom", str(headroom)]
        argv += ["--previous", str(self.args.previous), *extra]
        return [*argv, "--quick"] if self.args.quick else argv

    def run(self, argv: list[str], name: str) -> H.Worker:
        """Run one worker to its end (killed at ``--timeout`` or the time limit); with ``--log-dir``, log its output."""
        timeout = min(self.args.timeout, max(1.0, self.remaining()))
        done = H.run_worker(argv, timeout, name, self.env)
        if self.log_dir is not None:
            text = f"$ {' '.join(argv)}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
            (self.log_dir / f"{name}.log").write_text(text, "utf-8")
        return done


# ---------------------------------------------------------------------------------------------------- true maximum
def _predict_max(points: list[tuple[int, int]], budget_bytes: int) -> int | None:
    """Largest size whose peak, on the line through the two largest measured sizes, stays within the budget."""
    by_size = dict(sorted(points))
    if len(by_size) < 2:
        return None
    (b1, p1), (b2, p2) = list(by_size.items())[-2:]
    slope = (p2 - p1) / (b2 - b1)
    if slope <= 0:
        return None
    guess = b2 + math.floor((budget_bytes - p2) / slope)
    return guess if guess >= 1 else None


def _split(lo: int, hi: int | None, upper: int, n: int) -> list[int]:
    """``n`` sizes spread over the open bracket ``(lo, hi)`` (``hi=None``: up to and including ``upper``)."""
    base = max(lo, 1)
    if hi is None:
        return [round(base * (upper / base) ** (j / n)) for j in range(1, n + 1)]
    if hi / base > 4:
        return [round(base * (hi / base) ** (j / (n + 1))) for j in range(1, n + 1)]
    return [lo + round(j * (hi - lo) / (n + 1)) for j in range(1, n + 1)]


def _candidates(
    lo: int, hi: int | None, upper: int, k: int, predicted: int | None, guess: int | None = None
) -> list[int]:
    """Up to ``k`` untested sizes in the bracket ``(lo, hi)``, in this order of priority.

    ``guess`` and ``guess + 1`` (first round only), sizes next to ``predicted`` (``p``, ``p + 1``, ``p - 1``: the
    boundary is a pass next to a failure), a spread above ``guess`` (first round), then the bracket split evenly.
    """
    top = upper if hi is None else min(upper, hi - 1)
    if top <= lo:
        return []
    if top - lo <= k:
        return list(range(lo + 1, top + 1))
    ordered = [] if guess is None else [guess, guess + 1]
    if predicted is not None:
        near = min(max(predicted, lo + 1), top)
        ordered += [near, near + 1, near - 1][: min(3, k) if k <= 2 else min(3, k - 1)]
    if guess is not None:
        ordered += [math.ceil(guess * f) for f in (1.1, 1.25, 1.5, 2.0)]
    picks: list[int] = []
    extra = 0
    while len(picks) < k and extra <= 3 * k:
        for size in ordered:
            if len(picks) < k and lo < size <= top and size not in picks:
                picks.append(size)
        ordered = _split(lo, hi, upper, k - len(picks) + extra)
        extra += 1
    return sorted(picks)


def _gallop(lo: int, hi: int | None, upper: int, guess: int) -> list[int]:
    """One size: ``guess``, then steps of 1, 2, 4, ... away from it until the edge is bracketed, then halves."""
    if lo == 0 and hi is None:
        size = guess
    elif hi is None:
        size = lo + max(1, lo - guess + 1)
    elif lo == 0:
        size = hi - max(1, guess - hi + 1)
    else:
        size = (lo + hi) // 2
    size = max(1, min(size, upper if hi is None else hi - 1))
    return [size] if lo < size and (hi is None or size < hi) else []


def _bracket(probes: dict[int, dict[str, Any]]) -> tuple[int, int | None, list[int]]:
    """Largest passing size below the smallest failing one, that failing size, and passes above it (non-monotone)."""
    failed = [size for size, p in probes.items() if not p["ok"]]
    hi = min(failed) if failed else None
    passed = [size for size, p in probes.items() if p["ok"]]
    lo = max([size for size in passed if hi is None or size < hi], default=0)
    above = sorted(size for size in passed if hi is not None and size > hi)
    return lo, hi, above


def find_true_max(
    runner: Runner, model: str, w: M.Workload, parallel: int, guess: int | None, hints: list[tuple[int, int]]
) -> dict[str, Any]:
    """Exact largest batch size that passes the probe, by rounds of up to ``parallel`` concurrent candidates."""
    start = time.perf_counter()
    probes: dict[int, dict[str, Any]] = {}
    rounds = 0
    status = "exact"
    while True:
        lo, hi, _ = _bracket(probes)
        if hi is not None and hi == lo + 1:
            break
        if hi is None and lo >= w.search_upper:
            status = "upper_bound"
            break
        measured = [(s, p["peak_reserved"]) for s, p in probes.items() if p["ok"] and p.get("peak_reserved")]
        points = measured if len(measured) >= 2 else measured + [h for h in hints if h[0] not in probes]
        predicted = _predict_max(points, runner.budget_bytes)
        first_round_guess = guess if not probes else None  # the first round is centred on the tuner's answer
        if parallel == 1 and guess is not None:  # one at a time: gallop out from the guess, then bisect
            sizes = _gallop(lo, hi, w.search_upper, guess)
        else:
            sizes = _candidates(lo, hi, w.search_upper, parallel, predicted, first_round_guess)
        if not sizes:
            status = "no_candidates"
            break
        if runner.remaining() < MIN_START_SECONDS:
            status = "time_limit"
            break
        rounds += 1
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(sizes)) as pool:
            futures = {
                size: pool.submit(
                    runner.run, runner.argv(model, *_probe_args(runner, size)), f"{model}_probe_{size}"
                )
                for size in sizes
            }
            for size, future in futures.items():
                proc = future.result()
                probe = _as_probe(proc.result(), size) if runner.args.true_max == "fit" else proc.result()
                if probe is None or probe.get("error"):
                    why = proc.failure() if probe is None else probe["error"]
                    probe = {
                        "batch_size": size,
                        "ok": False,
                        "oom": False,
                        "error": why,
                        "timed_out": proc.timed_out,
                    }
                probe["wall_seconds"] = round(proc.seconds, 2)
                probes[size] = probe
        H.log(f"{model}: true max round {rounds}: " + ", ".join(_probe_summary(probes[s]) for s in sizes))
    lo, hi, above = _bracket(probes)
    return {
        "true_max": lo if probes and lo > 0 else (0 if hi == 1 else None),
        "status": status,
        "uncertain": hi is not None and bool(probes[hi].get("error")),
        "non_monotone_passes": above,
        "smallest_failure": hi,
        "rounds": rounds,
        "num_candidates": len(probes),
        "seconds": time.perf_counter() - start,
        "guess": guess,
        "probes": [probes[s] for s in sorted(probes)],
    }


def _probe_args(runner: Runner, size: int) -> list[str]:
    worker = ["--finder-worker", "fixed"] if runner.args.true_max == "fit" else ["--probe-worker"]
    return [*worker, "--batch-size", str(size)]


def _as_probe(result: dict[str, Any] | None, size: int) -> dict[str, Any] | None:
    """A fixed-size fit's result in the shape of a plain probe's: ok, oom, peaks, error."""
    if result is None:
        return None
    fit = result.get("fit") or {}
    if result.get("status") != "ok" or not fit:
        return {"batch_size": size, "ok": False, "oom": False, "error": result.get("error") or "no fit"}
    error = fit.get("error")
    return {
        "batch_size": size,
        "ok": not error,
        "oom": bool(fit.get("oom")),
        "error": None if not error or fit.get("oom") else error,
        "steps": fit.get("steps"),
        "val_batches": fit.get("val_batches"),
        "seconds": fit.get("seconds"),
        "peak_reserved": fit.get("peak_reserved"),
        "peak_allocated": fit.get("peak_allocated"),
    }


def _probe_summary(probe: dict[str, Any]) -> str:
    size = probe["batch_size"]
    if probe["ok"]:
        peak = probe.get("peak_reserved")
        return f"{size} ok" + (f" ({peak / GIB:.1f} GiB)" if peak else "")
    if probe.get("oom"):
        return f"{size} OOM"
    return f"{size} {'timeout' if probe.get('timed_out') else 'error'}"


# ---------------------------------------------------------------------------------------------------- finders
def run_finder(runner: Runner, model: str, finder: str, headroom: float | None = None) -> dict[str, Any]:
    """One finder's subprocess; returns its result, or a record of why there is none."""
    if runner.remaining() < MIN_START_SECONDS:
        return {"finder": finder, "status": "skipped", "error": "time limit"}
    name = f"{model}_{finder}" if headroom is None else f"{model}_{finder}_headroom{headroom}"
    proc = runner.run(runner.argv(model, "--finder-worker", finder, headroom=headroom), name)
    result = proc.result()
    if result is None:
        result = {
            "finder": finder,
            "status": "timeout" if proc.timed_out else "crashed",
            "error": proc.failure(),
        }
    result["wall_seconds"] = round(proc.seconds, 2)
    if headroom is not None:
        result["headroom"] = headroom
    label = finder if headroom is None else f"{finder} (headroom {headroom})"
    H.log(f"{model}: {label}: {_finder_summary(result)} [process {proc.seconds:.1f} s]")
    if result.get("tuner_log"):
        started = result.get("search_started_at")
        H.log(f"  search started at [{started:6.1f}s]" if started is not None else "  search start unknown")
        for line in result["tuner_log"]:
            H.log(f"  {line}")
    return result


def _finder_summary(r: dict[str, Any]) -> str:
    if r.get("status") != "ok":
        return f"{r.get('status')}: {r.get('error')}"
    return (
        f"batch size {r['batch_size']}, {r['num_trials']} trials, {r['num_ooms']} OOM,"
        f" search {r['search_seconds']:.1f} s, fit {_fit_cell(r)}"
    )


def _fit_cell(r: dict[str, Any]) -> str:
    fit = r.get("fit")
    if r.get("status") != "ok" or fit is None:
        return "-"
    if fit.get("error"):
        where = (
            f"validation batch {fit['val_batches'] + 1}"
            if fit["steps"] >= r["fit_steps"]
            else f"step {fit['steps'] + 1}"
        )
        return f"**OOM** at {where}" if fit.get("oom") else f"error at {where}"
    parts = (
        []
        if fit["steps"] == r["fit_steps"] and fit["val_batches"] == r["fit_val_batches"]
        else [f"{fit['steps']} steps, {fit['val_batches']} val batches"]
    )
    if fit.get("peak_reserved"):
        parts.append(f"peak {fit['peak_reserved'] / GIB:.1f} GiB")
    parts.append(f"{fit['seconds']:.1f} s")
    return f"ok ({', '.join(parts)})"


# ---------------------------------------------------------------------------------------------------- report
def _table(model: str, w: M.Workload, entry: dict[str, Any], budget_bytes: int, quick: bool) -> str:
    true = entry.get("true_max") or {}
    true_max = true.get("true_max")
    budget = (
        "no memory cap, simulated OOM above " + str(w.simulated_oom_above)
        if quick
        else f"budget {budget_bytes / GIB:.1f} GiB"
    )
    params = next((r["parameters"] for r in entry["finders"].values() if r.get("parameters")), None)
    param_text = ""
    if params:
        param_text = f", {params / 1e6:.1f}M parameters" if params >= 1e6 else f", {params:,} parameters"
    steps = next((r["fit_steps"] for r in entry["finders"].values() if r.get("fit_steps")), None)
    fit = f"{steps}-step fit" if steps else "fit"  # the fit after the search, as --fit-steps set it
    lines = [
        f"### {model}: {M.describe(w)}{param_text} ({budget})",
        "",
        f"| finder | batch size | fraction of true max | trials | OOMs | search s | {fit} + val |",
        "|---|---|---|---|---|---|---|",
    ]
    for finder in [*FINDERS, *(k for k in entry["finders"] if k not in FINDERS)]:
        r = entry["finders"].get(finder)
        if r is None:
            continue
        if r.get("status") != "ok":
            cells = [f"{r.get('status')}"] + ["-"] * 5
        else:
            size = r["batch_size"]
            fraction = f"{size / true_max:.2f}" if size and true_max else "-"
            cells = [
                str(size),
                fraction,
                str(r["num_trials"]),
                str(r["num_ooms"]),
                f"{r['search_seconds']:.1f}",
                _fit_cell(r),
            ]
        lines.append(f"| {_label(finder, r)} | " + " | ".join(cells) + " |")
    lines += ["", _true_max_line(true)]
    return "\n".join(lines)


def _label(finder: str, r: dict[str, Any]) -> str:
    """The table's name of a finder (``finder`` may end in ``-headroom-H``, a tuner's run at another headroom)."""
    base = finder.split("-headroom-")[0]
    if base not in TUNER_FINDERS:
        return FINDER_LABELS.get(base, finder)
    package, method = TUNER_FINDERS[base]
    headroom = r.get("headroom")
    arguments = "budget=B" + (f", headroom={headroom}" if headroom is not None and headroom != 0.05 else "")
    arguments += f", method='{method}'" if method else ""
    arguments += ", start='trace'" if base in TRACED_FINDERS else ""
    if package == "previous":
        return f"previous version{f', {method}' if method else ''}: `BatchSizeTuner({arguments})`"
    default = method is None and base not in TRACED_FINDERS
    return f"lightning_gpumem `BatchSizeTuner({arguments})`" + (" (default)" if default else "")


def _package_stamp(directory: Path | None) -> dict[str, Any] | None:
    """Where a ``lightning_gpumem`` package directory is, its ``__version__`` and a SHA-256 of its ``.py`` files."""
    if directory is None or not (directory / "__init__.py").is_file():
        return None
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*.py")):
        digest.update(str(path.relative_to(directory)).encode() + b"\0" + path.read_bytes() + b"\0")
    found = re.search(
        r"""^__version__\s*=\s*["']([^"']+)["']""", (directory / "__init__.py").read_text(), re.MULTILINE
    )
    return {"dir": str(directory), "version": found and found.group(1), "sha256": digest.hexdigest()}


def _true_max_line(true: dict[str, Any]) -> str:
    if not true:
        return "true max = not measured"
    value = true["true_max"]
    how = f"({true['num_candidates']} candidate processes, {true['seconds']:.1f} seconds)"
    if true["status"] == "upper_bound":
        text = f"true max >= {value} (the search's upper bound) {how}"
    elif true["status"] != "exact":
        text = (
            f"true max: not settled ({true['status']}; largest pass {value},"
            f" smallest failure {true['smallest_failure']}) {how}"
        )
    else:
        text = f"true max = {value} {how}"
    if true["uncertain"]:
        text += "; uncertain: a candidate at or above it failed without OOM (error or timeout), counted as a failure"
    if true["non_monotone_passes"]:
        text += f"; non-monotone: {true['non_monotone_passes']} passed although {true['smallest_failure']} failed"
    return text


def orchestrate(args: argparse.Namespace) -> int:
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    finders = [f.strip() for f in args.finders.split(",") if f.strip()]
    if unknown := set(finders) - set(FINDERS):
        sys.exit(f"--finders: unknown {sorted(unknown)}; expected some of {list(FINDERS)}")
    try:
        args.headrooms = [float(h) for h in args.headroom.split(",") if h.strip()]
    except ValueError:
        sys.exit(f"--headroom {args.headroom!r}: expected numbers, comma-separated")
    if not args.headrooms or not all(0.0 <= h < 1.0 for h in args.headrooms):
        sys.exit(f"--headroom {args.headroom!r}: expected values in [0, 1)")
    for name in models:
        M.workload(name, args.quick)  # unknown names fail now
    try:
        guesses = {m: int(n) for m, n in (g.split("=") for g in args.guess.split(",") if g.strip())}
    except ValueError:
        sys.exit(f"--guess {args.guess!r}: expected model=size pairs, comma-separated")
    args.previous = str(Path(args.previous).resolve())  # the workers run in the repository root
    packages = {"current": _package_stamp(_current_package_dir()), "previous": None}
    if any(TUNER_FINDERS.get(f, ("",))[0] == "previous" for f in finders):
        packages["previous"] = _package_stamp(Path(args.previous) / "lightning_gpumem")
        if packages["previous"] is None:
            sys.exit(
                f"--previous {args.previous}: no lightning_gpumem/__init__.py there (the previous-* finders need it)"
            )
    budget_bytes = int(args.budget_gib * GIB)
    if args.quick:
        device = {"name": "cpu", "total_bytes": None}
        parallel = max(1, min(args.parallel, os.cpu_count() or 1))
    elif torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        device = {"name": props.name, "total_bytes": int(props.total_memory)}
        if budget_bytes > props.total_memory:
            sys.exit(
                f"--budget-gib {args.budget_gib} is more than the device's {props.total_memory / GIB:.1f} GiB"
            )
        parallel = max(1, min(args.parallel, int(props.total_memory // (budget_bytes + CONTEXT_BYTES))))
    else:
        sys.exit("No CUDA device: the full benchmark needs one. Use --quick for a CPU smoke run.")

    versions = H.versions(("lightning", "torchvision", "timm", "transformers", "lightning-gpumem"))
    print("# Batch-size finders under a memory budget\n")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    for which, stamp in packages.items():
        if stamp is not None:
            print(
                f"{which} lightning_gpumem: {stamp['dir']} (version {stamp['version']}, sha256 {stamp['sha256'][:12]})"
            )
    if (
        packages["previous"]
        and packages["current"]
        and packages["previous"]["sha256"] == packages["current"]["sha256"]
    ):
        print("note: the previous package's files are identical to the current one's")
    total = f"{device['total_bytes'] / GIB:.1f} GiB" if device["total_bytes"] else "no memory cap"
    print(
        f"device: {device['name']} ({total}); budget {args.budget_gib} GiB per process; {parallel} probes at once"
    )
    fit_text = f"{args.fit_steps} steps + {args.fit_val_batches} validation batches"
    if args.true_max == "fit":
        print(f"true max and following fit: the same Lightning fit, {fit_text}, in a fresh process per size")
    else:
        print(
            f"true max: {args.steps} plain PyTorch training steps + 1 validation step; following fit: {fit_text}"
        )
    if args.quick:
        print("quick mode: CPU, tiny models, simulated OOM thresholds, numbers are not meaningful")
    print(flush=True)

    runner = Runner(args, budget_bytes)
    report: dict[str, Any] = {
        "settings": {**vars(args), "budget_bytes": budget_bytes, "parallel_used": parallel},
        "versions": versions,
        "packages": packages,
        "device": device,
        "workloads": {},
    }
    for model in models:
        w = M.workload(model, args.quick)
        H.log(f"{model}: {M.describe(w)}")
        entry: dict[str, Any] = {"workload": M.describe(w), "finders": {}}
        report["workloads"][model] = entry
        if not args.quick and finders:  # the first process of a model loads its kernels: no finder's cost
            warm = runner.run(runner.argv(model, "--probe-worker", "--batch-size", "1"), "warm_up")
            entry["warm_up_seconds"] = round(warm.seconds, 2)
            H.log(
                f"warm-up: one plain step of {model} at batch size 1 in a process of its own, {warm.seconds:.1f} s"
            )
        # The tuners first, the guide (the first of GUIDES asked for) first of all: it guides the true-max search.
        guide = next((f for f in GUIDES if f in finders), None)
        tuners = [f for f in finders if f in TUNER_FINDERS and f != guide]
        order = [guide, *tuners] if guide else []
        if args.true_max == "none":  # nothing to guide: the tuners in the order asked for (order effects)
            order = [f for f in finders if f in TUNER_FINDERS]
        if (
            args.rotate and order
        ):  # the first process on a model pays for its first kernels: each tuner in turn
            shift = models.index(model) % len(order)
            order = order[shift:] + order[:shift]
        for name in order:
            result = entry["finders"][name] = run_finder(runner, model, name, args.headrooms[0])
            if result.get("status") == "ok" and len(result.get("module_trials", [])) != result.get(
                "num_trials"
            ):
                seen = len(result["module_trials"])
                H.log(
                    f"{model}: {name}: note: the module saw {seen} trials, the tuner reports {result['num_trials']}"
                )
        guiding = entry["finders"].get(guide, {}) if guide else {}
        guess = guiding.get("batch_size") if guiding.get("status") == "ok" else None
        guess = guesses.get(model, guess)
        hints = [
            (t["batch_size"], t["peak_bytes"])
            for t in guiding.get("tuner_trials") or []
            if t["fits"] and t["peak_bytes"]
        ]
        entry["true_max_guide"] = guide
        for headroom in args.headrooms[1:] if guide else []:
            entry["finders"][f"{guide}-headroom-{headroom}"] = run_finder(runner, model, guide, headroom)
        for finder in [f for f in ("binsearch", "power") if f in finders]:
            entry["finders"][finder] = run_finder(runner, model, finder)
        if args.true_max != "none":  # last: under a time limit, the finders run first
            entry["true_max"] = find_true_max(runner, model, w, parallel, guess, hints)
            H.log(f"{model}: {_true_max_line(entry['true_max'])}")
        print(_table(model, w, entry, budget_bytes, args.quick) + "\n", flush=True)
        out = Path(args.json or f"benchmarks/results/tuner{'-quick' if args.quick else ''}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
    H.log(f"done in {time.perf_counter() - H.T0:.1f} s")
    return 0


def _current_package_dir() -> Path | None:
    """The directory of the ``lightning_gpumem`` this process would import (found, not imported)."""
    try:
        spec = importlib.util.find_spec("lightning_gpumem")
    except (ImportError, ValueError):
        return None
    return Path(spec.origin).resolve().parent if spec is not None and spec.origin else None


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--models",
        default="gpt,resnet",
        help="workloads, comma-separated (gpt, gpt-longval, gpt124, gpt-ckpt, encoder, resnet, vit, hf-gpt2)",
    )
    parser.add_argument(
        "--expandable",
        action="store_true",
        help="every worker with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    )
    parser.add_argument("--budget-gib", type=float, default=24.0, help="memory budget per process in GiB")
    parser.add_argument("--parallel", type=int, default=5, help="true-max candidates run at once")
    parser.add_argument(
        "--guess",
        default="",
        help="model=size pairs, comma-separated: the true max's first candidate (e.g. a traced plan's size),"
        " in place of the guiding tuner's answer; with one candidate at a time, the search gallops out from it",
    )
    parser.add_argument(
        "--true-max",
        choices=("fit", "plain", "none"),
        default="fit",
        help="true-max candidates: the finders' following fit at a fixed size (fit), plain PyTorch steps (plain),"
        " or no true-max search (none)",
    )
    parser.add_argument(
        "--finders",
        default=",".join(DEFAULT_FINDERS),
        help=f"finders to run, comma-separated, of {', '.join(FINDERS)}",
    )
    parser.add_argument(
        "--previous",
        default="out/previous",
        help="a directory holding a previous copy of the package (DIR/lightning_gpumem/) for the previous-* finders",
    )
    parser.add_argument(
        "--headroom",
        default="0.05",
        help="BatchSizeTuner's headroom (every tuner finder runs at the first); further values, comma-separated, run"
        " the guiding tuner (the first of default, predict, ours, previous-predict, previous-search asked for) again",
    )
    parser.add_argument(
        "--rotate",
        action="store_true",
        help="rotate the tuners' order from one model to the next (the first process on a model pays 1-2 s more)",
    )
    parser.add_argument("--steps", type=int, default=3, help="training steps of a plain true-max candidate")
    parser.add_argument(
        "--fit-steps", type=int, default=50, help="training steps of the fit after each search"
    )
    parser.add_argument("--fit-val-batches", type=int, default=5, help="validation batches of that fit")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds before a subprocess is killed")
    parser.add_argument(
        "--time-limit", type=float, default=500.0, help="no subprocess starts after this (seconds)"
    )
    parser.add_argument(
        "--json",
        help="write every number to this file (default: benchmarks/results/tuner.json, tuner-quick.json)",
    )
    parser.add_argument("--log-dir", help="write each subprocess's output to a file here")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny models, simulated OOMs")
    # Internal: the worker subprocesses.
    parser.add_argument("--probe-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--finder-worker", choices=(*FINDERS, "fixed"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--budget-bytes", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.probe_worker:
        return probe_worker(args)
    if args.finder_worker:
        return finder_worker(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
