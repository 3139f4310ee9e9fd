"""BatchSizeTuner must leave a fit exactly as trustworthy as one with the size set by hand.

A test (or a few) for each way a trial could leak into the run, grouped by what it could touch; the DDP agreement is
in `test_ddp_cpu.py` and the conformance matrix's DDP row. OOMs are simulated on CPU by raising the exception torch
raises; the tuner picks the largest size whose trial raises none.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import RandomDataset
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from lightning_gpumem import BatchSizeTuner
from lightning_gpumem._core.units import GIB, MIB
from tests.helpers.fakes import kept
from tests.helpers.tuning import (
    CPU_SEARCH,
    CappedFakeProbe,
    FakeTuner,
    FragileModel,
    OOMModel,
    tuner_trainer,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:`weights_only` was not set"),
    pytest.mark.filterwarnings("ignore:BatchSizeTuner. stopped at the upper bound"),
    pytest.mark.filterwarnings("ignore:.*could not find the monitored key"),
    pytest.mark.filterwarnings("ignore:.*You defined a `validation_step` but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:.*`training_step` returned `None`"),
]


def _oom(where: str = "") -> torch.cuda.OutOfMemoryError:
    return torch.cuda.OutOfMemoryError(f"CUDA out of memory (simulated{where})")


class InFit(Callback):
    """Marks the model once the real fit starts: callbacks never run during trials, so steps before it are trials'."""

    def on_train_start(self, trainer, pl_module):
        pl_module.in_fit = True


@contextmanager
def _info_records():
    """Collect INFO log records of Lightning (where `rank_zero_info` goes), the package and the root logger."""
    records: list[logging.LogRecord] = []

    class ListHandler(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = ListHandler(level=logging.INFO)
    loggers = [
        logging.getLogger(n) for n in ("lightning.fabric", "lightning.pytorch", "lightning_gpumem", "")
    ]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        yield records
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)


# --- What a trial runs: train mode, an optimizer step with accumulation, the user's hooks as often as by hand
class ModeModel(OOMModel):
    """Validation OOMs above 12; training OOMs above 66 in train mode but above 10 in eval mode.

    A trial that trains in eval mode after a validation OOM (at 16) measures the wrong thing: here it fails at 12,
    so the bug gives 10 where train-mode trials give 12.
    """

    def __init__(self):
        super().__init__(val_limit=12)
        self.in_fit = False
        self.trial_modes: list[tuple[int, bool]] = []

    def training_step(self, batch, batch_idx):
        if not self.in_fit:
            self.trial_modes.append((batch.shape[0], self.training))
        if batch.shape[0] > (66 if self.training else 10):
            raise _oom()
        return super().training_step(batch, batch_idx)


def test_every_trial_trains_in_train_mode_after_a_validation_oom():
    # Finding 2: an OOM in validation_step skips Lightning's return to train mode; the next trials trained in eval.
    model = ModeModel()
    tuner = BatchSizeTuner(max_val=CPU_SEARCH)
    tuner_trainer(None, callbacks=[tuner, InFit()], max_steps=2).fit(model)
    assert any(not t.fits for t in tuner.trials if t.batch_size > 12)  # validation did run out of memory
    assert model.trial_modes
    assert [n for n, training in model.trial_modes if not training] == []
    assert tuner.optimal_batch_size == model.batch_size == kept(12) == 12


class OptimizerStepOOM(OOMModel):
    """Training steps fit up to 70, but the optimizer step (its state, its update) only up to 47."""

    def __init__(self, batch_size: int = 2):
        super().__init__(batch_size=batch_size, train_limit=70)
        self.in_fit = False
        self.last_size = 0
        self.trial_accumulation: list[tuple[int, int]] = []
        self.optimizer_steps = 0

    def training_step(self, batch, batch_idx):
        self.last_size = batch.shape[0]
        if not self.in_fit:
            self.trial_accumulation.append((batch.shape[0], self.trainer.accumulate_grad_batches))
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer):
        if self.last_size > 47:
            raise _oom(" in the optimizer step")
        self.optimizer_steps += 1


def _fit_catching_oom(trainer, model) -> BaseException | None:
    try:
        trainer.fit(model)
    except torch.cuda.OutOfMemoryError as error:
        return error
    return None


