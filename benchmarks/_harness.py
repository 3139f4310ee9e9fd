"""What the benchmarks share: worker subprocesses, the timed window of a fit, interleaved rounds, version stamps.

Import it as ``import _harness as H`` from a script in ``benchmarks/`` (a script's own folder is first on
``sys.path``). It imports only the standard library and torch at import time, so that worker processes which must not
load Lightning (``tuner.py``'s probes, ``colocated.py``'s holder and B) can use it; only :meth:`StepWindow.callbacks`
imports Lightning.

* **Worker protocol** (``tuner.py``, ``colocated.py``; ``profile_tuner.py`` takes a tuner worker's :func:`emit`): the
  orchestrator starts each worker with :class:`Worker` (its own process group, stdout and stderr in files, killed
  with its group on timeout; :func:`run_worker` starts one and waits); the worker prints its result as one line
  ``RESULT {json}`` (:func:`emit`), and the orchestrator reads the last such line back (:meth:`Worker.result`) or,
  without one, says why (:meth:`Worker.failure`).
* **Timed window** (``microbatch_overhead.py``, ``monitor_overhead.py``, ``colocated.py``, ``history_overhead.py``,
  ``microbatch_gpt_overhead.py``): :class:`StepWindow` reads the clock at the start of training batch ``first`` and
  at the end of batch ``last``, synchronising CUDA there and nowhere else.
* **Rounds** (``microbatch_overhead.py``, ``monitor_overhead.py``, ``microbatch_gpt_overhead.py``):
  :func:`interleaved_rounds` runs every configuration once per round, the order rotated by one each round.
* **Version stamps** (``tuner.py``, ``colocated.py``, ``microbatch_gpt_overhead.py``): :func:`versions`.
* Small helpers: :func:`log` (progress lines on stderr), :func:`describe_error`, :func:`synchronize`,
  :func:`quiet_lightning` (``monitor_overhead.py``, ``microbatch_gpt_overhead.py``), :data:`QUIET_TRAINER`
  (``microbatch_overhead.py``, ``tuner.py``, ``colocated.py``), :data:`GIB`, :data:`MIB`, :data:`REPO_ROOT`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

GIB = 1024**3
MIB = 1024**2
REPO_ROOT = Path(__file__).resolve().parent.parent
RESULT_PREFIX = "RESULT "  # a worker's result line: this prefix, then one JSON object
T0 = time.perf_counter()  # when the first script of this process imported the harness: the origin of `log`


# ---------------------------------------------------------------------------------------------------- logging
def log(message: str) -> None:
    """A progress line on stderr, stamped with the seconds since :data:`T0`."""
    print(f"[{time.perf_counter() - T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def describe_error(error: BaseException) -> str:
    """``"Type: message"``, cut at 600 characters (an OOM message lists the allocator's state at length)."""
    return f"{type(error).__name__}: {error}"[:600]


def versions(dists: Sequence[str] = ("lightning", "lightning-gpumem")) -> dict[str, str]:
    """Python's and torch's versions, then each distribution's in ``dists``.

    ``torch`` is ``torch.__version__`` (with its local part, e.g. ``+cu130``); the others come from the installed
    distributions' metadata. A distribution that is not installed but importable from ``sys.path`` (this package,
    run with ``PYTHONPATH=.``) is stamped ``"<__version__> (source tree, not installed)"``, its version read from its
    ``__init__.py`` without importing it; one that is neither, ``"not installed"``.
    """
    stamps = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in dists:
        try:
            stamps[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            source = _source_version(dist.replace("-", "_"))
            stamps[dist] = "not installed" if source is None else f"{source} (source tree, not installed)"
    return stamps


def _source_version(module: str) -> str | None:
    """``__version__`` as written in ``module``'s ``__init__.py`` on ``sys.path``, ``None`` if not found."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    found = re.search(
        r"""^__version__\s*=\s*["']([^"']+)["']""", Path(spec.origin).read_text("utf-8"), re.MULTILINE
    )
    return found.group(1) if found else None


# ---------------------------------------------------------------------------------------------------- workers
def emit(result: dict[str, Any]) -> None:
    """In a worker: print ``result`` as the ``RESULT {json}`` line the orchestrator reads back."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def parse_result(stdout: str) -> dict[str, Any] | None:
    """The last ``RESULT`` line of a worker's stdout, decoded; ``None`` if it printed none."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    return json.loads(lines[-1][len(RESULT_PREFIX) :]) if lines else None


def worker_env() -> dict[str, str]:
    """This process's environment with the repository root first on ``PYTHONPATH`` and UTF-8 standard streams.

    UTF-8 because Lightning prints emoji: a C locale must not break the workers.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env["PYTHONIOENCODING"] = "utf-8"
    return env


class Worker:
    """A worker subprocess in its own process group (a kill takes its DataLoader workers too), started at once.

    stdout and stderr go to ``{name}.out`` and ``{name}.err`` in ``workdir`` (kept), or in a temporary folder of
    the worker's own (removed by :meth:`wait`); files, not pipes, so that nothing needs draining while it runs and a
    running worker's stderr can be read (:meth:`stderr_tail`). The working directory is the repository root.

    After :meth:`wait`: ``rc`` (the exit code; negative for a killed worker), ``stdout``, ``stderr``, ``seconds``
    (from start to exit or kill) and ``timed_out``.
    """

    def __init__(
        self,
        argv: list[str],
        name: str = "worker",
        env: dict[str, str] | None = None,
        workdir: Path | None = None,
    ) -> None:
        self.argv = argv
        self._tmp = None if workdir is not None else tempfile.TemporaryDirectory(prefix="bench_worker_")
        folder = Path(workdir if workdir is not None else self._tmp.name)  # type: ignore[union-attr]
        self.out, self.err = folder / f"{name}.out", folder / f"{name}.err"
        self.rc: int | None = None
        self.stdout = self.stderr = ""
        self.seconds = 0.0
        self.timed_out = False
        self._done = False  # waited for: output read, temporary folder gone
        self.started = time.perf_counter()
        env = env if env is not None else worker_env()
        with open(self.out, "w", encoding="utf-8") as out, open(self.err, "w", encoding="utf-8") as err:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=err, env=env, cwd=REPO_ROOT, start_new_session=True
            )

    def stderr_tail(self, chars: int = 800) -> str:
        """The last ``chars`` characters of stderr so far (the worker may still be running)."""
        if self._done:
            return self.stderr[-chars:]
        return self.err.read_text("utf-8", errors="replace")[-chars:]

    def kill(self) -> None:
        """Kill the worker's process group if the worker is still running, and reap it."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def wait(self, deadline: float) -> Worker:
        """Wait until the worker exits or ``deadline`` (a ``time.perf_counter()`` value) passes, then kill it.

        Reads its output into ``stdout`` and ``stderr`` and removes its temporary folder; returns ``self``.
        """
        try:
            self.proc.wait(timeout=max(0.1, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            self.timed_out = True
            self.kill()
        self.seconds = time.perf_counter() - self.started
        self.rc = self.proc.returncode
        self.stdout = self.out.read_text("utf-8", errors="replace")
        self.stderr = self.err.read_text("utf-8", errors="replace")
        self._done = True
        if self._tmp is not None:
            self._tmp.cleanup()
        return self

    def result(self) -> dict[str, Any] | None:
        """The worker's ``RESULT`` (after :meth:`wait`), ``None`` if it printed none."""
        return parse_result(self.stdout)

    def failure(self) -> str:
        """Why no result came back (timeout, or the exit code), with the end of stderr."""
        why = "timeout" if self.timed_out else f"exit code {self.rc}, no result"
        return f"{why}: ...{self.stderr_tail()}"


def run_worker(
    argv: list[str], timeout: float, name: str = "worker", env: dict[str, str] | None = None
) -> Worker:
    """Start a :class:`Worker` and wait for it, at most ``timeout`` seconds."""
    return Worker(argv, name, env).wait(time.perf_counter() + timeout)


# ---------------------------------------------------------------------------------------------------- timing
def synchronize(device: bool | str | torch.device) -> None:
    """Wait for the GPU's queued work when ``device`` is a CUDA device (or ``True``); nothing otherwise.

    Before a clock read, so that the GPU work launched before it counts on its side of the read.
    """
    if isinstance(device, bool):
        if device:
            torch.cuda.synchronize()
    elif torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class StepWindow:
    """The timed window of one fit: from the start of training batch ``first`` to the end of batch ``last``.

    Batches are counted from 0 in the order they run, across epochs (not Lightning's per-epoch ``batch_idx``).
    With ``cuda``, ``torch.cuda.synchronize()`` runs right before each of the two clock reads and at no other
    point, so the window holds the GPU's work of exactly its batches and the measurement adds no sync per step.

    :meth:`callbacks` gives the two Lightning callbacks that drive it: put the first first in the Trainer's
    callback list and the second last, so the window holds every other callback's hooks of its batches, start and
    end alike. Without Lightning, call :meth:`batch_started` and :meth:`batch_ended` yourself.
    """

    first: int
    last: int
    cuda: bool = False
    started: int = 0  # batches begun
    ended: int = 0  # batches finished
    t_start: float | None = None
    t_end: float | None = None

    @property
    def steps(self) -> int:
        """Batches in the window."""
        return self.last - self.first + 1

    def batch_started(self) -> None:
        """At the start of every batch: the clock starts at batch ``first``."""
        if self.started == self.first:
            synchronize(self.cuda)
            self.t_start = time.perf_counter()
        self.started += 1

    def batch_ended(self) -> None:
        """At the end of every batch: the clock stops at batch ``last``."""
        if self.ended == self.last:
            synchronize(self.cuda)
            self.t_end = time.perf_counter()
        self.ended += 1

    @property
    def complete(self) -> bool:
        """Whether both ends of the window were reached."""
        return self.t_start is not None and self.t_end is not None

    def seconds(self) -> float | None:
        """The window's wall time, ``None`` if the fit did not reach both ends."""
        return self.t_end - self.t_start if self.t_start is not None and self.t_end is not None else None

    def steps_per_second(self) -> float | None:
        """Batches per second in the window, ``None`` if the fit did not reach both ends."""
        seconds = self.seconds()
        return None if seconds is None else self.steps / seconds

    def callbacks(self) -> tuple[Any, Any]:
        """``(start, end)``: Lightning callbacks calling :meth:`batch_started` and :meth:`batch_ended`."""
        start_cls, end_cls = _window_callback_classes()
        return start_cls(self), end_cls(self)


@functools.cache
def _window_callback_classes() -> tuple[type, type]:
    """The two callbacks of :meth:`StepWindow.callbacks`; built on demand, so that importing this needs no Lightning."""
    from lightning.pytorch.callbacks import Callback

    class WindowStart(Callback):
        """First in the callback list: starts the clock before any other hook of batch ``first`` runs."""

        def __init__(self, window: StepWindow) -> None:
            self.window = window

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.window.batch_started()

    class WindowEnd(Callback):
        """Last in the callback list: stops the clock after every other hook of batch ``last`` ran."""

        def __init__(self, window: StepWindow) -> None:
            self.window = window

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            self.window.batch_ended()

    for cls in (
        WindowStart,
        WindowEnd,
    ):  # Lightning names a callback by its qualified name (profiler, state key)
        cls.__qualname__ = cls.__name__
    return WindowStart, WindowEnd


def quiet_lightning() -> None:
    """Silence Lightning's info lines and all warnings, so that the output is the tables.

    Both namespaces: ``lightning_gpumem`` imports ``pytorch_lightning`` where it is installed, and Lightning's
    ``rank_zero_info`` then logs through ``pytorch_lightning``'s logger.
    """
    warnings.filterwarnings("ignore")
    names = ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric")
    for name in (*names, "lightning_utilities"):
        logging.getLogger(name).setLevel(logging.ERROR)


# Trainer arguments of a benchmark fit that should do nothing but train: no logger, checkpoints, bars or summary.
QUIET_TRAINER: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


# ---------------------------------------------------------------------------------------------------- rounds
def rotation(configs: Sequence[str], index: int) -> list[str]:
    """``configs`` rotated left by ``index`` (modulo their number): the order of round ``index``."""
    shift = index % len(configs)
    return [*configs[shift:], *configs[:shift]]


def interleaved_rounds(
    configs: Sequence[str],
    rounds: int,
    measure: Callable[[str], float],
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, float]]:
    """``rounds`` rounds of ``measure(config)`` for every config, the order rotated by one each round.

    Rotating spreads a drift of the machine (clocks, temperature, a neighbour) over all configurations alike;
    compare them within a round (per-round ratios), then take the median over rounds. Returns one dict per round,
    config to measurement, its keys in the order they ran. ``progress`` gets one line per measurement.
    """
    per_round: list[dict[str, float]] = []
    for index in range(rounds):
        row: dict[str, float] = {}
        for config in rotation(configs, index):
            row[config] = measure(config)
            if progress is not None:
                progress(f"round {index + 1}/{rounds}: {config}: {row[config]:.4g}")
        per_round.append(row)
    return per_round
