"""The landing page and the docs: every relative link points at a file of the repository, no history voice, and the
README a landing page that leaves the reference to docs/."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *DOCS]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_point_at_files_and_headings_that_exist(page):
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target}"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked), f"{page.name}: {target}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_history_voice(page):
    text = page.read_text(encoding="utf-8").lower()
    for phrase in ("this session", "not yet re-measured", "predate", "in the run before", "earlier run"):
        assert phrase not in text, f"{page.name}: {phrase!r}"


# ------------------------------------------------------------------------------------ the README is a landing page
# It says what each callback is for, shows one call and links to the page under docs/ that is its reference; the
# reference itself (signatures, argument tables, key tables, long explanations) lives in docs/ only.
README = ROOT / "README.md"
SIGNATURE_LINE = re.compile(
    r"^\s+\w+: [^=]+ = .+,"
)  # `    headroom: float = 0.05,  # ...` of a signature block
REFERENCE_HEADERS = {"key", "unit", "meaning", "argument", "parameter", "default", "type"}
LONGEST = {
    "paragraph": 6,
    "code": 10,
    "table": 10,
}  # lines: an introduction, one example, one table of results


def _blocks(text: str) -> list[tuple[str, list[str]]]:
    """The page as (kind, lines) blocks: 'code' (a fenced block, fences included), 'table', 'heading', 'paragraph'."""
    blocks: list[tuple[str, list[str]]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif line.startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            blocks.append(("code", lines[i : end + 1]))
            i = end + 1
        elif line.startswith("#"):
            blocks.append(("heading", [line]))
            i += 1
        else:
            kind = "table" if line.startswith("|") else "paragraph"
            end = i
            while (
                end + 1 < len(lines)
                and lines[end + 1].strip()
                and not lines[end + 1].startswith(("```", "#"))
            ):
                if lines[end + 1].startswith("|") != (kind == "table"):
                    break  # a table right under a line of text (or text right under a table)
                end += 1
            blocks.append((kind, lines[i : end + 1]))
            i = end + 1
    return blocks


def _callbacks() -> list[type]:
    from lightning.pytorch import Callback

    import lightning_gpumem

    exported = [getattr(lightning_gpumem, name) for name in lightning_gpumem.__all__]
    return [obj for obj in exported if isinstance(obj, type) and issubclass(obj, Callback)]


def _missing_links(text: str) -> list[str]:
    """What a landing page fails to send the reader to: a docs/ page it never links, a callback it never introduces
    (`**`Name`**`), or one whose introduction links no page of docs/ titled with the callback's name."""
    problems = [f"no link to docs/{page.name}" for page in DOCS if f"(docs/{page.name}" not in text]
    paragraphs = ["\n".join(lines) for kind, lines in _blocks(text) if kind == "paragraph"]
    for cls in _callbacks():
        intro = next((p for p in paragraphs if f"**`{cls.__name__}`**" in p), None)
        if intro is None:
            problems.append(f"{cls.__name__} is not introduced")
            continue
        pages = [
            ROOT / target for target in LINK.findall(intro) if target.startswith("docs/") and ".md" in target
        ]
        titles = [page.read_text(encoding="utf-8").splitlines()[0] for page in pages if page.exists()]
        if not any(cls.__name__ in title for title in titles):
            problems.append(f"{cls.__name__}'s introduction links no reference page of docs/ named for it")
    return problems


def _reference_material(text: str) -> list[str]:
    """What belongs in docs/, not on a landing page: a key table, a table of arguments, a signature block."""
    arguments = {name for cls in _callbacks() for name in inspect.signature(cls).parameters}
    problems = ["a generated key table (<!-- keys: ... -->)"] if "<!-- keys:" in text else []
    for kind, lines in _blocks(text):
        if kind == "table":
            header = {cell.strip(" `").lower() for cell in lines[0].strip("|").split("|")}
            first_cells = [row.strip("|").split("|")[0].strip(" `") for row in lines[2:]]
            if header & REFERENCE_HEADERS:
                problems.append(f"a reference table: {lines[0]}")
            problems += [
                f"a row of logged keys: {cell}" for cell in first_cells if cell.startswith("gpumem/")
            ]
            problems += [f"a row per argument: {cell}" for cell in first_cells if cell in arguments]
        elif kind == "code":
            problems += [f"a signature: {line.strip()}" for line in lines if SIGNATURE_LINE.match(line)]
    return problems


