"""MemoryPlanner under a real CPU Trainer with a fake CUDA allocator: the plan, its budgets, stop, and no trace."""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.loggers import CSVLogger

from lightning_gpumem import MemoryPlanner
from lightning_gpumem._core.units import GIB, MIB
from tests.helpers.fakes import column, read_csv_metrics
from tests.helpers.tuning import CappedFakeProbe, MemoryModel, OOMModel, tuner_trainer

pytestmark = [pytest.mark.filterwarnings("ignore:`weights_only` was not set")]
OUTSIDE = 300 * MIB  # the fake's NVML process memory above its reserved bytes


class FakePlanner(MemoryPlanner):
    def __init__(self, probe, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fake = probe


class PlateauModel(MemoryModel):
    """The optimizer step's temporaries (`plateau` bytes) dominate small batches, activations large ones."""

    def __init__(self, probe, per_sample, plateau=0, **kwargs) -> None:
        super().__init__(probe, per_sample, **kwargs)
        self.plateau, self.steps = plateau, 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        if self.plateau and self.fake.allocated + self.plateau > self.fake.cap:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake allocator)")
        self.fake.spike(self.plateau)
        return super().training_step(batch, batch_idx)


def _largest(probe, budget, per_sample):
    """The largest size whose fake peak fits `budget` less the memory outside PyTorch."""
    return (budget - OUTSIDE - probe.allocated) // per_sample


