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
SIGNATURE_LINE = re.compile(r"^\s+\w+: [^=]+ = .+,")  # `    headroom: float = 0.05,  # ...` of a signature block
REFERENCE_HEADERS = {"key", "unit", "meaning", "argument", "parameter", "default", "type"}
LONGEST = {"paragraph": 6, "code": 10, "table": 10}  # lines: an introduction, one example, one table of results


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
            while end + 1 < len(lines) and lines[end + 1].strip() and not lines[end + 1].startswith(("```", "#")):
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
        pages = [ROOT / target for target in LINK.findall(intro) if target.startswith("docs/") and ".md" in target]
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
            problems += [f"a row of logged keys: {cell}" for cell in first_cells if cell.startswith("gpumem/")]
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
    signature, keys = monitor.split("```")[1], monitor[monitor.index("<!-- keys:") : monitor.index("<!-- /keys -->")]
    pasted = f"{readme}\n```{signature}```\n\n{keys}"
    found = _reference_material(pasted)
    assert any(p.startswith("a signature: log_every_n_steps") for p in found), found
    assert any(p.startswith("a reference table") for p in found), found
    assert any(p.startswith("a row of logged keys: gpumem/") for p in found), found
    arguments = f"{readme}\n| argument | default |\n| --- | --- |\n| `headroom` | 0.05 |\n"
    assert "a row per argument: headroom" in _reference_material(arguments)
    explained = readme.replace("**`AutoMicrobatch`**: ", "**`AutoMicrobatch`**: " + "more words on a line,\n" * 6)
    assert [p for p in _long_blocks(explained) if "AutoMicrobatch" in p], _long_blocks(explained)
