"""One trial measured: the peaks of its training steps and of its validation step, agreed across ranks.

Shared by ``BatchSizeTuner`` and ``MemoryPlanner``: both run trials through a :class:`TrialSession` and need
the same numbers from each (peak allocated per stage, peak reserved, allocator retries, the optimizer state's
size).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import lightning.pytorch as pl
import torch

from lightning_gpumem._hw.allocator import release_to
from lightning_gpumem._hw.probe import Probe, make_probe
from lightning_gpumem._pl.distributed import gather_named
from lightning_gpumem.tuning.search.model import Point, Trial
from lightning_gpumem.tuning.search.plan import Plan, Terms, Verdict
from lightning_gpumem.tuning.trials.session import TrialSession

LEFTOVER_BYTES = 2**20  # allocated above the start that is not worth a garbage collection (see `release_to`)


class TrialRunner:
    """``runner(size) -> Trial``: one trial at ``size`` from a fresh process's allocator layout, measured.

    Args:
        session: the open trial session.
        probe: the device's probe.
        steps: optimizer steps per trial.
        validate: run one validation batch where the fit validates.
        accumulation_for: ``accumulate_grad_batches`` for a size.
        check_batches: called with the size, the samples of each training batch, the dataset's length and
            whether the data ran out short of the size (to refuse a ``batch_arg_name`` that does not set the
            batch size).
        counts_samples: the size is a number of samples a batch holds (``False`` for a token budget): each
            trial then records the samples its largest batch held (:attr:`Trial.samples`).
    """

    def __init__(
        self,
        session: TrialSession,
        probe: Probe,
        *,
        steps: int,
        validate: bool,
        accumulation_for: Callable[[int], int],
        check_batches: BatchCheck | None = None,
        counts_samples: bool = True,
    ) -> None:
        self.session = session
        self.probe = probe
        self.steps = steps
        self.validate = validate
        self.accumulation_for = accumulation_for
        self.check_batches = check_batches
        self.counts_samples = counts_samples  # the size is a number of samples (not a token budget)
        self.baseline = probe.allocated_bytes()  # what each trial starts from, and the search ends at
        # the optimizers' state at the end of the last trial's training steps
        self.state_bytes: int | None = None

    def __call__(self, size: int) -> Trial:
        """Run one trial at ``size`` and measure it."""
        session, probe = self.session, self.probe
        trainer = session.trainer
        train: list[int | None] = [None, None]  # peak allocated and reserved of the training steps

        # the validation step's peaks are measured apart from the training steps'
        def after_training() -> None:
            train[:] = probe.read_peaks()
            probe.reset_peaks()
            self.state_bytes = optimizer_state_bytes(trainer)

        session.prepare(size, self.accumulation_for(size), self.steps, self.validate, after_training)
        # a fresh process's layout: no cache, no trial's tensors
        floor = release_to(probe, self.baseline, LEFTOVER_BYTES, blind=False)
        # what a full collection could not free is the run's (a lazily built buffer): kept
        if floor is not None:
            self.baseline = max(floor, self.baseline or 0)
        probe.reset_peaks()
        retries = probe.read(nvml=False, host=False).alloc_retries
        start = time.perf_counter()
        fits = session.run()
        seconds = time.perf_counter() - start
        after = probe.read(nvml=False, host=False).alloc_retries
        largest_batch = _largest_batch(session.batches_seen) if self.counts_samples else None
        # an epoch that ended on a batch short of the size: the data holds no more, whatever the attribute
        # does
        data_ended = session.epoch_ended and largest_batch is not None and largest_batch < size
        if self.check_batches is not None:
            self.check_batches(size, session.batches_seen, session.dataset_samples, data_ended=data_ended)
        end = list(probe.read_peaks())
        if session.validated:
            train_peaks, val_peaks = train, end
        else:
            train_peaks, val_peaks = ([_max(a, b) for a, b in zip(train, end, strict=True)], [None, None])
        # A reserved peak of validation alone is not measurable: the training steps' cache is still reserved
        # then.
        peaks = {
            "allocated": _max(train_peaks[0], val_peaks[0]),
            "reserved": _max(train_peaks[1], val_peaks[1]),
            "train_allocated": train_peaks[0],
            "val_allocated": val_peaks[0],
            "retries": None if retries is None or after is None else after - retries,
            "samples": largest_batch,
        }
        # all ranks measured the same sizes: agree on the largest peaks (nothing is communicated with one
        # process), and on the fewest samples a rank's largest batch had
        gathered = gather_named(trainer, peaks)
        samples = _int_or_none(gathered.pop("samples")[1])
        agreed = {name: _int_or_none(high) for name, (high, _) in gathered.items()}
        if not fits:
            agreed = dict.fromkeys(agreed)
        return Trial(
            size,
            fits=fits,
            peak_bytes=agreed["reserved"],
            seconds=seconds,
            allocated_bytes=agreed["allocated"],
            train_peak_bytes=agreed["train_allocated"],
            val_peak_bytes=agreed["val_allocated"],
            retries=agreed["retries"],
            samples=samples,
        )


class BatchCheck:
    """Refuses to report sizes that never ran.

    ``batch_arg_name`` must set the training batches' first dimension. Called after each trial with the size,
    the samples of each training batch and the dataset's length. Two sizes whose batches had the same number
    of samples, or that each made a dataset of exactly that many samples (the attribute sets the dataset's
    length, and every epoch is one batch of it), are refused with a ``ValueError``.
    """

    def __init__(self, owner: str, batch_arg_name: str) -> None:
        self.owner = owner
        self.name = batch_arg_name
        self.seen: dict[int, tuple[int, int | None]] = {}  # size: (largest batch, dataset length)

    def __call__(self, size: int, seen: list[int], samples: int | None, *, data_ended: bool = False) -> None:
        """Check the trial at ``size``.

        ``seen``, its training batches' samples; ``samples``, the dataset's length. ``data_ended``: the
        trial's epoch ended on a batch short of ``size`` (an iterable dataset or a sampler without a length
        that holds fewer samples): the data, not the attribute, bounded it, so it proves nothing.
        """
        if data_ended:
            return
        largest, name = max(seen, default=-1), self.name
        fix = (
            f" Build the dataloader's batch size from it (`DataLoader(..., batch_size=self.{name})`), or"
            " pass the name your code uses as `batch_arg_name`."
        )
        for other, (other_largest, other_samples) in self.seen.items() if largest >= 1 else ():
            if other == size:
                continue
            if largest != size and other_largest == largest:
                raise ValueError(
                    f"{self.owner}: setting `{name}` to {other} and to {size} gave training batches of"
                    f" {largest} samples both times, so `{name}` does not set the training dataloader's"
                    f" batch size.{fix}"
                )
            if samples == size and other_samples == other:
                raise ValueError(
                    f"{self.owner}: setting `{name}` to {other} and to {size} gave training datasets of"
                    f" {other} and {size} samples, so `{name}` sets the dataset's length, not the batch"
                    f" size.{fix}"
                )
        self.seen[size] = (largest, samples)


def _largest_batch(seen: list[int]) -> int | None:
    """Samples in the largest training batch a trial ran.

    0 where it ran none (a ``drop_last`` loader of fewer samples than the size), ``None`` where a batch
    cannot be counted (no tensor in it).
    """
    if any(size < 0 for size in seen):
        return None
    return max(seen, default=0)


def optimizer_state_bytes(trainer: pl.Trainer) -> int:
    """Bytes of the tensors in the optimizers' state (e.g. AdamW's two moments), on any device."""
    total = 0
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            for value in state.values() if isinstance(state, dict) else ():
                if isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
    return total


def module_bytes(module: torch.nn.Module) -> tuple[int, int]:
    """Bytes of the module's parameters and buffers, and of the gradients its trainable parameters get."""
    parameters = sum(p.numel() * p.element_size() for p in module.parameters())
    buffers = sum(b.numel() * b.element_size() for b in module.buffers())
    gradients = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    return parameters + buffers, gradients


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)


