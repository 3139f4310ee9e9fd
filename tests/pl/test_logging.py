"""Tables (the tuner's trials, the layer table) reach every logger, each the way it takes tables."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.loggers import CSVLogger, Logger

from lightning_gpumem import BatchSizeTuner
from lightning_gpumem._pl.logging import log_table, run_dir
from tests.helpers.fakes import PlainLogger
from tests.helpers.models import OOMModel
from tests.helpers.trainer import quiet_trainer


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
    assert written == [tmp_path / "plain" / "plain" / "version_0" / "gpumem_trials.csv"]  # <save_dir>/<name>/<version>
    with open(written[0], newline="") as file:
        assert list(csv.reader(file)) == [COLUMNS, ["2", "ok"], ["4", "OOM"]]


def test_loggers_sharing_a_directory_get_one_file_and_the_callers_own_directory_none(tmp_path):
    trainer = _trainer(tmp_path, [PlainLogger(save_dir=str(tmp_path)), PlainLogger(save_dir=str(tmp_path))])
    run = tmp_path / "plain" / "version_0"
    assert log_table(trainer, "gpumem/trials", COLUMNS, ROWS, step=0, text="") == [run / "gpumem_trials.csv"]
    assert log_table(trainer, "gpumem/other", COLUMNS, ROWS, step=0, text="", has_file=run) == []
    assert not (run / "gpumem_other.csv").exists()


def test_files_go_to_the_first_loggers_run_directory_as_model_checkpoint_places_them(tmp_path):
    assert run_dir(_trainer(tmp_path, [])) == tmp_path
    mlflow_like = PlainLogger(save_dir=str(tmp_path / "mlruns"))  # no log_dir: <save_dir>/<name>/<version>
    csv_logger = CSVLogger(tmp_path / "csv")
    assert run_dir(_trainer(tmp_path, [mlflow_like, csv_logger])) == tmp_path / "mlruns" / "plain" / "version_0"
    assert run_dir(_trainer(tmp_path, [csv_logger])) == Path(csv_logger.log_dir)
    assert run_dir(_trainer(tmp_path, [PlainLogger()])) == tmp_path / "plain" / "version_0"  # default_root_dir
    assert run_dir(_trainer(tmp_path, [PlainLogger(name=None)])) == tmp_path  # no run named: the root itself
    assert run_dir(_trainer(tmp_path, []), dirpath=tmp_path / "x") == tmp_path / "x"


def test_an_mlflow_first_and_a_csv_logger_later_each_get_the_table_in_their_own_run(tmp_path):
    mlflow = PlainLogger(save_dir=str(tmp_path / "mlruns"), experiment=MlflowClientLike(), run_id="run-1")
    csv_logger = CSVLogger(tmp_path / "csv")
    written = log_table(_trainer(tmp_path, [mlflow, csv_logger]), "gpumem/trials", COLUMNS, ROWS, step=0, text="t")
    assert mlflow.experiment.calls == [("log_text", "run-1", "t", "gpumem_trials.md")]
    assert written == [Path(csv_logger.log_dir) / "gpumem_trials.csv"]


def test_a_logger_or_disk_that_fails_is_named_in_a_warning_and_the_others_still_get_the_table(tmp_path):
    class Broken(SummaryWriterLike):
        def add_text(self, key, text, global_step):
            raise OSError(28, "No space left on device")

    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the run directory should be")
    plain_on_a_file = PlainLogger(save_dir=str(blocked))
    good = PlainLogger(save_dir=str(tmp_path / "good"))
    trainer = _trainer(tmp_path, [PlainLogger(experiment=Broken()), plain_on_a_file, good])
    with pytest.warns(UserWarning, match="could not write the table `gpumem/trials` to PlainLogger") as record:
        written = log_table(trainer, "gpumem/trials", COLUMNS, ROWS, step=0, text="t")
    assert len(record) == 2
    assert written == [tmp_path / "good" / "plain" / "version_0" / "gpumem_trials.csv"]


@pytest.mark.filterwarnings("ignore:BatchSizeTuner. stopped at the upper bound")
def test_a_csv_logger_run_of_the_tuner_leaves_its_trials_in_its_log_dir(tmp_path):
    logger = CSVLogger(tmp_path)
    tuner = BatchSizeTuner(include_validation=False)
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0, callbacks=[tuner], logger=logger)
    trainer.fit(OOMModel(train_limit=20))
    with open(Path(logger.log_dir) / "gpumem_batch_size_trials.csv", newline="") as file:
        rows = list(csv.reader(file))
    assert rows[0][:2] == ["batch size", "outcome"]
    assert [(int(r[0]), r[1]) for r in rows[1:]] == [(t.batch_size, "ok" if t.fits else "OOM") for t in tuner.trials]
