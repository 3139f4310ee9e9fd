"""Nothing lost, nothing hidden: a callback that cannot write never replaces the user's error, never leaves a partial
file, never writes outside the run, and undoes its patches on every exit path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.loggers import CSVLogger

import lightning_gpumem.snapshot as snapshot_module
from lightning_gpumem import AutoMicrobatch, LayerMemoryProfiler, OOMSnapshot
from lightning_gpumem._core.files import check_dirpath, unique_path, write_atomic
from lightning_gpumem._pl.compat import Callback
from lightning_gpumem._pl.patching import Patches
from tests.helpers.fakes import SNAPSHOT, FakeProbe, FakeProfiler, PlainLogger, read_csv_metrics
from tests.helpers.models import LayerNet, OOMModel
from tests.helpers.trainer import quiet_trainer
from tests.helpers.tuning import CPU_SEARCH


class RecordingSnapshot(OOMSnapshot):
    """OOMSnapshot on CPU: records "history" without CUDA, and snapshots a synthetic state."""

    def setup(self, trainer, pl_module, stage):
        self._trainer, self._recording = trainer, True

    def _stop(self):
        self.stopped = True
        self._recording = False


@pytest.fixture
def synthetic_snapshot(monkeypatch):
    monkeypatch.setattr(snapshot_module, "take_snapshot", lambda: SNAPSHOT)


def _trainer(tmp_path, callbacks, max_steps=2):
    """2 steps, no validation, in `tmp_path`, logged to a CSVLogger there, with Lightning's ModelCheckpoint."""
    options = dict(
        logger=CSVLogger(tmp_path), callbacks=callbacks, limit_val_batches=0, enable_checkpointing=True
    )
    return quiet_trainer(tmp_path, max_steps=max_steps, **options)


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------- on_exception
def test_no_callback_raises_from_on_exception_the_error_is_warned_and_the_users_error_kept():
    class Failing(Callback):
        def on_exception(self, trainer, pl_module, exception):
            raise OSError(28, "No space left on device")

    class Child(Failing):  # inherits the guarded hook
        pass

    error = ValueError("the user's own error")
    for callback in (Failing(), Child()):
        with pytest.warns(
            UserWarning, match=r"on_exception failed .*No space left.* while handling ValueError"
        ):
            callback.on_exception(None, None, error)
    assert error.__context__ is None
    assert error.__cause__ is None


@pytest.mark.usefixtures("synthetic_snapshot")
@pytest.mark.filterwarnings(
    "ignore:.*ckpt_path:UserWarning"
)  # OnExceptionCheckpoint's own notes on resuming
def test_an_oom_snapshot_that_cannot_write_keeps_the_oom_and_the_callbacks_after_it_run(tmp_path):
    target = tmp_path / "snapshots"
    snapshot = RecordingSnapshot(dirpath=target)
    target.write_text("a file where the directory should be: every write fails")  # after construction
    checkpoint = OnExceptionCheckpoint(dirpath=tmp_path / "ckpt")
    microbatch = AutoMicrobatch()
    model = OOMModel(
        batch_size=1, train_limit=0
    )  # every batch (of 1 sample: nothing to split) runs out of memory
    trainer = _trainer(tmp_path, [snapshot, microbatch, checkpoint])
    warns = pytest.warns(UserWarning, match="OOMSnapshot: could not write the oom snapshot")
    with warns, pytest.raises(torch.cuda.OutOfMemoryError) as raised:
        trainer.fit(model)
    assert raised.value.__context__ is None  # the user's error, not one raised while handling it
    assert snapshot.stopped
    assert snapshot.paths == []
    assert (
        tmp_path / "ckpt" / "on_exception.ckpt"
    ).is_file()  # OnExceptionCheckpoint, moved last, still ran
    assert not {"training_step", "log", "backward"} & set(vars(model))  # AutoMicrobatch put everything back


@pytest.mark.usefixtures("synthetic_snapshot")
def test_a_snapshot_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    snapshot = RecordingSnapshot(dirpath=tmp_path)
    snapshot._trainer = _trainer(tmp_path, [])
    snapshot._recording = True

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(
        snapshot_module, "render_html", fail
    )  # the second file fails: the first is taken back
    with pytest.warns(UserWarning, match="No space left"):
        assert snapshot.dump("oom") is None
    assert _files(tmp_path) == []
    monkeypatch.undo()
    monkeypatch.setattr(snapshot_module, "take_snapshot", lambda: SNAPSHOT)
    first, second = snapshot.dump("oom"), snapshot.dump("oom")  # a name taken before gets -v1
    assert first is not None
    assert second is not None
    assert [p.name for p in (*first, *second)] == [
        "oom_rank0_step0.pickle",
        "oom_rank0_step0.html",
        "oom_rank0_step0-v1.pickle",
        "oom_rank0_step0-v1.html",
    ]


