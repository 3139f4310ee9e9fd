"""Tables (the tuner's trials, the layer table) reach every logger, each the way it takes tables."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger, Logger

from lightning_gpumem import BatchSizeTuner
from lightning_gpumem._logging import log_dir, log_table
from tests.unit.test_tuner import OOMModel


class PlainLogger(Logger):
    """A logger with no text or table call (as a custom one may be)."""

    def __init__(self, save_dir: str | None = None, **attributes) -> None:
        super().__init__()
        self._save_dir = save_dir
        for name, value in attributes.items():
            setattr(self, name, value)

    @property
    def name(self):
        return "plain"

    @property
    def version(self):
        return 0

    @property
    def save_dir(self):
        return self._save_dir

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, params, *args, **kwargs):
        pass


class SummaryWriterLike:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def add_text(self, key, text, global_step):
        self.calls.append(("add_text", key, text, global_step))


class MlflowClientLike:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def log_text(self, run_id, text, artifact_file):
        self.calls.append(("log_text", run_id, text, artifact_file))


def _trainer(tmp_path: Path, loggers: list[Logger]) -> SimpleNamespace:
    return SimpleNamespace(loggers=loggers, default_root_dir=str(tmp_path))


COLUMNS, ROWS = ["batch size", "outcome"], [[2, "ok"], [4, "OOM"]]


def test_each_kind_of_logger_gets_the_table_its_own_way(tmp_path):
    tensorboard = PlainLogger(experiment=SummaryWriterLike())
    mlflow = PlainLogger(experiment=MlflowClientLike(), run_id="run-1")
    wandb_calls: list[dict] = []
    wandb = PlainLogger(log_table=lambda **kwargs: wandb_calls.append(kwargs))
    plain = PlainLogger(save_dir=str(tmp_path / "plain"))
    trainer = _trainer(tmp_path, [tensorboard, mlflow, wandb, plain])
    written = log_table(trainer, "gpumem/trials", COLUMNS, ROWS, step=7, text="| md |")
    assert tensorboard.experiment.calls == [("add_text", "gpumem/trials", "| md |", 7)]
    assert mlflow.experiment.calls == [("log_text", "run-1", "| md |", "gpumem_trials.md")]
    assert wandb_calls == [{"key": "gpumem/trials", "columns": COLUMNS, "data": ROWS, "step": 7}]
    assert written == [tmp_path / "plain" / "gpumem_trials.csv"]
    with open(written[0], newline="") as file:
        assert list(csv.reader(file)) == [COLUMNS, ["2", "ok"], ["4", "OOM"]]


def test_loggers_sharing_a_directory_get_one_file_and_files_can_be_left_to_the_caller(tmp_path):
    trainer = _trainer(tmp_path, [PlainLogger(save_dir=str(tmp_path)), PlainLogger(save_dir=str(tmp_path))])
    assert log_table(trainer, "gpumem/trials", COLUMNS, ROWS, step=0, text="") == [tmp_path / "gpumem_trials.csv"]
    assert log_table(trainer, "gpumem/other", COLUMNS, ROWS, step=0, text="", files=False) == []
    assert not (tmp_path / "gpumem_other.csv").exists()


def test_files_follow_the_first_loggers_directory_as_trainer_log_dir_does(tmp_path):
    assert log_dir(_trainer(tmp_path, [])) == tmp_path
    mlflow_like = PlainLogger(save_dir=str(tmp_path / "mlruns"))  # no log_dir: its save_dir, as Lightning's
    assert log_dir(_trainer(tmp_path, [mlflow_like, CSVLogger(tmp_path / "csv")])) == tmp_path / "mlruns"
    assert log_dir(_trainer(tmp_path, [PlainLogger()])) == tmp_path  # neither: default_root_dir
    assert log_dir(_trainer(tmp_path, []), dirpath=tmp_path / "x") == tmp_path / "x"


@pytest.mark.filterwarnings("ignore:BatchSizeTuner. stopped at the upper bound")
def test_a_csv_logger_run_of_the_tuner_leaves_its_trials_in_its_log_dir(tmp_path):
    logger = CSVLogger(tmp_path)
    tuner = BatchSizeTuner(include_validation=False)
    trainer = Trainer(
        accelerator="cpu",
        max_steps=1,
        limit_val_batches=0,
        callbacks=[tuner],
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(OOMModel(train_limit=20))
    with open(Path(logger.log_dir) / "gpumem_batch_size_trials.csv", newline="") as file:
        rows = list(csv.reader(file))
    assert rows[0][:2] == ["batch size", "outcome"]
    assert [(int(r[0]), r[1]) for r in rows[1:]] == [(t.batch_size, "ok" if t.fits else "OOM") for t in tuner.trials]