def test_with_gradient_accumulation_every_trial_reaches_an_optimizer_step():
    # Finding 3: with accumulate_grad_batches=4 no trial reached an optimizer step, so its memory was never tried.
    model = OptimizerStepOOM()
    tuner = BatchSizeTuner(max_val=CPU_SEARCH)
    trainer = tuner_trainer(None, callbacks=[tuner, InFit()], accumulate_grad_batches=4, limit_val_batches=0)
    error = _fit_catching_oom(trainer, model)
    assert tuner.optimal_batch_size is not None
    assert tuner.optimal_batch_size <= 47
    assert error is None, f"the fit ran out of memory at the tuned size: {error}"
    assert trainer.accumulate_grad_batches == 4
    assert model.optimizer_steps > 0


class StateOOM(OOMModel):
    """Adam's state is the memory that runs out: a training step above 400 samples runs out of memory once the
    optimizer holds state (the second step on), as a real step does where the state no longer fits."""

    def __init__(self, batch_size: int = 2):
        super().__init__(batch_size=batch_size, n=640)
        self.in_fit = False
        self.trial_steps: dict[int, int] = {}

    def training_step(self, batch, batch_idx):
        size = batch.shape[0]
        if not self.in_fit:
            self.trial_steps[size] = self.trial_steps.get(size, 0) + 1
        if size > 400 and self.optimizers().optimizer.state:
            raise _oom(" with the optimizer's state")
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(self.train_data, batch_size=self.batch_size, shuffle=True, drop_last=True)


