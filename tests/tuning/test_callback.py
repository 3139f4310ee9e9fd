"""BatchSizeTuner under a real CPU Trainer: simulated OOMs (exception types torch raises) and a fake allocator."""

from __future__ import annotations

import math
import time

import pytest
import torch
from lightning.pytorch import Callback, LightningDataModule, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader

from lightning_gpumem import BatchSizeTuner
from lightning_gpumem._core.units import GIB, MIB
from lightning_gpumem._hw.probe import MemorySample
from tests.helpers.fakes import FakeProbe, kept
from tests.helpers.tuning import (
    CPU_SEARCH,
    CappedFakeProbe,
    FakeTuner,
    FragileModel,
    MemoryModel,
    OOMModel,
    tuner_trainer,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:`weights_only` was not set"),
    pytest.mark.filterwarnings("ignore:BatchSizeTuner. stopped at the upper bound"),
]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"headroom": 1.0}, r"headroom=1.0.*\[0, 1\)"),
        ({"headroom": -0.1}, r"headroom=-0.1"),
        ({"init_val": 0}, r"init_val=0.*>= 1"),
        ({"steps_per_trial": 0}, r"steps_per_trial=0"),
        ({"max_val": 1, "init_val": 2}, r"max_val=1.*>= init_val"),
        ({"budget": "24 parsecs"}, r"budget='24 parsecs'"),
        ({"budget": 2.0}, r"budget=2.0.*\(0, 1\]"),
        ({"batch_arg_name": ""}, r"batch_arg_name=''"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BatchSizeTuner(**kwargs)


def test_missing_batch_attribute_is_named():
    model = OOMModel()
    with pytest.raises(AttributeError, match=r"batch_arg_name='bs'.*attribute `bs`"):
        tuner_trainer(BatchSizeTuner(max_val=CPU_SEARCH, batch_arg_name="bs")).fit(model)


def test_finds_the_exact_oom_boundary_and_fits_with_it():
    model = OOMModel(train_limit=41)
    tuner = BatchSizeTuner(max_val=CPU_SEARCH)
    trainer = tuner_trainer(tuner)
    trainer.fit(model)
    assert {(41, True), (42, False)} <= {(t.batch_size, t.fits) for t in tuner.trials}  # the boundary
    assert tuner.optimal_batch_size == model.batch_size == kept(41) == 39  # 38.95: at most 5% of it given up
    assert tuner.result.reason == "bracketed"
    assert any(not t.fits for t in tuner.trials)
    assert all(t.fits for t in tuner.trials if t.batch_size <= 41)
    assert trainer.global_step == -(-640 // 39)  # the real fit ran one epoch at 39


@pytest.mark.parametrize(
    ("limit", "headroom", "expected"),
    [(9, 0.0, 9), (9, 0.05, 9), (9, 0.5, 5), (40, 0.05, 38), (40, 0.02, 40), (19, 0.05, 19), (21, 0.05, 20)],
)
def test_the_size_kept_is_the_smallest_that_gives_up_at_most_the_headroom(limit, headroom, expected):
    # 0.95 * 9 = 8.55: giving up one size would be 11%; 0.95 * 40 = 38 exactly (not 38.000000000000004 -> 39)
    model = OOMModel(train_limit=limit)
    tuner = BatchSizeTuner(max_val=CPU_SEARCH, headroom=headroom, include_validation=False)
    tuner_trainer(tuner, limit_val_batches=0, max_steps=1).fit(model)
    assert tuner.optimal_batch_size == model.batch_size == expected


def test_headroom_is_a_share_of_one_less_than_the_smallest_size_that_failed_where_the_search_closed_in():
    model = OOMModel(train_limit=560, n=100_000)  # 560 runs, 561 does not
    tuner = BatchSizeTuner(max_val=CPU_SEARCH, include_validation=False)
    tuner_trainer(tuner, limit_val_batches=0, max_steps=1).fit(model)
    result = tuner.result
    ran = max(t.batch_size for t in result.trials if t.fits and t.batch_size <= 560)
    failed = min(t.batch_size for t in result.trials if not t.fits)
    assert ran < failed - 1  # the search stopped within 1%, short of the boundary
    assert result.reason == "bracketed"
    assert tuner.optimal_batch_size == math.ceil(0.95 * (failed - 1)) >= 0.95 * 560


def test_validation_is_part_of_every_trial():
    model = OOMModel(train_limit=50, val_limit=20)
    tuner = BatchSizeTuner(max_val=CPU_SEARCH)
    tuner_trainer(tuner).fit(model)
    assert tuner.optimal_batch_size == kept(20)
    model = OOMModel(train_limit=50, val_limit=20)
    tuner = BatchSizeTuner(max_val=CPU_SEARCH, include_validation=False)
    tuner_trainer(tuner, limit_val_batches=0).fit(model)
    assert kept(50) <= tuner.optimal_batch_size <= 50  # closed to within 2%: 51 may not have run


def test_memory_guided_search_respects_budget_and_headroom():
    probe = FakeProbe(base=2 * GIB, total=80 * GIB)
    model = MemoryModel(probe, per_sample=300 * MIB, n=100_000)
    tuner = FakeTuner(probe, budget="24GiB", headroom=0.1, include_validation=False)
    tuner_trainer(tuner, max_steps=1, limit_val_batches=0).fit(model)
    largest = int((24 * GIB - 2 * GIB) // (300 * MIB))
    best = kept(largest, 0.1)
    assert tuner.optimal_batch_size == best
    assert (largest, True) in {(t.batch_size, t.fits) for t in tuner.trials}  # the largest that runs
    assert tuner.budget_bytes == 24 * GIB
    assert len(tuner.trials) <= 5
    chosen = next(t for t in tuner.trials if t.batch_size == best)
    assert chosen.peak_bytes <= 24 * GIB


def test_no_oom_on_cpu_stops_at_the_dataset_size_with_a_warning():
    model = OOMModel(n=48)
    tuner = BatchSizeTuner(max_val=CPU_SEARCH)
    with pytest.warns(UserWarning, match=r"upper bound 48 .*no memory could be measured on `cpu`"):
        tuner_trainer(tuner).fit(model)
    assert tuner.optimal_batch_size == 48
    assert tuner.result.reason == "upper_bound"


def test_with_max_val_a_budget_in_bytes_on_a_cpu_searches_with_real_steps_and_says_once_it_is_not_applied():
    # without max_val it is traced instead (tests/tuning/test_traced_planner.py)
    tuner = BatchSizeTuner(budget="1000GiB", max_val=8)
    with pytest.warns(UserWarning, match=r"`budget='1000GiB'` is not applied on `cpu`") as record:
        tuner_trainer(tuner).fit(OOMModel())
    assert sum("is not applied" in str(w.message) for w in record) == 1
    assert tuner.trials  # real trials ran


def test_a_fraction_of_the_device_on_a_cpu_says_once_that_it_is_not_applied():
    # a budget in bytes is traced instead (tests/tuning/test_traced_planner.py)
    tuner = BatchSizeTuner(budget=0.5, max_val=8)
    with pytest.warns(UserWarning, match=r"`budget=0.5` is not applied on `cpu`") as record:
        tuner_trainer(tuner).fit(OOMModel())
    assert sum("is not applied" in str(w.message) for w in record) == 1


def test_limit_train_batches_zero_skips_the_tuner_without_running_a_trial():
    model = OOMModel()
    tuner = BatchSizeTuner(max_val=CPU_SEARCH)
    with pytest.warns(UserWarning, match="limit_train_batches=0"):
        tuner_trainer(tuner, limit_train_batches=0).fit(model)
    assert tuner.trials == ()
    assert model.batch_size == 2


def test_max_val_is_never_exceeded_and_was_run():
    model = OOMModel()
    tuner = BatchSizeTuner(max_val=100)
    tuner_trainer(tuner).fit(model)
    assert tuner.optimal_batch_size == 100
    assert max(t.batch_size for t in tuner.trials) == 100


def test_nothing_fits_raises_and_restores_the_batch_size():
    model = OOMModel(batch_size=8, train_limit=0)
    with pytest.raises(RuntimeError, match="even batch_size=1 does not fit"):
        tuner_trainer(BatchSizeTuner(max_val=CPU_SEARCH)).fit(model)
    assert model.batch_size == 8


def test_user_errors_are_not_swallowed():
    class Broken(OOMModel):
        def training_step(self, batch, batch_idx):
            if batch.shape[0] > 4:
                raise ValueError("shape mismatch in user code")
            return super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match="shape mismatch in user code"):
        tuner_trainer(BatchSizeTuner(max_val=CPU_SEARCH)).fit(Broken())


def test_no_trace_left_weights_equal_a_run_with_the_size_set_by_hand():
    seed_everything(7)
    tuned = OOMModel(train_limit=24)
    trainer = tuner_trainer(BatchSizeTuner(max_val=CPU_SEARCH))
    trainer.fit(tuned)
    assert tuned.batch_size == kept(24)

    seed_everything(7)
    by_hand = OOMModel(batch_size=kept(24), train_limit=24)
    reference = tuner_trainer(None, callbacks=[])
    reference.fit(by_hand)

    assert trainer.global_step == reference.global_step
    assert trainer.current_epoch == reference.current_epoch
    for (name, a), (_, b) in zip(tuned.state_dict().items(), by_hand.state_dict().items()):
        assert torch.equal(a, b), name
    opt_a, opt_b = trainer.optimizers[0].state_dict(), reference.optimizers[0].state_dict()
    assert opt_a["param_groups"] == opt_b["param_groups"]
    assert (
        trainer.lr_scheduler_configs[0].scheduler.state_dict()
        == reference.lr_scheduler_configs[0].scheduler.state_dict()
    )


def test_rng_and_callback_state_are_restored():
    class Recorder(Callback):
        def __init__(self):
            self.fit_starts = 0
            self.batches = 0

        def on_fit_start(self, trainer, pl_module):
            self.fit_starts += 1
            self.rng_at_start = torch.get_rng_state().clone()

        def on_train_batch_end(self, *args):
            self.batches += 1

        def state_dict(self):
            return {"batches": self.batches}

    class RngProbe(Callback):
        def on_fit_start(self, trainer, pl_module):
            self.rng = torch.get_rng_state().clone()

    before = RngProbe()
    after = RngProbe()
    recorder = Recorder()
    model = OOMModel(train_limit=16)
    trainer = tuner_trainer(
        None, callbacks=[before, BatchSizeTuner(max_val=CPU_SEARCH), after, recorder], max_steps=3
    )
    trainer.fit(model)
    assert torch.equal(before.rng, after.rng)  # trials drew random numbers; none of it shows
    assert recorder.fit_starts == 1
    assert recorder.batches == 3  # trial batches never reached the user's callbacks


def test_keep_effective_batch_adjusts_accumulation():
    model = OOMModel(batch_size=4, train_limit=16)
    tuner = BatchSizeTuner(max_val=CPU_SEARCH, keep_effective_batch=True)
    trainer = tuner_trainer(tuner, accumulate_grad_batches=8)
    trainer.fit(model)
    assert model.batch_size == kept(16) == 16
    assert trainer.accumulate_grad_batches == 2  # 16 x 2 = 4 x 8


@pytest.mark.filterwarnings("ignore:You defined a .validation_step. but have no .val_dataloader.")
def test_writes_to_the_datamodule_like_lightning():
    class DM(LightningDataModule):
        def __init__(self):
            super().__init__()
            self.save_hyperparameters({"batch_size": 2})

        def train_dataloader(self):
            return DataLoader(RandomDataset(32, 640), batch_size=self.hparams.batch_size)

    class Plain(BoringModel):
        def training_step(self, batch, batch_idx):
            if batch.shape[0] > 30:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
            return super().training_step(batch, batch_idx)

    dm = DM()
    tuner = BatchSizeTuner(max_val=CPU_SEARCH, include_validation=False)
    tuner_trainer(tuner, limit_val_batches=0).fit(Plain(), datamodule=dm)
    assert dm.hparams.batch_size == kept(30)


def test_mid_training_scale_counts_trial_steps_from_the_current_step():
    class RetuneAtEpoch1(BatchSizeTuner):
        def __init__(self) -> None:
            super().__init__(max_val=CPU_SEARCH)

        def on_fit_start(self, trainer, pl_module):
            return

        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 1:
                self.step_before = trainer.global_step
                self.scale(trainer, pl_module)
                self.step_after = trainer.global_step

    class Sizes(Callback):
        def __init__(self):
            self.sizes = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.sizes.append((trainer.current_epoch, batch.shape[0]))

    model = OOMModel(batch_size=16, train_limit=32, n=640)
    tuner = RetuneAtEpoch1()
    sizes = Sizes()
    trainer = tuner_trainer(
        None, callbacks=[tuner, sizes], max_epochs=2, max_steps=42
    )  # absolute: 40 done, 2 left
    trainer.fit(model)
    assert tuner.optimal_batch_size == kept(32)
    assert tuner.step_before == tuner.step_after == 40
    assert trainer.global_step == 42
    assert len(tuner.trials) >= 3  # trials ran although only 2 steps were left before max_steps
    assert sizes.sizes[:40] == [(0, 16)] * 40  # trial batches never reach the user's callbacks
    assert sizes.sizes[40:] == [(1, kept(32))] * 2  # the new size applies from the epoch it was tuned in


def test_budget_larger_than_the_device_is_refused_at_fit_start():
    probe = FakeProbe(base=GIB, total=16 * GIB)
    tuner = FakeTuner(probe, budget="24GiB")
    with pytest.raises(ValueError, match=r"budget='24GiB'.*24.0 GiB, larger than the device's 16.0 GiB"):
        tuner_trainer(tuner).fit(MemoryModel(probe, per_sample=MIB))


def test_trials_are_logged_to_the_loggers(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from tests.helpers.fakes import column, read_csv_metrics

    model = OOMModel(train_limit=21)
    tuner_trainer(BatchSizeTuner(max_val=CPU_SEARCH), logger=CSVLogger(tmp_path), max_steps=2).fit(model)
    assert list(column(read_csv_metrics(tmp_path), "gpumem/batch_size").values()) == [float(kept(21))]


@pytest.mark.parametrize("name", ["include_validation", "keep_effective_batch"])
def test_flags_must_be_bool(name):
    with pytest.raises(TypeError, match=rf"BatchSizeTuner\({name}=1\).*Expected True or False"):
        BatchSizeTuner(**{name: 1})


@pytest.mark.parametrize("in_memory", [True, False], ids=["host-memory", "checkpoint-file"])
def test_snapshot_restores_weights_optimizer_and_scheduler_mid_training(monkeypatch, tmp_path, in_memory):
    from copy import deepcopy

    from lightning_gpumem.tuning.trials import model_state as _state

    if not in_memory:
        monkeypatch.setattr(_state, "_host_has_room", lambda nbytes: False)

    class AdamModel(BoringModel):
        def configure_optimizers(self):
            optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]

    class Tamper(Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch != 1:
                return
            optimizer, scheduler = trainer.optimizers[0], trainer.lr_scheduler_configs[0].scheduler
            self.expected = deepcopy(
                (pl_module.state_dict(), optimizer.state_dict(), scheduler.state_dict())
            )
            snapshot = _state.ModelState(trainer)
            self.kept_in_memory = snapshot.in_memory and snapshot.ckpt_path is None
            for p in pl_module.parameters():  # what a trial does: steps that change everything
                p.grad = torch.randn_like(p)
            optimizer.step()
            scheduler.step()
            snapshot.restore()
            self.restored = deepcopy(
                (pl_module.state_dict(), optimizer.state_dict(), scheduler.state_dict())
            )

    tamper = Tamper()
    trainer = tuner_trainer(
        None, callbacks=[tamper], max_epochs=2, limit_train_batches=3, default_root_dir=tmp_path
    )
    trainer.fit(AdamModel())
    assert tamper.kept_in_memory is in_memory
    (weights, opt, sched), (weights0, opt0, sched0) = tamper.restored, tamper.expected
    assert all(torch.equal(weights[k], weights0[k]) for k in weights0)
    assert opt["param_groups"] == opt0["param_groups"]
    for index, state in opt0["state"].items():
        for key, value in state.items():
            assert torch.equal(opt["state"][index][key], value), key
    assert sched == sched0
    assert not list(tmp_path.glob(".gpumem_tuner_*.ckpt"))  # the file, if any, is gone


def test_trials_run_under_the_budget_and_the_size_kept_is_run_once_more():
    probe = CappedFakeProbe(base=2 * GIB, total=80 * GIB)
    model = MemoryModel(probe, per_sample=300 * MIB, n=100_000)
    tuner = FakeTuner(probe, budget="24GiB", headroom=0.1, include_validation=False)
    tuner_trainer(tuner, max_steps=1, limit_val_batches=0).fit(model)
    largest = int((24 * GIB - 2 * GIB) // (300 * MIB))  # 75
    assert tuner.optimal_batch_size == kept(largest, 0.1) == 68  # 67.5: at most 10% given up
    assert probe.fractions == pytest.approx(
        [24 / 80, 1.0]
    )  # the budget during trials, then the device's own
    assert tuner.trials[-1].batch_size == 68  # the size kept, run from the fit's starting state
    assert tuner.trials[-1].fits


def test_no_headroom_keeps_the_largest_size_that_runs_without_another_trial():
    probe = CappedFakeProbe(base=2 * GIB, total=80 * GIB)
    model = MemoryModel(probe, per_sample=300 * MIB, n=100_000)
    tuner = FakeTuner(probe, budget="24GiB", headroom=0.0, include_validation=False)
    tuner_trainer(tuner, max_steps=1, limit_val_batches=0).fit(model)
    assert tuner.optimal_batch_size == 75
    assert [t.batch_size for t in tuner.trials].count(75) == 1


def test_headroom_is_not_given_up_where_memory_does_not_bound_the_size():
    probe = CappedFakeProbe(base=2 * GIB, total=80 * GIB)
    model = MemoryModel(probe, per_sample=MIB, n=100_000)
    tuner = FakeTuner(probe, budget="24GiB", headroom=0.1, max_val=64, include_validation=False)
    tuner_trainer(tuner, max_steps=1, limit_val_batches=0).fit(model)
    assert tuner.result.reason == "upper_bound"
    assert tuner.optimal_batch_size == 64


def test_a_size_kept_that_does_not_run_gives_way_to_the_next_smaller_one_that_does():
    probe = CappedFakeProbe(holes=(68,), base=2 * GIB, total=80 * GIB)
    model = FragileModel(probe, per_sample=300 * MIB, n=100_000)
    tuner = FakeTuner(probe, budget="24GiB", headroom=0.1, include_validation=False)
    tuner_trainer(tuner, max_steps=1, limit_val_batches=0).fit(model)
    assert (68, False) in [(t.batch_size, t.fits) for t in tuner.trials]
    assert tuner.optimal_batch_size == model.batch_size == 67
    assert tuner.trials[-1].batch_size == 67
    assert tuner.trials[-1].fits


def test_without_a_budget_of_its_own_the_tuner_takes_a_memory_budgets():
    from lightning_gpumem import MemoryBudget

    probe = CappedFakeProbe(base=2 * GIB, total=80 * GIB)
    budget = MemoryBudget("24GiB")
    budget.fake = probe  # read through the tests' probe factory
    model = MemoryModel(probe, per_sample=300 * MIB, n=100_000)
    tuner = FakeTuner(probe, headroom=0.1, include_validation=False)
    tuner_trainer(None, callbacks=[budget, tuner], max_steps=1, limit_val_batches=0).fit(model)
    assert tuner.budget_bytes == 24 * GIB
    assert tuner.optimal_batch_size == kept(int((24 * GIB - 2 * GIB) // (300 * MIB)), 0.1)


class ValidationBufferModel(MemoryModel):
    """Validation holds a fixed buffer and little per sample; training grows faster (hard for a single-line search)."""

    def __init__(self, probe, per_sample, val_fixed, val_per_sample, **kwargs) -> None:
        super().__init__(probe, per_sample, **kwargs)
        self.val_fixed, self.val_per_sample = val_fixed, val_per_sample

    def validation_step(self, batch, batch_idx):
        need = self.val_fixed + batch.shape[0] * self.val_per_sample
        if self.fake.allocated + need > self.fake.cap:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake allocator, validation)")
        self.fake.spike(need)
        return super().validation_step(batch, batch_idx)


def test_trials_measure_the_training_and_validation_peaks_apart_and_the_search_uses_both_lines():
    probe = CappedFakeProbe(base=2 * GIB, total=80 * GIB)
    model = ValidationBufferModel(
        probe, per_sample=40 * MIB, val_fixed=12 * GIB, val_per_sample=4 * MIB, n=100_000, val_limit=10**9
    )
    model.val_data = model.train_data  # validation batches as large as the training ones
    tuner = FakeTuner(probe, budget="24GiB", headroom=0.1)
    tuner_trainer(tuner, max_steps=1, limit_val_batches=1, num_sanity_val_steps=0).fit(model)
    cap = 24 * GIB
    largest = min(int((cap - 2 * GIB) // (40 * MIB)), int((cap - 2 * GIB - 12 * GIB) // (4 * MIB)))
    best = kept(largest, 0.1)
    first = tuner.trials[0]
    assert first.train_peak_bytes == 2 * GIB + 2 * 40 * MIB
    assert first.val_peak_bytes == 2 * GIB + 12 * GIB + 2 * 4 * MIB
    assert first.allocated_bytes == first.val_peak_bytes  # the trial's peak is the larger stage
    assert tuner.optimal_batch_size == best
    search = tuner.trials[:-1]  # the last one is the size kept
    assert len(search) <= 6
    assert sum(not t.fits for t in search) <= 2


def test_the_tuner_tells_the_summary_the_allocator_counts_its_trials_left():
    probe = FakeProbe(base=2 * GIB, total=80 * GIB, retries=3)  # the fake's counters: 3 retries, 0 OOMs
    model = MemoryModel(probe, per_sample=300 * MIB, n=100_000)
    tuner = FakeTuner(probe, budget="24GiB", headroom=0.1, include_validation=False)
    tuner_trainer(tuner, max_steps=1, limit_val_batches=0).fit(model)
    assert tuner.gpumem_summary_context() == {"planned_ooms": 0, "planned_retries": 3, "tuned": True}


def test_below_a_kept_size_that_does_not_run_the_walk_doubles_its_step():
    probe = CappedFakeProbe(holes=(68, 67, 65), base=2 * GIB, total=80 * GIB)
    model = FragileModel(probe, per_sample=300 * MIB, n=100_000)
    tuner = FakeTuner(probe, budget="24GiB", headroom=0.1, include_validation=False)
    tuner_trainer(tuner, max_steps=1, limit_val_batches=0).fit(model)
    searched = [t.batch_size for t in tuner.trials].index(68)
    walk = [(t.batch_size, t.fits) for t in tuner.trials[searched:]]
    assert walk == [(68, False), (67, False), (65, False), (61, True)]  # 1, 2, then 4 below the last
    assert tuner.optimal_batch_size == model.batch_size == 61


def test_the_walk_keeps_a_size_the_search_ran_without_running_it_again():
    probe = CappedFakeProbe(holes=(68, 67, 65), base=2 * GIB, total=80 * GIB)
    model = FragileModel(probe, per_sample=300 * MIB, n=100_000)
    tuner = FakeTuner(probe, budget="24GiB", headroom=0.1, init_val=63, include_validation=False)
    tuner_trainer(tuner, max_steps=1, limit_val_batches=0).fit(model)
    sizes = [t.batch_size for t in tuner.trials]
    assert sizes[0] == 63  # ran by the search, between 65 (failed) and 61 (the walk's next size)
    assert sizes[sizes.index(68) :] == [68, 67, 65]
    assert tuner.optimal_batch_size == model.batch_size == 63


def test_the_report_leaves_the_trials_planned_retries_out_of_its_advice_as_the_fit_end_summary_does(
    tmp_path,
):
    from lightning.pytorch.loggers import CSVLogger

    from lightning_gpumem.report import load_runs, summarize
    from tests.helpers.fakes import FakeMonitor

    probe = FakeProbe(
        base=2 * GIB, total=80 * GIB, retries=3
    )  # the fake's counters: 3 retries, all the trials'
    model = MemoryModel(probe, per_sample=300 * MIB, n=100_000)
    tuner = FakeTuner(probe, budget="24GiB", headroom=0.1, include_validation=False)
    monitor = FakeMonitor(probe, nvml_host_interval_s=0)
    logger = CSVLogger(tmp_path, name="run")
    tuner_trainer(
        None,
        callbacks=[tuner, monitor],
        logger=logger,
        max_steps=2,
        limit_val_batches=0,
        log_every_n_steps=1,
    ).fit(model)
    fit_advice = [
        line.split("advice: ", 1)[1]
        for line in (monitor.summary_text or "").splitlines()
        if "advice: " in line
    ]
    summary = summarize(load_runs(tmp_path).runs[0])
    assert summary.alloc_retries == 3  # the counter as logged: the trials' retries are in it
    assert not any("allocator retries" in line for line in summary.advice)
    assert summary.advice == fit_advice


def test_a_size_kept_that_a_trial_of_the_search_ran_is_not_run_again():
    probe = CappedFakeProbe(base=2 * GIB, total=80 * GIB)
    model = MemoryModel(probe, per_sample=300 * MIB, n=100_000)
    tuner = FakeTuner(probe, budget="24GiB", headroom=0.1, init_val=68, include_validation=False)
    tuner_trainer(tuner, max_steps=1, limit_val_batches=0).fit(model)
    sizes = [t.batch_size for t in tuner.trials]
    assert sizes[0] == 68  # the search's first trial is the size kept (75 is the largest that runs)
    assert sizes.count(68) == 1
    assert tuner.optimal_batch_size == model.batch_size == 68


def test_on_a_cpu_without_max_val_the_size_is_kept_with_one_warning():
    # was: real CPU trials up to the dataset's size (more than 10 minutes on 100,000 samples)
    # with a budget in bytes the step is traced instead (tests/tuning/test_traced_planner.py)
    model = OOMModel(batch_size=8, n=100_000)
    tuner = BatchSizeTuner()
    trainer = tuner_trainer(tuner, max_steps=2, limit_val_batches=0)
    start = time.perf_counter()
    with pytest.warns(UserWarning, match=r"kept `batch_size=8`. Pass `max_val`") as record:
        trainer.fit(model)
    assert time.perf_counter() - start < 60
    assert sum("BatchSizeTuner" in str(w.message) for w in record) == 1
    assert tuner.optimal_batch_size is None
    assert tuner.trials == ()
    assert model.batch_size == 8
    assert trainer.global_step == 2


def test_on_a_cpu_an_explicit_max_val_searches_up_to_it():
    model = OOMModel(batch_size=8, n=100_000)
    tuner = BatchSizeTuner(max_val=48)
    tuner_trainer(tuner, max_steps=1, limit_val_batches=0).fit(model)
    assert tuner.optimal_batch_size == model.batch_size == 48


def test_with_drop_last_the_size_still_leaves_the_epoch_a_batch_after_limit_train_batches():
    # was: 224 of 300 samples with drop_last=True and limit_train_batches=0.5: one batch, halved to none (Lightning
    # refuses the fit), while the fit without the tuner runs
    from tests.helpers.tuning import CappedFakeProbe, FakeTuner, MemoryModel

    class DropLast(MemoryModel):
        def train_dataloader(self):
            return DataLoader(self.train_data, batch_size=self.batch_size, shuffle=True, drop_last=True)

    probe = CappedFakeProbe(base=GIB, total=24 * GIB)
    model = DropLast(probe, 100 * MIB, n=300)
    tuner = FakeTuner(probe)
    trainer = tuner_trainer(tuner, max_steps=1, limit_train_batches=0.5, limit_val_batches=0)
    trainer.fit(model)
    assert tuner.optimal_batch_size == 150  # 300 // 150 = 2 batches, half of them is 1
    assert trainer.global_step == 1


class SqueezingProbe(FakeProbe):
    """Every read finds the allocator met the cap twice more: each trial ran by flushing its cache."""

    def read(self, *, nvml: bool = True, host: bool = True) -> MemorySample:
        self.retries += 2
        return super().read(nvml=nvml, host=host)


def test_a_size_that_ran_only_by_flushing_the_cache_again_and_again_is_kept_with_a_warning():
    probe = SqueezingProbe(base=2 * GIB, total=80 * GIB)
    model = MemoryModel(probe, per_sample=300 * MIB, n=100_000)
    tuner = FakeTuner(probe, budget="24GiB", headroom=0.1, include_validation=False)
    with pytest.warns(UserWarning, match=r"ran only by the allocator giving its cache back \d+ times"):
        tuner_trainer(tuner, max_steps=1, limit_val_batches=0).fit(model)
    assert tuner.trials[-1].retries >= 2


def test_a_size_whose_trial_never_flushed_the_cache_is_kept_without_that_warning(recwarn):
    probe = FakeProbe(base=2 * GIB, total=80 * GIB, retries=3)  # a constant counter: 0 retries in each trial
    model = MemoryModel(probe, per_sample=300 * MIB, n=100_000)
    tuner = FakeTuner(probe, budget="24GiB", headroom=0.1, include_validation=False)
    tuner_trainer(tuner, max_steps=1, limit_val_batches=0).fit(model)
    assert not [w for w in recwarn if "giving its cache back" in str(w.message)]
