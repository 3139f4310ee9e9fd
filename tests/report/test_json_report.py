"""`gpumem report LOGDIR --json [FILE|-]` and `--run GLOB`: one JSON document of every run's figures, its schema."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_gpumem import keys
from lightning_gpumem.cli import main
from lightning_gpumem.report import load_runs, summarize
from lightning_gpumem.report.json_report import MARK, SCHEMA, document, dumps
from tests.report.test_report import _fit, _logged, _run_cli

ROOT = Path(__file__).resolve().parents[2]
TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("logs")
    _fit([TensorBoardLogger(root, name="tb"), CSVLogger(root, name="csv")])
    return root


# ----------------------------------------------------------------- a validator for the JSON Schema subset SCHEMA uses
def _is(value: object, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, TYPES[kind])


SUBSET = {"$schema", "title", "description", "type", "properties", "required", "additionalProperties"}
SUBSET |= {"items", "enum", "const"}


def _problems(value: object, schema: dict, where: str = "$") -> list[str]:
    """What in ``value`` breaks ``schema`` (type, enum, const, properties, required, additionalProperties, items)."""
    assert set(schema) <= SUBSET, f"{where}: the validator does not know {set(schema) - SUBSET}"
    problems = []
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_is(value, kind) for kind in kinds):
            return [f"{where}: {value!r} is not of type {kinds}"]
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if "const" in schema and (value != schema["const"] or type(value) is not type(schema["const"])):
        problems.append(f"{where}: {value!r} is not {schema['const']!r}")
    if isinstance(value, dict) and "properties" in schema:
        problems += [f"{where}: no {name!r}" for name in schema.get("required", []) if name not in value]
        if schema.get("additionalProperties") is False:
            problems += [
                f"{where}: {name!r} is not in the schema"
                for name in value
                if name not in schema["properties"]
            ]
        for name, sub in schema["properties"].items():
            if name in value:
                problems += _problems(value[name], sub, f"{where}.{name}")
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            problems += _problems(item, schema["items"], f"{where}[{index}]")
    return problems


def test_the_validator_catches_what_it_is_for(logs):
    good = document(load_runs(logs).runs, logs)
    assert _problems(good, SCHEMA) == []
    figures = good["runs"][0]["figures"]
    broken = json.loads(json.dumps(good))
    broken["version"] = 2
    broken["runs"][0]["figures"]["peak_allocated_gib"] = "3.0"
    broken["runs"][0]["figures"]["stages"]["train"]["extra_gib"] = 1.0
    del broken["runs"][0]["figures"]["ooms"]
    broken["runs"][0]["figures"]["leak_verdict"] = "maybe"
    broken["runs"][0]["figures"]["logged_batches"] = True
    assert sorted(_problems(broken, SCHEMA)) == [
        "$.runs[0].figures.leak_verdict: 'maybe' is not one of ['leak', 'no_leak', None]",
        "$.runs[0].figures.logged_batches: True is not of type ['integer']",
        "$.runs[0].figures.peak_allocated_gib: '3.0' is not of type ['number', 'null']",
        "$.runs[0].figures.stages.train: 'extra_gib' is not in the schema",
        "$.runs[0].figures: no 'ooms'",
        "$.version: 2 is not 1",
    ]
    assert figures["logged_batches"] == 8


def test_the_schema_is_a_json_schema_that_jsonschema_accepts(logs):
    jsonschema = pytest.importorskip("jsonschema")  # not a dependency: checked where it is installed
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    jsonschema.validate(document(load_runs(logs).runs, logs), SCHEMA)


# --------------------------------------------------------------------------------------------- the document itself
def test_json_on_stdout_is_the_whole_output_valid_and_the_tables_figures(logs):
    result = _run_cli("report", str(logs), "--json", "-")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # stdout holds the document and nothing else
    assert result.stdout.isascii()
    assert _problems(report, SCHEMA) == []
    assert report["schema"] == "lightning-gpumem.report"
    assert (report["version"], report["logdir"]) == (1, str(logs))
    assert [run["name"] for run in report["runs"]] == ["csv/version_0", "tb/version_0"]
    for run, loaded in zip(report["runs"], load_runs(logs).runs, strict=True):
        summary = summarize(loaded)
        figures = run["figures"]
        assert run["path"] == str(loaded.path)
        assert figures["peak_allocated_gib"] == pytest.approx(3.0)  # 1 GiB + the 2 GiB spike
        assert figures["stages"]["train"]["peak_allocated_gib"] == summary.stage_peaks["train"][0]
        assert figures["stages"]["val"]["peak_allocated_gib"] == pytest.approx(2.0)
        assert figures["stages"]["test"] == {"peak_allocated_gib": None, "peak_reserved_gib": None}
        assert figures["peak_reserved_gib"] == summary.peak_reserved
        assert (figures["first_step"], figures["last_step"]) == summary.steps == (0, 8)
        assert figures["batch_peak_mean_gib"] == pytest.approx(10 / 8)
        assert figures["logged_batches"] == 8
        assert figures["nvml_total_gib"] == pytest.approx(24.0)
        assert figures["headroom_gib"] == pytest.approx(24.0 - 3.0 - 300 / 1024)
        assert figures["headroom_of"] == "device"
        assert figures["headroom_pct"] == pytest.approx(100 * (24.0 - 3.0 - 300 / 1024) / 24.0)
        assert figures["cache_releases"] == summary.cache_releases >= 1
        assert figures["released_gib"] == summary.released
        assert figures["host_rss_peak_gib"] == pytest.approx(2.0)
        assert figures["budget_gib"] is None
        assert figures["step_peak_reserved_over_budget"] is None  # no budget
        assert figures["plan"] == dict.fromkeys(figures["plan"])  # no planner: every field null
        assert figures["advice"] == summary.advice
        assert figures["over_ranks"] is False


def test_budget_tuner_plan_token_budget_and_leak_figures(tmp_path):
    rows = [
        {
            "gpumem/budget_gib": 10.0,
            "gpumem/batch_size": 6144.0,
            "gpumem/token_budget": 6144.0,
            "gpumem/padding_fraction": 7.25,
            "gpumem/batch_size_budget_gib": 9.0,
            "gpumem/plan_peak_gib": 7.5,
            "gpumem/plan_band_gib": 0.25,
            "gpumem/plan_fixed_gib": 2.5,
            "gpumem/plan_per_sample_mib": 81.5,
            "gpumem/plan_outside_gib": 0.5,
            "gpumem/plan_largest_batch_size": 264.0,
        }
    ]
    rows += [
        {"gpumem/train_peak_reserved_gib": peak, "gpumem/train_peak_allocated_gib": peak - 1}
        for peak in (4.0, 6.0, 8.0)
    ]
    rows += [
        {"gpumem/leak_mib_per_step": 0.5},
        {"gpumem/leak_warnings": 1.0, "gpumem/leak_mib_per_step": 6.5},
    ]
    _logged(tmp_path, "rich", rows)
    report = json.loads(dumps(document(load_runs(tmp_path).runs, tmp_path)))
    assert _problems(report, SCHEMA) == []
    figures = report["runs"][0]["figures"]
    assert figures["budget_gib"] == 10.0
    assert figures["headroom_gib"] == 2.0  # the budget less the highest peak reserved
    assert (figures["headroom_of"], figures["headroom_pct"]) == ("budget", 20.0)
    assert figures["tuned_batch_size"] is None  # a token budget was tuned: the table shows it instead
    assert figures["tuned_token_budget"] == 6144
    assert (figures["padding_pct"], figures["tuned_for_gib"]) == (7.25, 9.0)
    assert figures["step_peak_reserved_over_budget"] == {
        "p50_ratio": 0.6,
        "p99_ratio": pytest.approx(0.796),
        "max_ratio": 0.8,
        "steps": 3,
        "over": "budget_gib",
    }
    assert figures["plan"] == {
        "peak_gib": 7.5,
        "band_gib": 0.25,
        "fixed_gib": 2.5,
        "per_sample_mib": 81.5,
        "outside_gib": 0.5,
        "largest_batch_size": 264,
    }
    assert (figures["leak_verdict"], figures["leak_warnings"]) == ("leak", 1)
    assert figures["leak_mib_per_step"] == 6.5  # the rate logged when it was flagged
    assert (figures["peak_allocated_gib"], figures["peak_reserved_gib"]) == (7.0, 8.0)


def test_the_leak_verdict_is_no_leak_when_a_rate_was_logged_and_null_when_nothing_was(tmp_path):
    _logged(
        tmp_path, "watched", [{"gpumem/train_peak_allocated_gib": 1.0, "gpumem/leak_mib_per_step": 0.01}]
    )
    _logged(tmp_path, "unwatched", [{"gpumem/train_peak_allocated_gib": 1.0, "gpumem/batch_size": 8.0}])
    report = document(load_runs(tmp_path).runs, tmp_path)
    verdicts = {run["name"]: run["figures"]["leak_verdict"] for run in report["runs"]}
    assert verdicts == {"unwatched/version_0": None, "watched/version_0": "no_leak"}
    tuned = next(run["figures"] for run in report["runs"] if run["name"] == "unwatched/version_0")
    assert (tuned["tuned_batch_size"], tuned["tuned_token_budget"]) == (8, None)
    assert tuned["step_peak_reserved_over_budget"] is None


def test_the_tuners_budget_is_what_the_step_peaks_are_over_without_a_memory_budget(tmp_path):
    rows = [{"gpumem/batch_size": 8.0, "gpumem/batch_size_budget_gib": 20.0}]
    rows += [{"gpumem/train_peak_reserved_gib": 10.0}]
    _logged(tmp_path, "tuned", rows)
    figures = document(load_runs(tmp_path).runs, tmp_path)["runs"][0]["figures"]
    assert figures["step_peak_reserved_over_budget"]["over"] == "tuned_for_gib"
    assert figures["step_peak_reserved_over_budget"]["max_ratio"] == 0.5


def test_a_name_with_control_characters_and_bytes_that_are_not_utf8_is_ascii_json(tmp_path):
    name = b"run-\xff\x1b[2J\xe2\x80\xae"
    directory = os.path.join(os.fsencode(tmp_path), name)
    os.mkdir(directory)
    with open(os.path.join(directory, b"metrics.csv"), "w", encoding="utf-8") as handle:
        handle.write("step,gpumem/train_peak_allocated_gib\n0,1.5\n")
    text = dumps(document(load_runs(tmp_path).runs, tmp_path))
    assert text.isascii()
    assert "\x1b" not in text
    (run,) = json.loads(text)["runs"]
    assert run["name"] == "run-\\xff\x1b[2J\u202e"  # the byte as the table shows it; the rest as it is
    assert json.dumps(run["name"]) == '"run-\\\\xff\\u001b[2J\\u202e"'


def test_skipped_files_are_in_the_document_and_on_stderr(logs, tmp_path, capsys):
    _logged(tmp_path, "good", [{"gpumem/train_peak_allocated_gib": 1.0}])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.csv").write_text("step,gpumem/train_peak_allocated_gib\n0,x\n1,2.0\n")
    assert main(["report", str(tmp_path), "--json", "-"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert len(report["skipped"]) == 1
    assert "line 2: gpumem/train_peak_allocated_gib = 'x' is not a finite number" in report["skipped"][0]
    assert "gpumem report: skipped" in err


# ------------------------------------------------------------------------------------- --json FILE and its safeguards
def test_json_file_is_written_beside_the_tables_and_replaced_on_the_next_run(logs, tmp_path, capsys):
    out = tmp_path / "memory.json"
    assert main(["report", str(logs), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("run ") == 2  # the tables, as without --json
    assert f"JSON: {out}" in printed
    text = out.read_text(encoding="ascii")
    assert MARK in text.encode()[:4096]
    assert _problems(json.loads(text), SCHEMA) == []
    assert main(["report", str(logs), "--json", str(out)]) == 0  # one the report wrote: replaced
    assert json.loads(out.read_text()) == json.loads(text)


def test_json_never_overwrites_a_file_it_did_not_write_or_an_input(logs, tmp_path, capsys):
    foreign = tmp_path / "notes.json"
    foreign.write_text('{"mine": true}\n')
    assert main(["report", str(logs), "--json", str(foreign)]) == 1
    assert "exists and was not written by gpumem report" in capsys.readouterr().err
    assert foreign.read_text() == '{"mine": true}\n'
    assert main(["report", str(logs), "--json", str(foreign), "--force"]) == 0
    assert json.loads(foreign.read_text())["schema"] == "lightning-gpumem.report"
    metrics = logs / "csv" / "version_0" / "metrics.csv"
    before = metrics.read_bytes()
    assert main(["report", str(logs), "--json", str(metrics), "--force"]) == 1
    assert "is an input of this report" in capsys.readouterr().err
    assert metrics.read_bytes() == before


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--json", ""], "--json '': expected a file name."),
        (["--json", "{tmp}"], "is a directory; expected a file name."),
        (["--json", "{tmp}/a.json", "--html", "{tmp}/a.json"], "--html and --json are the same file"),
    ],
)
def test_bad_json_paths_are_refused_naming_the_option(logs, tmp_path, capsys, extra, message):
    assert main(["report", str(logs), *[part.format(tmp=tmp_path) for part in extra]]) == 1
    out, err = capsys.readouterr()
    assert message in err
    assert out == ""


def test_with_json_on_stdout_the_other_outputs_are_named_on_stderr(logs, tmp_path, capsys):
    page = tmp_path / "memory.html"
    assert main(["report", str(logs), "--json", "-", "--html", str(page)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["runs"]
    assert f"HTML: {page}" in err
    assert page.is_file()


def test_json_without_a_file_name_goes_to_stdout(logs, capsys):
    assert main(["report", str(logs), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == 1


# ------------------------------------------------------------------------------------------------------- --run GLOB
@pytest.mark.parametrize(
    ("globs", "names"),
    [
        (["tb/*"], ["tb/version_0"]),
        (["*version_0"], ["csv/version_0", "tb/version_0"]),
        (["csv/version_0", "tb/*"], ["csv/version_0", "tb/version_0"]),
        (["c?v/version_[0-9]"], ["csv/version_0"]),
    ],
)
def test_run_selects_runs_by_name(logs, capsys, globs, names):
    selection = [part for glob in globs for part in ("--run", glob)]
    assert main(["report", str(logs), "--json", "-", *selection]) == 0
    assert [run["name"] for run in json.loads(capsys.readouterr().out)["runs"]] == names
    assert main(["report", str(logs), *selection]) == 0
    assert re.findall(r"^run (\S+)$", capsys.readouterr().out, flags=re.MULTILINE) == names


def test_a_run_glob_that_matches_nothing_exits_2_naming_it_and_the_runs(logs, capsys):
    assert main(["report", str(logs), "--run", "tb/*", "--run", "TB/*"]) == 2  # case-sensitive
    out, err = capsys.readouterr()
    assert out == ""
    names = "'csv/version_0', 'tb/version_0'"
    assert f"--run 'TB/*': no run matches; expected one of the runs' names: {names}." in err


# ------------------------------------------------------------------------------------------------------------ the docs
def _schema_fields(schema: dict, prefix: str = "") -> list[str]:
    """Every field of the document, dotted (a stage's fields once, as `stages.<stage>.peak_allocated_gib`)."""
    fields = []
    for name, sub in schema.get("properties", {}).items():
        path = f"{prefix}{name}"
        fields.append(path)
        if "items" in sub:
            fields += _schema_fields(sub["items"], f"{path}[].")
        elif name == "stages":
            fields += _schema_fields(sub["properties"][keys.STAGES[0]], f"{path}.<stage>.")
        else:
            fields += _schema_fields(sub, f"{path}.")
    return fields


def test_the_docs_tables_list_every_field_of_the_schema_and_no_other():
    """The document's fields, then the figures' (named from `figures`), in the schema's order."""
    text = (ROOT / "docs" / "report.md").read_text(encoding="utf-8")
    section = text.split("## Machine-readable output (--json)", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `([^`]+)` \|", section, flags=re.MULTILINE)
    figures = "runs[].figures."
    fields = _schema_fields(SCHEMA)
    expected = [f for f in fields if not f.startswith(figures)]
    expected += [f.removeprefix(figures) for f in fields if f.startswith(figures)]
    assert documented == expected