def test_write_atomic_leaves_the_old_file_or_the_new_one_never_a_part(tmp_path, monkeypatch):
    path = tmp_path / "table.csv"
    write_atomic(path, "old\n")

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, "new\n")
    monkeypatch.undo()
    assert path.read_text() == "old\n"
    assert _files(tmp_path) == ["table.csv"]  # no temporary file left
    path.chmod(0o640)
    write_atomic(path, b"new\n")
    assert path.read_text() == "new\n"
    assert path.stat().st_mode & 0o777 == 0o640  # the mode of the file it replaced
    umask = os.umask(0o022)
    try:
        fresh = write_atomic(tmp_path / "fresh.csv", lambda file: file.write(b"x"))
    finally:
        os.umask(umask)
    assert fresh.stat().st_mode & 0o777 == 0o644  # the umask's, not the temporary file's 0600
    assert unique_path(path) == tmp_path / "table-v1.csv"


# ---------------------------------------------------------------------------------------------- patches
def test_patches_put_back_exactly_what_was_there_and_leftovers_cannot_recurse():
    class Owner:
        def step(self, x):
            return x + 1

    owner = Owner()
    first = Patches()
    first.install(owner, "step", lambda x: first.original(owner, "step")(x) * 10)
    assert owner.step(1) == 20
    # `first` is never undone (a crash before its clean-up): a second owner installs over its leftover
    second = Patches()
    second.install(owner, "step", lambda x: second.original(owner, "step")(x) * 100)
    assert owner.step(1) == 200  # the original, wrapped once: not 2000, and no RecursionError
    second.undo()
    assert "step" not in vars(owner)
    assert owner.step(1) == 2


def test_a_new_automicrobatch_over_the_leftover_patches_of_one_that_never_cleaned_up_trains(tmp_path):
    model = BoringModel()
    crashed = AutoMicrobatch()
    crashed._unpatch = lambda: None  # its clean-up never runs: its patches stay on the module
    _trainer(tmp_path, [crashed]).fit(model)
    assert "training_step" in vars(model)
    fresh = AutoMicrobatch()
    _trainer(tmp_path, [fresh]).fit(model)  # was: RecursionError
    assert not {"training_step", "log", "backward"} & set(vars(model))


def test_ctrl_c_in_a_step_undoes_automicrobatchs_patches(tmp_path):
    class Interrupted(BoringModel):
        def training_step(self, batch, batch_idx):
            raise KeyboardInterrupt

    model = Interrupted()
    with pytest.raises(SystemExit):  # Lightning's graceful shutdown after Ctrl-C
        _trainer(tmp_path, [AutoMicrobatch()]).fit(model)
    assert not {"training_step", "log", "backward"} & set(vars(model))


# ---------------------------------------------------------------------------------------------- dirpath
@pytest.mark.parametrize("owner", [OOMSnapshot, LayerMemoryProfiler])
def test_a_dirpath_that_can_never_be_a_directory_is_refused_by_name(tmp_path, owner):
    existing = tmp_path / "file.txt"
    existing.write_text("x")
    for value, why in [
        (existing, "is an existing file"),
        (existing / "below", "not a directory"),
        ("logs\0x", "NUL byte"),
        ("a" * 300, "longer than 255 bytes"),
        (" ", "blank name"),
        ("", "blank name"),
    ]:
        with pytest.raises(
            ValueError, match=rf"`{owner.__name__}\(dirpath=.*Expected a directory path; .*{why}"
        ):
            owner(dirpath=value)
    with pytest.raises(TypeError, match=rf"`{owner.__name__}\(dirpath=5\)`"):
        owner(dirpath=5)
    assert owner(dirpath="~/gpumem").dirpath == Path.home() / "gpumem"  # as ModelCheckpoint expands it