def test_a_trial_whose_epoch_is_shorter_than_its_steps_goes_on_into_the_next_epoch():
    # An epoch of one batch (sizes above 320 of 640 samples): a trial that stopped at the epoch's end ran one step,
    # the only one without the optimizer's state, so it took sizes whose second step runs out of memory.
    model = StateOOM()
    tuner = BatchSizeTuner(max_val=CPU_SEARCH, headroom=0.0)
    trainer = tuner_trainer(None, callbacks=[tuner, InFit()], max_epochs=3, limit_val_batches=0)
    error = _fit_catching_oom(trainer, model)
    assert error is None, f"the fit ran out of memory at the tuned size: {error}"
    assert tuner.optimal_batch_size is not None
    assert 396 <= tuner.optimal_batch_size <= 400  # the search closes to within 1%
    assert all(steps >= 2 for steps in model.trial_steps.values())  # the first with state ran in every trial
    assert trainer.global_step == 3 * (640 // tuner.optimal_batch_size)


def test_keep_effective_batch_searches_the_micro_batch_with_accumulation_scaled_per_trial():
    # Finding 3 (keep_effective_batch=True): each trial runs at its own accumulation, size x accumulation ~ 8 x 4.
    model = OptimizerStepOOM(batch_size=8)
    tuner = BatchSizeTuner(max_val=CPU_SEARCH, keep_effective_batch=True)
    trainer = tuner_trainer(None, callbacks=[tuner, InFit()], accumulate_grad_batches=4, limit_val_batches=0)
    error = _fit_catching_oom(trainer, model)
    assert model.trial_accumulation
    assert all(acc == max(1, round(32 / n)) for n, acc in model.trial_accumulation), model.trial_accumulation
    assert tuner.optimal_batch_size is not None
    assert tuner.optimal_batch_size <= 47
    assert error is None, f"the fit ran out of memory at the tuned size: {error}"
    assert trainer.accumulate_grad_batches == max(1, round(32 / tuner.optimal_batch_size))
    assert model.optimizer_steps > 0


class HookCounter(OOMModel):
    HOOKS = ("on_train_start", "on_train_epoch_start", "on_validation_start", "on_train_end")

    def __init__(self, batch_size: int = 2):
        super().__init__(batch_size=batch_size, train_limit=24)
        self.calls = dict.fromkeys(self.HOOKS, 0)

    def on_train_start(self):
        self.calls["on_train_start"] += 1

    def on_train_epoch_start(self):
        self.calls["on_train_epoch_start"] += 1

    def on_validation_start(self):
        self.calls["on_validation_start"] += 1

    def on_train_end(self):
        self.calls["on_train_end"] += 1


def test_user_module_hooks_run_as_often_as_in_a_fit_with_the_size_set_by_hand():
    # Finding 13: the module's on_train_start / on_train_epoch_start / on_validation_start ran once per trial.
    tuned = HookCounter()
    tuner_trainer(
        BatchSizeTuner(max_val=CPU_SEARCH), max_epochs=2, limit_train_batches=2, limit_val_batches=1
    ).fit(tuned)
    assert tuned.batch_size == kept(24)
    by_hand = HookCounter(batch_size=kept(24))
    tuner_trainer(None, callbacks=[], max_epochs=2, limit_train_batches=2, limit_val_batches=1).fit(by_hand)
    # validation starts three times: the sanity check, then the end of each epoch
    assert by_hand.calls == {
        "on_train_start": 1,
        "on_train_epoch_start": 2,
        "on_validation_start": 3,
        "on_train_end": 1,
    }
    assert tuned.calls == by_hand.calls


# --- What the fit sees afterwards: metrics, checkpoints, epoch aggregates, torchmetrics
class MetricModel(OOMModel):
    """Logs `val_loss`, a plain epoch mean and a torchmetrics MeanMetric; remembers the fit's own batch values."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        import torchmetrics

        self.in_fit = False
        self.mean_metric = torchmetrics.MeanMetric()
        self.fit_values: list[float] = []

    def training_step(self, batch, batch_idx):
        value = batch.mean() + 10.0 * batch.shape[0]  # trials run other sizes: their values stand out
        if self.in_fit:
            self.fit_values.append(float(value))
        self.mean_metric.update(value)
        self.log("metric_mean", self.mean_metric, on_step=False, on_epoch=True)
        self.log("plain_mean", value, on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        out = super().validation_step(batch, batch_idx)
        self.log("val_loss", out["x"].abs().mean() + batch.shape[0])
        return out


class MetricsAtTrainStart(Callback):
    def on_train_start(self, trainer, pl_module):
        self.keys = set(trainer.callback_metrics)


def test_no_trial_metric_is_in_the_fits_callback_metrics():
    # Finding 5: a trial's `val_loss` was in `trainer.callback_metrics` when the fit started (no sanity check).
    model = MetricModel(train_limit=16)
    at_start = MetricsAtTrainStart()
    tuner_trainer(
        None, callbacks=[BatchSizeTuner(max_val=CPU_SEARCH), at_start], max_steps=2, num_sanity_val_steps=0
    ).fit(model)
    assert at_start.keys == set()


def test_no_checkpoint_is_saved_or_ranked_from_a_trials_validation(tmp_path):
    # Finding 5: ModelCheckpoint(monitor="val_loss") saved and ranked a checkpoint scored by a trial's validation.
    model = MetricModel(train_limit=16)
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path, monitor="val_loss", save_top_k=-1, save_on_train_epoch_end=True, filename="{epoch}"
    )
    trainer = tuner_trainer(
        None,
        callbacks=[BatchSizeTuner(max_val=CPU_SEARCH), checkpoint],
        enable_checkpointing=True,
        max_epochs=2,
        limit_train_batches=2,
        check_val_every_n_epoch=2,  # the fit validates only at the end of epoch 1
        num_sanity_val_steps=0,
    )
    trainer.fit(model)
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["epoch=1.ckpt"]
    assert [Path(p).name for p in checkpoint.best_k_models] == ["epoch=1.ckpt"]


def test_epoch_aggregates_and_torchmetrics_count_only_the_fits_own_batches():
    # Finding 5: epoch aggregates and torchmetrics states included the trials' batches.
    model = MetricModel(train_limit=16)
    trainer = tuner_trainer(
        None,
        callbacks=[BatchSizeTuner(max_val=CPU_SEARCH), InFit()],
        limit_train_batches=3,
        limit_val_batches=0,
    )
    trainer.fit(model)
    assert len(model.fit_values) == 3
    expected = sum(model.fit_values) / 3
    assert float(trainer.callback_metrics["plain_mean"]) == pytest.approx(expected)
    assert float(trainer.callback_metrics["metric_mean"]) == pytest.approx(expected)


# --- Schedulers and the estimated stepping batches
class OneCycleModel(OOMModel):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        steps = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class SteppingAtTrainStart(Callback):
    def on_train_start(self, trainer, pl_module):
        self.estimated = trainer.estimated_stepping_batches
        self.total_steps = trainer.lr_scheduler_configs[0].scheduler.total_steps


def test_estimated_stepping_batches_and_the_schedule_derived_from_it_follow_the_tuned_size():
    # Finding 6: configure_optimizers ran before tuning, so OneCycleLR was sized for batch_size=2 (320 steps).
    model = OneCycleModel(train_limit=41)
    recorder = SteppingAtTrainStart()
    trainer = tuner_trainer(
        None, callbacks=[BatchSizeTuner(max_val=CPU_SEARCH), recorder], limit_val_batches=0
    )
    trainer.fit(model)
    steps = math.ceil(640 / kept(41))
    assert model.batch_size == kept(41)
    assert recorder.estimated == steps
    assert recorder.total_steps == steps, (
        f"OneCycleLR(total_steps={recorder.total_steps}), {steps} steps at {kept(41)}"
    )
    assert trainer.global_step == steps  # and the whole schedule ran: OneCycleLR raises past total_steps


def test_each_trial_starts_the_schedule_over_so_a_step_limited_schedule_survives_the_trials():
    # Found on the GPU: OneCycleLR sized for the initial 320 (2 steps) counted every trial's steps and raised
    # "Tried to step 3 times" in the second trial; each trial now starts from the run's scheduler and LR.
    model = OneCycleModel(batch_size=320, train_limit=41)
    tuner = BatchSizeTuner(max_val=CPU_SEARCH)
    trainer = tuner_trainer(tuner, limit_val_batches=0)
    trainer.fit(model)
    assert len(tuner.trials) > 2
    assert model.batch_size == kept(41)
    assert (
        trainer.global_step
        == trainer.lr_scheduler_configs[0].scheduler.total_steps
        == math.ceil(640 / kept(41))
    )


def test_a_schedule_shorter_than_the_trials_does_not_stop_them():
    # OneCycleLR(total_steps=1) at the initial 640 (one batch an epoch); every trial runs 2 optimizer steps.
    model = OneCycleModel(batch_size=640, train_limit=41)
    trainer = tuner_trainer(BatchSizeTuner(max_val=CPU_SEARCH), limit_val_batches=0)
    trainer.fit(model)
    assert model.batch_size == kept(41)
    assert (
        trainer.lr_scheduler_configs[0].scheduler.total_steps
        == trainer.global_step
        == math.ceil(640 / kept(41))
    )


# --- Parameters toggled by a multi-optimizer step
class TwoOptimizerModel(OOMModel):
    """Manual optimisation with two optimizers (GAN style); an OOM can strike between toggle and untoggle."""

    def __init__(self):
        super().__init__(train_limit=24)
        self.automatic_optimization = False
        self.other = nn.Linear(32, 2)

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        for optimizer, layer in ((opt_a, self.layer), (opt_b, self.other)):
            self.toggle_optimizer(optimizer)
            if batch.shape[0] > self.train_limit:
                raise _oom(" between toggle_optimizer and untoggle_optimizer")
            loss = layer(batch).pow(2).mean()
            if (
                loss.requires_grad
            ):  # (a layer left frozen would otherwise crash the step, hiding what is tested)
                self.manual_backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            self.untoggle_optimizer(optimizer)

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1), torch.optim.SGD(
            self.other.parameters(), lr=0.1
        )


def test_an_oom_between_toggle_and_untoggle_leaves_no_parameter_frozen():
    # Finding 10: an OOM between toggle_optimizer() and untoggle_optimizer() left parameters requires_grad=False.
    model = TwoOptimizerModel()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    tuner = BatchSizeTuner(max_val=CPU_SEARCH)
    tuner_trainer(tuner, max_steps=4, limit_val_batches=0).fit(model)
    assert tuner.optimal_batch_size == kept(24)
    assert [name for name, p in model.named_parameters() if not p.requires_grad] == []
    unchanged = [name for name, p in model.named_parameters() if torch.equal(p, before[name])]
    assert unchanged == [], "these parameters were never trained"


# --- Dataloaders: the user's generator, trial workers, loaders passed to fit, iterable datasets
class GeneratorModel(OOMModel):
    def __init__(self, batch_size: int = 2):
        super().__init__(batch_size=batch_size, train_limit=24)
        self.generator = torch.Generator().manual_seed(1234)

    def train_dataloader(self):
        return DataLoader(
            self.train_data, batch_size=self.batch_size, shuffle=True, generator=self.generator
        )


def test_trials_do_not_advance_a_users_dataloader_generator():
    # Finding 13: the trials drew from the `DataLoader(generator=g)` the user holds.
    seed_everything(3)
    tuned = GeneratorModel()
    tuner_trainer(BatchSizeTuner(max_val=CPU_SEARCH), max_steps=3).fit(tuned)
    assert tuned.batch_size == kept(24)
    seed_everything(3)
    by_hand = GeneratorModel(batch_size=kept(24))
    tuner_trainer(None, callbacks=[], max_steps=3).fit(by_hand)
    assert torch.equal(tuned.generator.get_state(), by_hand.generator.get_state())


class WorkerModel(OOMModel):
    def __init__(self, batch_size: int = 2, persistent: bool = True):
        super().__init__(batch_size=batch_size, train_limit=20)
        self.persistent = persistent

    def train_dataloader(self):
        return DataLoader(
            self.train_data, batch_size=self.batch_size, num_workers=2, persistent_workers=self.persistent
        )

    def val_dataloader(self):
        return DataLoader(
            self.val_data, batch_size=self.batch_size, num_workers=2, persistent_workers=self.persistent
        )


class ChildProcesses(Callback):
    """Live child processes (DataLoader workers) at fit start (before the tuner) and when training starts."""

    def __init__(self, when: str):
        self.when = when
        self.counts: dict[str, int] = {}

    def _count(self, name):
        self.counts[name] = len(multiprocessing.active_children())

    def on_fit_start(self, trainer, pl_module):
        if self.when == "fit_start":
            self._count("fit_start")

    def on_train_start(self, trainer, pl_module):
        if self.when == "train_start":
            self._count("train_start")


def _new_workers(model, tuner) -> int:
    before, after = ChildProcesses("fit_start"), ChildProcesses("train_start")
    callbacks = [before, *([tuner] if tuner else []), after]
    tuner_trainer(None, callbacks=callbacks, max_steps=2, limit_val_batches=1, num_sanity_val_steps=0).fit(
        model
    )
    return after.counts["train_start"] - before.counts["fit_start"]


@pytest.mark.parametrize("persistent", [True, False])
def test_trial_dataloader_workers_are_not_alive_during_the_fit(persistent):
    # Finding 13: the trials' persistent DataLoader workers stayed alive through the fit. Workers are told to exit
    # when a trial ends (an OOM included) and reaped when the trials end.
    by_hand = _new_workers(WorkerModel(batch_size=kept(20), persistent=persistent), None)
    tuned_model = WorkerModel(persistent=persistent)
    tuner = BatchSizeTuner(max_val=24)
    tuned = _new_workers(tuned_model, tuner)
    assert tuned_model.batch_size == kept(20)
    assert tuner.result.num_ooms >= 1
    assert tuned == by_hand, (
        f"{tuned} worker processes alive when training starts, {by_hand} without the tuner"
    )


CLI_CONFIG = """
trainer:
  accelerator: cpu
  max_steps: 2
  limit_val_batches: 1
  logger: false
  enable_progress_bar: false
  enable_checkpointing: false
  enable_model_summary: false
  default_root_dir: {root}
  callbacks:
    - class_path: lightning_gpumem.BatchSizeTuner
      init_args:
        max_val: 1000000
model:
  train_limit: 24
"""


def test_dataloaders_passed_to_fit_are_refused_rather_than_misreported():
    # Finding 9: with `trainer.fit(model, train_dataloaders=...)` the tuner reported 256 though every batch had 8.
    model = OOMModel(batch_size=8)
    loader = DataLoader(RandomDataset(32, 256), batch_size=8)
    with pytest.raises(ValueError, match=r"trainer\.fit") as info:
        tuner_trainer(BatchSizeTuner(max_val=CPU_SEARCH), max_steps=1, limit_val_batches=0).fit(
            model, train_dataloaders=loader
        )
    message = str(info.value)
    assert "LightningModule" in message or "DataModule" in message, message
    assert model.batch_size == 8


class Stream(IterableDataset):
    def __init__(self, n: int = 256):
        self.n = n

    def __iter__(self):
        return (torch.randn(32) for _ in range(self.n))


class StreamModel(OOMModel):
    def train_dataloader(self):
        return DataLoader(Stream(), batch_size=self.batch_size)


def test_an_iterable_dataset_needs_max_val():
    # Finding 9: an IterableDataset of 256 samples was "tuned" to 8192 (no length, no max_val).
    probe = CappedFakeProbe()  # a device with memory to measure: the search needs a bound
    with pytest.raises(ValueError, match="max_val"):
        tuner_trainer(FakeTuner(probe), max_steps=1, limit_val_batches=0).fit(StreamModel())
    model = StreamModel()
    tuner = BatchSizeTuner(max_val=32)
    tuner_trainer(tuner, max_steps=1, limit_val_batches=0).fit(model)
    assert tuner.optimal_batch_size == model.batch_size == 32


# --- Validation: none, without a loader, an integer interval
def test_limit_val_batches_zero_means_validation_does_not_decide_the_size():
    # Finding 7: trials overrode `limit_val_batches=0` with 1, so validation that never runs set the size.
    model = OOMModel(train_limit=40, val_limit=10)
    tuner = BatchSizeTuner(max_val=CPU_SEARCH)
    tuner_trainer(tuner, max_steps=1, limit_val_batches=0).fit(model)
    assert tuner.optimal_batch_size == model.batch_size == kept(40)


class NoValLoaderModel(LightningModule):
    """A `validation_step` but no `val_dataloader` (Lightning skips validation with a warning)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(32, 2)
        self.batch_size = 2
        self.data = RandomDataset(32, 640)

    def training_step(self, batch, batch_idx):
        if batch.shape[0] > 20:
            raise _oom()
        return self.layer(batch).sum()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.layer(batch).sum())

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("include_validation", [True, False])
def test_validation_step_without_val_dataloader_does_not_break_the_tuner(include_validation):
    # Finding 7: a module with `validation_step` but no `val_dataloader` crashed the tuner.
    model = NoValLoaderModel()
    tuner = BatchSizeTuner(max_val=CPU_SEARCH, include_validation=include_validation)
    trainer = tuner_trainer(tuner, max_steps=2)
    trainer.fit(model)
    assert tuner.optimal_batch_size == model.batch_size == kept(20)
    assert trainer.global_step == 2


