r"""The report as one JSON document: ``gpumem report LOGDIR --json [FILE|-]``.

Every run's figures, the same the table shows (:func:`~lightning_gpumem.report.summary.summarize`), under a
named and versioned schema (:data:`SCHEMA_NAME`, :data:`VERSION`); :data:`SCHEMA` is that schema as a JSON
Schema. Sizes are GiB (``_gib``), shares percent (``_pct``), ratios plain (``_ratio``); a figure whose keys
were never logged is ``null``. The text is ASCII (``json.dumps``' escapes), so it holds any run name and
reaches a terminal safely; bytes of a name that are not UTF-8 are written ``\xNN``, as the table shows them.

Example:
    >>> document([], "logs")["schema"], VERSION
    ('lightning-gpumem.report', 1)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from lightning_gpumem import keys
from lightning_gpumem._core.files import write_atomic
from lightning_gpumem.report._output import check_output
from lightning_gpumem.report.runs import Run
from lightning_gpumem.report.summary import RunSummary, summarize

SCHEMA_NAME = "lightning-gpumem.report"
VERSION = 1
MARK = (
    f'"schema": "{SCHEMA_NAME}"'.encode()
)  # near the start of every document written: one the report wrote

PLAN_FIELDS = {
    "peak_gib": keys.PLAN_PEAK,
    "band_gib": keys.PLAN_BAND,
    "fixed_gib": keys.PLAN_FIXED,
    "per_sample_mib": keys.PLAN_PER_SAMPLE,
    "outside_gib": keys.PLAN_OUTSIDE,
    "largest_batch_size": keys.PLAN_LARGEST,
}


def _nullable(kind: str, description: str) -> dict[str, Any]:
    return {"type": [kind, "null"], "description": description}


def _closed(properties: dict[str, Any], description: str, nullable: bool = False) -> dict[str, Any]:
    """An object schema with exactly ``properties``, each required."""
    return {
        "type": ["object", "null"] if nullable else "object",
        "description": description,
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


_STAGE = _closed(
    {
        "peak_allocated_gib": _nullable("number", "the highest peak allocated logged in the stage"),
        "peak_reserved_gib": _nullable("number", "the highest peak reserved logged in the stage"),
    },
    "one stage's peaks (the highest over ranks, where the `_max` keys were logged)",
)

FIGURES_SCHEMA = _closed(
    {
        "first_step": _nullable("integer", "the first step with a gpumem/ value"),
        "last_step": _nullable("integer", "the last step with a gpumem/ value"),
        "peak_allocated_gib": _nullable(
            "number", "the highest peak allocated over the stages (gpumem/<stage>_peak_allocated_gib)"
        ),
        "peak_reserved_gib": _nullable(
            "number", "the highest peak reserved over the stages (gpumem/<stage>_peak_reserved_gib)"
        ),
        "stages": _closed({stage: _STAGE for stage in keys.STAGES}, "per stage, its peaks"),
        "batch_peak_mean_gib": _nullable("number", "mean of the per-batch training peaks (rank 0's)"),
        "batch_peak_max_gib": _nullable("number", "the largest per-batch training peak"),
        "logged_batches": {"type": "integer", "description": "training batches logged"},
        "nvml_process_peak_gib": _nullable("number", "the highest NVML reading for the process"),
        "nvml_used_peak_gib": _nullable("number", "the highest NVML reading for the device, all processes"),
        "nvml_total_gib": _nullable("number", "the device's memory (the MIG instance's under MIG)"),
        "non_torch_peak_gib": _nullable("number", "the highest share outside PyTorch"),
        "host_rss_peak_gib": _nullable("number", "the highest host resident memory"),
        "budget_gib": _nullable("number", "the last MemoryBudget logged"),
        "headroom_gib": _nullable(
            "number", "the budget (else the device and non-PyTorch share) less the peak"
        ),
        "headroom_pct": _nullable("number", "headroom_gib as a percentage of what it is measured against"),
        "headroom_of": {
            "enum": ["budget", "device", None],
            "description": "what the headroom is measured against",
        },
        "tuned_batch_size": _nullable("integer", "the batch size a BatchSizeTuner chose"),
        "tuned_token_budget": _nullable("integer", "the tokens per batch a BatchSizeTuner chose"),
        "padding_pct": _nullable("number", "padded positions of the epoch at that token budget"),
        "tuned_for_gib": _nullable("number", "the memory budget the tuner tuned for"),
        "step_peak_reserved_over_budget": _closed(
            {
                "p50_ratio": {"type": "number", "description": "the median step's peak reserved over it"},
                "p99_ratio": {"type": "number", "description": "the 99th percentile"},
                "max_ratio": {"type": "number", "description": "the largest"},
                "steps": {"type": "integer", "description": "training steps logged"},
                "over": {
                    "enum": ["budget_gib", "tuned_for_gib"],
                    "description": "the figure the peaks are divided by",
                },
            },
            "the training steps' peak reserved over the budget; null without a budget or per-step peaks",
            nullable=True,
        ),
        "plan": _closed(
            {
                name: _nullable("integer" if name == "largest_batch_size" else "number", key.meaning)
                for name, key in PLAN_FIELDS.items()
            },
            "what a MemoryPlanner logged before step 1 (gpumem/plan_*)",
        ),
        "cache_releases": _nullable("integer", "releases by EmptyCacheOnThreshold, summed over ranks"),
        "released_gib": _nullable("number", "what those releases gave back"),
        "leak_verdict": {
            "enum": ["leak", "no_leak", None],
            "description": "leak when flagged; no_leak when leak detection logged a rate and no warning",
        },
        "leak_warnings": {"type": "integer", "description": "how many times a leak was flagged"},
        "leak_mib_per_step": _nullable("number", "the growth rate logged when a leak was flagged"),
        "alloc_retries": _nullable("integer", "allocator retries, cumulative (the run's, not the tuner's)"),
        "ooms": _nullable("integer", "out-of-memory errors, cumulative"),
        "over_ranks": {"type": "boolean", "description": "the peaks are the highest over ranks (DDP/FSDP)"},
        "advice": {
            "type": "array",
            "items": {"type": "string"},
            "description": "the fit-end summary's advice",
        },
    },
    "one run's figures",
)

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "gpumem report --json",
    **_closed(
        {
            "schema": {"const": SCHEMA_NAME, "description": "what the document is"},
            "version": {"const": VERSION, "description": "the schema's version"},
            "logdir": {"type": "string", "description": "LOGDIR as given"},
            "runs": {
                "type": "array",
                "items": _closed(
                    {
                        "name": {"type": "string", "description": "the run's directory under LOGDIR"},
                        "path": {"type": "string", "description": "the run's directory"},
                        "figures": FIGURES_SCHEMA,
                    },
                    "one run",
                ),
                "description": "the runs, in path order (those --run selects)",
            },
            "skipped": {
                "type": "array",
                "items": {"type": "string"},
                "description": "each file, directory or value passed over, and why (as on stderr)",
            },
        },
        "the report of the runs under LOGDIR",
    ),
}
"""The document's JSON Schema (draft 2020-12): every field, its type and meaning; no others allowed."""