def _max(a: int | None, b: int | None) -> int | None:
    return a if b is None else b if a is None else max(a, b)


def plan_builder(
    trainer: pl.Trainer, probe: Probe, runner: TrialRunner, owner: object
) -> Callable[[list[Point], Verdict], Plan]:
    """``build(points, verdict) -> Plan`` with the terms measured on ``trainer``'s module and optimizers.

    Parameters and gradients come from the module, the optimizer state from the last trial's training steps,
    the memory outside PyTorch from NVML (``None`` where NVML cannot attribute memory to this process); what
    is left of the line's intercept is "other fixed". ``owner`` is the callback the NVML probe is made for.
    """
    outside_probe = make_probe(probe.device, owner, nvml=True) if probe.device.type == "cuda" else None

    def build(points: list[Point], verdict: Verdict) -> Plan:
        parameters, gradients = module_bytes(trainer.lightning_module)
        outside = outside_probe.read(host=False).non_torch_bytes if outside_probe is not None else None
        lines = Plan(points, verdict)
        state = runner.state_bytes
        terms = Terms(
            parameters=parameters,
            gradients=gradients,
            optimizer_state=state,
            other_fixed=float(lines.lines[0].intercept) - parameters - gradients - (state or 0),
            per_sample=float(lines.per_sample),
            outside=outside,
        )
        return Plan(points, verdict, outside, terms)

    return build