def test_check_dirpath_accepts_a_directory_to_be_made(tmp_path):
    assert check_dirpath("X", tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert check_dirpath("X", tmp_path) == tmp_path
    assert check_dirpath("X", None) is None


def test_a_dirpath_that_cannot_be_created_is_refused_at_setup_before_training(tmp_path):
    target = tmp_path / "later-a-file"
    profiler = FakeProfiler(FakeProbe(), at_step=1, dirpath=target)
    target.write_text("made a file after construction")
    model = LayerNet(profiler.fake)
    with pytest.raises(
        ValueError, match=r"`LayerMemoryProfiler\(dirpath=.*later-a-file'\)` cannot be written to"
    ):
        _trainer(tmp_path, [profiler], max_steps=3).fit(model)
    assert model.global_step == 0


def test_a_layer_csv_that_cannot_be_written_warns_and_training_goes_on(tmp_path, monkeypatch):
    import lightning_gpumem.layers as layers_module

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(layers_module, "write_atomic", full_disk)
    profiler = FakeProfiler(FakeProbe(), at_step=1, dirpath=tmp_path / "layers")
    trainer = _trainer(tmp_path, [profiler], max_steps=3)
    with pytest.warns(UserWarning, match="LayerMemoryProfiler: could not write .*No space left"):
        trainer.fit(LayerNet(profiler.fake))
    assert trainer.global_step == 3
    assert profiler.table is not None
    assert profiler.csv_path is None


def test_a_second_run_into_the_same_dirpath_keeps_the_first_runs_layer_csv(tmp_path):
    for _ in range(2):
        profiler = FakeProfiler(FakeProbe(), at_step=1, dirpath=tmp_path / "layers")
        _trainer(tmp_path, [profiler], max_steps=2).fit(LayerNet(profiler.fake))
    assert _files(tmp_path / "layers") == ["layer_memory_step1-v1.csv", "layer_memory_step1.csv"]


# ---------------------------------------------------------------------------------------------- every run's files
class HparamsOOMModel(BoringModel):
    """`batch_size` in the hparams Lightning logs; batches over 24 samples run out of memory (simulated)."""

    def __init__(self, batch_size: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()

    def training_step(self, batch, batch_idx):
        if batch.shape[0] > 24:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(RandomDataset(32, 640), batch_size=self.hparams.batch_size)


def _tuned_fit(tmp_path, version, ckpt_path=None, max_steps=2):
    from lightning_gpumem import BatchSizeTuner

    logger = CSVLogger(tmp_path, version=version)
    trainer = quiet_trainer(
        tmp_path,
        logger=logger,
        callbacks=[BatchSizeTuner(max_val=CPU_SEARCH, include_validation=False)],
        max_steps=max_steps,
        limit_val_batches=0,
        enable_checkpointing=True,
    )
    trainer.fit(HparamsOOMModel(), ckpt_path=ckpt_path)
    return trainer, Path(logger.log_dir)


@pytest.mark.filterwarnings(
    "ignore:The dirpath has changed:UserWarning", "ignore:You're resuming:UserWarning"
)
def test_a_resumed_run_records_the_size_it_trains_at_in_its_metrics_and_hparams(tmp_path):
    import yaml

    trainer, first = _tuned_fit(tmp_path, "first")
    tuned = trainer.callbacks[0].optimal_batch_size
    assert 20 <= tuned <= 24
    ckpt = tmp_path / "tuned.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed, second = _tuned_fit(tmp_path, "resumed", ckpt_path=ckpt, max_steps=4)
    assert resumed.callbacks[0].trials == ()  # restored, not searched
    for run, step in ((first, 0), (second, 2)):  # the resumed run's at the step it resumed from
        logged = [
            (int(r["step"]), float(r["gpumem/batch_size"]))
            for r in read_csv_metrics(run)
            if r.get("gpumem/batch_size")
        ]
        assert logged == [(step, tuned)], run.name
        assert yaml.safe_load((run / "hparams.yaml").read_text())["batch_size"] == tuned, run.name


def test_the_tuners_trials_on_cpu_log_no_allocator_counts_no_source_counted(tmp_path):

    _, run = _tuned_fit(tmp_path, "cpu")
    logged = {key for row in read_csv_metrics(run) for key, value in row.items() if value}
    assert "gpumem/batch_size" in logged
    assert not {"gpumem/batch_size_trial_ooms", "gpumem/batch_size_trial_retries"} & logged


def test_each_run_of_an_mlflow_like_logger_gets_its_own_directory_and_nothing_is_overwritten(
    tmp_path, make_trainer
):
    class RunLogger(PlainLogger):  # as MLflow: a save_dir shared by every run, a version per run, no log_dir
        def __init__(self, version):
            super().__init__(save_dir=str(tmp_path / "mlruns"), name="exp")
            self._version = version

        @property
        def version(self):
            return self._version

    profilers = []
    for version in ("run-a", "run-b"):
        profiler = FakeProfiler(FakeProbe(), at_step=1)
        trainer = make_trainer(
            logger=[RunLogger(version), CSVLogger(tmp_path / "csv")],
            callbacks=[profiler],
            max_steps=2,
            enable_checkpointing=True,
        )
        trainer.fit(LayerNet(profiler.fake))
        profilers.append((profiler, trainer))
    for (profiler, trainer), version in zip(profilers, ("run-a", "run-b"), strict=True):
        assert profiler.csv_path == tmp_path / "mlruns" / "exp" / version / "layer_memory_step1.csv"
        csv_run = Path(trainer.loggers[1].log_dir)  # the CSVLogger later in the list gets the table too
        assert (csv_run / "gpumem_layer_memory.csv").is_file()
    # beside each run's checkpoints/ (ModelCheckpoint's layout), none in the shared root
    assert [f for f in _files(tmp_path / "mlruns") if f.endswith(".csv")] == ["layer_memory_step1.csv"] * 2


# ---------------------------------------------------------------------- errors that say what happened
def test_automicrobatchs_own_errors_are_never_taken_for_an_oom():
    from lightning_gpumem._hw.oom import NotOutOfMemoryError, is_oom_error

    error = NotOutOfMemoryError("AutoMicrobatch: another rank ran out of memory at step 3; the run stops.")
    assert not is_oom_error(error)
    assert is_oom_error(RuntimeError("CUDA out of memory"))


@pytest.mark.parametrize(
    ("waited", "says"), [(12.0, "another rank left the agreement .* after 12 s"), (600.0, "within 600 s")]
)
def test_a_failed_agreement_says_whether_a_rank_is_gone_or_stuck(monkeypatch, waited, says):
    import lightning_gpumem.microbatch.callback as microbatch_module

    clock = iter([0.0, waited])
    monkeypatch.setattr(microbatch_module.time, "monotonic", lambda: next(clock))

    def gone(values, group):
        raise RuntimeError("[gloo] Connection closed by peer")

    monkeypatch.setattr(microbatch_module, "all_reduce_max", gone)
    callback = AutoMicrobatch()
    trainer = type("T", (), {"global_step": 5})()
    with pytest.raises(microbatch_module.NotOutOfMemoryError, match=says):
        callback._agree(trainer, failed=False, give_up=False)


def test_lightnings_batch_size_finder_beside_the_tuner_is_refused_as_a_conflict(tmp_path):
    from lightning.pytorch.callbacks import BatchSizeFinder

    from lightning_gpumem import BatchSizeTuner

    trainer = _trainer(tmp_path, [BatchSizeFinder(), BatchSizeTuner(max_val=CPU_SEARCH)])
    with pytest.raises(ValueError, match="BatchSizeTuner and Lightning's BatchSizeFinder are both"):
        trainer.fit(HparamsOOMModel())


def test_a_batch_arg_that_sets_the_dataset_length_is_refused(tmp_path):
    from lightning_gpumem import BatchSizeTuner

    class LengthModel(BoringModel):
        def __init__(self):
            super().__init__()
            self.n, self.batch_size = 64, 64

        def train_dataloader(self):
            return torch.utils.data.DataLoader(RandomDataset(32, self.n), batch_size=self.batch_size)

    trainer = _trainer(
        tmp_path, [BatchSizeTuner(max_val=CPU_SEARCH, batch_arg_name="n", include_validation=False)]
    )
    with pytest.raises(ValueError, match="`n` sets the dataset's length, not the batch size"):
        trainer.fit(LengthModel())


@pytest.mark.parametrize("name", ["OOMSnapshot", "LayerMemoryProfiler", "BatchSizeTuner", "AutoMicrobatch"])
def test_under_fabric_a_callback_says_it_needs_a_trainer(name):
    from lightning.fabric import Fabric

    import lightning_gpumem

    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[getattr(lightning_gpumem, name)()])
    with pytest.raises(TypeError, match=rf"{name} needs a Lightning `Trainer`; it got `Fabric`"):
        fabric.call("setup", fabric, BoringModel(), "fit")
