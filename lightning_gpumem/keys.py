"""Every ``gpumem/*`` key the package logs, with its unit and meaning, once.

The callbacks build the keys they log from here, the report (``gpumem report``) parses logged keys with
:func:`parse`, and the key tables in ``docs/`` are generated from :data:`KEYS`
(``python tools/key_tables.py``; a test checks they match). Keys follow ``gpumem/<stage>_<what>_<unit>``
where they belong to a stage, else ``gpumem/<what>_<unit>``; counts carry no unit. Under DDP/FSDP a key may
also be logged with a suffix: ``_max`` and ``_min`` (over ranks) or ``_rank<r>`` (one rank's own value).

One stage vocabulary: ``train``, ``val``, ``test``, ``predict`` (:data:`STAGES`), in keys, the fit-end
summary and the report alike. This module imports nothing beyond the standard library, so the report starts
without torch.

Example:
    >>> from lightning_gpumem import keys
    >>> keys.PEAK_ALLOCATED.format("val")
    'gpumem/val_peak_allocated_gib'
    >>> found = keys.parse("gpumem/train_peak_allocated_gib_max")
    >>> found.key is keys.PEAK_ALLOCATED, found.stage, found.suffix
    (True, 'train', '_max')
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = "gpumem/"
STAGES = ("train", "val", "test", "predict")
"""The stages, as keys, the fit-end summary and the report name them."""
STAGE_OF_LOOP = {"train": "train", "validate": "val", "test": "test", "predict": "predict"}
"""Lightning's name of a loop (``trainer.state.stage`` values) to the stage name used here."""

_SUFFIX = re.compile(r"(_max|_min|_rank\d+)$")


@dataclass(frozen=True)
class Key:
    """One logged key.

    Attributes:
        name: the key; ``{stage}`` stands for the stage where the key has one, ``{stat}`` for an allocator
            statistic.
        unit: ``GiB``, ``MiB``, ``MiB/step``, ``s``, ``%``, ``count``, ``raw`` (as the allocator reports it)
            or ``table``.
        meaning: what the value is, in a line.
        writer: the callback that logs it.
        ranks: how it is logged under DDP/FSDP besides rank zero's value: ``"max_min"`` (``_max``/``_min``
            over ranks), ``"per_rank"`` (``_rank<r>`` for every rank, instead of the plain key), or ``""``.
        when: the condition for it to be logged, if any (shown in the docs), e.g. ``"verbose=True"``.
    """

    name: str
    unit: str
    meaning: str
    writer: str
    ranks: str = ""
    when: str = ""

    @property
    def staged(self) -> bool:
        """Whether the key has a ``{stage}`` part."""
        return "{stage}" in self.name

    def format(self, stage: str | None = None, suffix: str = "") -> str:
        """The key as logged: for ``stage`` (one of :data:`STAGES`) where it has one, ``suffix`` appended."""
        if self.staged:
            if stage not in STAGES:
                raise ValueError(
                    f"`{self.name}` needs a stage: got stage={stage!r}, expected one of {STAGES}."
                )
            return self.name.format(stage=stage) + suffix
        if stage is not None:
            raise ValueError(f"`{self.name}` has no stage: got stage={stage!r}, expected None.")
        return self.name + suffix


def _key(
    name: str, unit: str, meaning: str, writer: str = "MemoryMonitor", ranks: str = "", when: str = ""
) -> Key:
    return Key(PREFIX + name, unit, meaning, writer, ranks, when)


PEAK_ALLOCATED = _key(
    "{stage}_peak_allocated_gib", "GiB", "peak memory held by tensors in the batch (loop)", ranks="max_min"
)
PEAK_RESERVED = _key(
    "{stage}_peak_reserved_gib", "GiB", "peak memory held by the caching allocator in it", ranks="max_min"
)
ALLOCATED = _key("{stage}_allocated_gib", "GiB", "memory held by tensors at its end")
RESERVED = _key("{stage}_reserved_gib", "GiB", "memory held by the caching allocator at its end")
INACTIVE_SPLIT = _key("inactive_split_gib", "GiB", "cached memory in split blocks (fragmentation)")
ALLOC_RETRIES = _key(
    "alloc_retries", "count", "cudaMalloc failures that flushed the cache and retried, cumulative"
)
OOMS = _key("ooms", "count", "out-of-memory errors raised by the allocator, cumulative")
NVML_USED = _key("nvml_used_gib", "GiB", "device memory used by all processes (`nvidia-smi`)")
NVML_TOTAL = _key("nvml_total_gib", "GiB", "device memory (the MIG instance's under MIG)")
NVML_PROCESS = _key(
    "nvml_process_gib", "GiB", "device memory NVML attributes to this process", ranks="max_min"
)
NON_TORCH = _key(
    "non_torch_gib", "GiB", "`nvml_process` minus reserved: CUDA context, NCCL, cuBLAS workspaces"
)
GPU_UTIL = _key("gpu_util_pct", "%", "GPU utilisation (NVML)")
HOST_RSS = _key("host_rss_gib", "GiB", "resident host memory of this process", ranks="max_min")
HOST_AVAILABLE = _key("host_available_gib", "GiB", "host memory available")
BUDGET = _key("budget_gib", "GiB", "the budget", when="with a `MemoryBudget`")
LEAK_RATE = _key(
    "leak_mib_per_step",
    "MiB/step",
    "growth rate of allocated memory",
    when="`detect_leaks`, from the leak detector's 32nd sample or a leak flagged sooner",
)
LEAK_WARNINGS = _key("leak_warnings", "count", "1 at the step a leak was flagged", when="`detect_leaks`")
ALLOCATOR_STAT = _key(
    "allocator/{stat}", "raw", "every `torch.cuda.memory_stats()` entry", when="`verbose=True`"
)

