"""MemoryPlanner without a GPU: the user's step traced on fake tensors, the budgets planned from the replay."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpumem import BatchSizeTuner, MemoryPlanner
from lightning_gpumem._core.units import MIB
from lightning_gpumem.tuning.search.headroom import headroom_size
from lightning_gpumem.tuning.sources.lightning_step import lightning_tracer
from lightning_gpumem.tuning.sources.traced import CONTEXT_BYTES, TRACE_MARGIN, TracedSource
from tests.helpers.trainer import quiet_trainer


class Wide(LightningModule):
    def __init__(self, batch_size: int = 16, item: bool = False) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.item = item
        self.net = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 10))
        self.data = TensorDataset(torch.randn(4096, 512), torch.randint(0, 10, (4096,)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        if self.item and loss.item() < 0:  # a data-dependent branch: cannot be traced
            return loss * 2
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


class Spy(MemoryPlanner):
    """Also replays its own trace of the same step, at fit start (the optimizer has no state yet), at the sizes
    each budget's answer must fit and those 1% above it must not."""

    def on_fit_start(self, trainer, pl_module):
        batch = next(iter(pl_module.train_dataloader()))
        val_batch = next(iter(pl_module.val_dataloader()))  # its own copy on the device, as in a fit
        source = TracedSource(lightning_tracer(trainer, pl_module, batch, val_batch=val_batch))
        super().on_fit_start(trainer, pl_module)
        self.peak = source.under(None)(16).peak_bytes  # the run's size, uncapped
        self.checks = []
        for p in self.predictions:
            limit = int((1 - TRACE_MARGIN) * p.limit)
            above = p.largest + p.largest // 100 + 1  # the search closes to within 1%
            self.checks.append((p, limit, source.under(limit)(p.largest), source.under(limit)(above)))


def _fit(planner: MemoryPlanner, model: LightningModule, **kwargs) -> object:
    trainer = quiet_trainer(
        accelerator="cpu", max_steps=2, limit_val_batches=1, **kwargs, callbacks=[planner]
    )
    trainer.fit(model)
    return trainer


def test_each_budgets_largest_size_fits_its_replay_and_one_percent_more_does_not():
    planner = Spy(budgets=[CONTEXT_BYTES + 200 * MIB, CONTEXT_BYTES + 150 * MIB])
    trainer = _fit(planner, Wide())
    assert trainer.global_step == 2  # the fit ran as it would have
    assert [p.budget for p in planner.predictions] == sorted([p.budget for p in planner.predictions])[::-1]
    assert len(planner.checks) == 2
    for p, limit, kept, above in planner.checks:
        assert p.traced
        assert p.how == "traced"
        assert p.limit == p.budget - CONTEXT_BYTES
        assert kept.fits
        assert kept.peak_bytes <= limit
        assert not above.fits or above.peak_bytes > limit
    assert planner.checks[0][0].largest > planner.checks[1][0].largest  # 50 MiB more holds more
    assert planner.predictions[0].peak == planner.peak
    assert planner.plan is not None
    assert planner.plan.verdict == "settled"


def test_the_plan_is_printed_with_its_rows_marked_traced(caplog):
    _fit(MemoryPlanner(budgets=["2GiB"]), Wide())
    table = "\\n".join(r.getMessage() for r in caplog.records if "MemoryPlanner" in r.getMessage())
    assert "| traced |" in table


def test_a_step_that_cannot_be_traced_warns_naming_the_op_and_the_fit_runs():
    planner = MemoryPlanner(budgets=["2GiB"])
    with pytest.warns(UserWarning, match=r"_local_scalar_dense.*no plan without a GPU"):
        trainer = _fit(planner, Wide(item=True))
    assert trainer.global_step == 2
    assert planner.plan is None
    assert planner.predictions == []


def test_a_fraction_of_the_device_is_refused_without_a_device():
    with pytest.raises(ValueError, match="no device memory is known"):
        _fit(MemoryPlanner(budgets=[0.5]), Wide())


def test_stop_makes_the_traced_plan_a_dry_run():
    planner = MemoryPlanner(budgets=["24GiB"], stop=True)
    trainer = _fit(planner, Wide())
    assert trainer.global_step == 0
    assert planner.predictions[0].largest is not None


