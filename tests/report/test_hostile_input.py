"""`gpumem report` on hostile inputs and outputs: no input overwritten, nothing blocking, nothing hidden."""

from __future__ import annotations

import html
import os
import re
import resource
import struct
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from lightning_gpumem.cli import main
from lightning_gpumem.report import ReportError, load_runs, render_html, summarize, write_html
from lightning_gpumem.report.summary import format_table, rows

ROOT = Path(__file__).resolve().parents[2]
CSV_TEXT = (
    "step,gpumem/train_peak_allocated_gib,gpumem/train_reserved_gib\n0,1.0,1.5\n1,2.0,2.5\n2,1.0,2.5\n"
)


def _csv_run(directory: Path, text: str = CSV_TEXT) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    file = directory / "metrics.csv"
    file.write_text(text, encoding="utf-8")
    return file


def _event_run(directory: Path) -> Path:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(directory)
    for step in range(3):
        writer.add_scalar("gpumem/train_peak_allocated_gib", 1.0 + step, step)
    writer.close()
    return next(directory.glob("events.out.tfevents.*"))


def _run_cli(*args: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess[str]:
    def limit_memory() -> (
        None
    ):  # a report that reads without bound fails here instead of exhausting the machine
        resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))

    return subprocess.run(
        [sys.executable, "-m", "lightning_gpumem", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        preexec_fn=limit_memory,
        **kwargs,
    )


# 1. Outputs: never an input, never a file the report did not write (without --force), never half written.


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_an_output_that_is_an_input_is_refused_even_with_force(tmp_path, capsys, force):
    source = _csv_run(tmp_path / "run")
    event = _event_run(tmp_path / "tb")
    link = tmp_path / "page.html"
    link.symlink_to(source)
    hard = tmp_path / "hard.html"
    os.link(event, hard)
    before = {path: path.read_bytes() for path in (source, event)}
    for target in (source, event, link, hard):
        assert main(["report", str(tmp_path), "--html", str(target), *force]) == 1
        error = capsys.readouterr().err
        assert f"--html {str(target)!r}: is an input of this report" in error, error
    assert {path: path.read_bytes() for path in before} == before
    assert link.is_symlink()


def test_an_existing_file_the_report_did_not_write_needs_force(tmp_path, capsys):
    _csv_run(tmp_path / "run")
    page = tmp_path / "notes.html"
    page.write_text("my notes", encoding="utf-8")
    assert main(["report", str(tmp_path), "--html", str(page)]) == 1
    captured = capsys.readouterr()
    assert "exists and was not written by gpumem report" in captured.err
    assert "--force" in captured.err
    assert captured.out == ""  # refused before any table is printed
    assert page.read_text(encoding="utf-8") == "my notes"
    assert main(["report", str(tmp_path), "--html", str(page), "--force"]) == 0
    assert "<!-- written by gpumem report -->" in page.read_text(encoding="utf-8")
    assert (
        main(["report", str(tmp_path), "--html", str(page)]) == 0
    )  # its own page: rewritten without --force
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.html", "run"]  # no temporary file left


def test_a_symlinked_output_is_refused_and_force_writes_its_target(tmp_path, capsys):
    _csv_run(tmp_path / "run")
    target = tmp_path / "elsewhere.html"
    target.write_text("kept", encoding="utf-8")
    link = tmp_path / "page.html"
    link.symlink_to(target)
    assert main(["report", str(tmp_path / "run"), "--html", str(link)]) == 1
    assert "is a symbolic link" in capsys.readouterr().err
    assert target.read_text(encoding="utf-8") == "kept"
    assert main(["report", str(tmp_path / "run"), "--html", str(link), "--force"]) == 0
    assert link.is_symlink()
    assert "<!-- written by gpumem report -->" in target.read_text(encoding="utf-8")


def test_an_output_that_is_not_a_regular_file_is_refused_even_with_force(tmp_path, capsys):
    _csv_run(tmp_path / "run")
    fifo = tmp_path / "page.html"
    os.mkfifo(fifo)
    assert main(["report", str(tmp_path / "run"), "--html", str(fifo), "--force"]) == 1
    assert "is not a regular file" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "run"), "--html", os.devnull, "--force"]) == 1
    assert Path(os.devnull).is_char_device()


