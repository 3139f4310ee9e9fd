"""`gpumem report` on MLflow and W&B runs: their stores read without their packages, as TensorBoard's are.

Where `mlflow` or `wandb` is installed, a CPU fit writes real runs through Lightning's `MLFlowLogger` (file store and
SQLite) and `WandbLogger(offline=True)` beside a `CSVLogger`, and the report must read the same values from each;
where they are not (CI), those tests skip and the rest run on stores written here in the loggers' formats: the
readers need neither package.
"""

from __future__ import annotations

import hashlib
import os
import re
import sqlite3
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_gpumem.cli import main
from lightning_gpumem.report import ReportError, _wandb, load_runs
from tests.report.test_report import _fit, _run_cli

ROOT = Path(__file__).resolve().parents[2]
PEAK = "gpumem/train_peak_allocated_gib"
# MLflow's SQLite store, writing the fixture's run, uses an option SQLAlchemy deprecates: not this package's warning.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The ``noload`` loader strategy is deprecated:DeprecationWarning"
)


def _csv_series(root: Path) -> dict:
    return next(run for run in load_runs(root / "csv").runs).series


# 1. Runs written by the real loggers (where their packages are installed).


@pytest.fixture(scope="module")
def mlflow_logs(tmp_path_factory) -> Path:
    pytest.importorskip("mlflow", reason="mlflow is not installed: MLFlowLogger cannot write a run to read")
    from lightning.pytorch.loggers import MLFlowLogger

    root = tmp_path_factory.mktemp("mlflow")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(
            "MLFLOW_ALLOW_FILE_STORE", "true"
        )  # MLflow 3 asks for it to write Lightning's default store
        _fit(
            [
                CSVLogger(root, name="csv"),
                MLFlowLogger(
                    experiment_name="exp one", run_name="first run", tracking_uri=f"file:{root}/mlruns"
                ),
                MLFlowLogger(
                    experiment_name="exp two",
                    run_name="db run",
                    tracking_uri=f"sqlite:///{root}/db/mlflow.db",
                ),
            ]
        )
    return root


@pytest.fixture(scope="module")
def wandb_logs(tmp_path_factory) -> Path:
    pytest.importorskip("wandb", reason="wandb is not installed: WandbLogger cannot write a run to read")
    from lightning.pytorch.loggers import WandbLogger

    root = tmp_path_factory.mktemp("wandb")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {
            "WANDB_SILENT": "true",
            "WANDB_CONSOLE": "off",
            "WANDB_DISABLE_GIT": "true",
            "WANDB_DISABLE_CODE": "true",
            "WANDB_CONFIG_DIR": str(root / "config"),
            "WANDB_CACHE_DIR": str(root / "cache"),
            "WANDB_DATA_DIR": str(root / "data"),
        }.items():
            patch.setenv(name, value)
        logger = WandbLogger(project="proj", name="wb run", offline=True, save_dir=str(root))
        _fit([CSVLogger(root, name="csv"), logger])
        logger.experiment.finish()
    return root


def test_mlflow_file_store_gives_the_values_the_fit_logged(mlflow_logs, monkeypatch):
    (run,) = load_runs(mlflow_logs / "mlruns").runs
    assert run.name == "exp one/first run"
    assert run.series == _csv_series(mlflow_logs)
    assert len(run.series) >= 15
    assert {run.path / "meta.yaml", run.path.parent / "meta.yaml"} <= set(run.sources)  # the names
    assert run.path / "metrics" / "gpumem" / "train_peak_allocated_gib" in run.sources
    # and MLflow's own client reads the same (the last value of a step logged twice)
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=f"file:{mlflow_logs}/mlruns")
    for key, points in run.series.items():
        history = sorted(client.get_metric_history(run.path.name, key), key=lambda m: m.timestamp)
        assert sorted({m.step: m.value for m in history}.items()) == points, key


def test_mlflow_sqlite_store_gives_the_values_the_fit_logged(mlflow_logs):
    store = mlflow_logs / "db" / "mlflow.db"
    before = hashlib.sha256(store.read_bytes()).hexdigest()
    loaded = load_runs(store.parent)
    (run,) = loaded.runs
    assert run.name == "exp two/db run"
    assert run.series == _csv_series(mlflow_logs)
    assert run.sources == [store] == loaded.inputs
    assert hashlib.sha256(store.read_bytes()).hexdigest() == before  # read-only
    assert sorted(p.name for p in store.parent.iterdir()) == ["mlflow.db"]  # no journal left beside it