def _long_blocks(text: str) -> list[str]:
    """Paragraphs, examples and tables longer than a landing page's (an explanation that belongs in docs/)."""
    return [
        f"a {kind} of {len(lines)} lines (at most {LONGEST[kind]}): {lines[0][:60]}"
        for kind, lines in _blocks(text)
        if kind in LONGEST and len(lines) > LONGEST[kind]
    ]


def test_the_readme_links_every_reference_page_and_introduces_every_callback_with_its_own():
    assert _missing_links(README.read_text(encoding="utf-8")) == []


def test_the_readme_holds_no_reference_material():
    assert _reference_material(README.read_text(encoding="utf-8")) == []


def test_each_block_of_the_readme_is_short():
    assert _long_blocks(README.read_text(encoding="utf-8")) == []


def test_the_landing_page_checks_catch_what_they_are_for():
    readme = README.read_text(encoding="utf-8")
    monitor = (ROOT / "docs" / "monitor.md").read_text(encoding="utf-8")
    unlinked = readme.replace("[Reference](docs/monitor.md)", "").replace("(docs/monitor.md)", "")
    assert _missing_links(unlinked) == [
        "no link to docs/monitor.md",
        "MemoryMonitor's introduction links no reference page of docs/ named for it",
    ]
    assert _missing_links(readme.replace("**`AutoMicrobatch`**", "AutoMicrobatch")) == [
        "AutoMicrobatch is not introduced"
    ]
    signature, keys = (
        monitor.split("```")[1],
        monitor[monitor.index("<!-- keys:") : monitor.index("<!-- /keys -->")],
    )
    pasted = f"{readme}\n```{signature}```\n\n{keys}"
    found = _reference_material(pasted)
    assert any(p.startswith("a signature: log_every_n_steps") for p in found), found
    assert any(p.startswith("a reference table") for p in found), found
    assert any(p.startswith("a row of logged keys: gpumem/") for p in found), found
    arguments = f"{readme}\n| argument | default |\n| --- | --- |\n| `headroom` | 0.05 |\n"
    assert "a row per argument: headroom" in _reference_material(arguments)
    explained = readme.replace(
        "**`AutoMicrobatch`**: ", "**`AutoMicrobatch`**: " + "more words on a line,\n" * 6
    )
    assert [p for p in _long_blocks(explained) if "AutoMicrobatch" in p], _long_blocks(explained)


# -------------------------------------------------------------- the examples: the README's commands, its table and CI
# Every `python examples/X.py ...` the README shows names a file that exists, sits in the README's examples table and
# is run by CI (`.ci/run`) with each option the README shows; every file of examples/ is in that table, or is one of
# the files below that the examples or the README's pictures are made with.
EXAMPLES = ROOT / "examples"
CI = ROOT / ".ci" / "run"
EXAMPLE_SUPPORT = {
    "_simulated_gpu.py": "the simulated GPU the examples run on without one (imported by them)",
    "make_pictures.sh": "draws the README's pictures (docs/*.png) from a run's logs",
    "tensorboard_screenshot.py": "make_pictures.sh's screenshot of TensorBoard (needs Chromium)",
}
EXAMPLE_COMMAND = re.compile(r"\bpython3? (examples/[\w./-]+)([^`\n#|]*)")
OPTION = re.compile(r"(--[\w-]+)(?: \{([\w,-]+)\}| (?![-\[{])([\w.-]+))?")


def _commands(text: str) -> list[tuple[str, str]]:
    """``(path, options)`` of every ``python examples/...`` command in ``text``, options as written after the path."""
    return [(path, rest.strip()) for path, rest in EXAMPLE_COMMAND.findall(text)]


def _variants(options: str) -> list[str]:
    """The options a command shows, one string each as CI must pass it: `[--leak]` gives `--leak`, `[--mode {batch,
    first}]` gives `--mode batch` and `--mode first` (an option whose value is a placeholder gives the option)."""
    variants = []
    for name, choices, value in OPTION.findall(options):
        if choices:
            variants += [f"{name} {choice}" for choice in choices.split(",")]
        elif value and not value.isupper():  # `--steps N`: any value; `--mode batch`: that value
            variants.append(f"{name} {value}")
        else:
            variants.append(name)
    return variants


