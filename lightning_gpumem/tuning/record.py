"""What the tuner says of a search.

The line on rank zero, the trials' table, and the size the run trains at.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_gpumem import keys
from lightning_gpumem._core.files import unique_path, write_atomic
from lightning_gpumem._core.units import GIB, format_gib
from lightning_gpumem._pl.logging import log_table, log_to_loggers, run_dir
from lightning_gpumem.tuning.lengths.longest import LongestFirst, margin_tip
from lightning_gpumem.tuning.lengths.token_budget import TokenBudgetSampler
from lightning_gpumem.tuning.search import SearchResult, Trial
from lightning_gpumem.tuning.search.moves import SQUEEZES
from lightning_gpumem.tuning.trials import session as _session


@dataclass
class Searched:
    """One search's record.

    Its budget, the margin its trials left free, the token sampler it tuned, the size and accumulation the
    run started with, and the allocator's counts when its trials ended (planned, not the run's).
    """

    budget_bytes: int | None = None
    margin: float = 0.0
    tokens: TokenBudgetSampler | None = None
    longest: LongestFirst | None = None  # the trials' longest-first order (`length_fn`)
    original: tuple[int, int] = (0, 1)
    # as logged: None where no source counts them
    counted: dict[str, int | None] = field(default_factory=dict)

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
    """The line on rank zero, the warning where memory did not bound the search, the trials' table.

    The table goes to every logger.
    """
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
            f"BatchSizeTuner: the batches vary in shape, so the trials ran under {1 - searched.margin:.0%}"
            f" of the budget and left {searched.margin:.0%} free for the allocator's fragmentation"
            f" (`shape_margin`){margin_tip(shape_margin)}."
        )
    squeezed = squeeze_warning(name, chosen)
    if squeezed is not None:
        rank_zero_warn(squeezed)
    if result.reason == "upper_bound":
        more = (
            "the device could take more."
            if budget is not None
            else f"no memory could be measured on `{trainer.strategy.root_device}`, so memory did not bound"
            " it."
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
    log_table(
        trainer, keys.BATCH_SIZE_TRIALS.format(), columns, rows, trainer.global_step, text, "BatchSizeTuner"
    )


def squeeze_warning(name: str, chosen: Trial) -> str | None:
    """What to say where the size kept ran only by the allocator giving its cache back again and again.

    Its trial met the cap :data:`~lightning_gpumem.tuning.search.moves.SQUEEZES` times or more: the steps
    ran by flushing the cache, and a later step whose blocks fall differently may not
    (``docs/batch_size_tuner.md``, "Limits"). ``None``: nothing to say.

    >>> print(squeeze_warning("batch_size", Trial(64, True, retries=3)))
    BatchSizeTuner: batch_size=64 ran only by the allocator giving its cache back 3 times in the trial; ...
    >>> squeeze_warning("batch_size", Trial(64, True, retries=1)) is None
    True
    """
    if (chosen.retries or 0) < SQUEEZES:
        return None
    return (
        f"BatchSizeTuner: {name}={chosen.batch_size} ran only by the allocator giving its cache back"
        f" {chosen.retries} times in the trial; later steps that fragment the cache differently may run out"
        " of memory. A larger `headroom`, or `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, leaves"
        " room."
    )


Shapes = tuple[tuple[int, ...], ...]  # a batch's tensor shapes, less the batch dimension


def refuse_none(
    result: SearchResult, budget_bytes: int | None, name: str = "batch_size", tokens: bool = False
) -> int:
    """The size the search kept.

    Raises:
        RuntimeError: where it kept none, saying why and what to change.
    """
    if result.batch_size is not None:
        return result.batch_size
    budget = format_gib(budget_bytes)
    if any(t.fits for t in result.trials):
        raise RuntimeError(
            f"BatchSizeTuner: the sizes that ran in the budget of {budget} ran out of memory when run again"
            " below the largest one (allocator fragmentation; trials:"
            f" {[(t.batch_size, t.fits) for t in result.trials]}). Raise `headroom`."
        )
    smallest = min((t.batch_size for t in result.trials), default=1)
    alone = " (the longest sample's cost alone)" if tokens else ""
    raise RuntimeError(
        f"BatchSizeTuner: even {name}={smallest}{alone} does not fit the budget of {budget}"
        f" ({len(result.trials)} trials). Lower the memory per sample (precision='bf16-mixed', activation"
        " checkpointing) or raise `budget`."
    )


def warn_shapes(shapes: list[Shapes]) -> None:
    """Warn where the trials' training batches changed shape: the size was tuned on the batches drawn."""
    if len(shapes) <= 1:
        return

    def shown(shape: Shapes) -> str:
        return ", ".join("x".join(map(str, s)) or "scalar" for s in shape)

    rank_zero_warn(
        f"BatchSizeTuner: the trials' training batches changed shape ({shown(shapes[0])} and"
        f" {shown(shapes[-1])}, less the batch dimension), so the size was tuned on the batches the trials"
        " happened to draw; a longer batch later in the fit may not fit. Pass `length_fn` (e.g."
        ' `BatchSizeTuner(length_fn="input_ids")`) so that trials run the longest samples, or batch by'
        " tokens with `TokenBudgetSampler` and tune its `max_tokens`."
    )