def test_an_mlflow_run_directory_alone_is_a_logdir(mlflow_logs):
    (run,) = load_runs(mlflow_logs / "mlruns").runs
    assert [r.name for r in load_runs(run.path).runs] == ["exp one/first run"]
    assert [r.name for r in load_runs(mlflow_logs).runs] == [
        "csv/version_0",
        "exp two/db run",
        "exp one/first run",
    ]


def test_wandb_offline_run_gives_the_values_the_fit_logged(wandb_logs):
    (run,) = load_runs(wandb_logs / "wandb").runs
    assert run.name == "proj/wb run"
    assert run.series == _csv_series(wandb_logs)  # the steps are Lightning's, not W&B's row counter
    (log,) = run.path.glob("run-*.wandb")
    assert run.sources == [log]
    assert [r.name for r in load_runs(run.path).runs] == ["proj/wb run"]


def test_wandb_field_numbers_are_wandbs_own():
    pytest.importorskip("wandb", reason="wandb is not installed: its protobuf descriptors are not here")
    from wandb.proto import wandb_internal_pb2 as proto

    def numbers(message, *names: str) -> list[int]:
        return [message.DESCRIPTOR.fields_by_name[name].number for name in names]

    assert numbers(proto.Record, "history", "run") == [_wandb._HISTORY, _wandb._RUN]
    assert numbers(proto.HistoryRecord, "item", "step") == [1, 2]
    assert numbers(proto.HistoryItem, "key", "nested_key", "value_json") == [1, 2, 16]
    assert numbers(proto.HistoryStep, "num") == [1]
    assert numbers(proto.RunRecord, "run_id", "project", "display_name") == [1, 3, 8]


@pytest.mark.parametrize("logger", ["mlflow", "wandb"])
def test_the_cli_prints_the_table_of_each_loggers_run(logger, request):
    logs = request.getfixturevalue(f"{logger}_logs")
    result = _run_cli("report", str(logs))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    names = ["exp one/first run", "exp two/db run"] if logger == "mlflow" else ["proj/wb run"]
    tables = result.stdout.split("\n\n")
    for name in names:
        (table,) = [table for table in tables if table.startswith(f"run {name}\n")]
        assert re.search(r"train peak\s+3\.00 GiB allocated, 3\.00 GiB reserved", table)
        assert "per-batch peak                mean 1.25 GiB, max 3.00 GiB over 8 logged batches" in table
        assert table.replace(f"run {name}", "").strip() == tables[0].replace("run csv/version_0", "").strip()


# 2. Stores written here in the loggers' formats: what CI runs without mlflow or wandb.


def _file_store_run(
    store: Path, values: dict[str, str], experiment: str = "exp", run: str = "a run", stage: str = "active"
) -> Path:
    """An MLflow file-store run: experiment 1, run `<run id>`, a metric file per key (its lines given)."""
    (store / "1").mkdir(parents=True, exist_ok=True)
    (store / "1" / "meta.yaml").write_text(
        f"experiment_id: '1'\nlifecycle_stage: active\nname: {experiment}\n"
    )
    run_id = hashlib.md5(run.encode()).hexdigest()
    directory = store / "1" / run_id
    (directory / "tags").mkdir(parents=True)
    (directory / "meta.yaml").write_text(
        f"run_id: {run_id}\nrun_name: {run}\nexperiment_id: '1'\nlifecycle_stage: {stage}\n"
    )
    for key, lines in values.items():
        file = directory / "metrics" / key
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(lines)
    return directory