def _examples_table(readme: str) -> set[str]:
    """The paths of examples/ named in the first cell of the README's examples table (under `## Examples`)."""
    blocks = _blocks(readme)
    start = next(
        i for i, (kind, lines) in enumerate(blocks) if kind == "heading" and lines[0] == "## Examples"
    )
    table = next(lines for kind, lines in blocks[start:] if kind == "table")
    return {
        path for row in table[2:] for path in re.findall(r"examples/[\w./-]+", row.strip("|").split("|")[0])
    }


def _example_problems(readme: str, ci: str, files: list[str]) -> list[str]:
    """What the README's examples get wrong, against ``ci`` (the text of `.ci/run`) and ``files`` (examples/'s)."""
    table = _examples_table(readme)
    ci_runs = _commands(ci)
    problems = []
    for path, options in _commands(readme):
        if not (ROOT / path).is_file():
            problems.append(f"{path}: no such file")
        if path not in table:
            problems.append(f"{path}: not in the README's examples table")
        if not any(ran == path for ran, _ in ci_runs):
            problems.append(f"{path}: not run by .ci/run")
        for variant in _variants(options):
            if not any(
                ran == path and re.search(rf"{re.escape(variant)}(?![\w-])", rest) for ran, rest in ci_runs
            ):
                problems.append(f"{path} {variant}: not run by .ci/run")
    for name in files:
        if f"examples/{name}" not in table and name not in EXAMPLE_SUPPORT:
            problems.append(f"examples/{name}: not in the README's examples table")
    return sorted(set(problems))


def _example_files() -> list[str]:
    return sorted(p.name for p in EXAMPLES.iterdir() if p.is_file() and not p.name.startswith("."))


def test_every_example_is_in_the_readmes_table_and_every_command_there_is_run_by_ci():
    readme, ci = README.read_text(encoding="utf-8"), CI.read_text(encoding="utf-8")
    assert _commands(readme), "the README shows no example command"
    assert _example_problems(readme, ci, _example_files()) == []


def test_the_example_support_files_exist_and_the_readme_names_those_a_reader_runs():
    readme = README.read_text(encoding="utf-8")
    for name in EXAMPLE_SUPPORT:
        assert (EXAMPLES / name).is_file(), name
        assert name.startswith("_") or f"examples/{name}" in readme, name


def test_the_example_checks_catch_what_they_are_for():
    readme, ci, files = README.read_text(encoding="utf-8"), CI.read_text(encoding="utf-8"), _example_files()
    row = next(
        line for line in readme.splitlines() if line.startswith("| `python examples/variable_length.py")
    )
    assert _example_problems(readme.replace(row + "\n", ""), ci, files) == [
        "examples/variable_length.py: not in the README's examples table"
    ]
    assert _example_problems(readme, ci, [*files, "new_example.py"]) == [
        "examples/new_example.py: not in the README's examples table"
    ]
    typo = readme.replace("python examples/quickstart.py\n", "python examples/quick_start.py\n", 1)
    assert _example_problems(typo, ci, files) == [
        "examples/quick_start.py: no such file",
        "examples/quick_start.py: not in the README's examples table",
        "examples/quick_start.py: not run by .ci/run",
    ]
    no_leak = "\n".join(line for line in ci.splitlines() if "keep_memory_in_bounds.py --leak" not in line)
    assert _example_problems(readme, no_leak, files) == [
        "examples/keep_memory_in_bounds.py --leak: not run by .ci/run"
    ]
    no_first = "\n".join(line for line in ci.splitlines() if "--mode first" not in line)
    assert _example_problems(readme, no_first, files) == [
        "examples/variable_length.py --mode first: not run by .ci/run"
    ]
    assert _variants("[--mode {batch,first}] [--steps N] --leak --budget 4GiB") == [
        "--mode batch", "--mode first", "--steps", "--leak", "--budget 4GiB"
    ]  # fmt: skip


