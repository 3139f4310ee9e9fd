"""`gpumem check LOGDIR --max-peak SIZE ...`: a memory gate on logs written by real loggers; exit 0, 1 or 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_gpumem.cli import main
from lightning_gpumem.report import load_runs, summarize
from lightning_gpumem.report.check import Limits, check_runs, exit_status, parse_fraction, parse_size, peak
from lightning_gpumem.report.json_report import document
from tests.report.test_report import _fit, _logged, _run_cli


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    """One TensorBoard run of 8 batches on a fake allocator: peak 3 GiB allocated and reserved (train)."""
    root = tmp_path_factory.mktemp("logs")
    _fit([TensorBoardLogger(root, name="tb")])
    return root


def _peaks(root: Path, name: str, allocated: float, reserved: float, **more: float) -> Path:
    return _logged(
        root,
        name,
        [{"gpumem/train_peak_allocated_gib": allocated, "gpumem/train_peak_reserved_gib": reserved, **more}],
    )


def _check(capsys, *args: str) -> tuple[int, list[str], str]:
    status = main(["check", *args])
    out, err = capsys.readouterr()
    return status, out.splitlines(), err


# ------------------------------------------------------------------------------------------------------------ limits
def test_a_run_under_its_limits_passes_with_one_line_per_check(logs, capsys):
    status, lines, err = _check(
        capsys, str(logs), "--max-peak", "20GiB", "--max-reserved", "22GiB", "--no-leak"
    )
    assert status == 0, err
    assert lines == [
        "ok   run tb/version_0: peak 3.0 GiB <= 20.0 GiB",
        "ok   run tb/version_0: peak reserved 3.0 GiB <= 22.0 GiB",
        "ok   run tb/version_0: leak warnings 0 (leak detection logged nothing: off, or under 32 samples)",
    ]
    assert err == ""


def test_a_broken_limit_exits_1_naming_the_run_the_figure_and_the_limit(logs, capsys):
    status, lines, err = _check(capsys, str(logs), "--max-peak", "2GiB", "--max-reserved", "3500MiB")
    assert status == 1
    assert lines == [
        "FAIL run tb/version_0: peak 3.0 GiB > 2.0 GiB (--max-peak)",
        "ok   run tb/version_0: peak reserved 3.0 GiB <= 3.4 GiB",
    ]
    assert "gpumem check: 1 of 2 checks broken, 0 not checked" in err


def test_the_peak_is_the_highest_peak_allocated_over_the_stages_and_the_jsons(logs):
    (run,) = load_runs(logs).runs
    summary = summarize(run)
    highest = max(allocated for allocated, _ in summary.stage_peaks.values())
    assert peak(summary) == highest == pytest.approx(3.0)
    figures = document([run], logs)["runs"][0]["figures"]
    assert figures["peak_allocated_gib"] == peak(summary)
    assert figures["peak_reserved_gib"] == summary.peak_reserved


def test_a_limit_at_the_figure_passes_and_close_figures_are_shown_apart(tmp_path, capsys):
    _peaks(tmp_path, "exact", 20.0, 20.0)
    assert _check(capsys, str(tmp_path), "--max-peak", "20GiB")[:2] == (
        0,
        ["ok   run exact/version_0: peak 20.0 GiB <= 20.0 GiB"],
    )
    _peaks(tmp_path, "over", 20.04, 20.04)
    status, lines, _ = _check(capsys, str(tmp_path), "--max-peak", "20GiB", "--run", "over/*")
    assert (status, lines) == (1, ["FAIL run over/version_0: peak 20.04 GiB > 20.00 GiB (--max-peak)"])
    status, lines, _ = _check(capsys, str(tmp_path), "--max-peak", "1MiB", "--run", "over/*")
    assert lines == ["FAIL run over/version_0: peak 20.0 GiB > 1.0 MiB (--max-peak)"]


def test_gb_and_gib_are_told_apart(tmp_path, capsys):
    _peaks(tmp_path, "run", 18.8, 18.8)  # 20 GB is 18.63 GiB
    assert _check(capsys, str(tmp_path), "--max-peak", "20GB")[:2] == (
        1,
        ["FAIL run run/version_0: peak 18.8 GiB > 18.6 GiB (--max-peak)"],
    )
    assert _check(capsys, str(tmp_path), "--max-peak", "20GiB")[0] == 0


def test_under_ddp_the_highest_rank_is_held_to_the_limit(tmp_path, capsys):
    _peaks(tmp_path, "ddp", 4.0, 4.5, **{"gpumem/train_peak_allocated_gib_max": 6.0})
    status, lines, _ = _check(capsys, str(tmp_path), "--max-peak", "5GiB")
    assert (status, lines) == (1, ["FAIL run ddp/version_0: peak 6.0 GiB > 5.0 GiB (--max-peak)"])


def test_a_figure_not_logged_is_not_checked_and_exits_2(tmp_path, capsys):
    _logged(tmp_path, "cpu", [{"gpumem/host_rss_gib": 0.5}])  # what a CPU run logs
    status, lines, err = _check(capsys, str(tmp_path), "--max-peak", "1GiB")
    assert status == 2
    assert lines == ["FAIL run cpu/version_0: peak not logged, so not held to 1.0 GiB (--max-peak)"]
    assert "0 of 1 checks broken, 1 not checked" in err


def test_a_broken_limit_outranks_a_figure_not_logged(tmp_path, capsys):
    _peaks(tmp_path, "high", 30.0, 30.0)
    _logged(tmp_path, "cpu", [{"gpumem/host_rss_gib": 0.5}])
    status, lines, _ = _check(capsys, str(tmp_path), "--max-peak", "20GiB")
    assert status == 1
    assert [line.split(":")[0] for line in lines] == ["FAIL run cpu/version_0", "FAIL run high/version_0"]


# ------------------------------------------------------------------------------------------------------------ --no-leak
def test_no_leak_fails_a_run_whose_monitor_flagged_a_leak(tmp_path, capsys):
    rows = [{"gpumem/train_peak_allocated_gib": 1.0, "gpumem/leak_mib_per_step": 0.5}]
    rows += [{"gpumem/leak_warnings": 1.0, "gpumem/leak_mib_per_step": 6.5}]
    _logged(tmp_path, "leaky", rows)
    _logged(tmp_path, "clean", [{"gpumem/train_peak_allocated_gib": 1.0, "gpumem/leak_mib_per_step": 0.01}])
    status, lines, _ = _check(capsys, str(tmp_path), "--no-leak")
    assert status == 1
    assert lines == [
        "ok   run clean/version_0: leak warnings 0",
        "FAIL run leaky/version_0: leak warnings 1 > 0, growth 6.50 MiB/step when flagged (--no-leak)",
    ]


# ------------------------------------------------------------------------------------------------------------ baseline
def test_a_run_grown_past_its_baseline_fails_and_one_within_passes(tmp_path, capsys):
    base, new = tmp_path / "base", tmp_path / "new"
    _peaks(base, "model", 10.0, 12.0)
    _peaks(new, "model", 10.8, 12.0)  # +8% allocated, reserved the same
    status, lines, _ = _check(capsys, str(new), "--baseline", str(base), "--max-increase", "5%")
    assert status == 1
    assert lines == [
        "FAIL run model/version_0: peak 10.8 GiB > 10.5 GiB, baseline 10.00 GiB + 5% (--max-increase 5%)",
        "ok   run model/version_0: peak reserved 12.0 GiB <= 12.6 GiB, baseline 12.00 GiB + 5%",
    ]
    status, lines, _ = _check(capsys, str(new), "--baseline", str(base), "--max-increase", "0.1")
    assert status == 0
    assert lines[0] == "ok   run model/version_0: peak 10.8 GiB <= 11.0 GiB, baseline 10.00 GiB + 10%"


def test_baseline_runs_are_matched_by_name(tmp_path, capsys):
    base, new = tmp_path / "base", tmp_path / "new"
    _peaks(base, "a", 10.0, 10.0)
    _peaks(base, "b", 4.0, 4.0)
    _peaks(new, "a", 4.0, 4.0)  # would break b's limit, not a's
    _peaks(new, "b", 4.1, 4.1)
    status, lines, _ = _check(capsys, str(new), "--baseline", str(base), "--max-increase", "5%")
    assert status == 0, lines
    assert [line.split(":")[0] for line in lines] == [f"ok   run {run}/version_0" for run in "aabb"]
    _peaks(new, "c", 1.0, 1.0)
    status, lines, err = _check(capsys, str(new), "--baseline", str(base), "--max-increase", "5%")
    assert status == 2
    assert (
        "FAIL run c/version_0: no baseline run of this name (the baseline's: 'a/version_0', 'b/version_0')"
        " (--max-increase 5%)"
    ) in lines
    assert "0 of 5 checks broken, 1 not checked" in err


def test_one_run_against_one_baseline_run_is_compared_whatever_the_names(tmp_path, capsys):
    _peaks(tmp_path / "base", "main", 10.0, 10.0)
    _peaks(tmp_path / "new", "branch", 11.0, 10.0)
    status, lines, _ = _check(
        capsys, str(tmp_path / "new"), "--baseline", str(tmp_path / "base"), "--max-increase", "5%"
    )
    assert status == 1
    assert lines[0] == (
        "FAIL run branch/version_0: peak 11.0 GiB > 10.5 GiB, baseline run 'main/version_0' 10.00 GiB + 5%"
        " (--max-increase 5%)"
    )


def test_run_selects_the_runs_checked_and_then_one_against_one(tmp_path, capsys):
    _peaks(tmp_path / "base", "main", 10.0, 10.0)
    _peaks(tmp_path / "new", "x", 9.0, 9.0)
    _peaks(tmp_path / "new", "y", 30.0, 30.0)
    args = [str(tmp_path / "new"), "--baseline", str(tmp_path / "base"), "--max-increase", "5%"]
    status, lines, _ = _check(capsys, *args, "--run", "x*")
    assert status == 0
    assert {line.split(":")[0] for line in lines} == {"ok   run x/version_0"}
    assert _check(capsys, *args, "--run", "y*")[0] == 1
    assert _check(capsys, str(tmp_path / "new"), "--max-peak", "20GiB", "--run", "x*")[0] == 0


def test_a_baseline_that_logged_no_peak_cannot_be_compared_with(tmp_path, capsys):
    _logged(tmp_path / "base", "cpu", [{"gpumem/host_rss_gib": 0.5}])
    _peaks(tmp_path / "new", "cpu", 1.0, 1.0)
    status, lines, _ = _check(
        capsys, str(tmp_path / "new"), "--baseline", str(tmp_path / "base"), "--max-increase", "5%"
    )
    assert status == 2
    assert lines == ["FAIL run cpu/version_0: baseline logged no peak to compare with (--max-increase 5%)"]


# ------------------------------------------------------------------------------------------------------ bad arguments
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-peak", "20XB"], "argument --max-peak: '20XB' is not a size: expected a positive size with a unit"),
        (["--max-peak", "20"], "argument --max-peak: '20' is not a size: expected a positive size with a unit"),
        (["--max-reserved", "0.5KiB"], "argument --max-reserved: '0.5KiB' is not a size: expected a size of at least 1 MiB"),
        (["--max-increase", "5"], "argument --max-increase: '5' is read as a fraction and is over 1: for 5 percent write '5%'"),
        (["--max-increase=-1%"], "argument --max-increase: '-1%' is not a share: expected a percentage such as '5%'"),
        (["--max-increase", "abc"], "argument --max-increase: 'abc' is not a share"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
        ([], "nothing to check: expected --max-peak SIZE, --max-reserved SIZE, --no-leak, or --baseline LOGDIR"),
        (["--baseline", "{logs}"], "--baseline needs --max-increase: expected both"),
        (["--max-increase", "5%"], "--max-increase needs --baseline: expected both"),
        (["--max-peak", "1GiB", "--run", "nope*"], "--run 'nope*': no run matches; expected one of the runs' names: 'tb/version_0'"),
        (["--max-peak", "1GiB", "--baseline", "/nonexistent", "--max-increase", "5%"], "--baseline: LOGDIR '/nonexistent' does not exist."),
    ],
)  # fmt: skip
def test_a_bad_argument_exits_2_naming_the_argument_and_its_value(logs, args, message):
    result = _run_cli("check", str(logs), *[arg.format(logs=logs) for arg in args])
    assert result.returncode == 2, result.stdout
    assert message in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("logdir", ["/nonexistent/logs", "README.md"])
def test_nothing_to_read_exits_2(logdir, capsys):
    assert main(["check", logdir, "--max-peak", "20GiB"]) == 2
    assert "gpumem check: error: LOGDIR" in capsys.readouterr().err


def test_a_directory_without_gpumem_metrics_exits_2(tmp_path, capsys):
    _logged(tmp_path, "plain", [{"loss": 1.0}])
    assert main(["check", str(tmp_path), "--max-peak", "20GiB"]) == 2
    assert "No `gpumem/` metrics under" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------- the parsing
@pytest.mark.parametrize(
    ("text", "gib"),
    [("20GiB", 20.0), ("512MiB", 0.5), ("20GB", 20e9 / 2**30), (" 1.5 gib ", 1.5), ("1MiB", 1 / 1024)],
)
def test_sizes_parse_as_the_callbacks_budgets_do(text, gib):
    assert parse_size(text) == pytest.approx(gib)


@pytest.mark.parametrize(
    ("text", "fraction"), [("5%", 0.05), ("0.05", 0.05), ("0", 0.0), ("150%", 1.5), ("1", 1.0)]
)
def test_shares_parse_as_percentages_or_fractions(text, fraction):
    assert parse_fraction(text) == pytest.approx(fraction)


def test_the_exit_status_is_1_for_a_broken_limit_else_2_for_an_unchecked_one_else_0(logs):
    summary = summarize(load_runs(logs).runs[0])
    assert exit_status(check_runs([summary], Limits(max_peak_gib=20.0))) == 0
    assert exit_status(check_runs([summary], Limits(max_peak_gib=1.0))) == 1
    assert exit_status(check_runs([summary], Limits(max_increase=0.05), [])) == 2  # no baseline run
    assert exit_status([]) == 0


# ------------------------------------------------------------------------------------------------- torch-free, CI
def test_gpumem_check_imports_neither_torch_nor_lightning(logs):
    code = (
        "import sys; from lightning_gpumem.cli import main;"
        f" status = main(['check', {str(logs)!r}, '--max-peak', '100GiB', '--no-leak']);"
        " print(status, sorted(m for m in ('torch', 'lightning', 'pytorch_lightning') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.splitlines()[-1] == "0 []"


def test_the_console_script_runs_the_gate(logs):
    result = _run_cli("check", str(logs), "--max-peak", "1MiB")
    assert result.returncode == 1
    assert result.stdout == "FAIL run tb/version_0: peak 3.0 GiB > 1.0 MiB (--max-peak)\n"