CACHE_RELEASES = _key("cache_releases", "count", "releases so far", "EmptyCacheOnThreshold", "per_rank")
RELEASED = _key(
    "released_gib",
    "GiB",
    "reserved memory before minus after, summed over releases",
    "EmptyCacheOnThreshold",
    "per_rank",
)
RELEASE_SECONDS = _key(
    "release_seconds",
    "s",
    "time spent releasing (`gc` + `empty_cache`), summed",
    "EmptyCacheOnThreshold",
    "per_rank",
)

BATCH_SIZE = _key(
    "batch_size",
    "count",
    "the batch size (or token budget) chosen, at the step where tuning ran",
    "BatchSizeTuner",
)
TOKEN_BUDGET = _key(
    "token_budget",
    "count",
    "the `TokenBudgetSampler` budget chosen (where it was tuned), at that step",
    "BatchSizeTuner",
)
PADDING = _key(
    "padding_fraction",
    "%",
    "padded positions in the epoch's batches at the budget chosen (where a budget was tuned)",
    "BatchSizeTuner",
)
TUNED_BUDGET = _key(
    "batch_size_budget_gib",
    "GiB",
    "the memory budget the size (or token budget) was tuned for, where a search ran",
    "BatchSizeTuner",
)
BATCH_SIZE_TRIALS = _key(
    "batch_size_trials", "table", "one row per trial: size, outcome, peaks (GiB), seconds", "BatchSizeTuner"
)
TRIAL_OOMS = _key(
    "batch_size_trial_ooms",
    "count",
    "`ooms` when the trials ended: planned, not the run's (none on CPU)",
    "BatchSizeTuner",
)
TRIAL_RETRIES = _key(
    "batch_size_trial_retries",
    "count",
    "`alloc_retries` when the trials ended: planned, not the run's (none on CPU)",
    "BatchSizeTuner",
)
PLAN_PEAK = _key(
    "plan_peak_gib", "GiB", "predicted reserved peak at the run's batch size, before step 1", "MemoryPlanner"
)
PLAN_BAND = _key(
    "plan_band_gib", "GiB", "half-width of the prediction's band (peak +- band)", "MemoryPlanner"
)
PLAN_PER_SAMPLE = _key(
    "plan_per_sample_mib",
    "MiB",
    "live memory per sample: the line's slope (the larger stage)",
    "MemoryPlanner",
)
PLAN_FIXED = _key(
    "plan_fixed_gib",
    "GiB",
    "live memory that does not grow with the batch size: the line's intercept",
    "MemoryPlanner",
)
PLAN_OUTSIDE = _key(
    "plan_outside_gib", "GiB", "memory outside PyTorch (CUDA context, kernels)", "MemoryPlanner", when="NVML"
)
PLAN_LARGEST = _key(
    "plan_largest_batch_size", "count", "the largest batch size that fits the first budget", "MemoryPlanner"
)
MEMORY_PLAN = _key(
    "memory_plan",
    "table",
    "one row per budget: limit, peak and band, fits, largest batch size",
    "MemoryPlanner",
)
MICROBATCHES = _key(
    "microbatches", "count", "micro-batches a batch runs as now (1: unsplit)", "AutoMicrobatch"
)
OOM_RECOVERIES = _key(
    "oom_recoveries", "count", "out-of-memory errors recovered, cumulative", "AutoMicrobatch"
)
LAYER_MEMORY = _key(
    "layer_memory", "table", "activation memory kept for backward, per layer", "LayerMemoryProfiler"
)