# -------------------------------------------------------------------- the keys and stages the docs show are the code's
# A `gpumem/...` key anywhere in README.md or docs/ (a sample's output, a key table, a sentence) is one that keys.py
# defines (`keys.parse` takes it apart), or a pattern of them (`gpumem/<stage>_peak_allocated_gib`, `gpumem/plan_*`).
# A stage a sample shows is one of `keys.STAGES`, the names the code prints: in a sample of the fit-end summary (the
# rows under its `stage` header), of the report (`<stage> peak` rows) and in a Markdown table's `stage` column.
KEY = re.compile(r"(?<![\w/.-])gpumem/[\w<>{}*/.-]*")
PLACEHOLDERS = {
    "<stage>": "(?:{stages})",
    "{stage}": "(?:{stages})",
    "<stat>": ".+",
    "{stat}": ".+",
    "<r>": r"\d+",
}
SUMMARY_HEADER = re.compile(r"^\s*stage\s{2,}peak allocated\s{2,}peak reserved\s*$")
SUMMARY_ROW = re.compile(r"^\s+(\S+)\s{2,}\S")
REPORT_ROW = re.compile(r"^\s*(\S+) peak\s{2,}.*\ballocated\b.*\breserved\b")


def _logged_names() -> list[str]:
    """Every key as the code can log it: each stage of a staged key, each DDP suffix (rank 0 for `_rank<r>`)."""
    from lightning_gpumem import keys

    suffixes = {"max_min": ["", "_max", "_min"], "per_rank": ["", "_rank0"], "": [""]}
    names = []
    for key in keys.KEYS:
        for stage in keys.STAGES if key.staged else [None]:
            name = key.format(stage).replace("{stat}", "allocated_bytes.all.peak")
            names += [name + suffix for suffix in suffixes[key.ranks]]
    return names


def _key_problems(text: str) -> list[str]:
    """The `gpumem/` keys in ``text`` that the code does not log (a bare `gpumem/`, the prefix, is not a key)."""
    from lightning_gpumem import keys

    names = _logged_names()
    problems = []
    for shown in sorted({k.rstrip(".-") for k in KEY.findall(text)} - {keys.PREFIX}):
        if not re.search(r"[<>{}*]", shown):
            known = keys.parse(shown) is not None
        else:
            pattern = re.escape(shown).replace(
                r"\*", ".*"
            )  # (a placeholder not below stays literal: no match)
            for placeholder, replacement in PLACEHOLDERS.items():
                pattern = pattern.replace(
                    re.escape(placeholder), replacement.format(stages="|".join(keys.STAGES))
                )
            known = any(re.fullmatch(pattern, name) for name in names)
        if not known:
            problems.append(f"{shown}: no such key in lightning_gpumem/keys.py")
    return problems


def _stage_problems(text: str) -> list[str]:
    """Stages shown in ``text``'s samples that the code never prints (it prints `keys.STAGES`)."""
    from lightning_gpumem import keys

    shown: list[str] = []
    for kind, lines in _blocks(text):
        if kind == "code":
            in_summary = False
            for line in lines[1:-1]:
                row = SUMMARY_ROW.match(line)
                if in_summary and row:
                    shown.append(row.group(1))
                else:
                    in_summary = bool(SUMMARY_HEADER.match(line))
                report = REPORT_ROW.match(line)
                shown += [report.group(1)] if report else []
        tables = [lines] if kind == "table" else []
        if kind == "code":  # a Markdown table printed by the code (the memory plan) sits in a code block
            tables = [[line for line in lines if line.startswith("|")]]
        for table in tables:
            if len(table) < 3:
                continue
            header = [cell.strip(" `").lower() for cell in table[0].strip().strip("|").split("|")]
            if "stage" in header:
                column = header.index("stage")
                shown += [row.strip().strip("|").split("|")[column].strip(" `") for row in table[2:]]
    return [
        f"stage {stage!r}: the code prints one of {keys.STAGES}"
        for stage in shown
        if stage not in keys.STAGES
    ]


