"""Variable-length data under a memory budget: ``TokenBudgetSampler`` with a tuned ``max_tokens`` against fixed sizes.

Run it from the repository root on one CUDA GPU. The whole matrix (2 data sets x 2 attentions x 4 configurations, each
in a fresh process) should take 20-25 minutes on an H100 (an estimate: see *Processes*); one attention per call keeps
each call under 10 minutes::

    PYTHONPATH=. python3 benchmarks/token_budget.py --attention sdpa --time-limit 560 --json token-budget-sdpa.json
    PYTHONPATH=. python3 benchmarks/token_budget.py --attention eager --samples 4000 --time-limit 560 \
        --json token-budget-eager.json
    PYTHONPATH=. python3 benchmarks/token_budget.py --datasets skewed --configs worst,tuned --budget-gib 12
    PYTHONPATH=. python3 benchmarks/token_budget.py --quick --json /tmp/tb.json     # CPU smoke run of the pipeline

**Data** (``benchmarks/_token_models.py``): ``--samples`` (default 8000) random token sequences, vocabulary 32768,
lengths in ``[16, --max-len]`` (default 2048): ``zipf``, ``min(max_len, 16 * zipf(a=1.3))`` (numpy, seed 0; at 8000
samples: median 96, mean 585, 20% at 2048, 4.7M tokens), and ``skewed``, 98% uniform in ``[16, 128]`` and 2% at
``max_len``. A sample is ``{"input_ids": LongTensor[L]}``; the collate pads to the batch's longest sample (id 0) and
builds the causal-LM inputs and targets (padding -100, ignored); the loss is a token mean (the real target tokens'
summed loss over their number). **Model**: a GPT-style decoder (``_tuner_models.GPT``: d_model 768, 12 layers, 12 heads,
tied head, a positional table of ``max_len`` rows; about 110M parameters), ``bf16-mixed``, AdamW. ``--attention sdpa``:
causal ``F.scaled_dot_product_attention`` (memory linear in L); ``eager``: ``softmax(Q K^T / sqrt(d))`` materialised
(quadratic in L). The sampler's ``quadratic`` coefficient (``--quadratic``): ``auto`` is 0 with sdpa and, with eager, an
estimate from the architecture, ``b / a`` where ``a = 38 * d_model * layers + 12 * vocab`` is the activations' bytes per
token and ``b = 6 * layers * heads`` the attention matrices' bytes per token^2 (an fp32 softmax and its bf16 copy per
head and layer): 0.00116 here (``_token_models.auto_quadratic`` derives it). A number sets it for both attentions.

**Configurations.** Each runs in a fresh subprocess whose allocator is capped at the budget ``B`` (``--budget-gib``,
default 24) with ``torch.cuda.set_per_process_memory_fraction(B / total)`` before anything is allocated, and trains
one epoch with ``Trainer(max_epochs=1, limit_val_batches=0)``:

1. ``finder``: ``DataLoader(shuffle=True, batch_size=model.batch_size)`` and Lightning's
   ``BatchSizeFinder(mode="binsearch", steps_per_trial=3)``: it tunes on whatever batches come.
2. ``worst``: the same loader and ``BatchSizeTuner(budget=B, length_fn="input_ids")``: a fixed batch size whose
   trials draw the longest samples first.
3. ``hand``: ``TokenBudgetSampler`` with ``max_tokens`` set by hand, as a careful user would: the first batch of a
   shuffled ``TokenBudgetSampler`` whose ``max_tokens`` is twice the longest sample's cost (about 4096 tokens) trains
   one warm-up step (so that AdamW's states exist), then one measured step on a throwaway copy of the model:
   ``bytes_per_token = (peak allocated - allocated before the step) / cost(batch)`` and ``max_tokens = 0.9 * (B -
   allocated before the step) / bytes_per_token`` (``cost``: the sampler's, with its ``quadratic``). Tuning time: those
   two steps (the copy's construction left out) plus the fit's start.
4. ``tuned``: ``TokenBudgetSampler`` and ``BatchSizeTuner(budget=B, batch_arg_name="max_tokens")``, whose trials run
   the sampler's heaviest batches.

**Measured, per configuration.** The value chosen (batch size or ``max_tokens``); *tuning s*: from the start of the
tuner's (finder's) ``on_fit_start`` to the module's ``on_train_start`` of the fit (the search and the loaders' setup;
CUDA synchronised; the finder's own hook alone is in the JSON as ``search_seconds``); trials (``tuner.result.trials``;
the finder's counted by the module: a trial starts at its batch 0); whether the epoch ran out of memory (the OOM is
caught and the configuration stops: 1 OOM, at the step it happened); tokens/s: the real (non-pad) tokens of the
epoch's completed steps over the epoch's wall time (synchronised at its first batch's start and at its end, or at the
OOM), tuning excluded; per-step peak memory over ``B`` (``torch.cuda.reset_peak_memory_stats()`` in each
``on_train_batch_start``, ``max_memory_reserved()`` and ``max_memory_allocated()`` in ``on_train_batch_end``): p50,
p99 and max; the padding fraction (padded positions ``n * max(L)`` not holding a token, over the epoch's batches);
steps. The caching allocator keeps what it reserved, so a step's reserved peak is at least the reserve left by the
steps before it: the *allocated* peaks show each step's own use.

**Output.** Per (data set, attention), a Markdown table on stdout (configuration | value | tuning s | trials | OOMs
(step) | tokens/s | vs worst | reserved / budget p50 p99 max | allocated / budget p50 p99 max | padding | steps) and
the issue's targets as checks: 0 OOMs for ``tuned`` and ``worst``; tokens/s of ``tuned`` >= 1.3x ``worst``;
``tuned``'s reserved p99 <= 0.97 and p50 >= 0.80; the tuning time of ``tuned`` next to ``worst``'s. Progress lines on
stderr; ``--json PATH`` writes every number (rewritten after each configuration, so a cut-off run keeps what it had):
settings, versions, device, the data sets' statistics, each configuration's result with its per-step peaks.

**Processes.** ``--parallel N`` (default 1) configurations run at once, each capped at ``B`` (fewer where ``N * (B + 1
GiB)`` would not fit the card); they then share the GPU's compute, so their tokens/s are not comparable: keep 1 for
timings. On a GPU, a warm-up process first trains one step (the first process loads the CUDA libraries from disk).
Within each (data set, attention) they run in the order worst, tuned, hand, finder, so that a time limit cuts the
configurations the checks do not need (the tables keep their own order). Each subprocess runs under ``--timeout``
(default 300 s) in its own process group, killed on timeout; none starts once ``--time-limit`` (default 1500 s) is
nearly spent. Expected durations (estimates from about 200k tokens/s for a 110M-parameter model in bf16 on an H100, not
yet measured): a ``tuned`` (sdpa, zipf) epoch of the 4.7M tokens 20-30 s; ``worst`` and ``finder`` pad the same tokens
to about 16M positions (71% padding), 2.5-3.5x longer; eager attention is slower per token at long lengths; tuning and a
process's start add 20-40 s per configuration.

``--quick`` runs on the CPU, 32-bit, with a tiny model (d_model 64, 2 layers, 4 heads, vocabulary 256, ``max_len`` 256),
600 samples, up to 4 processes at once (no more than the cores; each gets its share of them through ``OMP_NUM_THREADS``)
and no memory cap. A CPU never runs out of memory, so a step whose batch holds more than 4096 padded tokens (``n *
L_max``; with eager, ``n * L_max * (1 + q * L_max)``, ``q`` the tiny model's auto coefficient, 0.006) raises
``torch.cuda.OutOfMemoryError("CUDA out of memory ... (simulated ...)")``, in the trials and in the epoch alike;
``hand`` measures the simulated memory. Memory columns are "-"; numbers are not meaningful.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import math
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(
    0, str(Path(__file__).resolve().parent)
)  # `_harness`, `_token_models`, `tuner` next to this file
import _harness as H
import _token_models as TM
import _tuner_models as M
import tuner as T

GIB = H.GIB
MIB = H.MIB
CONFIGS = ("finder", "worst", "hand", "tuned")  # table order
CONFIG_LABELS = {
    "finder": "`finder`: Lightning `BatchSizeFinder(mode='binsearch')`",
    "worst": "`worst`: `BatchSizeTuner(length_fn='input_ids')`",
    "hand": "`hand`: `TokenBudgetSampler`, max_tokens by hand",
    "tuned": "`tuned`: `TokenBudgetSampler` + `BatchSizeTuner(batch_arg_name='max_tokens')`",
}
RUN_ORDER = ("worst", "tuned", "hand", "finder")
TOKEN_CONFIGS = ("hand", "tuned")  # those with a TokenBudgetSampler (the others: a fixed batch size)
HAND_MARGIN = 0.9  # hand: max_tokens = HAND_MARGIN * (budget - before) / bytes_per_token
HAND_PROBE_LONGEST = 2  # hand: the probe batch's budget, in costs of the longest sample
TARGET_SPEEDUP = 1.3  # tokens/s of tuned over worst
TARGET_P99 = 0.97  # tuned: reserved per-step peak over the budget, p99 at most
TARGET_P50 = 0.80  # tuned: ... p50 at least
CONTEXT_BYTES = (
    GIB  # per-process CUDA context and slack, when deciding how many processes fit the card at once
)
MIN_START_SECONDS = 20.0  # do not start a subprocess with less time left than this


# ---------------------------------------------------------------------------------------------------- workers
def _quadratic(value: str, s: TM.Setup, attention: str) -> float:
    """``--quadratic``: ``auto`` (0 with sdpa, the architecture's estimate with eager) or a number."""
    if value == "auto":
        return TM.auto_quadratic(s) if attention == "eager" else 0.0
    return float(value)


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    array = np.asarray(values, dtype=float)
    return {
        "p50": float(np.percentile(array, 50)),
        "p99": float(np.percentile(array, 99)),
        "max": float(array.max()),
    }


def measure_by_hand(
    s: TM.Setup, attention: str, data: TM.Tokens, quadratic: float, device: torch.device, budget_bytes: int
) -> dict[str, Any]:
    """``hand``: ``max_tokens`` from one measured step on the first batch of a small shuffled token budget.

    On the CPU (``--quick``) the memory is the simulated one: the batch's simulated cost in token units, against
    ``s.simulated_limit``.
    """
    from lightning_gpumem import TokenBudgetSampler

    longest_cost = math.ceil(TM.batch_cost(1, max(data.lengths), quadratic))
    probe = TokenBudgetSampler(
        data.lengths, max_tokens=HAND_PROBE_LONGEST * longest_cost, quadratic=quadratic, shuffle=True, seed=0
    )
    min_tokens = probe.min_tokens
    indices = next(iter(probe))
    batch = TM.collate([data[i] for i in indices])
    batch.pop("lengths")
    n, longest = TM.padded_shape(batch)
    cost = TM.batch_cost(n, longest, quadratic)
    out: dict[str, Any] = {"probe_samples": n, "probe_longest": longest, "probe_cost": cost}
    if device.type == "cuda":
        before, used, seconds = _two_steps(s, attention, batch, device)
        limit = budget_bytes
        gc.collect()
        torch.cuda.empty_cache()  # the throwaway model is gone: the fit starts from an empty cache
    else:  # --quick: the steps run, the memory is the simulated one, in token units
        _, _, seconds = _two_steps(s, attention, batch, device)
        before = 0
        used = TM.batch_cost(n, longest, TM.auto_quadratic(s) if attention == "eager" else 0.0)
        limit = s.simulated_limit or 0
    per_token = used / cost
    max_tokens = math.floor(HAND_MARGIN * (limit - before) / per_token)
    out.update(
        seconds=seconds,
        before_bytes=before,
        step_bytes=used,
        bytes_per_token=per_token,
        formula_max_tokens=max_tokens,
        max_tokens=max(
            max_tokens, min_tokens
        ),  # below the longest sample's cost, no budget holds every sample
    )
    return out


def _two_steps(
    s: TM.Setup, attention: str, batch: dict[str, torch.Tensor], device: torch.device
) -> tuple[int, int, float]:
    """A warm-up step and a measured one of a throwaway model on ``batch``: memory before, the step's, seconds."""
    torch.manual_seed(0)
    net = TM.build_model(s, attention).to(device)
    optimizer = M.make_optimizer(net)

    def step() -> None:
        TM.check_simulated_oom(s, attention, batch)
        on_device = {k: v.to(device) for k, v in batch.items()}
        with T._autocast(device):
            loss = TM.compute_loss(net, on_device)
        optimizer.zero_grad(set_to_none=True)  # after the forward, as in Lightning's closure
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    start = time.perf_counter()
    step()  # warm-up: AdamW allocates its states at its first step
    H.synchronize(device)
    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated(device) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    step()
    H.synchronize(device)
    used = torch.cuda.max_memory_allocated(device) - before if cuda else 0
    return before, used, time.perf_counter() - start


class _TimedSearch:
    """Mixed in before a tuner class: times its ``on_fit_start`` (the search) and tells the module when it ends."""

    search_seconds: float | None = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        pl_module.begin_search()
        start = time.perf_counter()
        super().on_fit_start(trainer, pl_module)  # type: ignore[misc]
        H.synchronize(pl_module.device)
        self.search_seconds = time.perf_counter() - start
        pl_module.start_fit()


def _lightning_classes() -> tuple[type, type, type, type]:
    """The LightningModule, the two timed tuners and the no-search start of ``hand``; built on demand."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BatchSizeFinder, Callback
    from torch.utils.data import DataLoader

    from lightning_gpumem import BatchSizeTuner, TokenBudgetSampler

    class TokenModule(pl.LightningModule):
        """The decoder on one data set; counts the epoch's tokens, padding, per-step peaks and the finder's trials."""

        def __init__(
            self, s: TM.Setup, attention: str, config: str, data: TM.Tokens, quadratic: float
        ) -> None:
            super().__init__()
            self.s, self.attention, self.config, self.data, self.quadratic = (
                s,
                attention,
                config,
                data,
                quadratic,
            )
            self.batch_size = 2  # finder, worst: tuned
            # hand, tuned: the sampler needs a budget that holds the longest sample; the tuner starts from that cost
            self.max_tokens = 2 * math.ceil(TM.batch_cost(1, max(data.lengths), quadratic))
            self.net = TM.build_model(s, attention)
            self.sampler: Any = None
            self.phase = "setup"  # "search" during the tuner's on_fit_start, then "fit"
            self.trials: list[dict[str, Any]] = []  # the finder's, counted here (it replaces the callbacks)
            self.budget_fraction = 1.0  # set by the worker on CUDA
            self.fraction_after_search: float | None = None
            self.search_started_at: float | None = None
            self.train_started_at: float | None = None
            self.epoch_started_at: float | None = None
            self.epoch_ended_at: float | None = None
            self.steps = 0
            self.tokens = 0  # real tokens of the completed steps
            self.positions = 0  # padded positions n * max(L) of the completed steps
            self.max_cost = 0.0  # the costliest batch of the epoch's completed steps (the sampler's cost)
            self._pending: tuple[int, int, float] | None = None
            self.peak_reserved: list[int] = []
            self.peak_allocated: list[int] = []

        # -------------------------------------------------------------- phases
        def begin_search(self) -> None:
            self.phase = "search"
            self.search_started_at = time.perf_counter()

        def start_fit(self) -> None:
            self.phase = "fit"
            if self.device.type == "cuda":
                getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
                self.fraction_after_search = None if getter is None else float(getter(self.device))
                # The fit runs under the budget whatever the tuner left: the benchmark's premise is a budget-size card.
                torch.cuda.set_per_process_memory_fraction(self.budget_fraction, self.device)

        def on_train_start(self) -> None:
            if self.phase == "fit":
                H.synchronize(self.device)
                self.train_started_at = time.perf_counter()

        # -------------------------------------------------------------- data
        def train_dataloader(self) -> DataLoader:
            if self.config in TOKEN_CONFIGS:
                self.sampler = TokenBudgetSampler(
                    self.data.lengths,
                    max_tokens=self.max_tokens,
                    quadratic=self.quadratic,
                    shuffle=True,
                    seed=0,
                )
                return DataLoader(self.data, batch_sampler=self.sampler, collate_fn=TM.collate)
            return DataLoader(self.data, batch_size=self.batch_size, shuffle=True, collate_fn=TM.collate)

        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            lengths = batch.pop("lengths")  # on the CPU: counted here, without a GPU sync
            if self.phase == "fit":
                n, longest = int(lengths.numel()), int(lengths.max())
                self._pending = (int(lengths.sum()), n * longest, TM.batch_cost(n, longest, self.quadratic))
            return batch

        # -------------------------------------------------------------- steps
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if (
                self.phase == "search" and batch_idx == 0
            ):  # every trial of the finder runs the loop from batch 0
                self.trials.append({"batch_size": self.batch_size, "train_steps": 0, "oom": False})
            if self.phase != "fit":
                return
            if self.epoch_started_at is None:
                H.synchronize(self.device)
                self.epoch_started_at = time.perf_counter()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            TM.check_simulated_oom(self.s, self.attention, batch)
            return TM.compute_loss(self.net, batch)

        def optimizer_step(
            self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None
        ) -> None:
            try:  # the closure inside runs training_step, zero_grad and backward
                super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
            except Exception as error:
                if self.phase == "search" and self.trials and M.is_oom(error):
                    self.trials[-1]["oom"] = True
                raise
            if self.phase == "search" and self.trials:
                self.trials[-1]["train_steps"] += 1

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.phase != "fit":
                return
            self.steps += 1
            if self._pending is not None:
                tokens, positions, cost = self._pending
                self.tokens += tokens
                self.positions += positions
                self.max_cost = max(self.max_cost, cost)
                self._pending = None
            if self.device.type == "cuda":
                self.peak_reserved.append(torch.cuda.max_memory_reserved(self.device))
                self.peak_allocated.append(torch.cuda.max_memory_allocated(self.device))

        def on_train_epoch_end(self) -> None:
            if self.phase == "fit" and self.epoch_ended_at is None:
                H.synchronize(self.device)
                self.epoch_ended_at = time.perf_counter()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return M.make_optimizer(self.net)

    class TimedBatchSizeFinder(_TimedSearch, BatchSizeFinder):
        """Lightning's finder, timed."""

    class TimedBatchSizeTuner(_TimedSearch, BatchSizeTuner):
        """lightning_gpumem's tuner, timed."""

    class HandStart(Callback):
        """``hand``: no search (``max_tokens`` was set before the fit); marks the fit's start like the tuners."""

        search_seconds: float | None = None

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            pl_module.begin_search()
            self.search_seconds = 0.0
            pl_module.start_fit()

    for cls in (TokenModule, TimedBatchSizeFinder, TimedBatchSizeTuner, HandStart):
        cls.__qualname__ = cls.__name__  # Lightning names a callback by its qualified name (state key)
    return TokenModule, TimedBatchSizeFinder, TimedBatchSizeTuner, HandStart


def config_worker(args: argparse.Namespace) -> int:
    """One configuration in a fresh process: tune at fit start, then one epoch; prints its result as JSON."""
    result: dict[str, Any] = {
        "config": args.worker,
        "dataset": args.dataset,
        "attention": args.attention,
        "status": "error",
        "error": None,
    }
    try:
        device = T._setup_device(args.quick, args.budget_bytes)
        warnings.filterwarnings(
            "ignore", message=r".*(num_workers|does not have many workers|LightningModule\.log).*"
        )
        warnings.filterwarnings("ignore", message=r".*`isinstance\(treespec, LeafSpec\)` is deprecated.*")
        import lightning.pytorch as pl

        module_cls, finder_cls, tuner_cls, hand_cls = _lightning_classes()
        s = TM.setup(args.quick, args.samples, args.max_len, args.zipf_a)
        data = TM.Tokens(TM.make_lengths(args.dataset, s), s.vocab, s.seed)
        quadratic = _quadratic(args.quadratic, s, args.attention)
        result["quadratic"] = quadratic
        hand = None
        if args.worker == "hand":
            hand = measure_by_hand(s, args.attention, data, quadratic, device, args.budget_bytes)
            result["hand"] = hand
        pl.seed_everything(0, verbose=False)
        model = module_cls(s, args.attention, args.worker, data, quadratic)
        if device.type == "cuda":
            model.budget_fraction = min(
                1.0, args.budget_bytes / torch.cuda.get_device_properties(device).total_memory
            )
        result["parameters"] = M.count_parameters(model.net)
        cpu = (
            {} if device.type == "cuda" else {"max_val": T.CPU_MAX_VAL}
        )  # on a CPU the tuner searches when asked
        if args.worker == "finder":
            callback = finder_cls(mode="binsearch", steps_per_trial=3)
        elif args.worker == "worst":
            callback = tuner_cls(
                budget=args.budget_bytes, length_fn="input_ids", shape_margin=args.shape_margin, **cpu
            )
        elif args.worker == "tuned":
            callback = tuner_cls(
                budget=args.budget_bytes, batch_arg_name="max_tokens", shape_margin=args.shape_margin, **cpu
            )
        else:
            assert hand is not None
            model.max_tokens = hand["max_tokens"]
            callback = hand_cls()
        fit_error: BaseException | None = None
        with (
            tempfile.TemporaryDirectory(prefix="token_budget_bench_") as root,
            warnings.catch_warnings(record=True) as seen,
        ):
            warnings.simplefilter("default")
            trainer = pl.Trainer(
                accelerator="gpu" if device.type == "cuda" else "cpu",
                devices=1,
                precision="bf16-mixed" if device.type == "cuda" else "32-true",
                max_epochs=1,
                limit_val_batches=0,
                num_sanity_val_steps=0,
                callbacks=[callback],
                default_root_dir=root,
                **H.QUIET_TRAINER,
            )
            try:
                trainer.fit(model)
            except Exception as error:
                fit_error = error
                if model.phase == "fit" and model.epoch_started_at is not None:
                    H.synchronize(device)
                    model.epoch_ended_at = time.perf_counter()
        result["warnings"] = _warning_lines(seen)
        _collect(result, args, callback, model, device, fit_error, hand)
    except Exception as error:
        result["error"] = H.describe_error(error)
    H.emit(result)
    return 0


def _warning_lines(seen: list[warnings.WarningMessage]) -> list[str]:
    """The distinct warnings of the fit (Lightning's usual noise left out), each cut at 300 characters."""
    noise = ("num_workers", "does not have many workers", "LightningModule.log", "LeafSpec", "weights_only")
    lines = [str(w.message)[:300] for w in seen if not any(text in str(w.message) for text in noise)]
    return list(dict.fromkeys(lines))


def _collect(
    result: dict[str, Any],
    args: argparse.Namespace,
    callback: Any,
    model: Any,
    device: torch.device,
    error: BaseException | None,
    hand: dict[str, Any] | None,
) -> None:
    """The worker's result from the callback's and the module's records."""
    searched = callback.search_seconds is not None
    tokens = args.worker in TOKEN_CONFIGS
    result["value_name"] = "max_tokens" if tokens else "batch_size"
    result["value"] = (model.max_tokens if tokens else model.batch_size) if searched else None
    result["callback_value"] = getattr(callback, "optimal_batch_size", None)
    hand_seconds = hand["seconds"] if hand else 0.0
    result["search_seconds"] = None if not searched else callback.search_seconds + hand_seconds
    result["tuning_seconds"] = (
        model.train_started_at - model.search_started_at + hand_seconds
        if model.train_started_at is not None and model.search_started_at is not None
        else None
    )
    if args.worker == "finder":
        result["trials"] = model.trials
        result["num_trials"] = len(model.trials)
        result["num_trial_ooms"] = sum(t["oom"] for t in model.trials)
    elif args.worker == "hand":
        result["num_trials"] = 1  # the measured step (after a warm-up step)
        result["num_trial_ooms"] = 0
    else:
        tuner = callback.result
        result["num_trials"] = len(tuner.trials) if tuner is not None else len(callback.trials)
        result["num_trial_ooms"] = tuner.num_ooms if tuner is not None else None
        result["tuner_reason"] = None if tuner is None else tuner.reason
        result["tuner_note"] = None if tuner is None else tuner.note
        result["shape_margin"] = getattr(
            callback, "_margin", None
        )  # the budget's fraction the trials left free
        result["trials"] = [
            {
                "value": t.batch_size,
                "fits": t.fits,
                "peak_bytes": t.peak_bytes,
                "seconds": round(t.seconds, 3),
            }
            for t in callback.trials
        ]
        result["trial_seconds"] = sum(t.seconds for t in callback.trials)
    if model.sampler is not None and searched:
        result["sampler_batches"] = len(model.sampler)
        result["sampler_padding_fraction"] = model.sampler.padding_fraction()
        result["sampler_worst_cost"] = model.sampler.worst_cost()
        result["expected_steps"] = len(model.sampler)
    elif searched and model.batch_size:
        result["expected_steps"] = math.ceil(len(model.data) / model.batch_size)
    seconds = (
        model.epoch_ended_at - model.epoch_started_at
        if model.epoch_started_at is not None and model.epoch_ended_at is not None
        else None
    )
    epoch: dict[str, Any] = {
        "steps": model.steps,
        "tokens": model.tokens,
        "positions": model.positions,
        "padding_fraction": 1 - model.tokens / model.positions if model.positions else None,
        "max_batch_cost": model.max_cost,
        "seconds": seconds,
        "tokens_per_second": model.tokens / seconds if seconds and model.steps else None,
        "oom": False,
        "oom_step": None,
        "error": None,
    }
    if device.type == "cuda":
        budget = args.budget_bytes
        epoch["peak_reserved"] = _percentiles([b / budget for b in model.peak_reserved])
        epoch["peak_allocated"] = _percentiles([b / budget for b in model.peak_allocated])
        epoch["peak_reserved_mib"] = [round(b / MIB) for b in model.peak_reserved]
        epoch["peak_allocated_mib"] = [round(b / MIB) for b in model.peak_allocated]
        epoch["cap_fraction"] = model.budget_fraction
        epoch["cap_fraction_left_by_tuner"] = model.fraction_after_search
        epoch["allocator_num_ooms"] = int(torch.cuda.memory_stats(device).get("num_ooms", 0))
    if error is None:
        result["status"] = "ok"
    elif model.phase != "fit":
        result["status"] = "search_oom" if M.is_oom(error) else "search_error"
        result["error"] = H.describe_error(error)
    else:
        result["status"] = "ok"
        epoch["oom"] = M.is_oom(error)
        epoch["oom_step"] = model.steps + 1
        epoch["error"] = H.describe_error(error)
    result["epoch"] = epoch if model.phase == "fit" else None


def warmup_worker(args: argparse.Namespace) -> int:
    """One plain training step of the sdpa model on a small batch: loads the CUDA libraries before any timing."""
    result: dict[str, Any] = {"status": "error", "error": None}
    try:
        device = T._setup_device(args.quick, args.budget_bytes)
        s = TM.setup(args.quick, 64, args.max_len)
        data = TM.Tokens(TM.make_lengths("zipf", s), s.vocab)
        net = TM.build_model(s, "sdpa").to(device)
        optimizer = M.make_optimizer(net)
        batch = {
            k: v.to(device) for k, v in TM.collate([data[i] for i in range(4)]).items() if k != "lengths"
        }
        with T._autocast(device):
            loss = TM.compute_loss(net, batch)
        loss.backward()
        optimizer.step()
        H.synchronize(device)
        result["status"] = "ok"
    except Exception as error:
        result["error"] = H.describe_error(error)
    H.emit(result)
    return 0


# ---------------------------------------------------------------------------------------------------- orchestration
class Runner:
    """Starts the worker subprocesses with the right environment, timeouts and time limit."""

    def __init__(self, args: argparse.Namespace, s: TM.Setup, budget_bytes: int, parallel: int) -> None:
        self.args = args
        self.s = s
        self.budget_bytes = budget_bytes
        self.deadline = H.T0 + args.time_limit
        self.env = H.worker_env()
        if (
            args.quick
        ):  # CPU workers side by side: share the cores, no oversubscription (OpenMP threads spin)
            self.env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // parallel))
        if args.expandable:  # before CUDA starts in each worker
            self.env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        self.log_dir = Path(args.log_dir) if args.log_dir else None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()

    def argv(self, worker: str, dataset: str = "zipf", attention: str = "sdpa") -> list[str]:
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", worker, "--dataset", dataset]
        argv += [
            "--attention",
            attention,
            "--budget-bytes",
            str(self.budget_bytes),
            "--samples",
            str(self.s.samples),
        ]
        argv += [
            "--max-len",
            str(self.s.max_len),
            "--zipf-a",
            str(self.s.zipf_a),
            "--quadratic",
            self.args.quadratic,
        ]
        if self.args.shape_margin is not None:
            argv += ["--shape-margin", str(self.args.shape_margin)]
        return [*argv, "--quick"] if self.args.quick else argv

    def run(self, argv: list[str], name: str) -> H.Worker:
        """Run one worker to its end (killed at ``--timeout`` or the time limit); with ``--log-dir``, log its output."""
        timeout = min(self.args.timeout, max(1.0, self.remaining()))
        done = H.run_worker(argv, timeout, name, self.env)
        if self.log_dir is not None:
            text = f"$ {' '.join(argv)}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
            (self.log_dir / f"{name}.log").write_text(text, "utf-8")
        return done


def run_config(runner: Runner, dataset: str, attention: str, config: str) -> dict[str, Any]:
    """One configuration's subprocess; returns its result, or a record of why there is none."""
    if runner.remaining() < MIN_START_SECONDS:
        return {"config": config, "status": "skipped", "error": "time limit"}
    name = f"{dataset}_{attention}_{config}"
    H.log(f"{dataset}/{attention}: {config}: started")
    proc = runner.run(runner.argv(config, dataset, attention), name)
    result = proc.result()
    if result is None:
        result = {
            "config": config,
            "status": "timeout" if proc.timed_out else "crashed",
            "error": proc.failure(),
        }
    result["wall_seconds"] = round(proc.seconds, 2)
    H.log(f"{dataset}/{attention}: {config}: {_summary(result)} [process {proc.seconds:.1f} s]")
    return result


def _summary(r: dict[str, Any]) -> str:
    if r.get("status") != "ok":
        return f"{r.get('status')}: {r.get('error')}"
    epoch = r.get("epoch") or {}
    rate = epoch.get("tokens_per_second")
    return (
        f"{r['value_name']}={r['value']}, {r['num_trials']} trials, tuning {_num(r.get('tuning_seconds'), 1)} s,"
        f" {_oom_cell(r)} OOM, {epoch.get('steps')} steps, {_num(rate, 0)} tokens/s"
    )


# ---------------------------------------------------------------------------------------------------- report
def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _oom_cell(r: dict[str, Any]) -> str:
    epoch = r.get("epoch") or {}
    if epoch.get("oom"):
        expected = r.get("expected_steps")
        return f"**1** (step {epoch['oom_step']}{f'/{expected}' if expected else ''})"
    if epoch.get("error"):
        return f"error at step {epoch['oom_step']}"
    return "0"


def _peaks_cell(epoch: dict[str, Any], key: str) -> str:
    peaks = epoch.get(key)
    if not peaks or peaks.get("p50") is None:
        return "-"
    return " / ".join(f"{peaks[p]:.2f}" for p in ("p50", "p99", "max"))


def _table(group: dict[str, Any], configs: list[str]) -> str:
    rows = group["configs"]
    worst_rate = ((rows.get("worst") or {}).get("epoch") or {}).get("tokens_per_second")
    lines = [
        f"### {group['dataset']} / {group['attention']}: {group['description']}",
        "",
        "| configuration | value | tuning s | trials | OOMs (step) | tokens/s | vs worst"
        " | reserved / budget p50 / p99 / max | allocated / budget p50 / p99 / max | padding | steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for config in configs:
        r = rows.get(config) or {}
        if r.get("status") != "ok":
            cells = [str(r.get("status"))] + ["-"] * 9
        else:
            epoch = r.get("epoch") or {}
            rate = epoch.get("tokens_per_second")
            rate_text = _num(rate, 0) + (" (until the OOM)" if epoch.get("oom") and rate else "")
            padding = epoch.get("padding_fraction")
            cells = [
                f"{r['value_name']}={r['value']}",
                _num(r.get("tuning_seconds"), 1),
                str(r.get("num_trials")),
                _oom_cell(r),
                rate_text,
                f"{rate / worst_rate:.2f}x" if rate and worst_rate else "-",
                _peaks_cell(epoch, "peak_reserved"),
                _peaks_cell(epoch, "peak_allocated"),
                "-" if padding is None else f"{100 * padding:.1f}%",
                f"{epoch.get('steps')}" + (f"/{r['expected_steps']}" if r.get("expected_steps") else ""),
            ]
        lines.append(f"| {CONFIG_LABELS[config]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def checks(rows: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets for one (data set, attention): each a dict with ``name``, ``passed`` (or None), ``text``."""
    tuned, worst = rows.get("tuned") or {}, rows.get("worst") or {}
    t_epoch, w_epoch = tuned.get("epoch") or {}, worst.get("epoch") or {}
    ran = tuned.get("status") == "ok" and worst.get("status") == "ok"
    out: list[dict[str, Any]] = []

    def ooms(r: dict[str, Any]) -> str:
        return (
            str(r.get("status"))
            if r.get("status") != "ok"
            else ("1" if (r.get("epoch") or {}).get("oom") else "0")
        )

    clean = ran and not t_epoch.get("error") and not w_epoch.get("error")
    out.append(
        {
            "name": "no_oom",
            "passed": clean if ran else None,
            "text": f"0 OOMs for tuned and worst: tuned {ooms(tuned)}, worst {ooms(worst)}",
        }
    )
    t_rate, w_rate = t_epoch.get("tokens_per_second"), w_epoch.get("tokens_per_second")
    ratio = t_rate / w_rate if t_rate and w_rate else None
    out.append(
        {
            "name": "speedup",
            "passed": None if ratio is None or not clean else ratio >= TARGET_SPEEDUP,
            "value": ratio,
            "text": f"tokens/s of tuned >= {TARGET_SPEEDUP}x worst: {_num(ratio, 2)}x"
            + ("" if clean or ratio is None else " (an epoch did not complete)"),
        }
    )
    peaks = t_epoch.get("peak_reserved") or {}
    p99, p50 = peaks.get("p99"), peaks.get("p50")
    out.append(
        {
            "name": "p99",
            "passed": None if p99 is None else p99 <= TARGET_P99,
            "value": p99,
            "text": f"tuned's per-step reserved peak / budget, p99 <= {TARGET_P99}: {_num(p99, 3)}",
        }
    )
    out.append(
        {
            "name": "p50",
            "passed": None if p50 is None else p50 >= TARGET_P50,
            "value": p50,
            "text": f"tuned's per-step reserved peak / budget, p50 >= {TARGET_P50}: {_num(p50, 3)}",
        }
    )
    t_s, w_s = tuned.get("tuning_seconds"), worst.get("tuning_seconds")
    out.append(
        {
            "name": "tuning_seconds",
            "passed": None,
            "value": {"tuned": t_s, "worst": w_s},
            "text": f"tuning time: tuned {_num(t_s, 1)} s, worst {_num(w_s, 1)} s"
            + (f" ({t_s / w_s:.2f}x)" if t_s and w_s else ""),
        }
    )
    return out


def _checks_text(found: list[dict[str, Any]]) -> str:
    marks = {True: "PASS", False: "FAIL", None: "n/a"}
    lines = ["checks:"]
    for check in found:
        mark = "info" if check["name"] == "tuning_seconds" else marks[check["passed"]]
        lines.append(f"- [{mark}] {check['text']}")
    return "\n".join(lines)


def _describe_data(name: str, stats: dict[str, Any], max_len: int) -> str:
    return (
        f"{stats['samples']} samples, lengths 16-{max_len} (median {stats['median']:.0f}, mean {stats['mean']:.0f},"
        f" {100 * stats['fraction_at_max_len']:.1f}% at {max_len}), {stats['tokens'] / 1e6:.2f}M tokens"
    )


def _names(value: str, known: tuple[str, ...], flag: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names or set(names) - set(known):
        sys.exit(f"{flag} {value!r}: expected some of {list(known)}, comma-separated")
    return names


def orchestrate(args: argparse.Namespace) -> int:
    datasets = _names(args.datasets, TM.DATASETS, "--datasets")
    attentions = _names(args.attention, TM.ATTENTIONS, "--attention")
    configs = _names(args.configs, CONFIGS, "--configs")
    if args.quadratic != "auto":
        try:
            if float(args.quadratic) < 0 or not math.isfinite(float(args.quadratic)):
                raise ValueError
        except ValueError:
            sys.exit(f"--quadratic {args.quadratic!r}: expected 'auto' or a finite number >= 0")
    s = TM.setup(args.quick, args.samples, args.max_len, args.zipf_a)
    budget_bytes = int(args.budget_gib * GIB)
    requested = args.parallel if args.parallel is not None else (4 if args.quick else 1)
    if args.quick:
        device = {"name": "cpu", "total_bytes": None}
        parallel = max(1, min(requested, os.cpu_count() or 1))
    elif torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        device = {"name": props.name, "total_bytes": int(props.total_memory)}
        if budget_bytes > props.total_memory:
            sys.exit(
                f"--budget-gib {args.budget_gib} is more than the device's {props.total_memory / GIB:.1f} GiB"
            )
        parallel = max(1, min(requested, int(props.total_memory // (budget_bytes + CONTEXT_BYTES))))
    else:
        sys.exit("No CUDA device: the full benchmark needs one. Use --quick for a CPU smoke run.")

    versions = H.versions(("lightning", "lightning-gpumem", "numpy"))
    quadratics = {a: _quadratic(args.quadratic, s, a) for a in attentions}
    probe_model = TM.build_model(s, "sdpa")
    parameters = M.count_parameters(probe_model)
    del probe_model
    print("# Variable-length data under a memory budget: token budgets against fixed batch sizes\n")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    total = f"{device['total_bytes'] / GIB:.1f} GiB" if device["total_bytes"] else "no memory cap"
    print(
        f"device: {device['name']} ({total}); budget {args.budget_gib} GiB per process; {parallel} at once"
    )
    print(f"model: {TM.describe(s)}, {parameters / 1e6:.1f}M parameters; one epoch per configuration")
    print("sampler quadratic: " + ", ".join(f"{a} {q:.3g}" for a, q in quadratics.items()))
    if args.quick:
        print(
            f"quick mode: CPU, tiny model, simulated OOM above {s.simulated_limit} padded tokens per batch;"
            " numbers are not meaningful"
        )
    if parallel > 1 and not args.quick:
        print(
            f"note: {parallel} processes share the GPU's compute: tokens/s are not comparable between them"
        )
    print(flush=True)

    stats = {name: TM.length_stats(TM.make_lengths(name, s), s.max_len) for name in datasets}
    report: dict[str, Any] = {
        "settings": {
            **vars(args),
            "samples": s.samples,
            "max_len": s.max_len,
            "budget_bytes": budget_bytes,
            "parallel_used": parallel,
            "model": TM.describe(s),
            "parameters": parameters,
            "quadratic_used": quadratics,
            "hand_margin": HAND_MARGIN,
            "hand_probe_longest": HAND_PROBE_LONGEST,
            "targets": {"speedup": TARGET_SPEEDUP, "p99_max": TARGET_P99, "p50_min": TARGET_P50},
        },
        "versions": versions,
        "device": device,
        "datasets": stats,
        "results": {},
    }
    out = Path(args.json or f"benchmarks/results/token-budget{'-quick' if args.quick else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    runner = Runner(args, s, budget_bytes, parallel)
    if (
        not args.quick
    ):  # the first process on a machine loads the CUDA libraries from disk: no configuration's cost
        warm = runner.run(runner.argv("warmup"), "warm_up")
        report["warm_up_seconds"] = round(warm.seconds, 2)
        H.log(
            f"warm-up: one plain step in a process of its own, {warm.seconds:.1f} s ({_summary_warm(warm)})"
        )
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for attention in attentions:
        for dataset in datasets:
            description = (
                _describe_data(dataset, stats[dataset], s.max_len)
                + f"; quadratic {quadratics[attention]:.3g}"
            )
            description += (
                f"; simulated OOM above {s.simulated_limit} token units"
                if args.quick
                else f"; budget {args.budget_gib} GiB"
            )
            group = {"dataset": dataset, "attention": attention, "quadratic": quadratics[attention]}
            groups[(dataset, attention)] = {**group, "description": description, "configs": {}, "checks": []}
            report["results"][f"{dataset}/{attention}"] = groups[(dataset, attention)]
    # Run order: within each (data set, attention), the two configurations the checks compare first, so that a time
    # limit cuts the others; the tables keep CONFIGS' order.
    order = sorted(configs, key=RUN_ORDER.index)
    jobs = [(d, a, c) for a in attentions for d in datasets for c in order]
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = {pool.submit(run_config, runner, *job): job for job in jobs}
        for future in concurrent.futures.as_completed(futures):
            dataset, attention, config = futures[future]
            group = groups[(dataset, attention)]
            group["configs"][config] = future.result()
            if len(group["configs"]) == len(configs):  # the group is complete: its table
                group["configs"] = {c: group["configs"][c] for c in configs}
                group["checks"] = checks(group["configs"])
                print(_table(group, configs) + "\n\n" + _checks_text(group["checks"]) + "\n", flush=True)
            out.write_text(
                json.dumps(report, indent=2)
            )  # after every configuration: a cut-off run keeps its results
    H.log(f"done in {time.perf_counter() - H.T0:.1f} s; JSON in {out}")
    return 0


def _summary_warm(warm: H.Worker) -> str:
    result = warm.result()
    if result is None:
        return warm.failure()
    return "ok" if result.get("status") == "ok" else str(result.get("error"))


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--datasets", default="zipf,skewed", help="data sets, comma-separated (zipf, skewed)"
    )
    parser.add_argument(
        "--attention", default="sdpa,eager", help="attentions, comma-separated (sdpa, eager)"
    )
    parser.add_argument("--configs", default=",".join(CONFIGS), help="configurations, comma-separated")
    parser.add_argument(
        "--samples",
        type=int,
        help=f"samples per data set (default {TM.DEFAULT_SAMPLES}; --quick {TM.QUICK_SAMPLES})",
    )
    parser.add_argument("--max-len", type=int, help="longest sample (default 2048; --quick 256)")
    parser.add_argument("--zipf-a", type=float, default=1.3, help="the zipf data set's exponent")
    parser.add_argument(
        "--quadratic",
        default="auto",
        help="the sampler's quadratic coefficient: auto (0 with sdpa) or a number",
    )
    parser.add_argument("--budget-gib", type=float, default=24.0, help="memory budget per process in GiB")
    parser.add_argument(
        "--parallel", type=int, help="configurations run at once (default 1; --quick 4); >1 skews tokens/s"
    )
    parser.add_argument(
        "--expandable",
        action="store_true",
        help="every worker with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    )
    parser.add_argument(
        "--shape-margin",
        type=float,
        help="BatchSizeTuner(shape_margin=...) for worst and tuned (default: the tuner's own, 0.2 or 0.02)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a subprocess is killed")
    parser.add_argument(
        "--time-limit", type=float, default=1500.0, help="no subprocess starts after this (seconds)"
    )
    parser.add_argument(
        "--json", help="write every number here (default: benchmarks/results/token-budget.json, -quick.json)"
    )
    parser.add_argument("--log-dir", help="write each subprocess's output to a file here")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, simulated OOMs")
    # Internal: the worker subprocesses.
    parser.add_argument("--worker", choices=(*CONFIGS, "warmup"), help=argparse.SUPPRESS)
    parser.add_argument("--dataset", choices=TM.DATASETS, help=argparse.SUPPRESS)
    parser.add_argument("--budget-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker and args.attention not in TM.ATTENTIONS:
        parser.error(f"--worker needs one --attention of {TM.ATTENTIONS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker == "warmup":
        return warmup_worker(args)
    if args.worker:
        return config_worker(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
