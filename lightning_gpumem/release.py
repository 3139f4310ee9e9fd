"""EmptyCacheOnThreshold: give cached memory back to the device when this process holds too much of it.

Why a threshold and hysteresis, not ``empty_cache()`` every step: the caching allocator keeps freed blocks so
the next step can reuse them without a ``cudaMalloc``; emptying the cache every step makes every step pay for
those allocations again and frees nothing PyTorch itself could use. What the cache costs is the memory
*other* processes on the card cannot have. So this releases only when the process holds more than a set share
of its budget (after a one-off spike, say a validation pass with larger shapes), and, after a release, not
again until usage has been seen below the mark on its own or ``min_steps_between`` steps have passed: a run
whose steady state is above the mark releases at most once per ``min_steps_between`` steps, not every step.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from lightning_gpumem import keys
from lightning_gpumem._core.checks import is_collection, require_flags, require_int, require_trainer
from lightning_gpumem._core.units import GIB, format_gib
from lightning_gpumem._hw.probe import Probe, make_probe
from lightning_gpumem._pl.compat import Callback
from lightning_gpumem._pl.distributed import gather_values
from lightning_gpumem._pl.logging import batches_that_stepped, is_accumulating, log_to_loggers
from lightning_gpumem._pl.peers import budget_bytes

HOOKS = (
    "train_batch_end",
    "train_epoch_end",
    "validation_batch_end",
    "validation_end",
    "test_batch_end",
    "test_end",
    "predict_batch_end",
    "predict_end",
)
DEFAULT_HOOKS = ("train_batch_end", "validation_end")


def _hook_names(value: object, name: str) -> tuple[str, ...]:
    """``value``, a hook name or a collection of them (any sequence or set), as a tuple of names.

    A ``ValueError`` naming the argument otherwise; the names are checked one by one, so a long collection of
    something else (``range(10**12)``) is refused at its first item, and an iterator without a length is
    refused.
    """
    items = (value,) if isinstance(value, str) else value if is_collection(value) else ()
    hooks: list[str] = []
    for hook in items:
        if not isinstance(hook, str) or hook not in HOOKS:
            hooks = []
            break
        hooks.append(str(hook))  # a numpy or OmegaConf string as a plain `str` (the state key shows it)
    if not hooks:
        raise ValueError(
            f"`EmptyCacheOnThreshold({name}={value!r})` is not valid. Expected a name or a list of names,"
            f" one or more of {', '.join(HOOKS)}."
        )
    return tuple(hooks)


class ReleasePolicy:
    """When to release: above ``mark_bytes``; again only once seen below it or ``min_steps_between`` later.

    Pure logic, no device: ``should_release(usage, step)`` for each check, ``released(step)`` after a
    release.

    Example:
        >>> policy = ReleasePolicy(mark_bytes=100, min_steps_between=10)
        >>> policy.should_release(120, step=1)
        True
        >>> policy.released(step=1)
        >>> [policy.should_release(120, step=s) for s in (2, 5, 11)]  # still above: wait 10 steps
        [False, False, True]
        >>> policy.released(step=11)
        >>> policy.should_release(90, step=12), policy.should_release(120, step=13)  # fell below: re-armed
        (False, True)
    """

    def __init__(self, mark_bytes: int, min_steps_between: int) -> None:
        self.mark_bytes = mark_bytes
        self.min_steps_between = min_steps_between
        self._armed = True
        self._last_step: int | None = None

    def should_release(self, usage_bytes: int, step: int) -> bool:
        """Whether to release now, with ``usage_bytes`` in use at training step ``step``."""
        if usage_bytes <= self.mark_bytes:
            self._armed = True  # seen below the mark without our help
            return False
        if self._armed:
            return True
        return self._last_step is not None and step - self._last_step >= self.min_steps_between

    def released(self, step: int) -> None:
        """Record a release at ``step``."""
        self._armed = False
        self._last_step = step


@keys.document
class EmptyCacheOnThreshold(Callback):
    r"""Empty the allocator's cache when this process holds more than ``threshold`` of its budget.

    At each hook named in ``hooks`` it reads the memory the process holds (the allocator's reserved memory,
    or NVML's figure for the process with ``measure="nvml"``, which includes the CUDA context) and, when that
    exceeds ``threshold`` times the budget (a :class:`~lightning_gpumem.MemoryBudget`'s when there is one,
    else the device's memory), runs ``gc.collect()`` if asked, then ``empty_cache()``. After a release it
    waits until usage has been seen below the mark again, or ``min_steps_between`` training steps have
    passed, before the next. Each rank decides for itself, with no collective. Without an accelerator it
    warns once and does nothing.

    **Logged metrics** (to every logger on Lightning's logging steps, at the end of each validation during
    fit and at the end of training; the table comes from :mod:`lightning_gpumem.keys`):

    {logged_metrics}

    Args:
        threshold: fraction of the budget, in (0, 1], above which the cache is released.
        relative_to: ``"budget"``: a :class:`~lightning_gpumem.MemoryBudget`'s budget if one is among the
            callbacks, else the device's memory; ``"device"``: always the device's memory.
        measure: ``"reserved"``: memory held by PyTorch's caching allocator; ``"nvml"``: memory NVML
            attributes to this process (what ``nvidia-smi`` shows; falls back to reserved where NVML cannot
            see processes).
        collect_garbage: run ``gc.collect()`` before emptying the cache, so tensors held only by reference
            cycles are freed too (costs milliseconds with many Python objects).
        min_steps_between: training steps to wait after a release before another while usage stays above the
            mark.
        hooks: the hooks after which to check (a name, or any sequence or set of names), any of
            ``"train_batch_end"``, ``"train_epoch_end"``, ``"validation_batch_end"``, ``"validation_end"``,
            ``"test_batch_end"``, ``"test_end"``, ``"predict_batch_end"``, ``"predict_end"``.

    Raises:
        ValueError: if ``threshold`` is not in (0, 1], ``relative_to``/``measure``/``hooks`` name something
            else (``hooks``: also an iterator without a length, such as a generator), ``min_steps_between``
            is not an integer >= 0.
        TypeError: if ``collect_garbage`` is not a ``bool``.

    Example::

        from lightning import Trainer
        from lightning_gpumem import EmptyCacheOnThreshold, MemoryBudget

        # Share the card: hold at most 20 GiB, and give back what a validation spike left cached.
        trainer = Trainer(callbacks=[MemoryBudget("20GiB"), EmptyCacheOnThreshold(threshold=0.8)])
    """

    def __init__(
        self,
        threshold: float = 0.9,
        relative_to: Literal["budget", "device"] = "budget",
        measure: Literal["reserved", "nvml"] = "reserved",
        collect_garbage: bool = False,
        min_steps_between: int = 50,
        hooks: Sequence[str] = DEFAULT_HOOKS,
    ) -> None:
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, (int, float))
            or not 0.0 < threshold <= 1.0
        ):
            raise ValueError(
                f"`EmptyCacheOnThreshold(threshold={threshold!r})` is not valid. Expected a number in (0,"
                " 1]."
            )
        if not isinstance(relative_to, str) or relative_to not in ("budget", "device"):
            raise ValueError(
                f"`EmptyCacheOnThreshold(relative_to={relative_to!r})` is not valid. Expected 'budget' or"
                " 'device'."
            )
        if not isinstance(measure, str) or measure not in ("reserved", "nvml"):
            raise ValueError(
                f"`EmptyCacheOnThreshold(measure={measure!r})` is not valid. Expected 'reserved' or 'nvml'."
            )
        require_int("EmptyCacheOnThreshold", "min_steps_between", min_steps_between, 0)
        chosen = _hook_names(hooks, "hooks")
        require_flags("EmptyCacheOnThreshold", collect_garbage=collect_garbage)
        self.threshold = float(threshold)
        self.relative_to = relative_to
        self.measure = measure
        self.collect_garbage = collect_garbage
        self.min_steps_between = min_steps_between
        self.hooks = frozenset(chosen)

        self.releases = 0
        """Releases so far, on this rank."""
        self.released_bytes = 0
        """Reserved memory given back so far (before minus after, summed), in bytes, on this rank."""
        self.release_seconds = 0.0
        """Time spent releasing so far, in seconds, on this rank."""
        self._probe: Probe | None = None
        self._policy: ReleasePolicy | None = None
        self._total: int | None = None
        self._every_n = 0
        self._warned = False

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_trainer("EmptyCacheOnThreshold", trainer)
        device = trainer.strategy.root_device
        self._every_n = trainer.log_every_n_steps  # type: ignore[attr-defined]
        probe = (
            self._probe
            if self._probe is not None and self._probe.device == device
            else make_probe(device, self, nvml=self.measure == "nvml")
        )
        total = probe.total_bytes() if probe.has_allocator else None
        if total is None:
            self._probe = self._policy = None
            if not self._warned:
                self._warned = True
                rank_zero_warn(
                    f"EmptyCacheOnThreshold: `{device}` has no allocator cache to release; doing nothing."
                )
            return
        self._probe = probe
        self._total = total
        # the mark is set at the first check, once every callback (a MemoryBudget) is set up
        self._policy = None

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
        if "train_batch_end" in self.hooks:
            self._check(trainer)
        self._log(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if "train_epoch_end" in self.hooks:
            self._check(trainer)

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if "validation_batch_end" in self.hooks:
            self._check(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if "validation_end" in self.hooks:
            self._check(trainer)
        if self._probe is None:
            # not set up: outside a Trainer (Fabric), say so
            require_trainer("EmptyCacheOnThreshold", trainer)
            return
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            # every rank ends validation together: a release there shows at once
            self._log(trainer, now=True)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(trainer, now=True)  # the releases since the last logging step

    @override
    def on_test_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if "test_batch_end" in self.hooks:
            self._check(trainer)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if "test_end" in self.hooks:
            self._check(trainer)

    @override
    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if "predict_batch_end" in self.hooks:
            self._check(trainer)

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if "predict_end" in self.hooks:
            self._check(trainer)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._policy is not None:
            rank_zero_info(
                f"EmptyCacheOnThreshold: {self.releases} cache releases, {format_gib(self.released_bytes)}"
                f" given back, {self.release_seconds:.3f} s (mark {format_gib(self._policy.mark_bytes)})."
            )

    @property
    @override
    def state_key(self) -> str:
        """Unique per configuration, so two instances (say one per hook set) can both be in a Trainer."""
        return self._generate_state_key(
            threshold=self.threshold,
            relative_to=self.relative_to,
            measure=self.measure,
            hooks=sorted(self.hooks),
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "releases": self.releases,
            "released_bytes": self.released_bytes,
            "seconds": self.release_seconds,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.releases = int(state_dict.get("releases", 0))
        self.released_bytes = int(state_dict.get("released_bytes", 0))
        self.release_seconds = float(state_dict.get("seconds", 0.0))

    # ------------------------------------------------------------------ helpers
    def _usage(self, probe: Probe) -> int | None:
        if self.measure == "nvml":
            process = probe.read(nvml=True, host=False).nvml_process_bytes
            if process is not None:
                return process
        return probe.reserved_bytes()

    def _policy_for(self, trainer: pl.Trainer) -> ReleasePolicy | None:
        if self._policy is None and self._probe is not None and self._total:
            budget = budget_bytes(trainer) if self.relative_to == "budget" else None
            self._policy = ReleasePolicy(
                int(self.threshold * (budget or self._total)), self.min_steps_between
            )
        return self._policy

    def _check(self, trainer: pl.Trainer) -> None:
        probe, policy = self._probe, self._policy_for(trainer)
        if probe is None or policy is None:
            # not set up: outside a Trainer (Fabric), say so
            require_trainer("EmptyCacheOnThreshold", trainer)
            return
        usage = self._usage(probe)
        step = trainer.global_step
        if usage is None or not policy.should_release(usage, step):
            return
        start = time.perf_counter()
        before = probe.reserved_bytes() or 0
        if self.collect_garbage:
            gc.collect()
        probe.release_cache()
        after = probe.reserved_bytes() or 0
        self.release_seconds += time.perf_counter() - start
        self.releases += 1
        self.released_bytes += max(0, before - after)
        policy.released(step)

    def _log(self, trainer: pl.Trainer, now: bool = False) -> None:
        # Logging steps by the step count alone (not `should_stop`, which one rank may set alone): under DDP
        # every rank must reach the gather below together. `now`: a point every rank reaches together
        # (validation end, train end).
        if self._probe is None:
            # not set up: outside a Trainer (Fabric), say so
            require_trainer("EmptyCacheOnThreshold", trainer)
            return
        if not trainer.loggers or self._every_n <= 0:
            return
        if not now and ((batches_that_stepped(trainer) + 1) % self._every_n or is_accumulating(trainer)):
            return  # the cheap test first: this runs after every training batch
        values = [float(self.releases), self.released_bytes / GIB, self.release_seconds]
        names = tuple(key.format() for key in (keys.CACHE_RELEASES, keys.RELEASED, keys.RELEASE_SECONDS))
        if trainer.world_size > 1:  # collective on logging steps, which every rank reaches alike
            rows = gather_values(trainer, values)
            metrics = {
                f"{name}_rank{rank}": float(value)
                for rank, row in enumerate(rows)
                for name, value in zip(names, row, strict=True)
                if value is not None
            }
        else:
            metrics = dict(zip(names, values, strict=True))
        if trainer.is_global_zero:
            log_to_loggers(trainer, metrics, step=batches_that_stepped(trainer))