# a LightningCLI script's model, shared with tests/tuning/test_plan_command.py
CLI_MODEL = """
import os

os.environ["JSONARGPARSE_DEPRECATION_WARNINGS"] = "off"
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader


class Model(BoringModel):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 4096), batch_size=self.batch_size)
"""

CLI_SCRIPT = (
    CLI_MODEL
    + """

cli = LightningCLI(Model, save_config_callback=None, args=[
    "fit", "--trainer.accelerator=cpu", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
    f"--trainer.default_root_dir={os.environ['ROOT_DIR']}",
    "--trainer.callbacks+=lightning_gpumem.MemoryPlanner",
    '--trainer.callbacks.budgets=["24GiB","A100-40GB"]', "--trainer.callbacks.stop=true",
])
planner = cli.trainer.callbacks[0]
print("plan", cli.trainer.global_step, [(p.budget >> 30, p.how) for p in planner.predictions])
"""
)


def test_a_lightning_cli_user_plans_on_a_cpu_with_no_code_change(tmp_path):
    """The command docs/memory_planner.md ("Without a GPU") shows, in a fresh interpreter."""
    pytest.importorskip("jsonargparse")
    import os
    import subprocess
    import sys

    env = {**os.environ, "ROOT_DIR": str(tmp_path)}
    command = [sys.executable, "-c", CLI_SCRIPT]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "plan 0 [(39, 'traced'), (24, 'traced')]" in result.stdout, result.stdout[-3000:]


def test_on_a_cpu_the_tuner_sets_the_traced_size_less_the_headroom_with_one_line_and_no_trials(caplog):
    budget = CONTEXT_BYTES + 150 * MIB
    planner = Spy(budgets=[budget])  # the same plan, for the size to expect
    torch.manual_seed(0)
    tuned = Wide()
    tuner = BatchSizeTuner(budget=budget, headroom=0.05)
    trainer = quiet_trainer(accelerator="cpu", max_steps=2, limit_val_batches=1, callbacks=[planner, tuner])
    trainer.fit(tuned)
    largest = planner.predictions[0].largest
    assert tuner.optimal_batch_size == tuned.batch_size == headroom_size(largest, 0.05)
    assert tuner.trials == ()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("BatchSizeTuner:")]
    assert len(lines) == 1
    assert f"batch_size={tuned.batch_size}, traced for" in lines[0]
    torch.manual_seed(0)
    by_hand = Wide(batch_size=tuned.batch_size)
    quiet_trainer(accelerator="cpu", max_steps=2, limit_val_batches=1).fit(by_hand)
    for (name, a), (_, b) in zip(tuned.state_dict().items(), by_hand.state_dict().items()):
        assert torch.equal(a, b), name  # the same fit as with that size set by hand


def test_on_a_cpu_nothing_is_given_up_where_the_data_bounds_the_traced_size(caplog):
    tuned = Wide()
    tuner = BatchSizeTuner(budget="16GiB", headroom=0.05)  # every size up to the dataset's 4096 fits
    quiet_trainer(accelerator="cpu", max_steps=1, limit_val_batches=0, callbacks=[tuner]).fit(tuned)
    assert tuner.optimal_batch_size == tuned.batch_size == 4096  # as the search: no headroom at `upper`


def test_on_a_cpu_a_step_the_tuner_cannot_trace_keeps_the_size_with_the_warning():
    model = Wide(item=True)
    tuner = BatchSizeTuner(budget="2GiB")
    with pytest.warns(UserWarning, match="_local_scalar_dense"):
        quiet_trainer(accelerator="cpu", max_steps=1, limit_val_batches=0, callbacks=[tuner]).fit(model)
    assert model.batch_size == 16
    assert tuner.optimal_batch_size is None


class FailsOnFakes(Wide):
    """A step that runs on real tensors and raises on fake ones (an op without a fake kernel of its own kind)."""

    def training_step(self, batch, batch_idx):
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(batch[0], FakeTensor):
            raise RuntimeError("no fake kernel for this op")
        return super().training_step(batch, batch_idx)