def test_a_rewritten_output_keeps_its_permissions(tmp_path):
    _csv_run(tmp_path / "run")
    page = tmp_path / "page.html"
    assert main(["report", str(tmp_path / "run"), "--html", str(page)]) == 0
    page.chmod(0o600)
    assert main(["report", str(tmp_path / "run"), "--html", str(page)]) == 0
    assert page.stat().st_mode & 0o777 == 0o600


def test_a_failed_write_leaves_the_old_file_whole_and_no_temporary_file(tmp_path):
    from lightning_gpumem._core.files import write_atomic

    page = tmp_path / "page.html"
    page.write_text("old", encoding="utf-8")

    def half_then_fail(handle) -> None:
        handle.write(b"new, cut sh")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomic(page, half_then_fail)
    assert page.read_text(encoding="utf-8") == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["page.html"]


def test_the_api_writers_refuse_the_runs_own_files(tmp_path):
    source = _csv_run(tmp_path)
    runs = load_runs(tmp_path).runs
    with pytest.raises(ReportError, match="is an input of this report"):
        write_html(runs, str(tmp_path), source, force=True)
    assert source.read_text(encoding="utf-8") == CSV_TEXT


def test_a_png_the_report_wrote_is_rewritten_and_another_is_refused(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _csv_run(tmp_path / "run")
    png = tmp_path / "memory.png"
    assert main(["report", str(tmp_path / "run"), "--png", str(png)]) == 0
    assert b"tEXtSoftware\x00gpumem report" in png.read_bytes()[:4096]
    assert main(["report", str(tmp_path / "run"), "--png", str(png)]) == 0
    other = tmp_path / "photo.png"
    other.write_bytes(b"\x89PNG\r\n\x1a\nnot ours")
    assert main(["report", str(tmp_path / "run"), "--png", str(other)]) == 1
    assert "exists and was not written by gpumem report" in capsys.readouterr().err
    assert other.read_bytes() == b"\x89PNG\r\n\x1a\nnot ours"


# 2. Inputs: regular files only, read up to a bound; every directory and file passed over is named.


def test_a_fifo_named_like_a_log_is_skipped_not_waited_on(tmp_path):
    _csv_run(tmp_path / "good")
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "metrics.csv")
    os.mkfifo(tmp_path / "fifo" / "events.out.tfevents.1.host.1.0")
    result = _run_cli("report", str(tmp_path), timeout=30)
    assert result.returncode == 0, result.stderr
    assert f"skipped {tmp_path / 'fifo' / 'metrics.csv'}: not a regular file (a FIFO)" in result.stderr
    assert "events.out.tfevents.1.host.1.0: not a regular file (a FIFO)" in result.stderr
    assert "run good" in result.stdout


def test_an_event_file_linked_to_dev_zero_is_skipped(tmp_path):
    _csv_run(tmp_path)
    (tmp_path / "events.out.tfevents.1.host.1.0").symlink_to("/dev/zero")
    result = _run_cli("report", str(tmp_path), timeout=30)
    assert result.returncode == 0, result.stderr
    assert "events.out.tfevents.1.host.1.0: not a regular file (a character device)" in result.stderr


def test_a_file_over_the_size_bound_is_read_up_to_it_and_named(tmp_path, monkeypatch):
    from lightning_gpumem.report import _reading

    source = _csv_run(tmp_path)
    bound = len(CSV_TEXT) - 3  # cuts the last row short: "2,1.0,2" would read 2 GiB for 2.5
    monkeypatch.setattr(_reading, "MAX_FILE_BYTES", bound)
    loaded = load_runs(tmp_path)
    (run,) = loaded.runs
    assert run.series["gpumem/train_reserved_gib"] == [(0, 1.5), (1, 2.5)]  # the row cut short is left out
    assert any(line.startswith(f"{source}: larger than {bound} bytes") for line in loaded.skipped), (
        loaded.skipped
    )