def test_an_integer_val_check_interval_bounds_the_size_after_limit_train_batches():
    # Finding 12: the upper bound from `val_check_interval=5` ignored `limit_train_batches=0.5`; the fit then
    # crashed in Lightning (val_check_interval larger than the number of training batches).
    model = OOMModel(train_limit=1000, n=640)
    tuner = BatchSizeTuner(max_val=CPU_SEARCH)
    trainer = tuner_trainer(
        tuner, max_epochs=1, val_check_interval=5, limit_train_batches=0.5, limit_val_batches=1
    )
    trainer.fit(model)
    assert tuner.optimal_batch_size is not None
    assert tuner.optimal_batch_size >= 32  # bounded, not collapsed
    assert trainer.num_training_batches >= 5
    assert int(math.ceil(640 / tuner.optimal_batch_size) * 0.5) >= 5


def test_a_size_kept_that_does_not_run_resumes_the_search_below_it():
    # Finding 12: a size failing its last trial fell back to an earlier accepted size far below; the largest size
    # below it that runs (67) is the right answer.
    probe = CappedFakeProbe(holes=(68,), base=2 * GIB, total=80 * GIB)
    model = FragileModel(probe, per_sample=300 * MIB, n=100_000)
    tuner = FakeTuner(probe, budget="24GiB", headroom=0.1, include_validation=False)
    tuner_trainer(tuner, max_steps=1, limit_val_batches=0).fit(model)
    assert tuner.optimal_batch_size == model.batch_size == 67, [(t.batch_size, t.fits) for t in tuner.trials]


