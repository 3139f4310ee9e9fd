"""The callbacks under the older namespace, `pytorch_lightning`: its Trainer, loggers, strategies and LightningCLI."""

from __future__ import annotations

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

from pytorch_lightning.demos.boring_classes import BoringModel  # noqa: E402

from lightning_gpumem import (  # noqa: E402
    AutoMicrobatch,
    BatchSizeTuner,
    EmptyCacheOnThreshold,
    LayerMemoryProfiler,
    MemoryBudget,
    MemoryMonitor,
    OOMSnapshot,
)
from lightning_gpumem._core.units import GIB  # noqa: E402
from lightning_gpumem.tuning.trials.model_state import keeps_whole_model  # noqa: E402
from tests.helpers.fakes import CudaFakeProbe, FakeRelease, kept, read_csv_metrics  # noqa: E402
from tests.helpers.models import OOMSteps  # noqa: E402
from tests.helpers.tensorboard import read_layouts  # noqa: E402
from tests.helpers.trainer import quiet_trainer  # noqa: E402
from tests.helpers.tuning import CPU_SEARCH  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:.*(has no allocator|has no memory cap|has no CUDA allocator|without an accelerator|no accelerator"
        "|does nothing|doing nothing).*"
    ),
    pytest.mark.filterwarnings("ignore:`weights_only` was not set"),
]


class OOMModel(OOMSteps, BoringModel):
    """tests.helpers.models.OOMModel under this namespace: out of memory above `train_limit` samples a batch."""


def _trainer(tmp_path, callbacks, **kwargs) -> pl.Trainer:
    """3 steps, 1 validation batch, in `tmp_path`, with the older namespace's Trainer."""
    options = dict(
        max_steps=3, limit_val_batches=1, callbacks=callbacks, logger=True, trainer_class=pl.Trainer
    )
    return quiet_trainer(tmp_path, **{**options, **kwargs})


def test_every_callback_is_a_callback_of_both_namespaces(tmp_path):
    import lightning.pytorch

    callbacks = [
        MemoryMonitor(),
        BatchSizeTuner(max_val=CPU_SEARCH),
        MemoryBudget("1GiB"),
        EmptyCacheOnThreshold(),
    ]
    callbacks += [OOMSnapshot(), LayerMemoryProfiler(), AutoMicrobatch()]
    for callback in callbacks:
        assert isinstance(callback, pl.Callback)
        assert isinstance(callback, lightning.pytorch.Callback)
    _trainer(tmp_path, callbacks, logger=pl.loggers.CSVLogger(tmp_path)).fit(OOMModel(train_limit=20))


def test_the_monitor_logs_and_writes_its_layout_to_a_pytorch_lightning_tensorboard_logger(tmp_path):
    pytest.importorskip("tensorboard")
    logger = pl.loggers.TensorBoardLogger(tmp_path)
    _trainer(tmp_path, [MemoryMonitor()], logger=logger, log_every_n_steps=1).fit(BoringModel())
    assert read_layouts(list(tmp_path.rglob("events.out.tfevents.*")))  # the Custom Scalars layout


def test_the_tuner_tunes_and_keeps_its_snapshot_in_memory(tmp_path):
    model, tuner = OOMModel(train_limit=20), BatchSizeTuner(max_val=CPU_SEARCH)
    trainer = _trainer(tmp_path, [tuner], logger=pl.loggers.CSVLogger(tmp_path))
    trainer.fit(model)
    assert tuner.optimal_batch_size == model.batch_size == kept(20)
    assert keeps_whole_model(trainer.strategy)  # a host copy, not a checkpoint file, undoes the trials
    assert float(read_csv_metrics(tmp_path)[0]["gpumem/batch_size"]) == kept(20)