def _sqlite_store(file: Path, rows: list[tuple], runs: list[tuple] | None = None) -> Path:
    """A SQLite MLflow store's three tables, as MLflow creates them; `rows`: (run, key, value, step, is_nan)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(file) as connection:
        connection.executescript(
            "CREATE TABLE experiments (experiment_id INTEGER PRIMARY KEY, name VARCHAR(256), lifecycle_stage VARCHAR(32));"
            "CREATE TABLE runs (run_uuid VARCHAR(32) PRIMARY KEY, name VARCHAR(250), lifecycle_stage VARCHAR(20),"
            " experiment_id INTEGER);"
            "CREATE TABLE metrics (key VARCHAR(250), value FLOAT, timestamp BIGINT, run_uuid VARCHAR(32),"
            " step BIGINT DEFAULT 0, is_nan BOOLEAN DEFAULT 0);"
            "INSERT INTO experiments VALUES (1, 'exp', 'active');"
        )
        connection.executemany("INSERT INTO runs VALUES (?, ?, ?, 1)", runs or [("r1", "db run", "active")])
        connection.executemany(
            "INSERT INTO metrics VALUES (?, ?, 0, ?, ?, ?)", [(k, v, r, s, n) for r, k, v, s, n in rows]
        )
    connection.close()
    return file


def _varint(number: int) -> bytes:
    out = bytearray()
    while True:
        byte, number = number & 0x7F, number >> 7
        out.append(byte | (0x80 if number else 0))
        if not number:
            return bytes(out)


def _field(number: int, payload: bytes | int) -> bytes:
    if isinstance(payload, int):
        return _varint(number << 3) + _varint(payload)
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _history(items: dict[str, str], step: int | None = None, nested: bool = True) -> bytes:
    """A `Record` holding a history row; keys as W&B's core writes them (`nested_key`) or in `key`."""
    row = b"".join(
        _field(1, _field(2 if nested else 1, k.encode()) + _field(16, v.encode())) for k, v in items.items()
    )
    return _field(2, row + (_field(2, _field(1, step)) if step is not None else b""))


def _run_record(run_id: str = "abc123", project: str = "proj", name: str = "") -> bytes:
    return _field(17, _field(1, run_id.encode()) + _field(3, project.encode()) + _field(8, name.encode()))


def _wandb_log(records: list[bytes]) -> bytes:
    """The records as W&B writes them: header, 32 KiB blocks of checksummed chunks, zero trailers."""
    out = bytearray(_wandb.HEADER)
    for record in records:
        first = True
        while True:
            left = 32768 - len(out) % 32768
            if left < 7:
                out += b"\0" * left
                continue
            chunk, record = record[: left - 7], record[left - 7 :]
            kind = (1 if first else 4) if not record else (2 if first else 3)
            crc = zlib.crc32(chunk, zlib.crc32(bytes([kind])))
            out += struct.pack("<IHB", crc, len(chunk), kind) + chunk
            first = False
            if not record:
                break
    return bytes(out)