def test_an_unreadable_directory_is_named(tmp_path, monkeypatch):
    _csv_run(tmp_path / "good")
    locked = tmp_path / "locked"
    _csv_run(locked)
    scandir = os.scandir

    def refuse_locked(path="."):
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refuse_locked)  # as `chmod 000`, which root (CI) reads through
    loaded = load_runs(tmp_path)
    assert [run.name for run in loaded.runs] == ["good"]
    assert f"directory {locked}: Permission denied (not searched)" in loaded.skipped


# 3. Huge finite values are left out and named, as non-finite ones are.


def test_a_huge_finite_csv_cell_is_left_out_with_a_notice(tmp_path, capsys):
    _csv_run(
        tmp_path,
        "step,gpumem/train_peak_allocated_gib,gpumem/nvml_total_gib\n0,1.7e299,1e300\n1,2.0,24\n1e300,1.0,24\n",
    )
    assert main(["report", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "line 2: gpumem/train_peak_allocated_gib = '1.7e299' is out of range" in captured.err
    assert "line 4: step '1e300' is out of range (beyond int64; row left out)" in captured.err
    assert "train peak" in captured.out


def test_values_left_out_are_named_five_per_file_then_counted(tmp_path):
    source = _csv_run(
        tmp_path, "step,gpumem/train_peak_allocated_gib\n" + "".join(f"{i},1e300\n" for i in range(8))
    )
    _csv_run(tmp_path / "ok")
    skipped = load_runs(tmp_path).skipped
    assert [line.split(", line")[0] for line in skipped[:5]] == [str(source)] * 5
    assert skipped[5:] == [f"{source}: 3 more values left out, as above"]


def test_a_huge_tensorboard_double_is_left_out_with_a_notice(tmp_path, capsys):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(tmp_path)
    writer.add_scalar("gpumem/train_peak_allocated_gib", 1e300, 0, new_style=True, double_precision=True)
    writer.add_scalar("gpumem/train_peak_allocated_gib", 2.0, 1, new_style=True, double_precision=True)
    writer.close()
    assert main(["report", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "gpumem/train_peak_allocated_gib at step 0 = 1e+300 is out of range" in captured.err
    assert re.search(r"train peak\s+2\.00 GiB allocated", captured.out)


# 4. Run names reach the terminal escaped.


def test_control_characters_in_run_names_are_escaped(tmp_path, capsys):
    name = "evil\x1b[2J\nrun forged\trow\u202e"
    _csv_run(tmp_path / name)
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for raw in ("\x1b", "\u202e", "\t"):
        assert raw not in out
    assert "run evil\\x1b[2J\\x0arun forged\\x09row\\u202e" in out
    assert not any(line.startswith("run forged") for line in out.splitlines())
    assert "\x1b" not in format_table(summarize(load_runs(tmp_path).runs[0]))


# Any name a file system allows: bytes that are not UTF-8, HTML's metacharacters, line breaks, bidirectional text,
# emoji, the longest name. Each is shown escaped (`\xff`, `\x0a`, `\u202e`), in the text, the HTML page and the PNG,
# and no run costs the others their page or picture. Keys: the directory's name as bytes; values: how the text
# table and the HTML page show it (the PNG also escapes what no font of its title holds).
ODD_NAMES = {
    b"run-\xff\xfe": "run-\\xff\\xfe",  # not UTF-8: os.fsdecode keeps the bytes as surrogates
    b"\xc3": "\\xc3",  # the first byte of a two-byte character, alone
    b"<b>&amp;\"q'<script>x": "<b>&amp;\"q'<script>x",
    b"new\nline\ttab\x1b[31m\r": "new\\x0aline\\x09tab\\x1b[31m\\x0d",
    "rtl-\u202eabc-\u05e2\u05d1\u05e8\u05d9\u05ea-\u0627\u0644\u0639\u0631\u0628\u064a\u0629".encode(): (
        "rtl-\\u202eabc-\u05e2\u05d1\u05e8\u05d9\u05ea-\u0627\u0644\u0639\u0631\u0628\u064a\u0629"
    ),
    "emoji-\U0001f600\U0001f980\U0001f44d\U0001f3fd-\u4e2d\u6587\u2028".encode(): (
        "emoji-\U0001f600\U0001f980\U0001f44d\U0001f3fd-\u4e2d\u6587\\u2028"
    ),
    b"L" * 255: "L" * 255,  # the longest name of one directory on most Linux file systems
}
TB_NAME, TB_SHOWN = b"tb-\xfa\xfb", "tb-\\xfa\\xfb"  # a TensorBoard run in a folder whose name is not UTF-8
LOGDIR_NAME, LOGDIR_SHOWN = b"logs-\xfe<&>", "logs-\\xfe<&>"


def _odd_dir(parent: Path, name: bytes) -> Path:
    """``parent/name`` made from bytes, as Python names it (``os.fsdecode``: surrogates for bytes not UTF-8)."""
    path = Path(os.fsdecode(os.path.join(os.fsencode(parent), name)))
    try:
        path.mkdir()
    except OSError as error:  # e.g. macOS's APFS refuses names that are not UTF-8 (EILSEQ)
        pytest.skip(f"this file system refuses the name {name!r}: {error}")
    return path


def _odd_logs(tmp_path: Path) -> Path:
    """A log directory (itself oddly named) with a CSV run under each of ODD_NAMES and a TensorBoard run."""
    logdir = _odd_dir(tmp_path, LOGDIR_NAME)
    for name in ODD_NAMES:
        _csv_run(_odd_dir(logdir, name))
    written = _event_run(
        tmp_path / "tb"
    )  # TensorBoard's writer cannot open a path that is not UTF-8: moved there
    _odd_dir(logdir, TB_NAME).rmdir()
    os.rename(written.parent, os.path.join(os.fsencode(logdir), TB_NAME))
    return logdir


class _Page(HTMLParser):
    """The HTML page's headings and cells, as a browser reads them, and whether its elements nest and close."""

    VOID = frozenset(
        {"meta", "br", "img", "input", "link", "hr"}
    )  # HTML void elements; SVG ones close with />

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.open: list[str] = []
        self.texts: dict[str, list[str]] = {}
        self.errors: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        if tag not in self.VOID:
            self.open.append(tag)
            self.texts.setdefault(tag, []).append("")

    def handle_startendtag(self, tag, attrs) -> None:
        pass

    def handle_endtag(self, tag) -> None:
        if tag in self.VOID:
            return
        if not self.open or self.open[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.open[-1:]}")
        else:
            self.open.pop()

    def handle_data(self, data) -> None:
        for tag in ("h1", "h2", "td"):
            if tag in self.open:
                self.texts[tag][-1] += data


def test_a_run_folder_named_with_bytes_that_are_not_utf8_is_reported(tmp_path, capsys):
    logdir = _odd_dir(tmp_path, LOGDIR_NAME)
    _csv_run(tmp_path / "plain")  # a run beside it, which the odd one must not cost its page
    os.rename(tmp_path / "plain", logdir / "plain")
    _csv_run(_odd_dir(logdir, b"run-\xff\xfe"))
    page = tmp_path / "memory.html"
    assert main(["report", str(logdir), "--html", str(page)]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert "run plain\n" in captured.out
    assert "run run-\\xff\\xfe\n" in captured.out
    text = page.read_bytes().decode("utf-8")  # strict: no surrogate reached the page
    assert "<bdi>run-\\xff\\xfe</bdi>" in text
    assert "<bdi>plain</bdi>" in text
    assert (
        f"<h1>Memory report: <bdi>{html.escape(str(tmp_path))}/{html.escape(LOGDIR_SHOWN)}</bdi></h1>"
        in text
    )


def test_every_odd_run_name_is_escaped_in_the_text_and_the_html_page(tmp_path, capsys):
    logdir = _odd_logs(tmp_path)
    page = tmp_path / "memory.html"
    assert main(["report", str(logdir), "--html", str(page)]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    shown = [*ODD_NAMES.values(), TB_SHOWN]
    headers = [line[4:] for line in captured.out.splitlines() if line.startswith("run ")]
    assert sorted(headers) == sorted(shown)  # one header per run, each on one line
    assert all(char.isprintable() for char in captured.out.replace("\n", ""))
    data = page.read_bytes()
    text = data.decode("utf-8")  # strict
    assert not set(data) & (set(range(32)) - {10})  # no control character but the newline
    assert "<script" not in text
    parsed = _Page()
    parsed.feed(text)
    parsed.close()
    assert parsed.errors == []
    assert parsed.open == []  # every element closed
    assert sorted(parsed.texts["h2"]) == sorted(
        shown
    )  # what the reader sees: the escaped names, nothing more
    assert parsed.texts["h1"] == [f"Memory report: {tmp_path}/{LOGDIR_SHOWN}"]
    assert text.count("<svg") == len(shown)
    assert "&lt;b&gt;&amp;amp;&quot;q&#x27;&lt;script&gt;x" in text


def test_every_odd_run_name_is_drawn_in_the_png(tmp_path, capsys, recwarn):
    pytest.importorskip("matplotlib")
    logdir = _odd_logs(tmp_path)
    png = tmp_path / "memory.png"
    assert main(["report", str(logdir), "--png", str(png)]) == 0
    assert "Traceback" not in capsys.readouterr().err
    data = png.read_bytes()
    assert b"tEXtSoftware\x00gpumem report" in data[:4096]
    assert struct.unpack(">II", data[16:24]) == (1000, 400 * (len(ODD_NAMES) + 1))  # a panel for every run
    assert not [
        str(w.message) for w in recwarn if "missing from" in str(w.message)
    ]  # no glyph drawn as a box
    from lightning_gpumem.report.plot import MAX_TITLE_CHARS, _figure, font_glyphs

    figure = _figure(load_runs(logdir).runs)
    titles = [ax.get_title(loc="left") for ax in figure.axes]
    glyphs = font_glyphs()
    assert all(ord(char) in glyphs for title in titles for char in title)
    for shown in (
        "run-\\xff\\xfe",
        "\\xc3",
        "new\\x0aline\\x09tab\\x1b[31m\\x0d",
        "<b>&amp;\"q'<script>x",
        TB_SHOWN,
    ):
        assert shown in titles
    (long,) = (title for title in titles if title.startswith("L"))
    assert len(long) <= MAX_TITLE_CHARS
    assert "\u2026" in long or "..." in long
    (emoji,) = (title for title in titles if title.startswith("emoji-"))
    assert emoji.endswith("\\u2028")
    assert "\\U0001f980" in emoji or "\U0001f980" in emoji


def test_an_odd_run_name_reaches_an_ascii_terminal_escaped(tmp_path):
    logdir = _odd_logs(tmp_path)
    result = _run_cli("report", str(logdir), env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "run emoji-\\U0001f600\\U0001f980\\U0001f44d\\U0001f3fd-\\u4e2d\\u6587\\u2028" in result.stdout
    assert "run rtl-\\u202eabc-\\u05e2" in result.stdout
    assert "run run-\\xff\\xfe" in result.stdout


# 5. A PNG holds at most MAX_RUNS runs and says which it left out.


def test_the_png_holds_at_most_max_runs_and_names_the_rest(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    from lightning_gpumem.report import plot

    assert 10 <= plot.MAX_RUNS <= 50
    monkeypatch.setattr(plot, "MAX_RUNS", 2)
    for i in range(4):
        _csv_run(tmp_path / f"run{i}")
    png = tmp_path / "memory.png"
    assert main(["report", str(tmp_path), "--png", str(png)]) == 0
    data = png.read_bytes()
    assert struct.unpack(">II", data[16:24]) == (1000, 800)  # two 1000 x 400 px panels
    err = capsys.readouterr().err
    assert "the PNG holds the first 2 of 4 runs; left out: 'run2', 'run3'" in err


# 7. A closed pipe ends the report quietly.


def test_a_closed_pipe_ends_the_report_quietly(tmp_path):
    for i in range(40):
        _csv_run(tmp_path / f"run{i:02d}")

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))

    process = subprocess.Popen(
        [sys.executable, "-m", "lightning_gpumem", "report", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        preexec_fn=limit_memory,
    )
    assert process.stdout is not None
    assert process.stderr is not None
    process.stdout.close()  # as `| head` that has read enough: the report's writes meet a closed pipe
    error = process.stderr.read().decode()
    process.stderr.close()
    assert process.wait(timeout=60) == 141  # 128 + SIGPIPE, as a shell reports it
    assert "Traceback" not in error, error
    assert "BrokenPipeError" not in error, error


# 8. The leak rate is shown only where the monitor flagged a leak.


def test_a_leak_free_runs_warm_up_estimate_is_not_shown(tmp_path):
    _csv_run(tmp_path)
    run = load_runs(tmp_path).runs[0]
    run.series["gpumem/leak_mib_per_step"] = [
        (32, 0.41),
        (100, 0.22),
        (500, 0.0),
    ]  # first samples, then flat
    table = dict(rows(summarize(run)))
    assert table["leak warnings"] == "0"
    assert summarize(run).leak_rate is None
    run.series["gpumem/leak_warnings"] = [(120, 1.0)]
    run.series["gpumem/leak_mib_per_step"] = [
        (32, 9.0),
        (100, 4.0),
        (120, 3.0),
        (500, 3.0),
    ]  # frozen once flagged
    assert dict(rows(summarize(run)))["leak warnings"] == "1 (growth 3.00 MiB/step when flagged)"


# 9. Whole-step ticks on the HTML timeline; `-` where nothing was measured.


@pytest.mark.parametrize("steps", [range(12), range(5, 6), range(0, 3)])
def test_the_html_timeline_ticks_whole_steps(tmp_path, steps):
    import xml.etree.ElementTree as ET

    _csv_run(tmp_path)
    run = load_runs(tmp_path).runs[0]
    run.series = {"gpumem/train_reserved_gib": [(step, 2.0) for step in steps]}
    page = render_html([run], "logs")
    svg = ET.fromstring(page[page.index("<svg") : page.index("</svg>") + 6])
    texts = svg.findall("{http://www.w3.org/2000/svg}text")
    x_labels = [t.text for t in texts if t.get("text-anchor") == "middle" and t.text != "step"]
    assert x_labels
    assert all(re.fullmatch(r"-?[\d,]+", label or "") for label in x_labels), x_labels


def test_a_value_not_measured_is_a_dash(tmp_path):
    _csv_run(tmp_path, "step,gpumem/train_peak_reserved_gib\n0,1.5\n")
    table = dict(rows(summarize(load_runs(tmp_path).runs[0])))
    assert table["train peak"] == "- allocated, 1.50 GiB reserved"


def test_event_files_of_one_second_are_read_in_the_writers_order(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    for value, counter in (
        (1.0, 9),
        (2.0, 10),
    ):  # one process's 10th writer after its 9th: "...1.10" < "...1.9"
        writer = SummaryWriter(tmp_path / "new")
        writer.add_scalar("gpumem/train_peak_allocated_gib", value, 0)
        writer.close()
        (written,) = (tmp_path / "new").iterdir()
        written.rename(tmp_path / f"events.out.tfevents.1700000000.host.1.{counter}")
    (tmp_path / "new").rmdir()
    (run,) = load_runs(tmp_path).runs
    assert run.series["gpumem/train_peak_allocated_gib"] == [(0, 2.0)]  # the last written wins


def test_a_dollar_sign_in_a_run_name_is_not_read_as_mathtext(tmp_path):
    pytest.importorskip("matplotlib")
    from lightning_gpumem.report import write_png

    _csv_run(tmp_path / "a$\\foo$b")  # mathtext would fail on the unknown command \foo
    png = write_png(load_runs(tmp_path).runs, tmp_path / "memory.png")
    assert png.stat().st_size > 0


def test_the_png_ticks_whole_steps(tmp_path):
    pytest.importorskip("matplotlib")
    from lightning_gpumem.report.plot import _figure

    _csv_run(tmp_path, "step,gpumem/train_reserved_gib\n0,1.0\n1,1.5\n2,1.2\n")
    figure = _figure(load_runs(tmp_path).runs)
    figure.draw_without_rendering()
    (ax,) = figure.axes
    ticks = [tick for tick in ax.get_xticks() if ax.get_xlim()[0] <= tick <= ax.get_xlim()[1]]
    assert ticks == [0, 1, 2]
