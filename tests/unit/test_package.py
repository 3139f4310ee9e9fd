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
