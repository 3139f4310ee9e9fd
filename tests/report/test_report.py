"""`python -m lightning_gpumem report` on logs written by real CPU training runs (a fake allocator gives known GiB)."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_gpumem._core.units import GIB
from lightning_gpumem.report import ReportError, load_runs, render_html, summarize, write_png
from lightning_gpumem.report._events import read_scalars
from lightning_gpumem.report.summary import rows
from tests.helpers.fakes import FakeMonitor, FakeProbe, FakeRelease, SpikeModel
from tests.helpers.tensorboard import read_layouts
from tests.helpers.trainer import quiet_trainer

ROOT = Path(__file__).resolve().parents[2]


def _fit(loggers, steps: int = 8) -> FakeProbe:
    """8 training batches on a fake 24 GiB allocator: 1 GiB base, a 2 GiB spike at step 3, 1 GiB in validation."""
    probe = FakeProbe(base=GIB)
    model = SpikeModel(probe, train_spikes={3: 2 * GIB}, val_spike=GIB)
    trainer = quiet_trainer(
        max_epochs=1,
        limit_train_batches=steps,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=loggers,
        callbacks=[
            FakeMonitor(probe, nvml_host_interval_s=0),
            FakeRelease(probe, threshold=2.5 / 24, min_steps_between=1),
        ],
        log_every_n_steps=1,
    )
    trainer.fit(model)
    return probe


def _logged(root: Path, name: str, rows: list[dict[str, float]]) -> Path:
    """A run written by Lightning's CSVLogger, one `log_metrics` call a row (step = the row's index)."""
    logger = CSVLogger(root, name=name)
    for step, row in enumerate(rows):
        logger.log_metrics(row, step=step)
    logger.save()
    return Path(logger.log_dir)


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("logs")
    _fit([TensorBoardLogger(root, name="tb"), CSVLogger(root, name="csv")])
    return root


def _event_file(logs: Path) -> Path:
    return next((logs / "tb").rglob("events.out.tfevents.*"))


def test_our_event_reader_matches_tensorboards(logs):
    ours = read_scalars(_event_file(logs))
    accumulator = EventAccumulator(str(_event_file(logs)), size_guidance={"scalars": 0})
    accumulator.Reload()
    tags = [tag for tag in accumulator.Tags()["scalars"] if tag.startswith("gpumem/")]
    assert len(tags) >= 15
    for tag in tags:
        assert [(e.step, pytest.approx(e.value)) for e in accumulator.Scalars(tag)] == ours[tag]


def test_the_table_equals_the_logged_scalars_and_the_known_numbers(logs):
    loaded = load_runs(logs)
    assert [run.name for run in loaded.runs] == ["csv/version_0", "tb/version_0"]
    accumulator = EventAccumulator(str(_event_file(logs)), size_guidance={"scalars": 0})
    accumulator.Reload()

    def logged(tag: str) -> list[float]:
        return [e.value for e in accumulator.Scalars(tag)]

    for run in loaded.runs:
        summary = summarize(run)
        batch_peaks = logged("gpumem/train_peak_allocated_gib")
        assert summary.logged_batches == len(batch_peaks) == 8
        assert (
            summary.batch_peak_max == pytest.approx(max(batch_peaks)) == pytest.approx(3.0)
        )  # 1 + 2 GiB spike
        assert summary.batch_peak_mean == pytest.approx(sum(batch_peaks) / 8) == pytest.approx(10 / 8)
        assert summary.stage_peaks["train"][0] == pytest.approx(3.0)
        assert summary.stage_peaks["val"][0] == pytest.approx(max(logged("gpumem/val_peak_allocated_gib")))
        assert summary.stage_peaks["val"][0] == pytest.approx(2.0)  # 1 GiB base + 1 GiB validation spike
        assert summary.nvml_process_peak == pytest.approx(max(logged("gpumem/nvml_process_gib")))
        assert summary.nvml_process_peak == pytest.approx(
            3 + 300 / 1024
        )  # reserved 3 GiB + the fake's 300 MiB
        assert summary.non_torch_peak == pytest.approx(300 / 1024)
        assert summary.host_rss_peak == pytest.approx(2.0)
        assert summary.nvml_total == pytest.approx(24.0)
        assert summary.headroom == pytest.approx(24.0 - 3.0 - 300 / 1024)  # no budget: the device less both
        assert summary.cache_releases == logged("gpumem/cache_releases")[-1] >= 1
        assert summary.released == pytest.approx(logged("gpumem/released_gib")[-1])
        assert summary.steps == (0, 8)  # the release counters are logged once more at the end of training
    table = dict(rows(summarize(loaded.runs[1])))
    assert table["per-batch peak"] == "mean 1.25 GiB, max 3.00 GiB over 8 logged batches"
    assert table["NVML process peak"] == "3.29 GiB; non-PyTorch 0.29 GiB (9%)"
    assert table["headroom at the highest peak"] == "20.71 GiB (86% of the device)"


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lightning_gpumem", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_cli_prints_a_table_per_run_and_writes_png_and_html(logs, tmp_path):
    pytest.importorskip("matplotlib")
    png, page = tmp_path / "memory.png", tmp_path / "memory.html"
    result = _run_cli("report", str(logs), "--png", str(png), "--html", str(page))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("run ") == 2
    assert "per-batch peak" in result.stdout
    assert re.search(r"train peak\s+3\.00 GiB allocated", result.stdout)
    assert _png_size(png) == (1000, 800)  # 10 x 4 inches per run at 100 dpi, two runs
    text = page.read_text()
    assert text.count("<svg") == 2
    assert "<script" not in text
    assert "cache release" in text


def test_console_script_is_declared():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'gpumem = "lightning_gpumem.cli:main"' in pyproject


def test_missing_directory_is_a_clear_error(tmp_path):
    result = _run_cli("report", str(tmp_path / "nope"))
    assert result.returncode == 1
    assert f"LOGDIR '{tmp_path / 'nope'}' does not exist" in result.stderr


def test_directory_without_gpumem_metrics_is_a_clear_error(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="plain")
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")
    result = _run_cli("report", str(tmp_path))
    assert result.returncode == 1
    assert "No `gpumem/` metrics under" in result.stderr
    assert "1 readable log file(s)" in result.stderr
    with pytest.raises(ReportError, match="No `gpumem/` metrics"):
        load_runs(tmp_path)


def test_corrupt_event_file_is_skipped_and_named(logs, tmp_path):
    good = tmp_path / "good"
    shutil.copytree(logs / "tb", good)
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    data = bytearray(_event_file(logs).read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of a record
    bad = bad_dir / "events.out.tfevents.123.host.1.0"
    bad.write_bytes(bytes(data))
    result = _run_cli("report", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert f"skipped {bad}" in result.stderr
    assert "checksum" in result.stderr
    assert "run good/version_0" in result.stdout


def test_a_record_cut_short_at_the_end_is_read_up_to_it(logs, tmp_path):
    data = _event_file(logs).read_bytes()
    cut = tmp_path / "events.out.tfevents.1.host.1.0"
    cut.write_bytes(data[: len(data) - 7])  # a run still writing its last record
    whole, partial = read_scalars(_event_file(logs)), read_scalars(cut)
    assert sum(map(len, partial.values())) == sum(map(len, whole.values())) - 1


def test_png_without_matplotlib_says_how_to_install(logs, tmp_path, monkeypatch):
    for name in [name for name in sys.modules if name.split(".")[0] == "matplotlib"] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if never installed, even when imported before
    with pytest.raises(ReportError, match=r"pip install 'lightning-gpumem\[report\]'"):
        write_png(load_runs(logs).runs, tmp_path / "x.png")


def test_tensorboard_layout_puts_each_stage_in_one_chart(logs):
    layouts = read_layouts([_event_file(logs)])
    assert len(layouts) == 1
    charts = {chart.title: list(chart.multiline.tag) for c in layouts[0].category for chart in c.chart}
    train = next(tags for title, tags in charts.items() if title.startswith("train"))
    val = next(tags for title, tags in charts.items() if title.startswith("validation"))
    logged = list(read_scalars(_event_file(logs)))

    def drawn(tags: list[str]) -> set[str]:
        return {key for key in logged if any(re.search(tag, key) for tag in tags)}

    assert {
        "gpumem/train_peak_allocated_gib",
        "gpumem/train_peak_reserved_gib",
        "gpumem/train_allocated_gib",
        "gpumem/train_reserved_gib",
        "gpumem/nvml_process_gib",
    } <= drawn(train)
    assert {"gpumem/val_peak_allocated_gib", "gpumem/val_reserved_gib", "gpumem/nvml_process_gib"} <= drawn(
        val
    )
    assert not any(key.startswith("gpumem/val_") for key in drawn(train))


def test_html_page_escapes_names_and_is_self_contained(logs):
    runs = load_runs(logs).runs
    page = render_html(runs, "<logs>")
    assert "&lt;logs&gt;" in page
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_released_and_budget_rows(logs):
    run = load_runs(logs).runs[1]
    run.series["gpumem/budget_gib"] = [(0, 4.0)]
    run.series["gpumem/batch_size"] = [(0, 48.0)]
    run.series["gpumem/leak_warnings"] = [(5, 1.0)]
    run.series["gpumem/leak_mib_per_step"] = [(4, 2.0), (6, 6.5)]
    table = dict(rows(summarize(run)))
    assert table["budget"] == "4.0 GiB"
    assert table["headroom at the highest peak"] == "1.00 GiB (25% of the budget)"
    assert table["tuned batch size"] == "48"
    assert table["leak warnings"] == "1 (growth 6.50 MiB/step when flagged)"


def test_the_last_layout_keeps_every_stage_run_so_far(tmp_path):
    """TensorBoard shows only a run's last layout: after fit then test it must still hold the train charts."""
    probe = FakeProbe(base=GIB)
    trainer = quiet_trainer(
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=1,
        limit_test_batches=1,
        num_sanity_val_steps=0,
        logger=TensorBoardLogger(tmp_path, name="tb"),
        callbacks=[FakeMonitor(probe)],
        log_every_n_steps=1,
    )
    model = SpikeModel(probe)
    trainer.fit(model)
    trainer.test(model)
    trainer.test(model)  # nothing new: no third layout
    files = sorted((tmp_path / "tb").rglob("events.out.tfevents.*"), key=lambda f: f.stat().st_mtime_ns)
    layouts = read_layouts(files)
    assert len(layouts) == 2
    titles = [chart.title.split(":")[0] for category in layouts[-1].category for chart in category.chart]
    assert titles[:3] == ["train", "validation", "test"]