# --- Resume
class AdamModel(OOMModel):
    """Optimizer state (Adam) and a per-step LR schedule: what a resume must bring back."""

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ResumeRecorder(Callback):
    def __init__(self):
        self.first_batch = None

    def on_train_start(self, trainer, pl_module):
        self.step, self.epoch = trainer.global_step, trainer.current_epoch
        self.opt_state = {
            k: v["exp_avg"].clone() for k, v in trainer.optimizers[0].state_dict()["state"].items()
        }
        self.sched_last_epoch = trainer.lr_scheduler_configs[0].scheduler.last_epoch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.first_batch is None:
            self.first_batch = (trainer.global_step, batch.shape[0])


def _fit_and_checkpoint(tmp_path) -> tuple[int, Path, dict]:
    model = AdamModel(train_limit=41)
    tuner = BatchSizeTuner(max_val=CPU_SEARCH)
    trainer = tuner_trainer(tuner, max_epochs=1, limit_train_batches=3, default_root_dir=tmp_path)
    trainer.fit(model)
    assert tuner.optimal_batch_size == kept(41)
    assert trainer.global_step == 3
    path = tmp_path / "fit1.ckpt"
    trainer.save_checkpoint(path)
    return kept(41), path, torch.load(path, weights_only=False)


def _assert_resumed(recorder: ResumeRecorder, checkpoint: dict) -> None:
    assert (recorder.step, recorder.epoch) == (3, 1), "the fit restarted instead of resuming"
    saved = checkpoint["optimizer_states"][0]["state"]
    assert recorder.opt_state, "the optimizer state was not restored"
    assert sorted(recorder.opt_state) == sorted(saved)
    assert all(torch.equal(recorder.opt_state[k], saved[k]["exp_avg"]) for k in saved)
    assert recorder.sched_last_epoch == 3, "the LR schedule restarted"