def _row(t: Trial) -> list[object]:
    def gib(value: int | None) -> str:
        return "-" if value is None else f"{value / GIB:.2f}"

    outcome = "OOM" if not t.fits else f"short: {t.samples} samples" if t.short else "ok"
    peaks = [gib(t.peak_bytes), gib(t.train_peak_bytes), gib(t.val_peak_bytes)]
    return [t.batch_size, outcome, *peaks, f"{t.seconds:.2f}"]


@dataclass
class SizeLog:
    """Says in the run's logs which size it trains at, tuned or restored from a checkpoint.

    On global rank zero. ``gpumem/batch_size`` to every logger; the size in the hyperparameters the loggers
    show (TensorBoard's HPARAMS, ``hparams.yaml``) where the module's or the datamodule's hparams hold
    ``batch_arg_name``, which Lightning logged with the size the run started with; and under LightningCLI
    ``gpumem_batch_size.yaml`` in the run's directory (where ``config.yaml``, which holds the initial size,
    is for TensorBoard and CSV).
    """

    name: str = "batch_size"
    size: int | None = None  # chosen or restored, not logged yet (``None``: nothing due)
    scalars: dict[str, float] = field(default_factory=dict)
    yaml_path: Path | None = None  # the `gpumem_batch_size.yaml` this callback wrote

    def record(
        self, trainer: pl.Trainer, name: str, size: int, accumulation: int | None, searched: Searched
    ) -> None:
        """A size was chosen or restored: log it, and write it next to LightningCLI's config.

        It is logged now mid-training (else at train start, after Lightning's own hparams), and written with
        ``accumulation`` where it was tuned too.
        """
        if not trainer.is_global_zero:
            return
        self.name, self.size = name, size
        self.scalars = {keys.BATCH_SIZE.format(): float(size)}
        if searched.budget_bytes is not None:  # what the run's per-step peaks are measured against
            self.scalars[keys.TUNED_BUDGET.format()] = searched.budget_bytes / GIB
        if searched.tokens is not None:  # a token budget was tuned
            self.scalars[keys.TOKEN_BUDGET.format()] = float(size)
            self.scalars[keys.PADDING.format()] = 100.0 * searched.tokens.padding_fraction(size)
        if _session.current_hook(trainer) != "on_fit_start":  # mid-training: Lightning logged its hparams
            self.log(trainer)
        lines = [
            "# Chosen by BatchSizeTuner at fit start; config.yaml holds the value the run started with.",
            f"{name}: {size}",
        ]
        if accumulation is not None:
            lines.append(f"accumulate_grad_batches: {accumulation}")
        self._write_next_to_cli_config(trainer, lines)

    def log(self, trainer: pl.Trainer) -> None:
        """Log the size due to every logger, and as the hyperparameter it is where the hparams hold it."""
        size, self.size = self.size, None
        if size is None or not trainer.is_global_zero:
            return
        log_to_loggers(trainer, self.scalars, step=trainer.global_step)
        if not _session.batch_arg_in_hparams(trainer, self.name):
            return
        for logger in trainer.loggers:
            try:
                hparams = dict(getattr(logger, "hparams", None) or {})
                logger.log_hyperparams({**hparams, self.name: size})
            except Exception as error:  # a logger that cannot: `gpumem/batch_size` says it all the same
                rank_zero_warn(
                    f"BatchSizeTuner: could not log `{self.name}` to {type(logger).__name__}'s"
                    f" hyperparameters ({error!r})."
                )

    def _write_next_to_cli_config(self, trainer: pl.Trainer, lines: list[str]) -> None:
        """Under LightningCLI, write the size chosen to the run's directory (:func:`run_dir`).

        Its own file of an earlier search in this run is replaced; a file of another run keeps its name (this
        one gets ``-v1``...). A disk that fails is named in a warning.
        """
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        if not any(type(c).__name__ == "SaveConfigCallback" for c in callbacks):
            return
        path = run_dir(trainer) / "gpumem_batch_size.yaml"  # trainer.log_dir's run, without its broadcast
        if path != self.yaml_path:
            path = unique_path(path)
        try:
            write_atomic(path, "\n".join(lines) + "\n")
            self.yaml_path = path
        except OSError as error:
            rank_zero_warn(f"BatchSizeTuner: could not write {path} ({error!r}).")