def test_the_key_and_stage_checks_catch_what_they_are_for():
    summary = (
        "```\nMemoryMonitor summary (NVIDIA H200 (cuda:0))\n"
        "  stage       peak allocated   peak reserved\n"
        "  train             0.07 GiB        0.07 GiB\n"
        "  {stage}          0.07 GiB        0.07 GiB\n"
        "  device total 139.8 GiB; headroom 139.0 GiB (99%) at the highest peak\n```\n"
    )
    assert _stage_problems(summary.format(stage="val     ")) == []
    assert _stage_problems(summary.format(stage="validate")) == [
        "stage 'validate': the code prints one of ('train', 'val', 'test', 'predict')"
    ]
    report = "```\nrun a/version_0\n  {stage} peak                    2.14 GiB allocated, 2.42 GiB reserved\n```\n"
    assert _stage_problems(report.format(stage="val")) == []
    assert _stage_problems(report.format(stage="validation")) == [
        "stage 'validation': the code prints one of ('train', 'val', 'test', 'predict')"
    ]
    table = "| stage | peak |\n| --- | --- |\n| `train` | 1 |\n| `fit` | 2 |\n"
    assert _stage_problems(table) == [
        "stage 'fit': the code prints one of ('train', 'val', 'test', 'predict')"
    ]
    known = (
        "`gpumem/train_peak_allocated_gib_max`, `gpumem/<stage>_reserved_gib`, `gpumem/plan_*`, the `gpumem/` keys,"
        " `gpumem/allocator/<stat>`, `gpumem/cache_releases_rank<r>`, lightning_gpumem/keys.py, gpumem/budget_gib."
    )
    assert _key_problems(known) == []
    assert _key_problems(
        "```\ngpumem/validate_peak_allocated_gib 1.0\n```\n`gpumem/<stage>_peak_gib`, `gpumem/tuner_*`, gpumem/<rank>"
    ) == [
        "gpumem/<rank>: no such key in lightning_gpumem/keys.py",
        "gpumem/<stage>_peak_gib: no such key in lightning_gpumem/keys.py",
        "gpumem/tuner_*: no such key in lightning_gpumem/keys.py",
        "gpumem/validate_peak_allocated_gib: no such key in lightning_gpumem/keys.py",
    ]


# ------------------------------------------------------------------------ samples and paths that are the code's now
# A sample is the code's output, pasted from a run: none excuses itself for differing from what the code prints now
# (regenerate it instead), and every file of the repository a page names (`lightning_gpumem/_hw/oom.py`) exists.
STALE_SAMPLE = re.compile(
    r"the code (?:as it is|now) prints|prints? (?:\w+ ){0,3}differently|now prints|older output|was printed"
    r"|(?:logs|output) (?:was|were) written without",
    flags=re.IGNORECASE,
)
REPO_PATH = re.compile(
    r"(?<![\w/.-])(?:lightning_gpumem|examples|tests|benchmarks|tools|docs|\.ci)/[\w./*<>{}-]*"
)


def _stale_samples(text: str) -> list[str]:
    return STALE_SAMPLE.findall(" ".join(text.split()))


def _missing_paths(text: str, base: Path = ROOT) -> list[str]:
    """Paths of the repository named in ``text`` (patterns with `*`, `<...>` or `{...}` aside) that do not exist."""
    named = {path.rstrip(".-") for path in REPO_PATH.findall(text)}
    return sorted(path for path in named if not re.search(r"[*<>{}]", path) and not (base / path).exists())


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_every_key_stage_sample_and_path_a_page_shows_is_the_codes(page):
    """Keys the code logs, stages it prints, no sample excusing itself, files that exist (the checks above)."""
    text = page.read_text(encoding="utf-8")
    assert _key_problems(text) == []
    assert _stage_problems(text) == []
    assert _stale_samples(text) == []
    assert _missing_paths(text) == []


def test_the_sample_and_path_checks_catch_what_they_are_for():
    assert _stale_samples(
        "This one is `examples/quickstart.py` on the H200. The code as it is prints two lines\ndifferently: ..."
    ) == ["The code as it is prints"]
    assert _stale_samples("(older output; the summary now prints the device total") == [
        "older output",
        "now prints",
    ]
    assert _stale_samples("It prints two lines\ndifferently:") == ["prints two lines differently"]
    assert _stale_samples("(the H200 run; these logs were written without those two keys)") == [
        "logs were written without"
    ]
    assert _stale_samples("Rank zero prints one line: `BatchSizeTuner: batch_size=38 (...)`.") == []
    assert _missing_paths(
        "in `lightning_gpumem/microbatch.py`; (`lightning_gpumem/_oom.py`); `lightning_gpumem/_hw/oom.py`,"
        " `benchmarks/results/tuner-*gib*.json`, `examples/oom_forensics.py:56`, docs/report.md, examples/nope.sh."
    ) == ["examples/nope.sh", "lightning_gpumem/_oom.py", "lightning_gpumem/microbatch.py"]
