"""What the tuner says of a search: the line on rank zero, the trials' table, and the size the run trains at."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_gpumem import keys
from lightning_gpumem._core.files import unique_path, write_atomic
from lightning_gpumem._core.units import GIB
from lightning_gpumem._pl.logging import log_table, log_to_loggers, run_dir
from lightning_gpumem.tuning.lengths.longest import LongestFirst, margin_tip
from lightning_gpumem.tuning.lengths.token_budget import TokenBudgetSampler
from lightning_gpumem.tuning.search import SearchResult, Trial
from lightning_gpumem.tuning.trials import session as _session


@dataclass
class Searched:
    """One search's record: its budget, the margin its trials left free, the token sampler it tuned, the size and
    accumulation the run started with, and the allocator's counts when its trials ended (planned, not the run's).
    """

    budget_bytes: int | None = None
    margin: float = 0.0
    tokens: TokenBudgetSampler | None = None
    longest: LongestFirst | None = None  # the trials' longest-first order (`length_fn`)
    original: tuple[int, int] = (0, 1)
    counted: dict[str, int | None] = field(default_factory=dict)  # as logged: None where no source counts them

    @property
    def planned(self) -> dict[str, int]:
        """The trials' OOM and retry counts, for the fit-end advice."""
        names = {keys.TRIAL_OOMS.format(): "planned_ooms", keys.TRIAL_RETRIES.format(): "planned_retries"}
        return {names[name]: count or 0 for name, count in self.counted.items()}


def report(
    trainer: pl.Trainer,
    name: str,
    result: SearchResult,
    searched: Searched,
    seconds: float,
    upper: int,
    shape_margin: float | None,
) -> None:
    """The line on rank zero, the warning where memory did not bound the search, the trials' table to every logger."""
    chosen = next(t for t in reversed(result.trials) if t.batch_size == result.batch_size)
    budget = searched.budget_bytes
    peak = (
        f"peak {chosen.peak_bytes / GIB:.1f}/{budget / GIB:.1f} GiB"
        if chosen.peak_bytes is not None and budget
        else "no memory measured"
    )
    rank_zero_info(
        f"BatchSizeTuner: {name}={result.batch_size} ({peak}, {len(result.trials)} trials,"
        f" {result.num_ooms} OOM, {seconds:.1f} s)"
    )
    if searched.margin > 0:
        rank_zero_info(
            f"BatchSizeTuner: the batches vary in shape, so the trials ran under {1 - searched.margin:.0%} of the"
            f" budget and left {searched.margin:.0%} free for the allocator's fragmentation (`shape_margin`)"
            f"{margin_tip(shape_margin)}."
        )
    if result.reason == "upper_bound":
        more = (
            "the device could take more."
            if budget is not None
            else f"no memory could be measured on `{trainer.strategy.root_device}`, so memory did not bound it."
        )
        rank_zero_warn(
            f"BatchSizeTuner: stopped at the upper bound {upper} (max_val, the dataset size per rank or"
            f" `val_check_interval`) without running out of memory; {more}"
        )
    if not trainer.is_global_zero:
        return
    columns = ["batch size", "outcome", "reserved GiB", "training allocated GiB", "validation allocated GiB"]
    columns.append("seconds")
    rows = [_row(t) for t in result.trials]
    table: list[list[object]] = [list(columns), ["---"] * len(columns), *rows]
    lines = ["| " + " | ".join(str(cell) for cell in row) + " |" for row in table]
    # the report subtracts the trials' planned OOMs and retries from the run's; only what a source counted
    scalars = {key: float(count) for key, count in searched.counted.items() if count is not None}
    log_to_loggers(trainer, scalars, step=trainer.global_step)
    text = "\n".join(lines)
    log_table(trainer, keys.BATCH_SIZE_TRIALS.format(), columns, rows, trainer.global_step, text, "BatchSizeTuner")


def _row(t: Trial) -> list[object]:
    def gib(value: int | None) -> str:
        return "-" if value is None else f"{value / GIB:.2f}"

    outcome = "OOM" if not t.fits else f"short: {t.samples} samples" if t.short else "ok"
    peaks = [gib(t.peak_bytes), gib(t.train_peak_bytes), gib(t.val_peak_bytes)]
    return [t.batch_size, outcome, *peaks, f"{t.seconds:.2f}"]


@dataclass
class SizeLog:
    """Says in the run's logs which size it trains at, tuned or restored from a checkpoint (global rank zero).

    ``gpumem/batch_size`` to every logger; the size in the hyperparameters the loggers show (TensorBoard's HPARAMS,
    ``hparams.yaml``) where the module's or the datamodule's hparams hold ``batch_arg_name``, which Lightning
    logged with the size the run started with; and under LightningCLI ``gpumem_batch_size.yaml`` in the run's
    directory (where ``config.yaml``, which holds the initial size, is for TensorBoard and CSV).
    """

    due: bool = False  # a size was chosen or restored and is not logged yet
    yaml_path: Path | None = None  # the `gpumem_batch_size.yaml` this callback wrote

    def record(self, trainer: pl.Trainer, lines: list[str], log: Callable[[pl.Trainer], None]) -> None:
        """A size was chosen: log it now mid-training (else at train start, after Lightning's own hparams), and
        write ``lines`` next to LightningCLI's config.
        """
        if not trainer.is_global_zero:
            return
        self.due = True
        if _session.current_hook(trainer) != "on_fit_start":  # mid-training: Lightning logged its hparams already
            log(trainer)
        self._write_next_to_cli_config(trainer, lines)

    def log(self, trainer: pl.Trainer, name: str, size: int, scalars: dict[str, float]) -> None:
        """Log ``scalars`` and the size as the hyperparameter ``name``, once per size chosen."""
        if not self.due or not trainer.is_global_zero:
            return
        self.due = False
        log_to_loggers(trainer, scalars, step=trainer.global_step)
        if not _session.batch_arg_in_hparams(trainer, name):
            return
        for logger in trainer.loggers:
            try:
                hparams = dict(getattr(logger, "hparams", None) or {})
                logger.log_hyperparams({**hparams, name: size})
            except Exception as error:  # a logger that cannot take them: `gpumem/batch_size` says it all the same
                rank_zero_warn(
                    f"BatchSizeTuner: could not log `{name}` to {type(logger).__name__}'s hyperparameters"
                    f" ({error!r})."
                )

    def _write_next_to_cli_config(self, trainer: pl.Trainer, lines: list[str]) -> None:
        """Under LightningCLI, write the size chosen to the run's directory (:func:`run_dir`).

        Its own file of an earlier search in this run is replaced; a file of another run keeps its name (this one
        gets ``-v1``...). A disk that fails is named in a warning.
        """
        if not any(type(c).__name__ == "SaveConfigCallback" for c in trainer.callbacks):  # type: ignore[attr-defined]
            return
        path = run_dir(trainer) / "gpumem_batch_size.yaml"  # trainer.log_dir's run, without its broadcast
        if path != self.yaml_path:
            path = unique_path(path)
        try:
            write_atomic(path, "\n".join(lines) + "\n")
            self.yaml_path = path
        except OSError as error:
            rank_zero_warn(f"BatchSizeTuner: could not write {path} ({error!r}).")
