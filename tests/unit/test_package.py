"""The package as users meet it: a lazy top level, the CLI without torch, its version and its metadata."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

import lightning_gpumem
from lightning_gpumem.cli import main


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


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
        assert pinned[: len(wanted)] == wanted, f"{name}: declared >={floor}, the floors job installs {pins[name]}"
