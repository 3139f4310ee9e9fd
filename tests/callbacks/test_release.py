"""EmptyCacheOnThreshold and MemoryBudget with a fake allocator under a real CPU Trainer, and on a plain CPU."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

from lightning_gpumem import EmptyCacheOnThreshold, MemoryBudget
from lightning_gpumem._core.units import GIB
from lightning_gpumem.release import ReleasePolicy
from tests._fakes import FakeMonitor, FakeProbe, SpikeModel, column, read_csv_metrics


class CudaFakeProbe(FakeProbe):
    """A fake CUDA allocator with a per-process cap (only the device's type is read)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.device = torch.device("cuda")
        self.fraction = 1.0
        self.releases = 0

    def set_memory_fraction(self, fraction: float) -> float:
        previous, self.fraction = self.fraction, fraction
        return previous

    def release_cache(self) -> None:
        self.releases += 1
        super().release_cache()


class FakeRelease(EmptyCacheOnThreshold):
    def __init__(self, probe: FakeProbe, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fake = probe


class FakeBudget(MemoryBudget):
    def __init__(self, probe: FakeProbe, budget) -> None:
        super().__init__(budget)
        self.fake = probe


def _trainer(tmp_path, callbacks, **kwargs) -> Trainer:
    defaults = dict(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=20,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=CSVLogger(tmp_path),
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        log_every_n_steps=1,
    )
    defaults.update(kwargs)
    return Trainer(**defaults)


# ---------------------------------------------------------------------------------------------------- policy
def test_policy_waits_for_usage_below_the_mark_or_min_steps():
    policy = ReleasePolicy(mark_bytes=100, min_steps_between=50)
    assert policy.should_release(101, 0)
    policy.released(0)
    assert not any(policy.should_release(150, step) for step in range(1, 50))  # steady state above: no every-step
    assert policy.should_release(150, 50)
    policy.released(50)
    assert not policy.should_release(100, 51)  # at the mark is not above it; re-arms
    assert policy.should_release(101, 52)


def test_policy_with_zero_min_steps_releases_whenever_above():
    policy = ReleasePolicy(mark_bytes=10, min_steps_between=0)
    policy.released(3)
    assert policy.should_release(11, 3)


# ---------------------------------------------------------------------------------------------------- release
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"threshold": 0.0}, r"threshold=0.0"),
        ({"threshold": 1.5}, r"threshold=1.5"),
        ({"threshold": True}, r"threshold=True"),
        ({"relative_to": "host"}, r"relative_to='host'"),
        ({"measure": "rss"}, r"measure='rss'"),
        ({"min_steps_between": -1}, r"min_steps_between=-1"),
        ({"hooks": ("train_batch_end", "after_lunch")}, r"hooks=\('train_batch_end', 'after_lunch'\)"),
        ({"hooks": ()}, r"hooks=\(\)"),
        ({"hooks": None}, r"hooks=None"),
        ({"hooks": 123}, r"hooks=123"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=r"EmptyCacheOnThreshold\(" + match):
        EmptyCacheOnThreshold(**kwargs)


def test_on_is_a_deprecated_alias_of_hooks():
    with pytest.warns(DeprecationWarning, match="use `hooks=...`"):
        release = EmptyCacheOnThreshold(on="validation_end")
    assert release.hooks == {"validation_end"}
    bad = pytest.raises(ValueError, match=r"EmptyCacheOnThreshold\(on=\[None\]\)")
    with pytest.warns(DeprecationWarning, match="hooks"), bad:
        EmptyCacheOnThreshold(on=[None])
    with pytest.raises(ValueError, match="`on` is the deprecated name of `hooks`"):
        EmptyCacheOnThreshold(hooks=["train_epoch_end"], on=["validation_end"])


