"""The key schema: every key a fit logs is in it and read back by the report; the docs' tables come from it."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger

from lightning_gpumem import (
    AutoMicrobatch,
    BatchSizeTuner,
    EmptyCacheOnThreshold,
    LayerMemoryProfiler,
    MemoryMonitor,
    keys,
)
from lightning_gpumem._core.units import GIB, MIB
from lightning_gpumem.report import load_runs
from tests.helpers.fakes import FakeMonitor, FakeProbe, FakeRelease, SpikeModel
from tests.helpers.trainer import quiet_trainer

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("key", keys.KEYS, ids=lambda k: k.name)
def test_every_key_parses_back_with_each_stage_and_suffix(key):
    stages = keys.STAGES if key.staged else (None,)
    suffixes = {"max_min": ["", "_max", "_min"], "per_rank": ["", "_rank0", "_rank12"], "": [""]}[key.ranks]
    for stage in stages:
        for suffix in suffixes:
            logged = key.name.format(stage=stage, stat="x.y") + suffix if "{stat}" in key.name else None
            logged = logged or key.format(stage, suffix)
            found = keys.parse(logged)
            assert found is not None, logged
            assert (found.key, found.stage, found.suffix) == (key, stage, suffix)


@pytest.mark.parametrize(
    "logged",
    [
        "loss",
        "gpumem/nope_gib",
        "gpumem/validate_peak_allocated_gib",
        "gpumem/ooms_max",
        "gpumem/budget_gib_rank1",
    ],
)
def test_keys_that_are_not_ours_do_not_parse(logged):
    assert keys.parse(logged) is None  # a suffix counts only where the key is logged with it


def test_format_names_a_missing_or_unwanted_stage():
    with pytest.raises(ValueError, match=r"needs a stage: got stage='validate'"):
        keys.PEAK_ALLOCATED.format("validate")
    with pytest.raises(ValueError, match=r"has no stage: got stage='train'"):
        keys.OOMS.format("train")


def test_the_docs_tables_are_generated_from_the_schema():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "key_tables.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, f"{proc.stdout}{proc.stderr} (run `python tools/key_tables.py`)"
    sys.path.insert(0, str(ROOT / "tools"))
    from key_tables import tables

    documented = {writer for page in (ROOT / "docs").glob("*.md") for writer in tables(page.read_text())}
    assert documented == set(keys.writers())


@pytest.mark.parametrize("cls", [MemoryMonitor, EmptyCacheOnThreshold, BatchSizeTuner, AutoMicrobatch])
def test_the_docstring_tables_are_the_schemas(cls):
    doc = cls.__doc__ or ""
    assert "{logged_metrics}" not in doc
    assert keys.rst_table(cls.__name__) in doc
    assert "gpumem/" in (LayerMemoryProfiler.__doc__ or "")


class Budget(Callback):
    """A callback that sets a budget, found by the monitor through the registry's duck typing."""

    def gpumem_budget(self) -> int:
        return 4 * GIB


class _LeakyModel(SpikeModel):
    def training_step(self, batch, batch_idx):
        self.fake.allocate(4 * MIB)  # a leak: flagged, and its rate logged
        return super().training_step(batch, batch_idx)


def test_every_key_a_fit_logs_is_in_the_schema_and_read_back_by_the_report(tmp_path):
    probe = FakeProbe(base=GIB)
    model = _LeakyModel(probe, train_spikes={3: 2 * GIB}, val_spike=GIB)
    trainer = quiet_trainer(
        max_steps=60,
        limit_val_batches=2,
        val_check_interval=30,
        logger=CSVLogger(tmp_path, name="run"),
        callbacks=[
            FakeMonitor(probe, verbose=True, nvml_host_interval_s=0),
            FakeRelease(probe, threshold=2.5 / 24, min_steps_between=1),
            Budget(),
        ],
        log_every_n_steps=5,
    )
    with pytest.warns(UserWarning, match="keeps growing"):
        trainer.fit(model)
    trainer.test(model, verbose=False)
    with open(next(tmp_path.rglob("metrics.csv")), newline="") as f:
        logged = {name for name in next(csv.reader(f)) if name.startswith(keys.PREFIX)}
    unknown = sorted(name for name in logged if keys.parse(name) is None)
    assert not unknown, f"logged but not in lightning_gpumem/keys.py: {unknown}"
    found = {keys.parse(name).key for name in logged}  # type: ignore[union-attr]
    expected = {
        k for k in keys.KEYS if k.writer in ("MemoryMonitor", "EmptyCacheOnThreshold") and k.unit != "table"
    }
    assert found == expected  # verbose, a budget, a leak, releases: every key of theirs
    stages = {keys.parse(name).stage for name in logged} - {None}  # type: ignore[union-attr]
    assert stages == {"train", "val", "test"}
    (run,) = load_runs(tmp_path).runs
    assert set(run.series) == logged  # the report reads back every key the fit logged