def test_two_release_callbacks_coexist(tmp_path):
    # Coexisting: the older namespace's Trainer takes both (it refuses two stateful callbacks of one state key), each
    # releases on its own hooks at its own mark and counts only its own releases, and a checkpoint keeps both counts
    # apart. (Both log under the same `gpumem/cache_releases` keys, so `logger=False`: the logs cannot tell them apart.)
    probe = CudaFakeProbe(base=GIB, total=10 * GIB)

    class Spiking(BoringModel):  # the cache keeps each spike: 6 GiB at step 0, then 9 GiB at steps 1 and 3
        def training_step(self, batch, batch_idx):
            probe.spike({0: 6 * GIB, 1: 9 * GIB, 3: 9 * GIB}.get(self.global_step, 0))
            return super().training_step(batch, batch_idx)

    every_batch = FakeRelease(
        probe, threshold=0.5
    )  # train_batch_end and validation_end, mark 5 GiB, 50 steps apart
    after_epoch = FakeRelease(
        probe, threshold=0.9, hooks="train_epoch_end", min_steps_between=0
    )  # mark 9 GiB
    assert every_batch.state_key != after_epoch.state_key
    seen = []

    class Counts(pl.Callback):  # after both: each one's count at each batch end
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((every_batch.releases, after_epoch.releases))

    options = dict(logger=False, max_steps=-1, max_epochs=2, limit_train_batches=2)
    trainer = _trainer(tmp_path, [every_batch, after_epoch, Counts()], **options)
    trainer.fit(Spiking())
    assert trainer.global_step == 4
    assert seen == [
        (1, 0),
        (1, 0),
        (1, 1),
        (2, 1),
    ]  # `after_epoch` waits for the epoch's end, above its mark or not
    # Step 0: 7 GiB reserved, above 5: `every_batch` gives 6 back. Step 1: 10 GiB, but `every_batch` released one
    # step ago and has not seen the cache below its mark since: the end of epoch 0 is `after_epoch`'s, 9 back. Step 2
    # is seen below the mark (re-armed), so step 3's 9 GiB are `every_batch`'s again, and epoch 1 ends at 1 GiB.
    assert (every_batch.releases, every_batch.released_bytes) == (2, (6 + 9) * GIB)
    assert (after_epoch.releases, after_epoch.released_bytes) == (1, 9 * GIB)
    assert probe.releases == 3  # no release counted twice, none lost
    path = tmp_path / "both.ckpt"
    trainer.save_checkpoint(path)
    states = torch.load(path, weights_only=False)["callbacks"]
    assert states[every_batch.state_key] == {
        "releases": 2,
        "released_bytes": 15 * GIB,
        "seconds": every_batch.release_seconds,
    }
    assert states[after_epoch.state_key]["releases"] == 1
    resumed = [FakeRelease(probe, threshold=0.5), FakeRelease(probe, threshold=0.9, hooks="train_epoch_end")]
    for callback in resumed:
        callback.load_state_dict(states[callback.state_key])  # each finds its own state under its own key
    assert [(c.releases, c.released_bytes) for c in resumed] == [(2, 15 * GIB), (1, 9 * GIB)]


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
@pytest.mark.filterwarnings("ignore:No seed found")
@pytest.mark.filterwarnings("ignore:MemoryMonitor. no logger")
def test_pytorch_lightning_cli_takes_the_callbacks_by_class_path(tmp_path, monkeypatch):
    monkeypatch.setenv("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
    pytest.importorskip("jsonargparse")
    from pytorch_lightning.cli import LightningCLI

    config = tmp_path / "input.yaml"
    config.write_text(
        "model:\n  train_limit: 20\n"
        "trainer:\n  accelerator: cpu\n  max_steps: 2\n  limit_val_batches: 1\n  logger: false\n"
        f"  enable_progress_bar: false\n  enable_checkpointing: false\n  default_root_dir: {tmp_path / 'run'}\n"
        "  callbacks:\n    - class_path: lightning_gpumem.MemoryMonitor\n"
        "    - class_path: lightning_gpumem.BatchSizeTuner\n      init_args:\n        max_val: 16\n"
    )
    with pytest.warns(UserWarning, match="BatchSizeTuner: stopped at the upper bound 16"):
        cli = LightningCLI(OOMModel, args=["fit", "--config", str(config)])
    tuner = next(c for c in cli.trainer.callbacks if isinstance(c, BatchSizeTuner))
    assert cli.model.batch_size == tuner.optimal_batch_size == 16  # the dataset fits: stopped at max_val


def test_callbacks_without_state_are_not_stateful_in_either_namespace():
    # Each Trainer decides "stateful" by comparing `state_dict` with its own Callback's; a false positive would
    # refuse two instances of one callback ("Found more than one stateful callback").
    import lightning.pytorch
    from lightning.pytorch.utilities.model_helpers import is_overridden as new_is_overridden
    from pytorch_lightning.utilities.model_helpers import is_overridden as old_is_overridden

    for callback in (OOMSnapshot(), LayerMemoryProfiler(), MemoryBudget("1GiB")):
        assert not new_is_overridden("state_dict", callback, parent=lightning.pytorch.Callback)
        assert not old_is_overridden("state_dict", callback, parent=pl.Callback)
    for callback in (MemoryMonitor(), BatchSizeTuner(max_val=CPU_SEARCH), EmptyCacheOnThreshold()):
        assert new_is_overridden("state_dict", callback, parent=lightning.pytorch.Callback)
        assert old_is_overridden("state_dict", callback, parent=pl.Callback)


def test_auto_microbatch_recovers_under_the_pytorch_lightning_trainer(tmp_path):
    model = OOMModel(batch_size=32, train_limit=20)  # every batch of 32 runs out of memory; 16 fits
    callback = AutoMicrobatch()
    trainer = _trainer(tmp_path, [callback], logger=False, limit_val_batches=0)
    with pytest.warns(UserWarning, match="re-running it as 2 micro-batches of about 16"):
        trainer.fit(model)
    assert trainer.global_step == 3
    assert (callback.oom_recoveries, callback.microbatches) == (1, 2)