def test_two_instances_with_different_settings_coexist_and_each_keeps_its_own_state(tmp_path):
    every_batch = EmptyCacheOnThreshold(threshold=0.9, hooks=["train_batch_end"])
    after_validation = EmptyCacheOnThreshold(threshold=0.5, hooks="validation_end")
    assert every_batch.state_key != after_validation.state_key
    every_batch.releases, after_validation.releases = 1, 2
    trainer = Trainer(
        accelerator="cpu",
        max_steps=1,
        limit_val_batches=0,
        callbacks=[every_batch, after_validation],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with pytest.warns(UserWarning, match="has no allocator cache"):
        trainer.fit(BoringModel())
    path = tmp_path / "two.ckpt"
    trainer.save_checkpoint(path)
    states = torch.load(path, weights_only=False)["callbacks"]
    assert states[every_batch.state_key]["releases"] == 1
    assert states[after_validation.state_key]["releases"] == 2


def test_the_on_attribute_still_reads_with_a_deprecation_warning():
    release = EmptyCacheOnThreshold(hooks="validation_end")
    with pytest.warns(DeprecationWarning, match="use `.hooks`"):
        assert release.on == {"validation_end"}


# Lightning on resuming a mid-epoch checkpoint in place, with the callback's state under a key it does not know:
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
@pytest.mark.filterwarnings("ignore:Be aware that when using .ckpt_path., callbacks used to create the checkpoint")
def test_a_checkpoint_from_before_the_per_configuration_state_key_still_restores_the_counts(tmp_path):
    def trainer(release, steps):
        return Trainer(
            accelerator="cpu",
            max_steps=steps,
            limit_val_batches=0,
            callbacks=[release],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )

    first = EmptyCacheOnThreshold(threshold=0.5)
    first.releases = 4
    fit = trainer(first, 1)
    with pytest.warns(UserWarning, match="has no allocator cache"):
        fit.fit(BoringModel())
    checkpoint = torch.load(fit.checkpoint_callback.best_model_path, weights_only=False)
    checkpoint["callbacks"] = {"EmptyCacheOnThreshold": checkpoint["callbacks"].pop(first.state_key)}  # the old key
    old = tmp_path / "old.ckpt"
    torch.save(checkpoint, old)
    resumed = EmptyCacheOnThreshold(threshold=0.5)
    with pytest.warns(UserWarning, match="has no allocator cache"):
        trainer(resumed, 2).fit(BoringModel(), ckpt_path=old)
    assert resumed.releases == 4


def test_collect_garbage_must_be_bool():
    with pytest.raises(TypeError, match=r"EmptyCacheOnThreshold\(collect_garbage='yes'\)"):
        EmptyCacheOnThreshold(collect_garbage="yes")


def test_a_validation_spike_is_released_once_and_logged(tmp_path):
    probe = CudaFakeProbe(base=GIB, total=10 * GIB)
    release = FakeRelease(probe, threshold=0.5)  # mark: 5 GiB of the 10 GiB device
    model = SpikeModel(probe, val_spike=6 * GIB)  # the cache keeps 7 GiB after validation
    _trainer(tmp_path, [release], val_check_interval=10).fit(model)
    assert release.releases == 2  # after each of the two validations (steps 10 and 20)
    assert release.released_bytes == 2 * 6 * GIB
    assert probe.reserved == GIB
    rows = read_csv_metrics(tmp_path)
    logged = [(int(r["step"]), float(r["gpumem/cache_releases"])) for r in rows if r.get("gpumem/cache_releases")]
    # Training batch 9 logs 0; the validation that follows it releases and logs 1 at once, at the same step (the
    # step Lightning logs that validation's metrics at); the end of training logs the second.
    assert logged[9:11] == [(9, 0.0), (9, 1.0)]
    assert logged[-1] == (20, 2.0)  # the last validation runs after the 20th batch stepped
    assert column(rows, "gpumem/released_gib")[10] == pytest.approx(6.0)
    assert column(rows, "gpumem/release_seconds")[10] >= 0.0


def test_steady_state_above_the_mark_releases_every_min_steps_only(tmp_path):
    probe = CudaFakeProbe(base=GIB, total=10 * GIB)
    release = FakeRelease(probe, threshold=0.5, min_steps_between=5)
    model = SpikeModel(probe, train_spikes={s: 6 * GIB for s in range(20)})  # every step refills the cache
    _trainer(tmp_path, [release], limit_val_batches=0).fit(model)
    assert release.releases == 4  # steps 0, 5, 10, 15: not 20 releases


def test_the_mark_follows_a_memory_budget(tmp_path):
    probe = CudaFakeProbe(base=GIB, total=80 * GIB)
    release = FakeRelease(probe, threshold=0.5)
    budget = FakeBudget(probe, "8GiB")
    model = SpikeModel(probe, train_spikes={3: 4 * GIB})  # 5 GiB reserved: above 4 GiB (half the budget)
    _trainer(tmp_path, [budget, release], limit_val_batches=0).fit(model)
    assert release.releases == 1
    device_relative = FakeRelease(probe, threshold=0.5, relative_to="device")  # 40 GiB mark: never
    probe.reserved = probe.allocated
    _trainer(tmp_path, [FakeBudget(probe, "8GiB"), device_relative], limit_val_batches=0).fit(
        SpikeModel(probe, train_spikes={3: 4 * GIB})
    )
    assert device_relative.releases == 0


def test_on_cpu_it_warns_once_and_does_nothing(tmp_path):
    release = EmptyCacheOnThreshold(threshold=0.01, collect_garbage=True)
    with pytest.warns(UserWarning, match="EmptyCacheOnThreshold: `cpu` has no allocator cache"):
        _trainer(tmp_path, [release]).fit(BoringModel())
    assert release.releases == 0
    assert not any("gpumem/cache_releases" in f.read_text() for f in tmp_path.rglob("metrics.csv"))


def test_release_counts_survive_a_checkpoint():
    release = EmptyCacheOnThreshold()
    release.releases, release.released_bytes, release.release_seconds = 3, 5 * GIB, 0.25
    fresh = EmptyCacheOnThreshold()
    fresh.load_state_dict(release.state_dict())
    assert (fresh.releases, fresh.released_bytes, fresh.release_seconds) == (3, 5 * GIB, 0.25)
    fresh.load_state_dict({})  # an older checkpoint without the keys
    assert fresh.releases == 0


# ---------------------------------------------------------------------------------------------------- budget
@pytest.mark.parametrize(
    ("budget", "error"), [("24 parsecs", ValueError), (0, ValueError), (1.5, ValueError), ([1], TypeError)]
)
def test_bad_budgets_name_themselves(budget, error):
    with pytest.raises(error, match=r"MemoryBudget\(budget="):
        MemoryBudget(budget)


def test_budget_caps_from_setup_to_teardown_and_restores_the_previous_cap(tmp_path):
    probe = CudaFakeProbe(base=GIB, total=80 * GIB)
    probe.fraction = 0.75  # a cap the user had set before
    seen = []

    class Spy(FakeMonitor):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(probe.fraction)
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    budget = FakeBudget(probe, "20GiB")
    _trainer(tmp_path, [budget, Spy(probe)], limit_train_batches=3, limit_val_batches=0).fit(BoringModel())
    assert seen == [pytest.approx(0.25)] * 3
    assert budget.budget_bytes == 20 * GIB
    assert probe.fraction == 0.75  # restored at teardown
    assert column(read_csv_metrics(tmp_path), "gpumem/budget_gib")[0] == pytest.approx(20.0)


def test_budget_above_the_device_warns_and_caps_at_the_device(tmp_path):
    probe = CudaFakeProbe(base=GIB, total=16 * GIB)
    budget = FakeBudget(probe, "24GiB")
    with pytest.warns(UserWarning, match=r"MemoryBudget\(budget='24GiB'\) is 24.0 GiB, more than the device's 16.0"):
        _trainer(tmp_path, [budget], limit_train_batches=1, limit_val_batches=0).fit(BoringModel())
    assert budget.budget_bytes == 16 * GIB


def test_budget_fraction_of_the_device(tmp_path):
    probe = CudaFakeProbe(base=GIB, total=80 * GIB)
    budget = FakeBudget(probe, 0.25)
    _trainer(tmp_path, [budget], limit_train_batches=1, limit_val_batches=0).fit(BoringModel())
    assert budget.budget_bytes == 20 * GIB


def test_budget_on_cpu_warns_once_and_does_nothing(tmp_path):
    budget = MemoryBudget("2GiB")
    with pytest.warns(UserWarning, match="MemoryBudget: `cpu` has no memory cap"):
        _trainer(tmp_path, [budget], limit_train_batches=2).fit(BoringModel())
    assert budget.budget_bytes is None


def test_progress_bar_shows_usage_against_the_budget(tmp_path):
    probe = CudaFakeProbe(base=GIB, total=80 * GIB)
    monitor = FakeMonitor(probe)
    trainer = _trainer(
        tmp_path,
        [FakeBudget(probe, "8GiB"), monitor],
        limit_train_batches=2,
        limit_val_batches=0,
        enable_progress_bar=True,
    )
    trainer.fit(BoringModel())
    assert trainer.progress_bar_metrics["mem"] == "1.0/8.0 GiB"


def test_budget_is_undone_when_the_fit_raises(tmp_path):
    """Lightning calls no callback `teardown` after an exception: the cap must still be lifted."""
    probe = CudaFakeProbe(base=GIB, total=80 * GIB)

    class Broken(BoringModel):
        def training_step(self, batch, batch_idx):
            raise ValueError("user bug")

    with pytest.raises(ValueError, match="user bug"):
        _trainer(tmp_path, [FakeBudget(probe, "8GiB")], limit_val_batches=0).fit(Broken())
    assert probe.fraction == 1.0


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
@pytest.mark.filterwarnings("ignore:No seed found")
def test_hooks_is_a_plain_key_in_a_lightning_cli_yaml_config(tmp_path, monkeypatch):
    # `on:` unquoted is the boolean True in YAML 1.1; `hooks:` is read as written.
    monkeypatch.setenv("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "input.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  max_steps: 1\n  logger: false\n  enable_progress_bar: false\n"
        f"  default_root_dir: {tmp_path / 'run'}\n"
        "  callbacks:\n    - class_path: lightning_gpumem.EmptyCacheOnThreshold\n"
        "      init_args:\n        threshold: 0.8\n        hooks: [train_epoch_end, validation_end]\n"
    )
    with pytest.warns(UserWarning, match="has no allocator cache"):
        cli = LightningCLI(BoringModel, args=["fit", "--config", str(config)])
    (release,) = [c for c in cli.trainer.callbacks if isinstance(c, EmptyCacheOnThreshold)]
    assert release.hooks == {"train_epoch_end", "validation_end"}
    assert release.threshold == 0.8
