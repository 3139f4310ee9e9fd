"""OOMSnapshot: record allocation history during the run and dump it when memory runs out.

Why the allocator's OOM observer and not only ``on_exception``: user code (or a library, or our own
batch-size search) may catch an ``OutOfMemoryError``; the observer is called by the allocator itself, before
the exception exists, so every OOM is seen, caught or not. ``on_exception`` is the fallback where torch has
no observer. History recording keeps a Python stack per allocation, which costs time per allocation: measure
it on your model before leaving it on for a long run (docs/oom_forensics.md).
"""

from __future__ import annotations

import itertools
import numbers
import operator
import pickle
import sys
import warnings
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from lightning_gpumem._core.checks import require_int, require_trainer
from lightning_gpumem._core.files import check_dirpath, prepare_dir, unique_path, write_atomic
from lightning_gpumem._core.snapshot_report import format_report, render_html
from lightning_gpumem._hw.allocator import attach_oom_observer, start_history, stop_history, take_snapshot
from lightning_gpumem._hw.oom import is_oom_error, oom_expected
from lightning_gpumem._pl.compat import Callback
from lightning_gpumem._pl.logging import run_dir

_ACTIVE: weakref.WeakSet[OOMSnapshot] = weakref.WeakSet()
_OBSERVER_ATTACHED = False
MAX_OOM_DUMPS = 5  # per run: a loop that catches OOMs and retries must not fill the disk