def test_the_plan_predicts_the_peak_and_the_largest_size_before_step_one_and_validates_it(tmp_path):
    probe = CappedFakeProbe(base=GIB, total=24 * GIB)
    model = PlateauModel(probe, per_sample=100 * MIB, plateau=2 * GIB, batch_size=4, n=4096)
    planner = FakePlanner(probe)
    trainer = tuner_trainer(planner, max_steps=2, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    trainer.fit(model)
    plan = planner.plan
    assert plan is not None
    assert plan.verdict == "settled"
    assert plan.per_sample == 100 * MIB
    assert plan.outside == OUTSIDE
    device = planner.predictions[0]
    assert device.budget == 24 * GIB
    assert device.largest == _largest(probe, 24 * GIB, 100 * MIB)
    assert device.validated  # a trial ran it under the device's cap
    assert device.fits
    assert device.peak == pytest.approx(GIB + 2 * GIB)
    assert [p.budget for p in planner.predictions] == [
        24 * GIB,
        16 * GIB,
    ]  # the device and the cards below it
    assert planner.predictions[1].largest == _largest(probe, 16 * GIB, 100 * MIB)
    assert min(probe.fractions) < 1.0  # validation trials ran under the budgets' caps...
    assert probe.cap == probe.total  # ...and the cap is put back
    assert model.batch_size == 4
    assert trainer.global_step == 2
    rows = read_csv_metrics(tmp_path)
    assert column(rows, "gpumem/plan_largest_batch_size") == {0: float(device.largest)}
    assert column(rows, "gpumem/plan_per_sample_mib") == {0: 100.0}
    assert set(column(rows, "gpumem/plan_outside_gib").values()) == {OUTSIDE / GIB}
    assert list(tmp_path.rglob("gpumem_memory_plan.csv"))  # the table, for a logger that takes no tables


def test_stop_ends_the_fit_after_planning_before_the_sanity_check_and_step_one():
    probe = CappedFakeProbe(base=GIB, total=24 * GIB)
    model = PlateauModel(probe, per_sample=100 * MIB, n=4096)
    planner = FakePlanner(probe, stop=True)
    trainer = tuner_trainer(planner, max_epochs=3)
    trainer.fit(model)
    assert planner.plan is not None
    assert trainer.global_step == 0
    assert trainer.current_epoch == 0


def test_a_size_that_does_not_fit_says_by_how_much_and_what_would_make_it_fit(caplog):
    probe = CappedFakeProbe(base=GIB, total=24 * GIB)
    model = PlateauModel(probe, per_sample=100 * MIB, batch_size=200, n=4096)
    planner = FakePlanner(probe, budgets=["24GiB", "12GiB"], validate=False, stop=True)
    with caplog.at_level("INFO"):
        tuner_trainer(planner).fit(model)
    twelve = planner.predictions[1]
    assert not twelve.fits
    assert planner.predictions[0].fits
    assert not twelve.validated
    text = caplog.text
    assert "Does not fit 12.0 GiB: batch_size=200 needs" in text
    assert f"batch_size={twelve.largest} fits" in text
    assert "precision='bf16-mixed'" in text  # the fit runs in 32-bit
    assert "| 12.0 | 11.71 |" in text  # the table: the budget less the memory outside PyTorch


def test_probes_off_a_line_say_so_and_predict_no_size(recwarn):
    probe = CappedFakeProbe(base=GIB, total=24 * GIB)

    class Padded(
        PlateauModel
    ):  # memory per sample that changes with the size: padding that depends on the data
        def training_step(self, batch, batch_idx):
            self.per_sample = 100 * MIB * (1 + 0.5 * (batch.shape[0].bit_length() % 2))
            return super().training_step(batch, batch_idx)

    planner = FakePlanner(probe, stop=True)
    tuner_trainer(planner).fit(Padded(probe, per_sample=100 * MIB, n=4096))
    assert planner.plan is not None
    assert planner.plan.verdict == "not_affine"
    assert all(p.largest is None and not p.validated for p in planner.predictions)
    assert any("not on a line" in str(w.message) for w in recwarn)


def test_on_a_cpu_the_planner_traces_the_step_and_the_fit_runs():
    # was: a warning and no plan; tests/tuning/test_traced_planner.py has what the traced plan says
    model = OOMModel()
    planner = MemoryPlanner()
    trainer = tuner_trainer(planner, max_steps=2)
    trainer.fit(model)
    assert trainer.global_step == 2
    assert planner.predictions
    assert all(p.traced and not p.validated for p in planner.predictions)


def test_a_fit_after_planning_equals_the_fit_without_the_planner():
    def fit(with_planner: bool):
        probe = CappedFakeProbe(base=GIB, total=24 * GIB)
        seed_everything(7)
        model = PlateauModel(probe, per_sample=100 * MIB, batch_size=8, n=256)
        callbacks = [FakePlanner(probe)] if with_planner else []
        trainer = tuner_trainer(None, callbacks=callbacks, max_epochs=2)
        trainer.fit(model)
        optimizer = trainer.optimizers[0].state_dict()
        return model, trainer, optimizer

    planned, planned_trainer, planned_optimizer = fit(True)
    plain, plain_trainer, plain_optimizer = fit(False)
    for a, b in zip(planned.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert planned_trainer.global_step == plain_trainer.global_step == 2 * math.ceil(256 / 8)
    assert planned_optimizer["state"].keys() == plain_optimizer["state"].keys()
    assert planned.steps > plain.steps  # the planner ran training steps of its own, and they left no trace


def test_a_missing_batch_attribute_and_loaders_passed_to_fit_are_refused():
    probe = CappedFakeProbe(base=GIB, total=24 * GIB)
    with pytest.raises(AttributeError, match=r"batch_arg_name='bs'"):
        tuner_trainer(FakePlanner(probe, batch_arg_name="bs")).fit(OOMModel())
    model = OOMModel()
    with pytest.raises(ValueError, match=r"passed straight to `trainer\.fit"):
        tuner_trainer(FakePlanner(probe)).fit(model, train_dataloaders=model.train_dataloader())


class TextPlanModel(MemoryModel):
    """Variable-length text on the fake allocator: `per_token` bytes per padded token of a batch."""

    def __init__(self, probe, lengths: list[int], per_token: int, batch_size: int = 4) -> None:
        super().__init__(probe, per_sample=0, batch_size=batch_size)
        self.lengths, self.per_token = lengths, per_token

    def training_step(self, batch, batch_idx):
        need = batch.numel() * self.per_token
        if self.fake.allocated + need > self.fake.cap:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake allocator)")
        self.fake.spike(need)
        return self.layer(torch.ones(batch.shape[0], 32)).sum()

    def validation_step(self, batch, batch_idx):
        return None

    def train_dataloader(self):
        from torch.utils.data import DataLoader

        texts = [torch.ones(n, dtype=torch.long) for n in self.lengths]
        collate = lambda samples: torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)  # noqa: E731
        return DataLoader(texts, batch_size=self.batch_size, shuffle=True, collate_fn=collate)

    def val_dataloader(self):
        return None