def test_resume_keeps_the_training_state_and_reuses_the_checkpointed_size_without_trials(tmp_path):
    # Finding 1: `fit(ckpt_path=...)` with a tuner restarted at step 0 / epoch 0 with empty optimizer state.
    size, path, checkpoint = _fit_and_checkpoint(tmp_path)
    model = AdamModel(train_limit=41)  # batch_size=2 until the tuner applies the checkpointed size
    tuner, recorder = BatchSizeTuner(max_val=CPU_SEARCH), ResumeRecorder()
    trainer = tuner_trainer(
        None, callbacks=[tuner, recorder], max_epochs=2, limit_train_batches=3, default_root_dir=tmp_path
    )
    with _info_records() as records:
        trainer.fit(model, ckpt_path=path)
    _assert_resumed(recorder, checkpoint)
    assert tuner.trials == ()
    assert tuner.state_dict()["batch_size"] == size
    assert model.batch_size == size
    assert recorder.first_batch == (3, size)
    assert trainer.global_step == 6
    assert any("restored from the checkpoint" in r.getMessage() for r in records)


def test_retune_on_resume_runs_trials_and_still_keeps_the_training_state(tmp_path):
    # Finding 1 (retune_on_resume=True): trials run, the restored step, optimizer and schedule are kept.
    _, path, checkpoint = _fit_and_checkpoint(tmp_path)
    model = AdamModel(
        train_limit=30
    )  # the memory changed since the checkpoint: the retuned size must show it
    tuner, recorder = BatchSizeTuner(max_val=CPU_SEARCH, retune_on_resume=True), ResumeRecorder()
    trainer = tuner_trainer(
        None, callbacks=[tuner, recorder], max_epochs=2, limit_train_batches=3, default_root_dir=tmp_path
    )
    trainer.fit(model, ckpt_path=path)
    _assert_resumed(recorder, checkpoint)
    assert tuner.trials
    assert model.batch_size == tuner.optimal_batch_size == kept(30)
    assert recorder.first_batch == (3, kept(30))
    assert trainer.global_step == 6