def _wandb_run(directory: Path, records: list[bytes]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    file = directory / "run-abc123.wandb"
    file.write_bytes(_wandb_log(records))
    return file


def _steps(n: int, value: float = 1.0) -> list[bytes]:
    """A run's record, then `n` history rows as `WandbLogger` logs them: Lightning's step beside W&B's."""
    return [_run_record()] + [
        _history(
            {PEAK: repr(value + step), "trainer/global_step": str(step), "_step": str(2 * step)}, 2 * step
        )
        for step in range(n)
    ]


def test_a_file_store_run_is_read_at_every_level_and_named_by_mlflow(tmp_path):
    store = tmp_path / "mlruns"
    run = _file_store_run(store, {PEAK: "1 1.0 0\n2 3.0 1\n3 2.0 1\n", "loss": "1 0.5 0\n"})
    for logdir in (tmp_path, store, store / "1", run):
        (found,) = load_runs(logdir).runs
        assert found.name == "exp/a run"
        assert found.series == {PEAK: [(0, 1.0), (1, 2.0)]}  # one value per step, the last written
        assert found.sources == [store / "1" / "meta.yaml", run / "meta.yaml", run / "metrics" / PEAK]


def test_an_older_mlflow_runs_name_is_in_its_tags_and_a_lone_runs_experiment_is_its_id(tmp_path):
    run = _file_store_run(tmp_path / "mlruns", {PEAK: "1 1.0 0\n"})
    (run / "meta.yaml").write_text(f"run_uuid: {run.name}\nname: ''\nlifecycle_stage: active\n")  # MLflow 1
    (run / "tags" / "mlflow.runName").write_text("tagged")
    (found,) = load_runs(tmp_path).runs
    assert found.name == "exp/tagged"
    assert run / "tags" / "mlflow.runName" in found.sources
    (run.parent / "meta.yaml").unlink()
    (run / "tags" / "mlflow.runName").unlink()
    assert [r.name for r in load_runs(run).runs] == [f"1/{run.name}"]


def test_a_bad_metric_line_is_named_and_a_last_line_being_written_is_not(tmp_path):
    run = _file_store_run(
        tmp_path, {PEAK: "1 1.0 0\nnot a metric\n2 x 1\n3 2.0 9999999999999999999999\n4 5.0 2\n5 6"}
    )
    loaded = load_runs(tmp_path)
    assert loaded.runs[0].series[PEAK] == [(0, 1.0), (2, 5.0)]
    file = run / "metrics" / PEAK
    assert loaded.skipped == [
        f"{file}, line 2: 'not a metric' is not `<timestamp> <value> <step>` (line left out)",
        f"{file}, line 3: '2 x 1' is not `<timestamp> <value> <step>` (line left out)",
        f"{file}, line 4: step 9999999999999999999999 is out of range (beyond int64; line left out)",
    ]


def test_a_directory_like_a_run_without_a_run_id_is_searched_as_any_other(tmp_path):
    (tmp_path / "metrics").mkdir()
    (tmp_path / "meta.yaml").write_text("name: not mlflow\n")
    (tmp_path / "metrics" / "metrics.csv").write_text(f"step,{PEAK}\n0,1.5\n")
    (run,) = load_runs(tmp_path).runs
    assert run.name == "metrics"
    assert run.series == {PEAK: [(0, 1.5)]}


def test_a_sqlite_store_is_read_by_run_and_another_programs_database_is_passed_over(tmp_path):
    store = _sqlite_store(
        tmp_path / "mlflow.db",
        [
            ("r1", PEAK, 1.0, 0, 0),
            ("r1", PEAK, 2.0, 1, 0),
            ("r1", "loss", 9.0, 0, 0),
            ("r2", PEAK, 0.0, 0, 1),
            ("r3", PEAK, 4.0, 0, 0),
        ],
        runs=[("r1", "same", "active"), ("r2", "same", "active"), ("r3", "", "active")],
    )
    with sqlite3.connect(tmp_path / "other.sqlite") as other:
        other.execute("CREATE TABLE metrics (key TEXT)")
    other.close()
    (tmp_path / "notes.db").write_text("not a database")
    loaded = load_runs(tmp_path)
    assert [run.name for run in loaded.runs] == ["exp/r3", "exp/same (run r1)", "exp/same (run r2)"]
    assert loaded.runs[1].series == {PEAK: [(0, 1.0), (1, 2.0)]}
    assert str(loaded.runs[2].series[PEAK][0][1]) == "nan"  # MLflow's `is_nan`
    assert loaded.inputs == [store]
    assert loaded.skipped == []


def test_a_deleted_mlflow_run_is_named_and_not_reported(tmp_path):
    _file_store_run(tmp_path / "mlruns", {PEAK: "1 1.0 0\n"}, run="kept")
    gone = _file_store_run(tmp_path / "mlruns", {PEAK: "1 1.0 0\n"}, run="gone", stage="deleted")
    _sqlite_store(
        tmp_path / "db" / "mlflow.db",
        [("r1", PEAK, 1.0, 0, 0), ("r2", PEAK, 1.0, 0, 0)],
        runs=[("r1", "db kept", "active"), ("r2", "db gone", "deleted")],
    )
    loaded = load_runs(tmp_path)
    assert [run.name for run in loaded.runs] == ["exp/db kept", "exp/kept"]
    assert loaded.skipped == [
        f"{tmp_path / 'db' / 'mlflow.db'}: run exp/db gone is deleted in MLflow (not reported)",
        f"{gone}: run exp/gone is deleted in MLflow (not reported)",
    ]


def test_a_damaged_sqlite_store_is_one_skipped_line(tmp_path):
    store = _sqlite_store(tmp_path / "bad" / "mlflow.db", [("r1", PEAK, 1.0, 0, 0)])
    data = bytearray(store.read_bytes())
    data[100:] = b"\xff" * (len(data) - 100)  # the header kept, the pages destroyed
    store.write_bytes(bytes(data))
    result = _run_cli("report", str(tmp_path))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert f"{store}: " in result.stderr
    _file_store_run(tmp_path / "mlruns", {PEAK: "1 1.0 0\n"})
    result = _run_cli("report", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert re.search(
        rf"gpumem report: skipped {re.escape(str(store))}: .+\(the store is skipped\)", result.stderr
    )
    assert "run exp/a run" in result.stdout


def test_a_python_without_sqlite3_names_what_it_lacks(tmp_path, monkeypatch):
    store = _sqlite_store(tmp_path / "db" / "mlflow.db", [("r1", PEAK, 1.0, 0, 0)])
    _wandb_run(tmp_path / "w", _steps(1))
    monkeypatch.setitem(sys.modules, "sqlite3", None)  # a Python built without it
    loaded = load_runs(tmp_path)
    assert [run.name for run in loaded.runs] == ["proj/abc123"]
    assert loaded.skipped == [f"{store}: reading it needs Python's sqlite3 module (not in this Python)"]
    assert store in loaded.inputs


def test_odd_values_in_a_sqlite_store_are_left_out_and_named(tmp_path):
    store = _sqlite_store(
        tmp_path / "mlflow.db",
        [
            ("r1", PEAK, 1e300, 0, 0),
            ("r1", PEAK, "x", 1, 0),
            ("r1", PEAK, 2.0, 2.5, 0),
            ("r1", PEAK, 3.0, 3, 0),
        ],
    )
    loaded = load_runs(tmp_path)
    assert loaded.runs[0].series == {PEAK: [(3, 3.0)]}
    assert loaded.skipped == [
        f"{store}, run r1: {PEAK} at step 1 = 'x' is not a number (value left out)",
        f"{store}, run r1: {PEAK}: step 2.5 is not an int64 (value left out)",
        f"{store}, {PEAK} at step 0 = 1e+300 is out of range (beyond ±1e+100; value left out)",
    ]


def test_a_store_under_an_awkward_path_is_read(tmp_path):
    directory = Path(os.fsdecode(bytes(tmp_path) + b"/a ?#%20\xff"))
    _sqlite_store(directory / "mlflow.db", [("r1", PEAK, 1.0, 0, 0)])
    _wandb_run(directory, _steps(2))
    assert [run.name for run in load_runs(tmp_path).runs] == ["exp/db run", "proj/abc123"]


def test_wandb_records_across_blocks_are_joined_and_steps_are_lightnings(tmp_path):
    big = _history({"media": "x" * 70_000, PEAK: "7.0", "trainer/global_step": "1000"}, 1001)  # 3 blocks
    rows = _steps(500)[1:]
    file = _wandb_run(tmp_path, [_run_record(name="r"), *rows, big, _history({PEAK: "8.0"}, 2000)])
    assert file.stat().st_size > 3 * 32768
    (run,) = load_runs(tmp_path).runs
    assert run.name == "proj/r"
    points = run.series[PEAK]
    assert points[:3] == [(0, 1.0), (1, 2.0), (2, 3.0)]  # Lightning's step, not W&B's `_step` (2 per row)
    assert points[-2:] == [(1000, 7.0), (2000, 8.0)]  # without Lightning's step, W&B's
    assert len(points) == 502


def test_wandb_keys_in_either_field_are_read(tmp_path):
    _wandb_run(tmp_path, [_run_record(), _history({PEAK: "2.5", "trainer/global_step": "4"}, nested=False)])
    (run,) = load_runs(tmp_path).runs
    assert run.series == {PEAK: [(4, 2.5)]}
    assert run.name == "proj/abc123"  # no display name: the run's id


def test_a_damaged_wandb_log_keeps_the_records_before_the_damage(tmp_path):
    file = _wandb_run(tmp_path / "run", _steps(40))
    whole = file.read_bytes()
    file.write_bytes(whole[:-5])  # a run still writing: quiet
    loaded = load_runs(tmp_path)
    assert len(loaded.runs[0].series[PEAK]) == 39
    assert loaded.skipped == []
    data = bytearray(whole)
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))
    loaded = load_runs(tmp_path)
    assert 0 < len(loaded.runs[0].series[PEAK]) < 40
    (line,) = loaded.skipped
    assert re.fullmatch(
        rf"{re.escape(str(file))}: chunk at byte \d+ fails its checksum \(record \d+\); the rest of the file is"
        r" skipped \(\d+ values before it are kept\)",
        line,
    )


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"not wandb at all", "not a W&B run log (no `:W&B` header; file skipped)"),
        (
            _wandb.HEADER[:6] + b"\x07" + b"\0" * 20,
            "W&B log version 7; this report reads version 0 (file skipped)",
        ),
    ],
)
def test_a_file_named_like_a_wandb_log_that_is_not_one_is_named(tmp_path, data, why):
    (tmp_path / "run-x.wandb").write_bytes(data)
    with pytest.raises(ReportError, match="1 file\\(s\\) skipped") as error:
        load_runs(tmp_path)
    assert f"{tmp_path / 'run-x.wandb'}: {why}" in str(error.value)