def test_a_trace_that_fails_otherwise_warns_and_never_stops_the_fit():
    planner = MemoryPlanner(budgets=["2GiB"])
    tuner = BatchSizeTuner(budget="2GiB")
    with pytest.warns(
        UserWarning, match="could not be traced on fake tensors .RuntimeError: no fake kernel"
    ):
        trainer = _fit(planner, FailsOnFakes())
    assert trainer.global_step == 2
    assert planner.plan is None
    model = FailsOnFakes()
    with pytest.warns(UserWarning, match="could not be traced"):
        quiet_trainer(accelerator="cpu", max_steps=1, limit_val_batches=0, callbacks=[tuner]).fit(model)
    assert model.batch_size == 16


def test_budgets_may_name_cards_and_a_name_that_is_no_card_is_refused_naming_it():
    from lightning_gpumem._core.cards import CARD_MEMORY_GIB, card_bytes

    planner = MemoryPlanner(budgets=["A100-40GB", "rtx 4090"], stop=True)
    _fit(planner, Wide())
    assert [p.budget for p in planner.predictions] == [card_bytes("A100-40GB"), card_bytes("RTX4090")]
    assert [round(p.budget / 2**30, 2) for p in planner.predictions] == [CARD_MEMORY_GIB["A100-40GB"], 23.65]
    with pytest.raises(ValueError, match=r"MemoryPlanner\(budgets='Z100'\)"):
        MemoryPlanner(budgets=["Z100"])


def test_a_named_card_is_traced_with_its_own_kernels(monkeypatch):
    from lightning_gpumem._core.cards import card_bytes, card_device
    from lightning_gpumem._core.kernels import H100
    from lightning_gpumem.tuning import traced_plan

    devices = []
    real = traced_plan.traced_source

    def spy(trainer, owner, include_validation, device=H100, steps=3):
        devices.append(device)
        return real(trainer, owner, include_validation, device, steps)

    monkeypatch.setattr(traced_plan, "traced_source", spy)
    planner = MemoryPlanner(budgets=["A100-40GB", "H100-80GB", "24GiB", "RTX4090"], stop=True)
    _fit(planner, Wide())
    a100, rtx = card_device("A100-40GB"), card_device("RTX4090")
    assert devices == [H100, a100, rtx]  # the H100's for the H100 and a size in bytes, one trace per card
    assert a100.multiprocessors == 108
    assert rtx.threads_per_multiprocessor == 1536
    budgets = sorted((card_bytes(b) or 24 * 2**30 for b in planner.budgets), reverse=True)
    assert [p.budget for p in planner.predictions] == budgets
    assert all(p.largest for p in planner.predictions)


def test_ddps_gradient_buckets_are_a_copy_of_the_gradients_unless_they_are_views(tmp_path):
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lightning_gpumem.tuning.traced_plan import ddp_bucket_bytes

    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    net[1].bias.requires_grad_(False)
    trainable = (64 * 32 + 32 + 32 * 8) * 4
    assert ddp_bucket_bytes(SimpleNamespace(strategy=SimpleNamespace(model=net))) == 0  # not DDP
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for views, expected in ((False, trainable), (True, 0)):
            wrapped = DistributedDataParallel(net, gradient_as_bucket_view=views)
            assert ddp_bucket_bytes(SimpleNamespace(strategy=SimpleNamespace(model=wrapped))) == expected
    finally:
        dist.destroy_process_group()


def test_the_bucket_copy_is_held_before_the_first_step_of_every_traced_trial():
    from lightning_gpumem._hw.trace import trace_training

    trace = trace_training(
        torch.nn.Linear(256, 256),
        lambda ps: torch.optim.SGD(ps, lr=0.1),
        lambda m, x: m(x).sum(),
        torch.randn(4, 256),
    )
    plain = TracedSource(lambda size: trace)
    with_buckets = TracedSource(lambda size: trace, bucket_bytes=64 * MIB)
    assert with_buckets.replay(4).peak_allocated - plain.replay(4).peak_allocated == 64 * MIB
    assert with_buckets.under(10**12).bucket_bytes == 64 * MIB
