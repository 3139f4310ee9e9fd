"""EmptyCacheOnThreshold with a fake allocator under a real CPU Trainer, and on a plain CPU."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_gpumem import EmptyCacheOnThreshold
from lightning_gpumem._core.units import GIB
from lightning_gpumem.release import ReleasePolicy
from tests.helpers.fakes import CudaFakeProbe, FakeBudget, FakeRelease, SpikeModel, column, read_csv_metrics
from tests.helpers.trainer import csv_epoch_trainer


# ---------------------------------------------------------------------------------------------------- policy
def test_policy_waits_for_usage_below_the_mark_or_min_steps():
    policy = ReleasePolicy(mark_bytes=100, min_steps_between=50)
    assert policy.should_release(101, 0)
    policy.released(0)
    assert not any(
        policy.should_release(150, step) for step in range(1, 50)
    )  # steady state above: no every-step
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


def test_two_instances_with_different_settings_coexist_and_each_keeps_its_own_state(tmp_path, make_trainer):
    every_batch = EmptyCacheOnThreshold(threshold=0.9, hooks=["train_batch_end"])
    after_validation = EmptyCacheOnThreshold(threshold=0.5, hooks="validation_end")
    assert every_batch.state_key != after_validation.state_key
    every_batch.releases, after_validation.releases = 1, 2
    trainer = make_trainer(
        max_steps=1,
        limit_val_batches=0,
        callbacks=[every_batch, after_validation],
        enable_checkpointing=True,
    )
    with pytest.warns(UserWarning, match="has no allocator cache"):
        trainer.fit(BoringModel())
    path = tmp_path / "two.ckpt"
    trainer.save_checkpoint(path)
    states = torch.load(path, weights_only=False)["callbacks"]
    assert states[every_batch.state_key]["releases"] == 1
    assert states[after_validation.state_key]["releases"] == 2


def test_collect_garbage_must_be_bool():
    with pytest.raises(TypeError, match=r"EmptyCacheOnThreshold\(collect_garbage='yes'\)"):
        EmptyCacheOnThreshold(collect_garbage="yes")


def test_a_validation_spike_is_released_once_and_logged(tmp_path):
    probe = CudaFakeProbe(base=GIB, total=10 * GIB)
    release = FakeRelease(probe, threshold=0.5)  # mark: 5 GiB of the 10 GiB device
    model = SpikeModel(probe, val_spike=6 * GIB)  # the cache keeps 7 GiB after validation
    csv_epoch_trainer(tmp_path, [release], val_check_interval=10).fit(model)
    assert release.releases == 2  # after each of the two validations (steps 10 and 20)
    assert release.released_bytes == 2 * 6 * GIB
    assert probe.reserved == GIB
    rows = read_csv_metrics(tmp_path)
    logged = [
        (int(r["step"]), float(r["gpumem/cache_releases"])) for r in rows if r.get("gpumem/cache_releases")
    ]
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
    csv_epoch_trainer(tmp_path, [release], limit_val_batches=0).fit(model)
    assert release.releases == 4  # steps 0, 5, 10, 15: not 20 releases


def test_the_mark_follows_a_memory_budget(tmp_path):
    probe = CudaFakeProbe(base=GIB, total=80 * GIB)
    release = FakeRelease(probe, threshold=0.5)
    budget = FakeBudget(probe, "8GiB")
    model = SpikeModel(probe, train_spikes={3: 4 * GIB})  # 5 GiB reserved: above 4 GiB (half the budget)
    csv_epoch_trainer(tmp_path, [budget, release], limit_val_batches=0).fit(model)
    assert release.releases == 1
    device_relative = FakeRelease(probe, threshold=0.5, relative_to="device")  # 40 GiB mark: never
    probe.reserved = probe.allocated
    csv_epoch_trainer(tmp_path, [FakeBudget(probe, "8GiB"), device_relative], limit_val_batches=0).fit(
        SpikeModel(probe, train_spikes={3: 4 * GIB})
    )
    assert device_relative.releases == 0


def test_on_cpu_it_warns_once_and_does_nothing(tmp_path):
    release = EmptyCacheOnThreshold(threshold=0.01, collect_garbage=True)
    with pytest.warns(UserWarning, match="EmptyCacheOnThreshold: `cpu` has no allocator cache"):
        csv_epoch_trainer(tmp_path, [release]).fit(BoringModel())
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