def test_fifos_named_like_store_files_are_skipped_not_waited_on(tmp_path):
    _wandb_run(tmp_path / "good", _steps(2))
    run = _file_store_run(tmp_path / "mlruns", {})
    (run / "metrics" / "gpumem").mkdir(parents=True)
    os.mkfifo(run / "metrics" / PEAK)
    os.mkfifo(tmp_path / "run-fifo.wandb")
    os.mkfifo(tmp_path / "mlflow.db")
    result = subprocess.run(
        [sys.executable, "-m", "lightning_gpumem", "report", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    for fifo in (run / "metrics" / PEAK, tmp_path / "run-fifo.wandb", tmp_path / "mlflow.db"):
        assert f"skipped {fifo}: not a regular file (a FIFO)" in result.stderr
    assert "run proj/abc123" in result.stdout


def test_runs_of_the_same_name_are_told_apart_by_their_paths(tmp_path):
    _wandb_run(tmp_path / "wandb" / "offline-run-1", _steps(2))
    _wandb_run(
        tmp_path / "wandb" / "offline-run-2", _steps(3)
    )  # a resumed run: the same id, a new directory
    (tmp_path / "proj" / "abc123").mkdir(parents=True)
    (tmp_path / "proj" / "abc123" / "metrics.csv").write_text(f"step,{PEAK}\n0,1.0\n")
    assert [run.name for run in load_runs(tmp_path).runs] == [
        "proj/abc123",
        "proj/abc123 (wandb/offline-run-1)",
        "proj/abc123 (wandb/offline-run-2)",
    ]


def test_a_store_file_is_an_input_no_output_may_overwrite(tmp_path, capsys):
    store = _sqlite_store(tmp_path / "mlflow.db", [("r1", PEAK, 1.0, 0, 0)])
    log = _wandb_run(tmp_path / "w", _steps(2))
    metric = _file_store_run(tmp_path / "mlruns", {PEAK: "1 1.0 0\n"}) / "metrics" / PEAK
    for target in (store, log, metric):
        before = target.read_bytes()
        assert main(["report", str(tmp_path), "--html", str(target), "--force"]) == 1
        assert "is an input of this report" in capsys.readouterr().err
        assert target.read_bytes() == before


def test_the_readers_need_neither_mlflow_nor_wandb_nor_torch(tmp_path):
    _file_store_run(tmp_path / "mlruns", {PEAK: "1 1.0 0\n"})
    _sqlite_store(tmp_path / "mlflow.db", [("r1", PEAK, 1.0, 0, 0)])
    _wandb_run(tmp_path / "wandb" / "offline-run-1", _steps(2))
    code = (
        "import sys\n"
        "for name in ('mlflow', 'wandb', 'torch'):\n"
        "    sys.modules[name] = None  # as if not installed\n"
        "from lightning_gpumem.report import load_runs\n"
        f"print([run.name for run in load_runs({str(tmp_path)!r}).runs])\n"
        "assert not {'lightning', 'pytorch_lightning', 'tensorboard'} & set(sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['exp/db run', 'exp/a run', 'proj/abc123']"