class OOMSnapshot(Callback):
    r"""Record allocations with their Python stacks; on an out-of-memory error, dump what was held and why.

    From ``setup`` to ``teardown`` the CUDA caching allocator records its history
    (``torch.cuda.memory._record_memory_history``). When an allocation fails anywhere in fit, validate or
    test, even if the error is caught, it writes ``oom_rank<r>_step<n>.pickle`` (open it in PyTorch's memory
    viewer, https://pytorch.org/memory_viz) and ``oom_rank<r>_step<n>.html`` (one self-contained page:
    totals, the failed allocation and where it was made, a map of the segments, the largest live allocations)
    in the first logger's run directory or in ``dirpath``, and prints the paths, the failed allocation and
    the ten largest live allocations with the line that made each. The exception itself propagates unchanged:
    a snapshot that cannot be written (a full disk, a read-only directory) is named in a warning, leaves no
    partial file, and the callbacks after this one still get ``on_exception``. A name another run took gets a
    ``-v1``, ``-v2``... suffix. ``at_steps`` writes ``snapshot_rank<r>_step<n>.*`` at the end of those
    training steps without any error. Without CUDA it warns once and does nothing.

    **Logged metrics**: none; the files and the printed report are the output.

    Args:
        dirpath: where to write (``~`` expanded); ``None``: the first logger's run directory
            (``trainer.log_dir`` for TensorBoard and CSV, ``<save_dir>/<name>/<version>`` for MLflow and W&B,
            as ``ModelCheckpoint``), else ``default_root_dir``.
        max_entries: allocation events kept in the history (older ones are dropped); more costs host memory.
        at_steps: training steps (``global_step`` after the step) at which to write a snapshot anyway: a
            collection or an iterable of at most a million integers >= 0, or a ``range`` of any length.

    Raises:
        ValueError: if ``max_entries`` is not an integer in [1, ``sys.maxsize``], ``at_steps`` holds anything
            but integers >= 0 (or more than a million of them outside a ``range``), or ``dirpath`` cannot be
            a directory (an existing file, a path under a file, a blank name, a NUL byte, a name over 255
            bytes); at ``setup``, if ``dirpath`` cannot be created or written to.
        TypeError: if ``at_steps`` is not a collection or ``dirpath`` not a path.

    Example::

        from lightning import Trainer
        from lightning_gpumem import OOMSnapshot

        trainer = Trainer(callbacks=[OOMSnapshot()])
        trainer.fit(model)  # on an OOM: lightning_logs/version_0/oom_rank0_step123.{pickle,html}
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        max_entries: int = 100_000,
        at_steps: Iterable[int] | None = None,
    ) -> None:
        require_int("OOMSnapshot", "max_entries", max_entries, 1)
        if max_entries > sys.maxsize:  # torch's own default and the most its history takes
            raise ValueError(
                f"`OOMSnapshot(max_entries={max_entries!r})` is not valid. Expected at most sys.maxsize."
            )
        self.dirpath = check_dirpath("OOMSnapshot", dirpath)
        self.at_steps = _steps(at_steps)
        self.max_entries = max_entries
        self.paths: list[Path] = []
        """Every file written, in order."""
        self._trainer: pl.Trainer | None = None
        self._recording = False
        self._dumped_for_oom = False  # the observer wrote this OOM's snapshot: `on_exception` need not
        self._oom_dumps = 0
        self._warned = False

    # ------------------------------------------------------------------ setup / teardown
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_trainer("OOMSnapshot", trainer)
        if trainer.strategy.root_device.type != "cuda":
            if not self._warned:
                self._warned = True
                rank_zero_warn(
                    f"OOMSnapshot: `{trainer.strategy.root_device}` has no CUDA allocator history; doing"
                    " nothing."
                )
            return
        if self.dirpath is not None:
            prepare_dir("OOMSnapshot", self.dirpath)
        self._trainer = trainer
        if not self._recording:
            try:
                start_history(self.max_entries)
                _attach_observer()
            except Exception as error:  # e.g. the cudaMallocAsync backend, which keeps no history
                rank_zero_warn(
                    f"OOMSnapshot: the allocator cannot record its history ({error!r}); doing nothing."
                )
                return
            self._recording = True
        _ACTIVE.add(self)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop()

    def _stop(self) -> None:
        _ACTIVE.discard(self)
        if self._recording:
            stop_history()
            self._recording = False

    # ------------------------------------------------------------------ hooks
    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._recording and trainer.global_step in self.at_steps:
            self.dump("snapshot", print_report=False)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        try:
            if (
                self._recording
                and is_oom_error(exception)
                and not self._dumped_for_oom
                and not oom_expected()
            ):
                self.dump("oom")  # no observer in this torch, or it failed: the state is still the OOM's
        finally:
            self._dumped_for_oom = False
            self._stop()  # Lightning skips the callbacks' `teardown` after an exception

    # ------------------------------------------------------------------ writing
    def dump(self, kind: str = "snapshot", print_report: bool = True) -> tuple[Path, Path] | None:
        """Write the current snapshot as ``<kind>_rank<r>_step<n>.pickle`` and ``.html``; return both paths.

        A name another run took gets a ``-v1``, ``-v2``... suffix. A file that cannot be written (a full
        disk, a directory made read-only) is reported in a warning and nothing is left under its name;
        ``None`` is returned.
        """
        trainer = self._trainer
        if trainer is None or not self._recording:
            return None
        try:
            snapshot = take_snapshot()
            directory = run_dir(trainer, self.dirpath)
            stem = f"{kind}_rank{trainer.global_rank}_step{trainer.global_step}"
            pickle_path = unique_path(directory / f"{stem}.pickle")
            html_path = unique_path(pickle_path.with_suffix(".html"))
            title = f"{kind} on rank {trainer.global_rank} at step {trainer.global_step}"
            write_atomic(pickle_path, pickle.dumps(snapshot))
            try:
                write_atomic(html_path, render_html(snapshot, title))
            except BaseException:
                pickle_path.unlink(missing_ok=True)  # the two files or neither
                raise
        except Exception as error:  # the run, and the user's error if there is one, go on unchanged
            warnings.warn(f"OOMSnapshot: could not write the {kind} snapshot ({error!r}).", stacklevel=2)
            return None
        self.paths += [pickle_path, html_path]
        if print_report:
            # Every rank prints its own: an OOM is a rank's own story.
            print(
                f"OOMSnapshot: {title}\n  {pickle_path}\n  {html_path}\n{format_report(snapshot)}",
                flush=True,
            )
        return pickle_path, html_path

    def gpumem_oom_recovered(self) -> None:
        """An ``AutoMicrobatch`` recovered the OOM just written: rename its files ``oom_recovered_...``.

        (How the callbacks find each other: ``lightning_gpumem._pl.peers``.) The OOM's snapshot is kept, so
        the memory that ran out can still be looked at; the name says the run went on.
        """
        if not self._dumped_for_oom:
            return
        self._dumped_for_oom = False
        renamed = []
        for path in self.paths[-2:]:
            target = path
            if path.name.startswith("oom_rank") and path.exists():
                target = unique_path(path.with_name(path.name.replace("oom_rank", "oom_recovered_rank", 1)))
                try:
                    path.rename(target)
                except OSError as error:  # the file keeps its name; the run goes on
                    warnings.warn(f"OOMSnapshot: could not rename {path} ({error!r}).", stacklevel=2)
                    target = path
            renamed.append(target)
        self.paths[-2:] = renamed

    def on_out_of_memory(self) -> None:
        """Called by the allocator as it raises an OOM: write the snapshot.

        Unless the OOM is expected, or enough were written.
        """
        if not self._recording or oom_expected() or self._oom_dumps >= MAX_OOM_DUMPS:
            return
        self._oom_dumps += 1
        self._dumped_for_oom = self.dump("oom") is not None


# `at_steps` beyond a range: more steps than this is a mistake (or an endless iterator)
MAX_STEPS = 1_000_000


def _steps(at_steps: object) -> range | frozenset[int]:
    """``at_steps`` as a set of steps; a ``range`` stays one (``range(0, 10**12, 100)`` costs nothing)."""

    def refuse(expected: str) -> ValueError:
        return ValueError(f"`OOMSnapshot(at_steps={at_steps!r})` is not valid. Expected {expected}.")

    if at_steps is None:
        return frozenset()
    if isinstance(at_steps, range):
        if at_steps and min(at_steps[0], at_steps[-1]) < 0:
            raise refuse("steps >= 0")
        return at_steps
    if isinstance(at_steps, (str, bytes, Mapping)) or not isinstance(at_steps, Iterable):
        raise TypeError(
            f"`OOMSnapshot(at_steps={at_steps!r})` is not valid. Expected None or a collection of integers"
            " >= 0, such as [100, 200] or range(0, 10_000, 500)."
        )
    steps = list(itertools.islice(at_steps, MAX_STEPS + 1))
    if len(steps) > MAX_STEPS:
        raise refuse(f"at most {MAX_STEPS:,} steps (a range for more, such as range(0, 10**9, 100))")
    # numbers.Integral: Python's and NumPy's integers; not a bool, not a float
    if not all(
        isinstance(s, numbers.Integral) and not isinstance(s, bool) and operator.index(s) >= 0 for s in steps
    ):
        raise refuse("integers >= 0")
    return frozenset(operator.index(s) for s in steps)


def _attach_observer() -> None:
    """Attach one allocator OOM observer per process; it calls every active OOMSnapshot."""
    global _OBSERVER_ATTACHED
    if not _OBSERVER_ATTACHED:
        _OBSERVER_ATTACHED = attach_oom_observer(_observer)


def _observer(device: int, alloc: int, device_total: int, device_free: int) -> None:
    # Called by the allocator while it raises: never raise from here (the user's error must stay the one they
    # see).
    for callback in list(_ACTIVE):
        try:
            callback.on_out_of_memory()
        except Exception as error:  # pragma: no cover - reported, never masks the OOM
            print(f"OOMSnapshot: could not write the snapshot ({error!r}).", flush=True)