def test_on_a_cpu_the_layout_has_no_empty_chart(tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_gpumem import MemoryMonitor

    trainer = quiet_trainer(
        max_steps=4,
        limit_val_batches=1,
        log_every_n_steps=1,
        callbacks=[MemoryMonitor(nvml_host_interval_s=0)],
        logger=TensorBoardLogger(tmp_path, name="cpu"),
    )
    trainer.fit(BoringModel())
    (file,) = tmp_path.rglob("events.out.tfevents.*")
    (layout,) = read_layouts([file])
    charts = [list(chart.multiline.tag) for category in layout.category for chart in category.chart]
    logged = list(read_scalars(file))
    assert charts
    for tags in charts:  # every chart draws at least one logged key
        assert any(re.search(tag, key) for tag in tags for key in logged), tags


def test_a_directory_whose_only_file_is_damaged_names_it(logs, tmp_path):
    data = bytearray(_event_file(logs).read_bytes())
    data[-6] ^= 0xFF  # the last record's data
    bad = tmp_path / "events.out.tfevents.9.host.1.0"
    bad.write_bytes(bytes(data))
    result = _run_cli("report", str(tmp_path))
    assert result.returncode == 0, result.stderr  # what came before the damage is kept and reported
    assert f"skipped {bad}: record at byte" in result.stderr
    assert "scalars before it are kept" in result.stderr
    data[30] ^= 0xFF  # now the first record too
    bad.write_bytes(bytes(data))
    result = _run_cli("report", str(tmp_path))
    assert result.returncode == 1
    assert "No readable `gpumem/` metrics" in result.stderr
    assert f"{bad}: record" in result.stderr


def test_a_resumed_run_keeps_the_last_value_of_each_step(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    for start, value in ((0, 1.0), (5, 2.0)):  # the second writer re-logs steps 5-9, as after a resume
        writer = SummaryWriter(tmp_path / "run")
        for step in range(start, start + 10):
            writer.add_scalar("gpumem/train_peak_allocated_gib", value, step)
        writer.close()
    (run,) = load_runs(tmp_path).runs
    points = run.series["gpumem/train_peak_allocated_gib"]
    assert [s for s, _ in points] == list(range(15))
    assert [v for _, v in points] == [1.0] * 5 + [2.0] * 10
    assert summarize(run).logged_batches == 15


def test_negative_steps_and_new_style_scalars_read_as_tensorboard_does(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(tmp_path)
    writer.add_scalar("gpumem/x_gib", 1.5, -5)
    writer.add_scalar("gpumem/y_gib", 2.5, 2**40, new_style=True)
    writer.close()
    scalars = read_scalars(next(tmp_path.glob("events.out.tfevents.*")))
    assert scalars["gpumem/x_gib"] == [(-5, 1.5)]
    assert scalars["gpumem/y_gib"] == [(2**40, 2.5)]


def test_cross_rank_maxima_set_the_peaks_and_the_headroom(logs):
    run = load_runs(logs).runs[1]
    run.series["gpumem/train_peak_allocated_gib_max"] = [(0, 7.0), (1, 7.5)]
    run.series["gpumem/train_peak_reserved_gib_max"] = [(0, 9.0)]
    summary = summarize(run)
    assert summary.over_ranks
    assert summary.stage_peaks["train"] == (7.5, 9.0)
    assert summary.batch_peak_max == 7.5
    assert summary.batch_peak_mean == pytest.approx(10 / 8)  # rank 0's batches
    assert summary.headroom == pytest.approx(24.0 - 9.0 - 300 / 1024)
    assert dict(rows(summary))["ranks"].startswith("peaks and headroom: the highest over ranks")


def test_output_errors_are_clear_and_html_comes_first(logs, tmp_path):
    result = _run_cli("report", str(logs), "--png", str(tmp_path / "memory"))
    assert result.returncode == 1
    assert "expected a file name ending in .png" in result.stderr
    (tmp_path / "page").mkdir()
    result = _run_cli("report", str(logs), "--html", str(tmp_path / "page"))
    assert result.returncode == 1
    assert "gpumem report: error: --html" in result.stderr
    assert "is a directory" in result.stderr
    assert "Traceback" not in result.stderr


def test_html_survives_nan_and_single_points(logs):
    import xml.etree.ElementTree as ET

    def svg_of(series):
        run = load_runs(logs).runs[1]
        run.series = series
        page = render_html([run], "logs")
        return ET.fromstring(page[page.index("<svg") : page.index("</svg>") + 6])

    ns = "{http://www.w3.org/2000/svg}"
    root = svg_of({"gpumem/budget_gib": [(0, float("nan"))], "gpumem/train_peak_allocated_gib": [(5, 1.0)]})
    assert len(root.findall(f"{ns}circle")) == 1  # the single point is a marker; the NaN budget is left out
    root = svg_of({"gpumem/train_reserved_gib": [(2**40, 2.0), (2**40 + 10, 2.0)]})
    labels = [t.text for t in root.findall(f"{ns}text") if t.text and t.text.startswith("1,099,511,627,7")]
    assert len(set(labels)) == len(labels) >= 2  # large steps keep distinct tick labels


def test_write_png_leaves_the_callers_matplotlib_backend_alone(logs, tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("svg")
    write_png(load_runs(logs).runs, tmp_path / "x.png")
    assert matplotlib.get_backend().lower() == "svg"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--png", ""], r"--png '': expected a file name"),
        (["--html", " "], r"--html ' ': expected a file name"),
        (["--html", "{d}/same.png", "--png", "{d}/same.png"], r"--png and --html are the same file"),
        (
            ["--html", "{d}/page.html", "--png", "{d}/picture.jpg"],
            r"--png '.*picture.jpg': expected .* \.png",
        ),
        (["--html", "{d}/note.txt/page.html"], r"--html '.*': '.*note.txt' is a file, not a directory"),
        (["--png", "{d}"], r"--png '.*': is a directory"),
    ],
)
def test_bad_output_paths_are_refused_before_anything_is_written(logs, tmp_path, options, message):
    (tmp_path / "note.txt").write_text("a file")
    args = [option.format(d=tmp_path) for option in options]
    result = _run_cli("report", str(logs / "csv"), *args)
    assert result.returncode == 1
    assert re.search(message, result.stderr), result.stderr
    assert result.stdout == ""  # no table printed, nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["note.txt"]


def test_a_cell_that_is_not_a_number_is_left_out_and_the_rest_of_the_file_kept(logs, tmp_path):
    source = next((logs / "csv").rglob("metrics.csv"))
    lines = source.read_text().splitlines()
    header = lines[0].split(",")
    column = header.index("gpumem/train_peak_allocated_gib")
    row = next(i for i, line in enumerate(lines[1:], start=1) if line.split(",")[column])
    cells = lines[row].split(",")
    cells[column] = "oops"
    lines[row] = ",".join(cells)
    damaged = tmp_path / "version_0" / "metrics.csv"
    damaged.parent.mkdir()
    damaged.write_text("\n".join(lines) + "\n")
    (run,) = load_runs(tmp_path).runs
    kept = run.series["gpumem/train_peak_allocated_gib"]
    original = load_runs(source.parent).runs[0].series["gpumem/train_peak_allocated_gib"]
    assert len(kept) == len(original) - 1
    result = _run_cli("report", str(tmp_path))
    assert result.returncode == 0
    assert (
        f"line {row + 1}: gpumem/train_peak_allocated_gib = 'oops' is not a finite number" in result.stderr
    )


def test_a_flat_series_at_the_top_of_its_range_is_drawn_inside_the_frame(tmp_path):
    pytest.importorskip("matplotlib")
    from lightning_gpumem.report.plot import _figure
    from lightning_gpumem.report.runs import Run

    # host RSS of examples/quickstart.py on a CPU: nearly flat, so autoscaling's margin (5% of the range) is nil
    flat = [(0, 0.3678), (20, 0.3690), (40, 0.3698)]
    run = Run(name="cpu", path=tmp_path, series={"gpumem/host_rss_gib": flat})
    figure = _figure([run])
    figure.draw_without_rendering()  # lay the figure out, as saving it does
    (ax,) = figure.axes
    (line,) = ax.get_lines()
    frame = ax.get_window_extent()
    _, y_pixel = ax.transData.transform((40, 0.3698))
    half_width = line.get_linewidth() * figure.dpi / 72 / 2
    assert (
        frame.y0 + half_width < y_pixel < frame.y1 - half_width - 2
    )  # its pixels inside the frame, off the edge
    assert write_png([run], tmp_path / "cpu.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("logdir", "message"),
    [
        ("", r"LOGDIR '': expected a directory"),
        ("/nonexistent/logs", "does not exist"),
        ("README.md", "not a directory"),
    ],
)
def test_a_bad_logdir_is_refused_naming_it(logdir, message):
    result = _run_cli("report", logdir)
    assert result.returncode == 1
    assert re.search(message, result.stderr), result.stderr
    assert result.stdout == ""


def test_infinite_cells_are_left_out_and_the_png_is_still_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    run_dir = tmp_path / "version_0"
    run_dir.mkdir()
    (run_dir / "metrics.csv").write_text(
        "step,gpumem/train_peak_allocated_gib\n0,1.0\ninf,2.0\n2,inf\n3,1.5\n", encoding="utf-8"
    )
    (run,) = load_runs(tmp_path).runs
    assert run.series["gpumem/train_peak_allocated_gib"] == [(0, 1.0), (3, 1.5)]
    result = _run_cli("report", str(tmp_path), "--png", str(tmp_path / "out.png"))
    assert result.returncode == 0, result.stderr
    assert "line 3: step 'inf' is not a finite number" in result.stderr
    assert "line 4: gpumem/train_peak_allocated_gib = 'inf' is not a finite number" in result.stderr


@pytest.mark.parametrize("retries", [0, 3])
def test_the_report_gives_the_fit_end_summarys_advice_and_headroom(tmp_path, retries):
    probe = FakeProbe(base=GIB, retries=retries)
    monitor = FakeMonitor(probe, nvml_host_interval_s=0)
    quiet_trainer(
        max_steps=6,
        limit_val_batches=1,
        logger=CSVLogger(tmp_path, name="run"),
        callbacks=[monitor],
        log_every_n_steps=1,
    ).fit(SpikeModel(probe, train_spikes={2: 3 * GIB}))
    lines = (monitor.summary_text or "").splitlines()
    fit_advice = [line.split("advice: ", 1)[1] for line in lines if "advice: " in line]
    summary = summarize(load_runs(tmp_path).runs[0])
    assert fit_advice, monitor.summary_text  # low use of the device (and the retries) give advice
    assert summary.advice == fit_advice
    headroom = next(line for line in lines if "headroom" in line).split("headroom ")[1].split(" GiB")[0]
    assert f"{summary.headroom:.1f}" == headroom


def test_a_planned_run_shows_its_plan_in_a_row(tmp_path):
    run_dir = tmp_path / "planned"
    run_dir.mkdir()
    columns = {
        "gpumem/plan_peak_gib": 7.55,
        "gpumem/plan_band_gib": 0.09,
        "gpumem/plan_fixed_gib": 2.43,
        "gpumem/plan_per_sample_mib": 81.3,
        "gpumem/plan_outside_gib": 0.52,
        "gpumem/plan_largest_batch_size": 264.0,
    }
    (run_dir / "metrics.csv").write_text(
        "step," + ",".join(columns) + "\n0," + ",".join(str(v) for v in columns.values()) + "\n"
    )
    (run,) = load_runs(tmp_path).runs
    table = dict(rows(summarize(run)))
    assert table["memory plan"] == (
        "peak 7.55 +- 0.09 GiB; 2.43 GiB + 81.3 MiB per sample; 0.52 GiB outside PyTorch; largest batch size 264"
    )


def test_a_tuned_token_budget_shows_in_a_row_instead_of_a_batch_size(tmp_path):
    run_dir = tmp_path / "tokens"
    run_dir.mkdir()
    columns = {"gpumem/batch_size": 6144.0, "gpumem/token_budget": 6144.0, "gpumem/padding_fraction": 7.25}
    (run_dir / "metrics.csv").write_text(
        "step," + ",".join(columns) + "\n0," + ",".join(str(v) for v in columns.values()) + "\n"
    )
    (run,) = load_runs(tmp_path).runs
    table = dict(rows(summarize(run)))
    assert table["tuned token budget"] == "6144 tokens per batch (7.2% of the epoch's positions padding)"
    assert "tuned batch size" not in table


def _csv(run_dir: Path, rows_: list[dict[str, float]]) -> None:
    run_dir.mkdir()
    columns = sorted({key for row in rows_ for key in row})
    lines = ["step," + ",".join(columns)]
    lines += [f"{step}," + ",".join(str(row.get(c, "")) for c in columns) for step, row in enumerate(rows_)]
    (run_dir / "metrics.csv").write_text("\n".join(lines) + "\n")


def test_step_peaks_over_the_tuners_budget_are_a_row(tmp_path):
    peaks = [float(p) for p in range(11, 21)]  # 11..20 GiB over a budget of 20 GiB: 0.55..1.00
    rows_ = [{"gpumem/batch_size": 8.0, "gpumem/batch_size_budget_gib": 20.0}]
    rows_ += [{"gpumem/train_peak_reserved_gib": p} for p in peaks]
    _csv(tmp_path / "tuned", rows_)
    (run,) = load_runs(tmp_path).runs
    summary = summarize(run)
    p50, p99, highest, steps = summary.step_peaks_over_budget
    assert (steps, highest) == (10, 1.0)
    assert p50 == pytest.approx(0.775)  # numpy's linear percentiles of 0.55..1.00
    assert p99 == pytest.approx(0.9955)
    table = dict(rows(summary))
    assert table["tuned batch size"] == "8, for 20.0 GiB"
    assert table["step peak reserved / budget"] == (
        "p50 0.78, p99 1.00, max 1.00 over 10 logged training steps (the tuner's budget)"
    )


def test_step_peaks_are_over_a_memory_budget_first_and_the_highest_rank(tmp_path):
    rows_ = [{"gpumem/budget_gib": 10.0, "gpumem/batch_size_budget_gib": 20.0}]
    rows_ += [
        {"gpumem/train_peak_reserved_gib": 4.0, "gpumem/train_peak_reserved_gib_max": 5.0} for _ in range(3)
    ]
    _csv(tmp_path / "ddp", rows_)
    (run,) = load_runs(tmp_path).runs
    assert summarize(run).step_peaks_over_budget == (0.5, 0.5, 0.5, 3)
    assert dict(rows(summarize(run)))["step peak reserved / budget"].endswith("(the budget)")


def test_no_budget_no_step_peak_row(tmp_path):
    _csv(tmp_path / "plain", [{"gpumem/train_peak_reserved_gib": 4.0}])
    (run,) = load_runs(tmp_path).runs
    assert summarize(run).step_peaks_over_budget is None
    assert "step peak reserved / budget" not in dict(rows(summarize(run)))


def test_curves_that_coincide_stay_apart_and_the_tuners_budget_spans_the_panel(tmp_path):
    """A peak equal to what stays allocated and reserved (three curves on one line) is still three curves: the
    peak wide and translucent underneath, the others with their own markers and dashes; the tuner's budget,
    logged once, is a line across the panel."""
    pytest.importorskip("matplotlib")
    from lightning_gpumem.report.plot import _figure
    from lightning_gpumem.report.runs import Run

    same = [(step, 2.0) for step in range(0, 100, 5)]
    series = {
        "gpumem/train_peak_allocated_gib": same,
        "gpumem/train_allocated_gib": same,
        "gpumem/train_reserved_gib": same,
        "gpumem/batch_size_budget_gib": [(0, 3.0)],
    }
    figure = _figure([Run(name="same", path=tmp_path, series=series)])
    (ax,) = figure.axes
    drawn = {line.get_label(): line for line in ax.get_lines()}
    styles = {
        label: (line.get_linestyle(), line.get_marker(), line.get_linewidth())
        for label, line in drawn.items()
        if label in ("per-batch peak allocated", "allocated (batch end)", "reserved (batch end)")
    }
    assert len(styles) == 3
    assert len(set(styles.values())) == 3  # each drawn its own way
    peak = drawn["per-batch peak allocated"]
    assert peak.get_linewidth() > max(w for _, _, w in styles.values() if w != peak.get_linewidth())
    assert peak.get_zorder() < drawn["allocated (batch end)"].get_zorder()  # underneath
    budget = drawn["the tuner's budget"]
    assert list(budget.get_ydata()) == [3.0, 3.0]
    assert list(budget.get_xdata()) == [0, 1]  # axes coordinates: the whole width
    assert write_png([Run(name="same", path=tmp_path, series=series)], tmp_path / "same.png").stat().st_size