# --- Errors inside a trial and scale_from's hooks
class RaisingModel(OOMModel):
    """Raises `error` (not an OOM) once a batch is larger than 4; batch size held as attribute and in hparams."""

    def __init__(self, error: type[BaseException]):
        super().__init__(batch_size=2)
        self.save_hyperparameters({"batch_size": 2})
        self.error = error

    def training_step(self, batch, batch_idx):
        if batch.shape[0] > 4:
            raise self.error("raised by the user's training_step")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_an_error_inside_a_trial_puts_the_original_batch_size_back(error):
    # Finding 8: an error or KeyboardInterrupt in a trial left the trial's batch size on model, hparams, dataloader.
    model = RaisingModel(error)
    trainer = tuner_trainer(BatchSizeTuner(max_val=CPU_SEARCH))
    handler = signal.getsignal(signal.SIGINT)  # Lightning ignores SIGINT after a KeyboardInterrupt
    try:
        with pytest.raises(
            (ValueError, KeyboardInterrupt, SystemExit)
        ):  # Lightning turns Ctrl+C into exit(1)
            trainer.fit(model)
    finally:
        signal.signal(signal.SIGINT, handler)
    assert model.batch_size == 2
    assert model.hparams.batch_size == 2
    loader = trainer.train_dataloader
    assert loader is None or loader.batch_size == 2


