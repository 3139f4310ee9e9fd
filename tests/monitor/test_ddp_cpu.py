"""DDP with 2 CPU processes (gloo): every rank measures, rank zero logs cross-rank max/min; each rank releases."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.fakes import column, read_csv_metrics

pytestmark = pytest.mark.ddp  # every test reads the run of `ddp_script.py` on 2 processes
SCRIPT = Path(__file__).with_name("ddp_script.py")


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("ddp")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(log_dir)], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return log_dir


def test_cross_rank_max_and_min_are_logged(ddp_run):
    rows = read_csv_metrics(ddp_run)
    high = column(rows, "gpumem/train_peak_allocated_gib_max")
    low = column(rows, "gpumem/train_peak_allocated_gib_min")
    assert sorted(high) == sorted(low) == [1, 3]
    assert set(high.values()) == {2.0}  # rank 1 peaks at 2 GiB
    assert set(low.values()) == {1.0}  # rank 0 at 1 GiB
    assert set(column(rows, "gpumem/train_peak_allocated_gib").values()) == {1.0}  # un-suffixed: rank zero

    rss_high = column(rows, "gpumem/host_rss_gib_max")
    rss_low = column(rows, "gpumem/host_rss_gib_min")
    assert rss_high
    assert all(rss_high[s] >= rss_low[s] > 0 for s in rss_high)


def test_every_rank_measured_and_only_rank_zero_summarises(ddp_run):
    rank0 = json.loads((ddp_run / "rank0.json").read_text())
    rank1 = json.loads((ddp_run / "rank1.json").read_text())
    assert rank0["peaks"]["train"][0] == 2**30
    assert rank1["peaks"]["train"][0] == 2 * 2**30
    assert rank1["summary"] is None
    assert "max over 2 ranks" in rank0["summary"]
    assert "2.00 GiB" in rank0["summary"]  # the summary takes the maximum over ranks
    assert len(list(ddp_run.rglob("metrics.csv"))) == 1  # one writer


def test_each_rank_releases_for_itself_and_rank_zero_logs_every_rank(ddp_run):
    rank0 = json.loads((ddp_run / "rank0.json").read_text())
    rank1 = json.loads((ddp_run / "rank1.json").read_text())
    assert (rank0["releases"], rank1["releases"]) == (0, 1)  # 1 GiB stays under the mark, 2 GiB does not
    rows = read_csv_metrics(ddp_run)
    assert set(column(rows, "gpumem/cache_releases_rank0").values()) == {0.0}
    assert set(column(rows, "gpumem/cache_releases_rank1").values()) == {1.0}
    assert set(column(rows, "gpumem/released_gib_rank1").values()) == {2.0}


def test_every_key_logged_under_ddp_is_in_the_schema(ddp_run):
    from lightning_gpumem import keys

    logged = {name for row in read_csv_metrics(ddp_run) for name in row if name.startswith(keys.PREFIX)}
    assert any(name.endswith("_max") for name in logged)
    assert any("_rank1" in name for name in logged)
    assert sorted(name for name in logged if keys.parse(name) is None) == []