KEYS: tuple[Key, ...] = (
    PEAK_ALLOCATED,
    PEAK_RESERVED,
    ALLOCATED,
    RESERVED,
    INACTIVE_SPLIT,
    ALLOC_RETRIES,
    OOMS,
    NVML_USED,
    NVML_TOTAL,
    NVML_PROCESS,
    NON_TORCH,
    GPU_UTIL,
    HOST_RSS,
    HOST_AVAILABLE,
    BUDGET,
    LEAK_RATE,
    LEAK_WARNINGS,
    ALLOCATOR_STAT,
    CACHE_RELEASES,
    RELEASED,
    RELEASE_SECONDS,
    BATCH_SIZE,
    TOKEN_BUDGET,
    PADDING,
    TUNED_BUDGET,
    BATCH_SIZE_TRIALS,
    TRIAL_OOMS,
    TRIAL_RETRIES,
    PLAN_PEAK,
    PLAN_BAND,
    PLAN_PER_SAMPLE,
    PLAN_FIXED,
    PLAN_OUTSIDE,
    PLAN_LARGEST,
    MEMORY_PLAN,
    MICROBATCHES,
    OOM_RECOVERIES,
    LAYER_MEMORY,
)
"""Every key, in the order the docs list them."""


@dataclass(frozen=True)
class Parsed:
    """A logged key taken apart: its :class:`Key`, stage (or ``None``) and DDP suffix (or ``""``)."""

    key: Key
    stage: str | None
    suffix: str


def parse(logged: str) -> Parsed | None:
    """The :class:`Key` behind a logged key (with its stage and suffix); ``None`` for a key not ours."""
    if not logged.startswith(PREFIX):
        return None
    if logged.startswith(ALLOCATOR_STAT.name.split("{")[0]):
        return Parsed(ALLOCATOR_STAT, None, "")
    match = _SUFFIX.search(logged)
    suffix = match.group(1) if match else ""
    base = logged[: len(logged) - len(suffix)]
    for key in KEYS:
        if suffix and key.ranks != ("per_rank" if suffix.startswith("_rank") else "max_min"):
            continue
        if not key.staged:
            if key.name == base:
                return Parsed(key, None, suffix)
            continue
        for stage in STAGES:
            if key.name.format(stage=stage) == base:
                return Parsed(key, stage, suffix)
    return None


def _rows(writer: str, code: str) -> list[tuple[str, str, str]]:
    r"""(key, unit, meaning) of ``writer``'s keys, ``code`` around names (Markdown ``\```, RST ``\`\```)."""
    rows = []
    for key in KEYS:
        if key.writer != writer:
            continue
        shown = key.name.replace("{stage}", "<stage>").replace("{stat}", "<stat>")
        meaning = f"{key.when}: {key.meaning}" if key.when else key.meaning
        if key.ranks == "max_min":
            meaning += "; DDP/FSDP: also `_max`, `_min` over ranks"
        elif key.ranks == "per_rank":
            meaning += "; DDP/FSDP: `_rank<r>` per rank instead"
        rows.append((f"{code}{shown}{code}", key.unit, meaning.replace("`", code)))
    return rows


def markdown_table(writer: str) -> str:
    """The Markdown table of ``writer``'s keys (key, unit, meaning), as the docs show it."""
    lines = ["| Key | Unit | Meaning |", "| --- | --- | --- |"]
    lines += [f"| {key} | {unit} | {meaning} |" for key, unit, meaning in _rows(writer, "`")]
    return "\n".join(lines)


def rst_table(writer: str, indent: int = 4) -> str:
    """The reStructuredText table of ``writer``'s keys (key, unit, meaning), for its docstring."""
    rows = [("Key", "Unit", "Meaning"), *_rows(writer, "``")]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    rule = "  ".join("=" * w for w in widths)
    lines = [rule, "  ".join(c.ljust(w) for c, w in zip(rows[0], widths, strict=True)).rstrip(), rule]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows[1:]]
    lines.append(rule)
    return "\n".join(" " * indent + line if i else line for i, line in enumerate(lines))


def document(cls: type, writer: str | None = None) -> type:
    """Put ``writer``'s key table into ``cls``'s docstring at ``{logged_metrics}``.

    ``writer`` is the class's name by default.
    """
    if cls.__doc__:
        cls.__doc__ = cls.__doc__.replace("{logged_metrics}", rst_table(writer or cls.__name__))
    return cls


def writers() -> tuple[str, ...]:
    """The callbacks that log keys, in the order of :data:`KEYS`."""
    return tuple(dict.fromkeys(key.writer for key in KEYS))