class ScaleFrom(BatchSizeTuner):
    """Calls `scale()` from one hook (once), not from on_fit_start."""

    def __init__(self, hook: str, epoch: int = 0):
        super().__init__(max_val=CPU_SEARCH)
        self.hook, self.epoch, self.calls = hook, epoch, 0
        for name in (
            "on_train_batch_start",
            "on_train_epoch_start",
            "on_train_epoch_end",
            "on_validation_epoch_end",
        ):
            if name == hook:
                setattr(self, name, self._scale_once)

    def on_fit_start(self, trainer, pl_module):
        return

    def _scale_once(self, trainer, pl_module, *args, **kwargs):
        if self.calls == 0 and trainer.current_epoch == self.epoch and not trainer.sanity_checking:
            self.calls += 1
            self.scale(trainer, pl_module)


@pytest.mark.parametrize("hook", ["on_train_batch_start", "on_train_epoch_end", "on_validation_epoch_end"])
def test_scale_from_an_unsupported_hook_raises_a_runtime_error_naming_it(hook):
    # Finding 11: from on_train_epoch_end / on_validation_epoch_end an AssertionError; from on_train_batch_start
    # the epoch silently ran half its samples.
    model = OOMModel(batch_size=16, train_limit=32)
    with pytest.raises(RuntimeError, match=hook):
        tuner_trainer(ScaleFrom(hook), max_epochs=1, limit_train_batches=4, limit_val_batches=1).fit(model)


class SampleCounter(Callback):
    def __init__(self):
        self.samples: dict[int, int] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.samples[trainer.current_epoch] = self.samples.get(trainer.current_epoch, 0) + batch.shape[0]


def test_scale_from_on_train_epoch_start_is_supported_and_the_epoch_sees_every_sample():
    # Finding 11 (control for the refusal above): on_train_epoch_start stays supported.
    model = OOMModel(batch_size=16, train_limit=32, n=640)
    tuner, counter = ScaleFrom("on_train_epoch_start", epoch=1), SampleCounter()
    trainer = tuner_trainer(None, callbacks=[tuner, counter], max_epochs=2)
    trainer.fit(model)
    assert tuner.optimal_batch_size == model.batch_size == kept(32)
    assert counter.samples == {0: 640, 1: 640}
    assert trainer.global_step == 40 + math.ceil(640 / kept(32))


# --- LightningCLI
@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
@pytest.mark.filterwarnings("ignore:No seed found")
def test_lightning_cli_records_the_tuned_size_next_to_its_config(tmp_path, monkeypatch):
    # Finding 13: under LightningCLI the tuned size was written nowhere next to the saved config.yaml.
    monkeypatch.setenv("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
    pytest.importorskip("jsonargparse")
    yaml = pytest.importorskip("yaml")
    from lightning.pytorch.cli import LightningCLI

    root = tmp_path / "run"
    source = tmp_path / "input.yaml"
    source.write_text(CLI_CONFIG.format(root=root))
    cli = LightningCLI(OOMModel, args=["fit", "--config", str(source)])
    assert cli.model.batch_size == kept(24)
    (saved,) = list(root.rglob("config.yaml"))
    written = saved.with_name("gpumem_batch_size.yaml")
    assert written.is_file(), f"no {written.name} next to {saved}"
    assert yaml.safe_load(written.read_text()) == {"batch_size": kept(24)}