def _text_lengths() -> list[int]:
    lengths = [8] * 2000
    lengths[77] = lengths[1500] = 256  # two samples of 256 tokens: the worst batch's length
    return lengths


@pytest.mark.parametrize("margin", [None, 0.0])
def test_with_length_fn_the_plan_is_the_plan_of_the_longest_batch_and_leaves_the_shape_margin(
    margin, caplog
):
    # Every probe draws the 256-token samples first, so the line's slope is 256 tokens a sample; the allocator
    # limit of each budget leaves `shape_margin` (default 0.2 with the default allocator) of it free.
    seed_everything(0)
    probe = CappedFakeProbe(base=GIB, total=24 * GIB)
    model = TextPlanModel(probe, _text_lengths(), per_token=MIB // 4)
    planner = FakePlanner(
        probe, length_fn=len, shape_margin=margin, budgets=["16GiB"], include_validation=False
    )
    with caplog.at_level("INFO"):
        tuner_trainer(planner, max_steps=1, limit_val_batches=0).fit(model)
    plan = planner.plan
    assert plan is not None
    assert plan.verdict == "settled"
    assert plan.per_sample == 256 * MIB // 4  # the longest samples' cost, not the 8-token ones'
    expected = 0.2 if margin is None else 0.0
    assert plan.margin == expected
    (prediction,) = planner.predictions
    assert prediction.limit == int((16 * GIB - OUTSIDE) * (1 - expected))
    assert prediction.largest == (prediction.limit - probe.allocated) // (256 * MIB // 4)
    assert prediction.validated
    assert ("leaves 20% of it free" in caplog.text) == (margin is None)


def test_without_length_fn_the_plan_follows_the_first_batches():
    # The counterpart: the first batches are short, so the plan's slope is far below the worst batch's.
    seed_everything(0)
    probe = CappedFakeProbe(base=GIB, total=24 * GIB)
    model = TextPlanModel(probe, _text_lengths(), per_token=MIB // 4)
    planner = FakePlanner(probe, budgets=["16GiB"], include_validation=False)
    tuner_trainer(planner, max_steps=1, limit_val_batches=0).fit(model)
    assert planner.plan is None or planner.plan.per_sample < 256 * MIB // 4
    assert planner.plan is None or planner.plan.margin == 0.0


def test_an_error_of_length_fn_reaches_the_user_from_the_planner():
    probe = CappedFakeProbe(base=GIB, total=24 * GIB)
    model = TextPlanModel(probe, _text_lengths(), per_token=MIB // 4)

    def broken(sample):
        raise KeyError("input_ids")

    planner = FakePlanner(probe, length_fn=broken, budgets=["16GiB"], include_validation=False)
    with pytest.raises(KeyError, match="input_ids") as info:  # the user's own error, unchanged
        tuner_trainer(planner, max_steps=1, limit_val_batches=0).fit(model)
    assert "`length_fn=broken`" in info.value.__notes__[0]


def test_default_budgets_that_validate_the_same_size_give_a_plan():
    # An 80 GiB card and a dataset of 300 samples: the largest size of the 80, 48 and 40 GiB budgets clamps to 300,
    # so the validation trials measure one size three times (was: ZeroDivisionError ending the fit).
    probe = CappedFakeProbe(base=GIB, total=80 * GIB)
    model = PlateauModel(probe, per_sample=100 * MIB, batch_size=4, n=300)
    planner = FakePlanner(probe)
    trainer = tuner_trainer(planner, max_steps=2)
    trainer.fit(model)
    assert trainer.global_step == 2
    assert planner.plan is not None
    assert [p.size for p in planner.plan.probes] == sorted({p.size for p in planner.plan.probes})
    assert [p.largest for p in planner.predictions[:3]] == [300] * 3
    assert [p.budget // GIB for p in planner.predictions] == [80, 48, 40, 24, 16]
    assert all(p.validated for p in planner.predictions)


def test_stop_ends_the_fit_on_a_cpu_too():
    # was: a warning, then the whole fit (a dry run that trained)
    trainer = tuner_trainer(MemoryPlanner(stop=True), max_epochs=3)
    trainer.fit(OOMModel(n=4096))
    assert trainer.global_step == 0
    assert trainer.current_epoch == 0


def test_a_token_budget_is_refused_at_fit_start_naming_what_to_use():
    from torch.utils.data import DataLoader

    from lightning_gpumem import TokenBudgetSampler

    class Tokens(OOMModel):
        def __init__(self) -> None:
            super().__init__(n=64)
            self.max_tokens = 512

        def train_dataloader(self):
            data = [torch.ones(8) for _ in range(64)]
            sampler = TokenBudgetSampler([8] * 64, max_tokens=self.max_tokens)
            return DataLoader(data, batch_sampler=sampler)

    probe = CappedFakeProbe(base=GIB, total=24 * GIB)
    for name in ("max_tokens", "batch_size"):
        model = Tokens()
        with pytest.raises(
            ValueError, match=rf"MemoryPlanner\(batch_arg_name='{name}'\).*BatchSizeTuner"
        ) as info:
            tuner_trainer(FakePlanner(probe, batch_arg_name=name), max_steps=1).fit(model)
        assert model.max_tokens == 512  # was: a probe's size written into the user's budget
        assert "max_tokens=2" not in str(info.value)


def test_probes_that_reach_the_samples_an_epoch_draws_plan_every_size_without_a_false_warning(recwarn):
    # A plateau up to 16 samples, then 100 MiB per sample: the probes reach the 48 samples before they settle. Every
    # size that can run lies between probes, so the plan interpolates them (was: "not on a line", no size at all).
    probe = CappedFakeProbe(base=GIB, total=24 * GIB)
    model = PlateauModel(probe, per_sample=100 * MIB, plateau=2 * GIB, batch_size=4, n=48)
    planner = FakePlanner(probe, budgets=["24GiB", "4GiB"])
    tuner_trainer(planner, max_steps=1).fit(model)
    assert planner.plan is not None
    assert planner.plan.verdict == "settled"
    assert not any("not on a line" in str(w.message) for w in recwarn)
    large, small = planner.predictions
    assert large.largest == 48  # no batch is larger than an epoch's samples
    assert large.validated
    exact = (4 * GIB - OUTSIDE - GIB) // (100 * MIB)  # 27: between the probes
    assert small.validated
    assert 0.95 * exact <= small.largest <= exact


def test_next_to_a_memory_budget_the_probes_stay_under_its_cap():
    # was: probes doubled up to half the device, ran out of memory under the 8 GiB budget, and there was no plan
    from tests.helpers.fakes import FakeBudget

    probe = CappedFakeProbe(base=GIB, total=24 * GIB)
    planner = FakePlanner(probe)
    trainer = tuner_trainer(None, callbacks=[FakeBudget(probe, "8GiB"), planner], max_steps=1)
    trainer.fit(PlateauModel(probe, per_sample=100 * MIB, n=4096))
    assert planner.plan is not None
    assert [p.budget for p in planner.predictions] == [8 * GIB]  # the budget, not the device
    assert planner.predictions[0].validated
