"""AutoMicrobatch on CPU with simulated OOMs: the recovered run equals a run that never ran out of memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_gpumem import AutoMicrobatch
from tests.helpers.fakes import column, read_csv_metrics
from tests.helpers.microbatch import STEPS, Net, oom_error
from tests.helpers.trainer import quiet_trainer


def _fit(tmp_path, model, callbacks=(), ckpt_path=None, **kwargs):
    seed_everything(0)
    options = dict(
        max_steps=STEPS, logger=CSVLogger(tmp_path), callbacks=list(callbacks), log_every_n_steps=1
    )
    trainer = quiet_trainer(**{**options, **kwargs})
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def _weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _reference(tmp_path, **kwargs):
    seed_everything(0)
    model = Net()
    _fit(tmp_path / "reference", model, **kwargs)
    return model, read_csv_metrics(tmp_path / "reference")


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.filterwarnings("ignore:AutoMicrobatch. step .* ran as .* batches run so from now on")
def test_a_recovered_run_equals_one_that_never_ran_out_of_memory(tmp_path, where):
    reference, reference_rows = _reference(tmp_path)
    seed_everything(0)
    model = Net(limit=5, where=where, pressure=range(4, 12))
    callback = AutoMicrobatch(grow_after=4)
    with pytest.warns(UserWarning, match="AutoMicrobatch: out of memory"):
        trainer = _fit(tmp_path / "split", model, [callback])
    assert trainer.global_step == STEPS
    assert callback.oom_recoveries >= 2  # 16 -> 8 -> 4 (a micro-batch of at most 5)
    assert max(model.sizes) == 16
    assert 4 in model.sizes
    torch.testing.assert_close(_weights(model), _weights(reference), atol=1e-5, rtol=0)
    rows = read_csv_metrics(tmp_path / "split")
    assert column(rows, "train_loss_step") == pytest.approx(
        column(reference_rows, "train_loss_step"), abs=1e-6
    )
    assert column(rows, "samples_step") == column(reference_rows, "samples_step")  # one batch of 16 a step
    assert column(rows, "epoch_loss") == pytest.approx(column(reference_rows, "epoch_loss"), abs=1e-6)
    assert column(rows, "epoch_loss")  # (logged at the epoch's end)
    assert callback.microbatches == 1  # grown back after the pressure


def test_without_the_callback_the_same_pressure_kills_the_run(tmp_path):
    with pytest.raises(torch.OutOfMemoryError):
        _fit(tmp_path, Net(limit=5, pressure=range(4, 12)))


def test_the_lr_schedule_and_step_count_are_those_of_the_unsplit_run(tmp_path):
    reference, _ = _reference(tmp_path)
    seed_everything(0)
    model = Net(limit=5, pressure=range(4, 12))
    with pytest.warns(UserWarning, match="AutoMicrobatch"):
        trainer = _fit(tmp_path / "split", model, [AutoMicrobatch(grow_after=4)])
    reference_lr = reference.trainer.optimizers[0].param_groups[0]["lr"]
    assert trainer.optimizers[0].param_groups[0]["lr"] == reference_lr == 0.1 * 0.5**4
    progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer
    assert progress.step.total.ready == progress.step.total.completed == STEPS
    assert progress.zero_grad.total.completed == STEPS


@pytest.mark.parametrize("pressure", [{4, 8}, {5, 9}, {3, 4, 5}], ids=["window-start", "window-end", "both"])
def test_with_gradient_accumulation_any_batch_of_a_window_is_recovered(tmp_path, pressure):
    seed_everything(0)
    reference = Net(batch_size=8)
    _fit(tmp_path / "reference", reference, accumulate_grad_batches=2, max_steps=10)
    reference_rows = read_csv_metrics(tmp_path / "reference")
    seed_everything(0)
    model = Net(batch_size=8, limit=5, pressure=pressure)
    with pytest.warns(UserWarning, match="AutoMicrobatch"):
        _fit(
            tmp_path / "split",
            model,
            [AutoMicrobatch(grow_after=2)],
            accumulate_grad_batches=2,
            max_steps=10,
        )
    torch.testing.assert_close(_weights(model), _weights(reference), atol=1e-5, rtol=0)
    rows = read_csv_metrics(tmp_path / "split")
    assert column(rows, "train_loss_step") == pytest.approx(
        column(reference_rows, "train_loss_step"), abs=1e-6
    )


@pytest.mark.filterwarnings("ignore:AutoMicrobatch. step .* ran as .* batches run so from now on")
def test_an_oom_in_the_optimizer_step_is_recovered(tmp_path):
    reference, _ = _reference(tmp_path)
    seed_everything(0)
    model = Net(optimizer_fails=[3, 9])
    callback = AutoMicrobatch(grow_after=2)
    with pytest.warns(UserWarning, match="in the optimizer step"):
        _fit(tmp_path / "split", model, [callback])
    assert callback.oom_recoveries == 2
    torch.testing.assert_close(_weights(model), _weights(reference), atol=1e-5, rtol=0)


class MidUpdateSGD(torch.optim.SGD):
    """SGD with momentum: at step ``fail_at`` it changes its first parameter or momentum, then runs out of memory."""

    def __init__(self, params, fail_at, what, **kwargs):
        super().__init__(params, **kwargs)
        self.fail_at, self.what, self.calls = fail_at, what, 0

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            first = self.param_groups[0]["params"][0]
            target = first if self.what == "parameter" else self.state[first]["momentum_buffer"]
            with torch.no_grad():
                target.mul_(0.5)  # half an update: what a re-run would apply a second time
            raise oom_error()
        super().step()
        return loss


@pytest.mark.parametrize("what", ["parameter", "state"])
def test_an_oom_in_the_middle_of_the_optimizer_update_propagates_with_why(tmp_path, what):
    class Model(Net):
        def configure_optimizers(self):
            return MidUpdateSGD(self.parameters(), fail_at=3, what=what, lr=0.1, momentum=0.9)

    callback = AutoMicrobatch()
    with pytest.raises(torch.OutOfMemoryError) as raised:
        _fit(tmp_path, Model(), [callback])
    assert "in the middle of the optimizer's update" in "".join(getattr(raised.value, "__notes__", []))
    assert callback.oom_recoveries == 0


class HalfStateAdam(torch.optim.Adam):
    """Adam that at step ``fail_at`` runs out of memory while creating its state: one entry made, the rest not."""

    def __init__(self, params, fail_at, **kwargs):
        super().__init__(params, **kwargs)
        self.fail_at, self.calls = fail_at, 0

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            self.state[self.param_groups[0]["params"][0]]["step"] = torch.tensor(0.0)
            raise oom_error()
        super().step()
        return loss


@pytest.mark.parametrize("touch_in_forward", [False, True])
@pytest.mark.filterwarnings("ignore:AutoMicrobatch. step .* ran as .* batches run so from now on")
def test_an_oom_while_the_optimizer_creates_its_state_is_recovered(tmp_path, touch_in_forward):
    """The half-made state is dropped; a parameter changed in place in the forward (not by the update) is no update."""

    class Model(Net):
        def __init__(self, fail_at=None):
            super().__init__()
            self.fail_at = fail_at

        def training_step(self, batch, batch_idx):
            if touch_in_forward:
                with torch.no_grad():
                    self.layer.weight.mul_(1.0)  # as `nn.Embedding(max_norm=...)` renormalises in place
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            return HalfStateAdam(self.parameters(), fail_at=self.fail_at, lr=0.01)

    seed_everything(0)
    reference = Model()
    _fit(tmp_path / "reference", reference)
    seed_everything(0)
    model, callback = Model(fail_at=0), AutoMicrobatch()
    with pytest.warns(UserWarning, match="in the optimizer step"):
        _fit(tmp_path / "split", model, [callback])
    assert callback.oom_recoveries == 1
    torch.testing.assert_close(_weights(model), _weights(reference), atol=1e-5, rtol=0)


def test_bf16_and_gradient_clipping_still_match(tmp_path):
    seed_everything(0)
    reference = Net()
    _fit(tmp_path / "reference", reference, precision="bf16-mixed", gradient_clip_val=0.5)
    seed_everything(0)
    model = Net(limit=5, pressure=range(2, 6))
    with pytest.warns(UserWarning, match="AutoMicrobatch"):
        _fit(
            tmp_path / "split",
            model,
            [AutoMicrobatch(grow_after=2)],
            precision="bf16-mixed",
            gradient_clip_val=0.5,
        )
    torch.testing.assert_close(
        _weights(model), _weights(reference), atol=2e-2, rtol=0
    )  # bf16 sums differ a little


@pytest.mark.filterwarnings("ignore:AutoMicrobatch. out of memory in the forward or backward")  # the retries
def test_an_oom_that_a_split_cannot_fix_propagates_with_a_clear_message(tmp_path):
    model = Net(limit=0, pressure=range(STEPS))
    with pytest.raises(
        torch.OutOfMemoryError,
        match=r"even with the batch of 16 split into 4 micro-batch\(es\) \(max_microbatches\)",
    ):
        _fit(tmp_path, model, [AutoMicrobatch(max_microbatches=4)])


def test_other_errors_propagate_unchanged(tmp_path):
    class Broken(Net):
        def training_step(self, batch, batch_idx):
            raise ValueError("the user's own bug")

    with pytest.raises(ValueError, match="the user's own bug"):
        _fit(tmp_path, Broken(), [AutoMicrobatch()])


def test_without_pressure_nothing_changes(tmp_path):
    reference, reference_rows = _reference(tmp_path)
    seed_everything(0)
    model = Net()
    _fit(tmp_path / "with", model, [AutoMicrobatch()])
    assert torch.equal(_weights(model), _weights(reference))
    rows = read_csv_metrics(tmp_path / "with")
    assert column(rows, "train_loss_step") == column(reference_rows, "train_loss_step")
    assert set(column(rows, "gpumem/microbatches").values()) == {1.0}
    assert set(column(rows, "gpumem/oom_recoveries").values()) == {0.0}


def test_the_module_is_left_as_it_was(tmp_path):
    model = Net()
    _fit(tmp_path, model, [AutoMicrobatch()])
    assert "training_step" not in vars(model)
    assert "log" not in vars(model)
    assert not [name for name in vars(model) if name.startswith("_gpumem")]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"grow_after": 0}, r"AutoMicrobatch\(grow_after=0\)"),
        ({"grow_after": 1.5}, r"AutoMicrobatch\(grow_after=1.5\)"),
        ({"max_microbatches": 1}, r"AutoMicrobatch\(max_microbatches=1\).*None or an integer >= 2"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AutoMicrobatch(**kwargs)


def test_hooks_run_once_per_step_and_after_backward_sees_the_whole_gradient(tmp_path):
    class Hooked(Net):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.after_backward, self.before_zero, self.losses = [], 0, []

        def on_after_backward(self):
            self.after_backward.append(self.layer.weight.grad.clone())

        def on_before_zero_grad(self, optimizer):
            self.before_zero += 1

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

    seed_everything(0)
    reference = Hooked()
    _fit(tmp_path / "reference", reference, max_steps=8)
    seed_everything(0)
    model = Hooked(limit=5, pressure=range(2, 6))
    with pytest.warns(UserWarning, match="AutoMicrobatch"):
        _fit(tmp_path / "split", model, [AutoMicrobatch()], max_steps=8)
    assert len(model.after_backward) == len(reference.after_backward) == 8
    assert model.before_zero == reference.before_zero == 8
    assert model.losses == pytest.approx(reference.losses, abs=1e-6)  # `outputs["loss"]`: the batch's
    for got, expected in zip(model.after_backward, reference.after_backward, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_a_checkpoint_keeps_the_split(tmp_path):
    seed_everything(0)
    model = Net(limit=5, pressure={1})
    callback = AutoMicrobatch(grow_after=100)
    with pytest.warns(UserWarning, match="AutoMicrobatch"):
        trainer = _fit(tmp_path, model, [callback], max_steps=3)
    trainer.save_checkpoint(tmp_path / "split.ckpt")
    resumed = AutoMicrobatch(grow_after=100)
    _fit(tmp_path / "resumed", Net(), [resumed], max_steps=5, ckpt_path=tmp_path / "split.ckpt")
    assert (
        (resumed.microbatches, resumed.oom_recoveries)
        == (callback.microbatches, callback.oom_recoveries)
        == (4, 2)
    )


def test_the_tuners_planned_ooms_stay_the_tuners_and_the_monitor_reports_recoveries(tmp_path):
    from lightning_gpumem import BatchSizeTuner
    from tests.helpers.fakes import FakeMonitor, FakeProbe

    class Tunable(Net):
        def training_step(self, batch, batch_idx):
            if len(
                batch[0]
            ) > 8 and not self.trainer.fit_loop.epoch_loop.automatic_optimization.__dict__.get("run"):
                raise oom_error()  # the tuner's trials (before AutoMicrobatch takes over): above 8 does not fit
            return super().training_step(batch, batch_idx)

    probe = FakeProbe()
    monitor = FakeMonitor(probe)
    callback = AutoMicrobatch()
    model = Tunable(limit=4, pressure={2}, batch_size=4)
    tuner = BatchSizeTuner(init_val=4, max_val=16, headroom=0.0, steps_per_trial=1)
    with pytest.warns(UserWarning, match="AutoMicrobatch: out of memory"):
        _fit(tmp_path, model, [tuner, callback, monitor], max_steps=6, limit_val_batches=0)
    assert model.batch_size == 8  # the tuner's OOMs above 8 were not recovered (nor counted)
    assert callback.oom_recoveries == 1  # the OOM of batch 2, in the fit
    assert "AutoMicrobatch recovered 1 out-of-memory error(s); batches ended as 2 micro-batch(es)" in (
        monitor.summary_text or ""
    )


def test_callbacks_that_listen_are_told_of_each_recovered_oom(tmp_path):
    from lightning.pytorch import Callback

    class Listener(Callback):
        told = 0

        def gpumem_oom_recovered(self):
            self.told += 1

    listener = Listener()
    callback = AutoMicrobatch()
    with pytest.warns(UserWarning, match="AutoMicrobatch"):
        _fit(tmp_path, Net(limit=5, pressure={2}), [callback, listener], max_steps=4)
    assert listener.told == callback.oom_recoveries == 2


def test_oom_snapshot_marks_the_snapshot_of_a_recovered_oom(tmp_path):
    from lightning_gpumem import OOMSnapshot

    snapshot = OOMSnapshot(dirpath=tmp_path)
    files = [tmp_path / "oom_rank0_step3.pickle", tmp_path / "oom_rank0_step3.html"]
    for path in files:
        path.write_text("x")
    snapshot.paths, snapshot._dumped_for_oom = list(files), True  # as the OOM observer leaves them
    snapshot.gpumem_oom_recovered()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "oom_recovered_rank0_step3.html",
        "oom_recovered_rank0_step3.pickle",
    ]
    assert [p.name for p in snapshot.paths] == [
        "oom_recovered_rank0_step3.pickle",
        "oom_recovered_rank0_step3.html",
    ]
    snapshot.gpumem_oom_recovered()  # nothing new was written: nothing more is renamed
    assert len(list(tmp_path.iterdir())) == 2


class FakeMemoryNet(Net):
    """Each sample of a (micro)batch takes ``per_sample`` bytes of a fake allocator capped at ``budget``."""

    def __init__(self, probe, per_sample, budget, light_after=None, **kwargs):
        super().__init__(**kwargs)
        self.fake, self.per_sample, self.budget, self.light_after = probe, per_sample, budget, light_after

    def training_step(self, batch, batch_idx):
        per_sample = self.per_sample
        if self.light_after is not None and batch_idx >= self.light_after:
            per_sample //= 4  # the pressure ends: a whole batch fits again
        need = len(batch[0]) * per_sample
        if self.fake.allocated + need > self.budget:
            raise oom_error()
        self.fake.spike(need)
        return super().training_step(batch, batch_idx)


class Budget(Callback):
    """A callback that sets a budget (found through the registry, as a MemoryBudget is)."""

    def __init__(self, nbytes):
        self.nbytes = nbytes

    def gpumem_budget(self):
        return self.nbytes


def test_a_measured_peak_that_says_the_whole_batch_cannot_fit_skips_the_try(tmp_path):
    from lightning_gpumem._core.units import GIB
    from tests.helpers.fakes import FakeProbe

    probe = FakeProbe(base=GIB, total=24 * GIB)
    callback = AutoMicrobatch(grow_after=2)
    callback.fake = probe
    model = FakeMemoryNet(probe, per_sample=GIB // 4, budget=4 * GIB)  # 16 samples: 4 GiB on top of 1 GiB
    with pytest.warns(UserWarning, match="AutoMicrobatch: out of memory"):
        _fit(tmp_path, model, [callback, Budget(4 * GIB)])
    assert callback.oom_recoveries == 1  # the first OOM only: every try of the whole batch was skipped
    assert callback.microbatches == 2
    assert callback.policy.wait >= 16  # each skipped try doubled the wait


def test_a_measured_peak_that_says_it_fits_lets_the_batch_grow_back(tmp_path):
    from lightning_gpumem._core.units import GIB
    from tests.helpers.fakes import FakeProbe

    probe = FakeProbe(base=GIB, total=24 * GIB)
    callback = AutoMicrobatch(grow_after=2)
    callback.fake = probe
    model = FakeMemoryNet(probe, per_sample=GIB // 4, budget=4 * GIB, light_after=10)
    with pytest.warns(UserWarning, match="AutoMicrobatch"):
        _fit(tmp_path, model, [callback, Budget(4 * GIB)])
    assert callback.oom_recoveries == 1
    assert callback.microbatches == 1  # grown back once the measured peak allowed it


def test_the_monitors_running_peak_keeps_what_the_split_steps_reset(tmp_path):
    from lightning_gpumem._core.units import GIB
    from tests.helpers.fakes import FakeMonitor, FakeProbe

    class Spiky(FakeMemoryNet):
        def training_step(self, batch, batch_idx):
            if (
                batch_idx == 4 and len(batch[0]) < 16
            ):  # an unlogged batch: 0.5 GiB more than the others, once
                self.fake.spike(len(batch[0]) * self.per_sample + GIB // 2)
            return super().training_step(batch, batch_idx)

    probe = FakeProbe(base=GIB, total=24 * GIB)
    callback = AutoMicrobatch(grow_after=100)
    callback.fake = probe
    monitor = FakeMonitor(probe, log_every_n_steps=10)
    model = Spiky(probe, per_sample=GIB // 4, budget=4 * GIB)
    with pytest.warns(UserWarning, match="AutoMicrobatch"):
        _fit(tmp_path, model, [monitor, callback, Budget(4 * GIB)])
    assert (
        monitor.peaks["train"][0] == GIB + 2 * GIB + GIB // 2
    )  # batch 4's micro-batch of 8, plus its 0.5 GiB


def test_a_validation_step_that_calls_training_step_is_left_alone_even_when_split(tmp_path):
    class Shared(Net):
        def validation_step(self, batch, batch_idx):
            limit, self.limit = self.limit, None  # (the pressure is on training only)
            loss = self.training_step(batch, batch_idx)
            self.limit = limit
            self.log("val_loss", loss)

        def val_dataloader(self):
            return self.train_dataloader()

    seed_everything(0)
    model = Shared(limit=5, pressure={1})
    trainer = quiet_trainer(
        max_steps=6, val_check_interval=3, limit_val_batches=2, callbacks=[AutoMicrobatch(grow_after=100)]
    )
    with pytest.warns(UserWarning, match="AutoMicrobatch"):
        trainer.fit(model)
    assert "val_loss" in trainer.callback_metrics  # validation's logs were not taken for the step's


def test_a_training_step_without_batch_idx_is_called_as_lightning_calls_it(tmp_path):
    class NoIndex(Net):
        def training_step(self, batch):  # Lightning passes `batch_idx` only where the signature takes it
            return super().training_step(batch, 0)

    trainer = _fit(tmp_path, NoIndex(), [AutoMicrobatch()], max_steps=3)
    assert trainer.global_step == 3


@pytest.mark.filterwarnings("ignore:You are using the .dataloader_iter. step flavor")
@pytest.mark.filterwarnings("ignore:Found .dataloader_iter. argument in the .training_step.")
def test_training_step_with_dataloader_iter_is_refused_with_a_warning(tmp_path):
    class Iterating(Net):
        def training_step(self, dataloader_iter):
            batch, _, _ = next(dataloader_iter)
            x, y = batch
            loss = F.mse_loss(self.head(torch.tanh(self.layer(x))).squeeze(-1), y)
            self.log("train_loss", loss, batch_size=len(x))
            return loss

    with pytest.warns(UserWarning, match=r"dataloader_iter\)` is not supported"):
        _fit(tmp_path, Iterating(), [AutoMicrobatch()], max_steps=2)


def test_a_logged_parameter_is_its_value_at_log_time(tmp_path):
    class LogsWeight(Net):
        def training_step(self, batch, batch_idx):
            self.log("bias", self.head.bias[0])  # a view of a parameter the optimizer step changes
            return super().training_step(batch, batch_idx)

    seed_everything(0)
    _fit(tmp_path / "reference", LogsWeight(), max_steps=4)
    seed_everything(0)
    _fit(tmp_path / "with", LogsWeight(), [AutoMicrobatch()], max_steps=4)
    expected = column(read_csv_metrics(tmp_path / "reference"), "bias")
    assert column(read_csv_metrics(tmp_path / "with"), "bias") == expected


@pytest.mark.filterwarnings("ignore:.training_step. returned .None.")
def test_a_micro_batch_that_returns_none_skips_the_whole_batch_as_unsplit(tmp_path):
    class SkipsBatchThree(Net):
        """Batch 3 holds a sample `training_step` refuses (returns None): the whole batch is skipped."""

        def on_train_batch_start(self, batch, batch_idx):
            self._last_sample = batch[0][-1]

        def training_step(self, batch, batch_idx):
            if self.limit is not None and batch_idx in self.pressure and len(batch[0]) > self.limit:
                raise oom_error()
            if batch_idx == 3 and any(torch.equal(row, self._last_sample) for row in batch[0]):
                return None  # unsplit: the whole batch; split in two: the second half only
            return super().training_step(batch, batch_idx)

    seed_everything(0)
    reference = SkipsBatchThree()
    _fit(tmp_path / "reference", reference, max_steps=6)
    seed_everything(0)
    model = SkipsBatchThree(limit=8, pressure={3})  # batch 3 runs as two micro-batches of 8
    with pytest.warns(UserWarning, match="AutoMicrobatch"):
        _fit(tmp_path / "split", model, [AutoMicrobatch(grow_after=100)], max_steps=6)
    assert 8 in model.sizes
    torch.testing.assert_close(_weights(model), _weights(reference), atol=1e-6, rtol=0)


def test_a_second_fit_starts_unsplit_and_nothing_is_kept_after_a_fit(tmp_path):
    callback = AutoMicrobatch(grow_after=100)
    with pytest.warns(UserWarning, match="AutoMicrobatch"):
        _fit(
            tmp_path / "first",
            Net(batch_size=8, limit=5, pressure={1}),
            [callback],
            accumulate_grad_batches=4,
        )
    assert callback.microbatches == 2
    assert (callback._window, callback._attempt.calls, callback._probe) == ([], [], None)
    model = Net(batch_size=8)
    _fit(tmp_path / "second", model, [callback], max_steps=3)
    assert set(model.sizes) == {8}  # unsplit from the start
    assert callback.microbatches == 1


@pytest.mark.filterwarnings("ignore:Trying to infer the .batch_size. from an ambiguous collection")
def test_a_batch_whose_dimension_cannot_be_told_is_not_split_and_the_oom_propagates(tmp_path):
    class PerSample(Net):
        """Batches carry per-sample tensors of other first dimensions (boxes per image, as in object detection)."""

        def train_dataloader(self):
            def collate(samples):
                x, y = torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])
                return x, y, [torch.zeros(i % 3 + 1, 4) for i in range(len(samples))]

            return DataLoader(super().train_dataloader().dataset, batch_size=16, collate_fn=collate)

        def training_step(self, batch, batch_idx):
            if self.global_step == 1:
                raise oom_error()
            return super().training_step(batch[:2], batch_idx)

    with pytest.raises(torch.OutOfMemoryError, match=r"not recovered: the batch's tensors do not share"):
        _fit(tmp_path, PerSample(), [AutoMicrobatch()], max_steps=3)
