"""OOMSnapshot: record allocation history during the run and dump it when memory runs out.

Why the allocator's OOM observer and not only ``on_exception``: user code (or a library, or our own batch-size
search) may catch an ``OutOfMemoryError``; the observer is called by the allocator itself, before the exception
exists, so every OOM is seen, caught or not. ``on_exception`` is the fallback where torch has no observer.
History recording keeps a Python stack per allocation, which costs time per allocation: measure it on your model
before leaving it on for a long run (docs/oom_forensics.md).
"""

from __future__ import annotations

import pickle
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from lightning_gpumem._checks import is_int_at_least, require_dirpath, require_int
from lightning_gpumem._compat import Callback
from lightning_gpumem._logging import log_dir
from lightning_gpumem._oom import is_oom_error, oom_expected
from lightning_gpumem._snapshot_report import format_report, render_html
from lightning_gpumem.probe import attach_oom_observer, start_history, stop_history, take_snapshot

_ACTIVE: weakref.WeakSet[OOMSnapshot] = weakref.WeakSet()
_OBSERVER_ATTACHED = False
MAX_OOM_DUMPS = 5  # per run: a loop that catches OOMs and retries must not fill the disk


class OOMSnapshot(Callback):
    r"""Record allocations with their Python stacks; on an out-of-memory error, dump what was in memory and why.

    From ``setup`` to ``teardown`` the CUDA caching allocator records its history
    (``torch.cuda.memory._record_memory_history``). When an allocation fails anywhere in fit, validate or test,
    even if the error is caught, it writes ``oom_rank<r>_step<n>.pickle`` (open it in PyTorch's memory viewer,
    https://pytorch.org/memory_viz) and ``oom_rank<r>_step<n>.html`` (one self-contained page: totals, the failed
    allocation and where it was made, a map of the segments, the largest live allocations) next to the logger's
    files or in ``dirpath``, and prints the paths, the failed allocation and the ten largest live allocations with
    the line that made each. The exception itself propagates unchanged. ``at_steps`` writes
    ``snapshot_rank<r>_step<n>.*`` at the end of those training steps without any error. Without CUDA it warns
    once and does nothing.

    **Logged metrics**: none; the files and the printed report are the output.

    Args:
        dirpath: where to write; ``None``: ``trainer.log_dir`` (the first logger's directory, else
            ``default_root_dir``).
        max_entries: allocation events kept in the history (older ones are dropped); more costs host memory.
        at_steps: training steps (``global_step`` after the step) at which to write a snapshot anyway.

    Raises:
        ValueError: if ``max_entries`` is not a positive integer or ``at_steps`` holds anything but integers >= 0.

    Example::

        from lightning import Trainer
        from lightning_gpumem import OOMSnapshot

        trainer = Trainer(callbacks=[OOMSnapshot()])
        trainer.fit(model)  # on an OOM: lightning_logs/version_0/oom_rank0_step123.{pickle,html}
    """

    def __init__(
        self, dirpath: str | Path | None = None, max_entries: int = 100_000, at_steps: Iterable[int] | None = None
    ) -> None:
        require_int("OOMSnapshot", "max_entries", max_entries, 1)
        if at_steps is not None and (isinstance(at_steps, (str, bytes)) or not isinstance(at_steps, Iterable)):
            raise TypeError(
                f"`OOMSnapshot(at_steps={at_steps!r})` is not valid. Expected None or a collection of integers >= 0,"
                " such as [100, 200]."
            )
        steps = tuple(at_steps) if at_steps is not None else ()
        if not all(is_int_at_least(s, 0) for s in steps):
            raise ValueError(f"`OOMSnapshot(at_steps={at_steps!r})` is not valid. Expected integers >= 0.")
        require_dirpath("OOMSnapshot", dirpath)
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.max_entries = max_entries
        self.at_steps = frozenset(steps)
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
        if trainer.strategy.root_device.type != "cuda":
            if not self._warned:
                self._warned = True
                rank_zero_warn(
                    f"OOMSnapshot: `{trainer.strategy.root_device}` has no CUDA allocator history; doing nothing."
                )
            return
        self._trainer = trainer
        if not self._recording:
            try:
                start_history(self.max_entries)
                _attach_observer()
            except Exception as error:  # e.g. the cudaMallocAsync backend, which keeps no history
                rank_zero_warn(f"OOMSnapshot: the allocator cannot record its history ({error!r}); doing nothing.")
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
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        if self._recording and trainer.global_step in self.at_steps:
            self.dump("snapshot", print_report=False)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._recording and is_oom_error(exception) and not self._dumped_for_oom and not oom_expected():
            self.dump("oom")  # no observer in this torch, or it failed: the state is still the OOM's
        self._dumped_for_oom = False
        self._stop()  # Lightning skips the callbacks' `teardown` after an exception

    # ------------------------------------------------------------------ writing
    def dump(self, kind: str = "snapshot", print_report: bool = True) -> tuple[Path, Path] | None:
        """Write the current snapshot as ``<kind>_rank<r>_step<n>.pickle`` and ``.html``; returns the two paths."""
        trainer = self._trainer
        if trainer is None or not self._recording:
            return None
        snapshot = take_snapshot()
        directory = log_dir(trainer, self.dirpath)
        directory.mkdir(parents=True, exist_ok=True)
        stem = f"{kind}_rank{trainer.global_rank}_step{trainer.global_step}"
        pickle_path, html_path = directory / f"{stem}.pickle", directory / f"{stem}.html"
        with open(pickle_path, "wb") as f:
            pickle.dump(snapshot, f)
        title = f"{kind} on rank {trainer.global_rank} at step {trainer.global_step}"
        html_path.write_text(render_html(snapshot, title), encoding="utf-8")
        self.paths += [pickle_path, html_path]
        if print_report:
            # Every rank prints its own: an OOM is a rank's own story.
            print(f"OOMSnapshot: {title}\n  {pickle_path}\n  {html_path}\n{format_report(snapshot)}", flush=True)
        return pickle_path, html_path

    def _gpumem_oom_recovered(self) -> None:
        """An ``AutoMicrobatch`` recovered the OOM just written: rename its files ``oom_recovered_...``.

        (How the callbacks find each other: ``lightning_gpumem._registry``.) The OOM's snapshot is kept, so the memory
        that ran out can still be looked at; the name says the run went on.
        """
        if not self._dumped_for_oom:
            return
        self._dumped_for_oom = False
        renamed = []
        for path in self.paths[-2:]:
            if path.name.startswith("oom_rank") and path.exists():
                target = path.with_name(path.name.replace("oom_rank", "oom_recovered_rank", 1))
                path.rename(target)
                renamed.append(target)
            else:
                renamed.append(path)
        self.paths[-2:] = renamed

    def _on_oom(self) -> None:
        if not self._recording or oom_expected() or self._oom_dumps >= MAX_OOM_DUMPS:
            return
        self._oom_dumps += 1
        self._dumped_for_oom = self.dump("oom") is not None


def _attach_observer() -> None:
    """Attach one allocator OOM observer per process; it calls every active OOMSnapshot."""
    global _OBSERVER_ATTACHED
    if not _OBSERVER_ATTACHED:
        _OBSERVER_ATTACHED = attach_oom_observer(_observer)


def _observer(device: int, alloc: int, device_total: int, device_free: int) -> None:
    # Called by the allocator while it raises: never raise from here (the user's error must stay the one they see).
    for callback in list(_ACTIVE):
        try:
            callback._on_oom()
        except Exception as error:  # pragma: no cover - reported, never masks the OOM
            print(f"OOMSnapshot: could not write the snapshot ({error!r}).", flush=True)
