"""The package as users meet it: a lazy top level, the CLI without torch, its version and its metadata."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

import lightning_gpumem
from lightning_gpumem.cli import main


def _run(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_the_cli_and_the_report_import_neither_torch_nor_lightning():
    loaded = _run(
        "import sys, lightning_gpumem.cli, lightning_gpumem.report;"
        " print(sorted(m for m in ('torch', 'lightning', 'pytorch_lightning') if m in sys.modules))"
    )
    assert loaded == "[]"


def test_every_exported_name_resolves_on_first_use():
    for name in lightning_gpumem.__all__:
        assert getattr(lightning_gpumem, name) is not None, name
    assert set(lightning_gpumem.__all__) <= set(dir(lightning_gpumem))
    assert _run("from lightning_gpumem import *; print(MemoryMonitor.__name__)") == "MemoryMonitor"


def test_an_unknown_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        lightning_gpumem.Nope


def test_version_matches_the_installed_metadata(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    version = importlib.metadata.version("lightning-gpumem")
    assert capsys.readouterr().out.strip() == f"gpumem {version}"
    assert lightning_gpumem.__version__ == version


def test_the_ci_floors_job_installs_the_floors_pyproject_declares():
    import re
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"])
    for extra in ("tensorboard", "report", "test"):
        declared += project["optional-dependencies"][extra]
    floors = {}
    for requirement in declared:
        name, floor = re.fullmatch(r"([A-Za-z0-9_.\-]+)(?:\[[^]]*\])?>=([0-9.]+)", requirement).groups()
        floors[name.lower()] = floor
    pins = {}
    for line in (root / ".ci" / "floors.txt").read_text().splitlines():
        if match := re.fullmatch(r"([A-Za-z0-9_.\-]+)(?:\[[^]]*\])?==([0-9.]+)(?:\.\*)?", line.strip()):
            pins[match.group(1).lower()] = match.group(2)
    for name, floor in floors.items():
        assert name in pins, f"{name}>={floor} is declared but the floors job does not install it"
        pinned = [int(p) for p in pins[name].split(".")]
        wanted = [int(p) for p in floor.split(".")]
        assert pinned[: len(wanted)] == wanted, (
            f"{name}: declared >={floor}, the floors job installs {pins[name]}"
        )


def _project() -> dict:
    from pathlib import Path

    import tomllib

    return tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())


def test_the_python_classifiers_claim_only_the_version_ci_checks():
    """CI runs one Python (3.11; its wheel check fails when the classifiers name another), and mypy checks for it."""
    import re

    config = _project()
    versions = {
        c.rsplit(" :: ", 1)[1]
        for c in config["project"]["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    }
    assert versions == {config["tool"]["mypy"]["python_version"]}
    floor = re.fullmatch(r">=3\.(\d+)", config["project"]["requires-python"]).group(1)
    assert all(int(v.split(".")[1]) >= int(floor) for v in versions)


def test_the_sdist_ships_what_the_readme_links_to_and_the_tests_read():
    """The README is the long description: its relative links and pictures resolve inside the sdist (MANIFEST.in)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    assert _project()["project"]["readme"] == "README.md"
    shipped = {"README.md", "LICENSE", "pyproject.toml"}  # setuptools ships these without MANIFEST.in
    grafted = set()
    for line in (root / "MANIFEST.in").read_text().splitlines():
        command, *paths = line.split()
        if command == "include":
            shipped.update(paths)
        elif command == "graft":
            grafted.update(paths)
    assert {"tests", "docs", "examples", ".ci", "tools", "benchmarks"} <= grafted
    for target in re.findall(r"\]\(([^)\s]+)\)", (root / "README.md").read_text(encoding="utf-8")):
        path = target.partition("#")[0]
        if not path or target.startswith(("http://", "https://", "mailto:")):
            continue
        assert path in shipped or path.split("/")[0] in grafted, (
            f"README.md links to {path}, not in the sdist"
        )
