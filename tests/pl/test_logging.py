"""Tables (the tuner's trials, the layer table) reach every logger, each the way it takes tables."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.loggers import CSVLogger, Logger

from lightning_gpumem import BatchSizeTuner
from lightning_gpumem._pl.logging import log_table, run_dir
from tests.helpers.fakes import PlainLogger
from tests.helpers.models import OOMModel
from tests.helpers.trainer import quiet_trainer
from tests.helpers.tuning import CPU_SEARCH


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
    assert written == [
        tmp_path / "plain" / "plain" / "version_0" / "gpumem_trials.csv"
    ]  # <save_dir>/<name>/<version>
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
    assert (
        run_dir(_trainer(tmp_path, [mlflow_like, csv_logger])) == tmp_path / "mlruns" / "plain" / "version_0"
    )
    assert run_dir(_trainer(tmp_path, [csv_logger])) == Path(csv_logger.log_dir)
    assert (
        run_dir(_trainer(tmp_path, [PlainLogger()])) == tmp_path / "plain" / "version_0"
    )  # default_root_dir
    assert run_dir(_trainer(tmp_path, [PlainLogger(name=None)])) == tmp_path  # no run named: the root itself
    assert run_dir(_trainer(tmp_path, []), dirpath=tmp_path / "x") == tmp_path / "x"


def test_an_mlflow_first_and_a_csv_logger_later_each_get_the_table_in_their_own_run(tmp_path):
    mlflow = PlainLogger(save_dir=str(tmp_path / "mlruns"), experiment=MlflowClientLike(), run_id="run-1")
    csv_logger = CSVLogger(tmp_path / "csv")
    written = log_table(
        _trainer(tmp_path, [mlflow, csv_logger]), "gpumem/trials", COLUMNS, ROWS, step=0, text="t"
    )
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
    with pytest.warns(
        UserWarning, match="could not write the table `gpumem/trials` to PlainLogger"
    ) as record:
        written = log_table(trainer, "gpumem/trials", COLUMNS, ROWS, step=0, text="t")
    assert len(record) == 2
    assert written == [tmp_path / "good" / "plain" / "version_0" / "gpumem_trials.csv"]


@pytest.mark.filterwarnings("ignore:BatchSizeTuner. stopped at the upper bound")
def test_a_csv_logger_run_of_the_tuner_leaves_its_trials_in_its_log_dir(tmp_path):
    logger = CSVLogger(tmp_path)
    tuner = BatchSizeTuner(max_val=CPU_SEARCH, include_validation=False)
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0, callbacks=[tuner], logger=logger)
    trainer.fit(OOMModel(train_limit=20))
    with open(Path(logger.log_dir) / "gpumem_batch_size_trials.csv", newline="") as file:
        rows = list(csv.reader(file))
    assert rows[0][:2] == ["batch size", "outcome"]
    assert [(int(r[0]), r[1]) for r in rows[1:]] == [
        (t.batch_size, "ok" if t.fits else "OOM") for t in tuner.trials
    ]


# ---------------------------------------------------------------------- a logger whose log_metrics fails
class FailingLogger(CSVLogger):
    """A tracker whose network fails: `log_metrics` raises for our keys (the user's own keys still log)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.failures = 0

    def log_metrics(self, metrics, step=None):
        if any(k.startswith("gpumem/") for k in metrics):
            self.failures += 1
            raise ConnectionError("tracker unreachable")
        super().log_metrics(metrics, step)


def _failing_fit(tmp_path, which):
    from tests.helpers.fakes import CudaFakeProbe, FakeMonitor, FakeRelease, SpikeModel
    from tests.helpers.microbatch import Net
    from tests.helpers.tuning import CappedFakeProbe, FakeTuner, MemoryModel

    logger = FailingLogger(tmp_path)
    options = dict(logger=logger, log_every_n_steps=1, max_steps=6)
    if which == "monitor":
        probe = CudaFakeProbe()
        return logger, quiet_trainer(callbacks=[FakeMonitor(probe)], **options), SpikeModel(probe)
    if which == "release":
        probe = CudaFakeProbe(total=10 * 2**30)
        model = SpikeModel(probe, train_spikes={s: 6 * 2**30 for s in range(6)})
        return logger, quiet_trainer(callbacks=[FakeRelease(probe, threshold=0.5)], **options), model
    if which in ("tuner", "planner"):
        from lightning_gpumem import MemoryPlanner

        probe = CappedFakeProbe(total=24 * 2**30)
        model = MemoryModel(probe, per_sample=100 * 2**20, n=512)
        if which == "tuner":
            callback = FakeTuner(probe)
        else:
            callback = MemoryPlanner(validate=False)
            callback.fake = probe  # type: ignore[attr-defined]
        return logger, quiet_trainer(callbacks=[callback], **options), model
    from lightning_gpumem import AutoMicrobatch

    model = Net(limit=5, pressure=range(2, 4))
    return logger, quiet_trainer(callbacks=[AutoMicrobatch(grow_after=2)], **options), model


@pytest.mark.parametrize("which", ["monitor", "release", "tuner", "planner", "microbatch"])
@pytest.mark.filterwarnings("ignore:AutoMicrobatch")
@pytest.mark.filterwarnings("ignore:`weights_only` was not set")
def test_a_logger_whose_log_metrics_raises_never_ends_the_fit(tmp_path, which, recwarn):
    logger, trainer, model = _failing_fit(tmp_path, which)
    trainer.fit(model)  # was: ConnectionError from the callback's metrics
    assert trainer.global_step == 6
    assert logger.failures >= 1  # the callback did try to log its keys
    warned = [str(w.message) for w in recwarn if "could not log `gpumem/*` metrics" in str(w.message)]
    assert len(warned) == 1, warned  # one warning, however many failures
    assert "FailingLogger" in warned[0]
    assert "tracker unreachable" in warned[0]


def test_the_other_loggers_still_get_the_metrics(tmp_path):
    from lightning_gpumem._pl.logging import log_to_loggers

    failing, plain = FailingLogger(tmp_path / "a"), CSVLogger(tmp_path / "b")
    trainer = SimpleNamespace(loggers=[failing, plain], default_root_dir=str(tmp_path))
    with pytest.warns(UserWarning, match="could not log"):
        log_to_loggers(trainer, {"gpumem/x": 1.0}, step=0)
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        log_to_loggers(trainer, {"gpumem/x": 2.0}, step=1)
    assert not later  # one warning per logger
    plain.save()
    assert (Path(plain.log_dir) / "metrics.csv").read_text().splitlines()[1:] == ["1.0,0", "2.0,1"]


@pytest.mark.filterwarnings("ignore:`weights_only` was not set")
@pytest.mark.filterwarnings("ignore:Experiment logs directory")
def test_a_table_file_of_another_run_in_a_reused_logger_directory_is_kept(tmp_path):
    from tests.helpers.tuning import CappedFakeProbe, FakeTuner, MemoryModel

    def fit(logger, per_sample):
        probe = CappedFakeProbe(total=24 * 2**30)
        trainer = quiet_trainer(max_steps=1, callbacks=[FakeTuner(probe)], logger=logger)
        trainer.fit(MemoryModel(probe, per_sample=per_sample, n=4096))

    first = CSVLogger(tmp_path, version="same")
    fit(first, 100 * 2**20)
    run = Path(first.log_dir)
    before = (run / "gpumem_batch_size_trials.csv").read_text()
    fit(CSVLogger(tmp_path, version="same"), 200 * 2**20)  # another run, the same directory
    assert (run / "gpumem_batch_size_trials.csv").read_text() == before  # was: replaced
    second = (run / "gpumem_batch_size_trials-v1.csv").read_text()
    assert second != before
    fit(first, 300 * 2**20)  # the first run's logger again: its own file is replaced, no -v2
    assert (run / "gpumem_batch_size_trials.csv").read_text() not in (before, second)
    assert not (run / "gpumem_batch_size_trials-v2.csv").exists()


class Unhashable(CSVLogger):
    """A logger whose hash and equality raise (a custom logger), and whose log_metrics fails."""

    def __hash__(self):
        raise NotImplementedError("loggers are not hashable here")

    def __eq__(self, other):
        raise RuntimeError("ambiguous comparison")

    def log_metrics(self, metrics, step=None):
        raise ConnectionError("tracker unreachable")


class EqualByName(FailingLogger):
    """Distinct loggers that call each other equal."""

    def __eq__(self, other):
        return isinstance(other, EqualByName)

    def __hash__(self):
        return 1


def test_loggers_are_known_by_identity_never_by_their_hash_or_equality(tmp_path):
    from lightning_gpumem._pl.logging import log_to_loggers

    loggers = [Unhashable(tmp_path / "u"), EqualByName(tmp_path / "a"), EqualByName(tmp_path / "b")]
    trainer = SimpleNamespace(loggers=loggers, default_root_dir=str(tmp_path))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(3):
            log_to_loggers(trainer, {"gpumem/x": 1.0}, step=step)  # was: NotImplementedError ended the fit
    named = [str(w.message) for w in record if "could not log" in str(w.message)]
    assert len(named) == 3  # one per logger, however they compare


def test_a_logger_without_weak_references_replaces_its_own_table(tmp_path):
    class NoWeakReferences:  # a custom logger object of slots only (not a Lightning Logger subclass)
        __slots__ = ("name", "save_dir", "version")

        def __init__(self, root):
            self.save_dir, self.name, self.version = str(root), "nw", 0

    logger = NoWeakReferences(tmp_path)
    trainer = SimpleNamespace(loggers=[logger], default_root_dir=str(tmp_path))
    for _ in range(3):
        log_table(trainer, "gpumem/trials", COLUMNS, ROWS, step=0, text="")
    assert sorted(p.name for p in tmp_path.rglob("*.csv")) == ["gpumem_trials.csv"]  # was: -v1, -v2