def figures(summary: RunSummary) -> dict[str, Any]:
    """One run's figures, as :data:`FIGURES_SCHEMA` names them, from its :class:`RunSummary`."""
    peaks = [allocated for allocated, _ in summary.stage_peaks.values() if allocated is not None]
    # as the table: against the budget, else the device
    of = summary.budget if summary.budget is not None else summary.nvml_total
    headroom_of = None
    if summary.headroom is not None:
        headroom_of = "budget" if summary.budget is not None else "device"
    ratios = None
    if summary.step_peaks_over_budget is not None:
        p50, p99, highest, steps = summary.step_peaks_over_budget
        ratios = {
            "p50_ratio": p50,
            "p99_ratio": p99,
            "max_ratio": highest,
            "steps": steps,
            "over": "budget_gib" if summary.budget is not None else "tuned_for_gib",
        }
    token_budget, padding = summary.token_budget or (None, None)
    plan: dict[str, float | int | None] = {
        name: summary.plan.get(key.name) for name, key in PLAN_FIELDS.items()
    }
    largest = plan["largest_batch_size"]
    plan["largest_batch_size"] = None if largest is None else round(largest)
    verdict = None
    if summary.leak_warnings:
        verdict = "leak"
    elif summary.leaks_watched:
        verdict = "no_leak"
    return {
        "first_step": summary.steps[0] if summary.steps else None,
        "last_step": summary.steps[1] if summary.steps else None,
        "peak_allocated_gib": max(peaks) if peaks else None,
        "peak_reserved_gib": summary.peak_reserved,
        "stages": {
            stage: {"peak_allocated_gib": allocated, "peak_reserved_gib": reserved}
            for stage in keys.STAGES
            for allocated, reserved in [summary.stage_peaks.get(stage, (None, None))]
        },
        "batch_peak_mean_gib": summary.batch_peak_mean,
        "batch_peak_max_gib": summary.batch_peak_max,
        "logged_batches": summary.logged_batches,
        "nvml_process_peak_gib": summary.nvml_process_peak,
        "nvml_used_peak_gib": summary.nvml_used_peak,
        "nvml_total_gib": summary.nvml_total,
        "non_torch_peak_gib": summary.non_torch_peak,
        "host_rss_peak_gib": summary.host_rss_peak,
        "budget_gib": summary.budget,
        "headroom_gib": summary.headroom,
        "headroom_pct": None if summary.headroom is None or not of else 100 * summary.headroom / of,
        "headroom_of": headroom_of,
        "tuned_batch_size": summary.batch_size,
        "tuned_token_budget": token_budget,
        "padding_pct": padding,
        "tuned_for_gib": summary.tuned_budget,
        "step_peak_reserved_over_budget": ratios,
        "plan": plan,
        "cache_releases": summary.cache_releases,
        "released_gib": summary.released,
        "leak_verdict": verdict,
        "leak_warnings": summary.leak_warnings,
        "leak_mib_per_step": summary.leak_rate,
        "alloc_retries": summary.alloc_retries,
        "ooms": summary.ooms,
        "over_ranks": summary.over_ranks,
        "advice": list(summary.advice),
    }


