"""Memory reports from the logs a run wrote: ``python -m lightning_gpumem report LOGDIR`` (or ``gpumem``).

Reads the ``gpumem/`` scalars from TensorBoard event files and ``CSVLogger`` CSVs, prints a summary table per
run, and draws the memory timeline as a PNG (matplotlib) and/or a self-contained HTML page.
"""

from lightning_gpumem.report.html import render_html, write_html
from lightning_gpumem.report.plot import write_png
from lightning_gpumem.report.runs import LoadResult, ReportError, Run, load_runs
from lightning_gpumem.report.summary import RunSummary, format_table, summarize

__all__ = [
    "LoadResult",
    "ReportError",
    "Run",
    "RunSummary",
    "format_table",
    "load_runs",
    "render_html",
    "summarize",
    "write_html",
    "write_png",
]
