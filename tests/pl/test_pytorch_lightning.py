"""The callbacks under the older namespace, `pytorch_lightning`: its Trainer, loggers, strategies and LightningCLI."""

from __future__ import annotations

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

from pytorch_lightning.demos.boring_classes import BoringModel, RandomDataset  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_gpumem import (  # noqa: E402
    AutoMicrobatch,
    BatchSizeTuner,
    EmptyCacheOnThreshold,
    LayerMemoryProfiler,
    MemoryBudget,
    MemoryMonitor,
    OOMSnapshot,
)
from lightning_gpumem.tuning.model_state import keeps_whole_model  # noqa: E402
from tests._fakes import kept, read_csv_metrics  # noqa: E402
from tests.integration.test_report import _layouts  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:.*(has no allocator|has no memory cap|has no CUDA allocator|without an accelerator|no accelerator"
        "|does nothing|doing nothing).*"
    ),
    pytest.mark.filterwarnings("ignore:`weights_only` was not set"),
]


class OOMModel(BoringModel):
    def __init__(self, batch_size: int = 2, train_limit: int = 20) -> None:
        super().__init__()
        self.batch_size, self.train_limit = batch_size, train_limit
        self.data = RandomDataset(32, 640)

    def training_step(self, batch, batch_idx):
        if batch.shape[0] > self.train_limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


def _trainer(tmp_path, callbacks, **kwargs) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        max_steps=3,
        limit_val_batches=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    return pl.Trainer(callbacks=callbacks, **{**defaults, **kwargs})


def test_every_callback_is_a_callback_of_both_namespaces(tmp_path):
    import lightning.pytorch

    callbacks = [MemoryMonitor(), BatchSizeTuner(), MemoryBudget("1GiB"), EmptyCacheOnThreshold()]
    callbacks += [OOMSnapshot(), LayerMemoryProfiler(), AutoMicrobatch()]
    for callback in callbacks:
        assert isinstance(callback, pl.Callback)
        assert isinstance(callback, lightning.pytorch.Callback)
    _trainer(tmp_path, callbacks, logger=pl.loggers.CSVLogger(tmp_path)).fit(OOMModel())


def test_the_monitor_logs_and_writes_its_layout_to_a_pytorch_lightning_tensorboard_logger(tmp_path):
    pytest.importorskip("tensorboard")
    logger = pl.loggers.TensorBoardLogger(tmp_path)
    _trainer(tmp_path, [MemoryMonitor()], logger=logger, log_every_n_steps=1).fit(BoringModel())
    assert _layouts(list(tmp_path.rglob("events.out.tfevents.*")))  # the Custom Scalars layout


def test_the_tuner_tunes_and_keeps_its_snapshot_in_memory(tmp_path):
    model, tuner = OOMModel(), BatchSizeTuner()
    trainer = _trainer(tmp_path, [tuner], logger=pl.loggers.CSVLogger(tmp_path))
    trainer.fit(model)
    assert tuner.optimal_batch_size == model.batch_size == kept(20)
    assert keeps_whole_model(trainer.strategy)  # a host copy, not a checkpoint file, undoes the trials
    assert float(read_csv_metrics(tmp_path)[0]["gpumem/batch_size"]) == kept(20)


def test_two_release_callbacks_coexist(tmp_path):
    callbacks = [EmptyCacheOnThreshold(threshold=0.5), EmptyCacheOnThreshold(threshold=0.9, hooks="train_epoch_end")]
    _trainer(tmp_path, callbacks, logger=False).fit(BoringModel())


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
@pytest.mark.filterwarnings("ignore:No seed found")
@pytest.mark.filterwarnings("ignore:MemoryMonitor. no logger")
def test_pytorch_lightning_cli_takes_the_callbacks_by_class_path(tmp_path, monkeypatch):
    monkeypatch.setenv("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
    pytest.importorskip("jsonargparse")
    from pytorch_lightning.cli import LightningCLI

    config = tmp_path / "input.yaml"
    config.write_text(
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
    for callback in (MemoryMonitor(), BatchSizeTuner(), EmptyCacheOnThreshold()):
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