def document(
    runs: Sequence[Run], logdir: str | os.PathLike[str], skipped: Iterable[str] = ()
) -> dict[str, Any]:
    """The report of ``runs`` as the document :data:`SCHEMA` describes.

    ``skipped``: what the reading passed over (:attr:`~lightning_gpumem.report.runs.LoadResult.skipped`).
    """
    return {
        "schema": SCHEMA_NAME,
        "version": VERSION,
        "logdir": _text(str(logdir)),
        "runs": [
            {"name": _text(run.name), "path": _text(str(run.path)), "figures": figures(summarize(run))}
            for run in runs
        ],
        "skipped": [_text(line) for line in skipped],
    }


def dumps(report: dict[str, Any]) -> str:
    """The document as ASCII JSON text, indented, with a newline at the end.

    ``"schema"`` comes first, near the start, where :data:`MARK` finds it.
    """
    return json.dumps(report, indent=2, ensure_ascii=True, allow_nan=False) + "\n"


def write_json(
    runs: Sequence[Run],
    logdir: str | os.PathLike[str],
    path: str | os.PathLike[str],
    force: bool = False,
    skipped: Iterable[str] = (),
) -> Path:
    """Write :func:`document` to ``path`` (whole or not at all) and return it.

    ``path`` is never one of the runs' sources; an existing file that the report did not write (one without
    :data:`MARK` near its start), or a symbolic link, is replaced only with ``force`` (which writes the
    link's target).

    Raises:
        ReportError: ``path`` is refused, as above.
        OSError: it cannot be written.
    """
    inputs = [source for run in runs for source in run.sources]
    out = check_output("--json", path, MARK, inputs, force)
    text = dumps(document(runs, logdir, skipped)).encode("ascii")
    write_atomic(out, lambda handle: handle.write(text))
    return Path(path)


def _text(text: str) -> str:
    r"""``text`` with the bytes that are not UTF-8 (kept by ``os.fsdecode`` as lone surrogates) as ``\xNN``.

    >>> _text("run-\udcff")
    'run-\\xff'
    """
    if not any("\udc80" <= char <= "\udcff" for char in text):
        return text
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
