"""The package's layering: no callback imports another, the monitor stays thin, the report starts without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_gpumem"
CALLBACKS = {
    "lightning_gpumem.monitor": "monitor.py",
    "lightning_gpumem.release": "release.py",
    "lightning_gpumem.budget": "budget.py",
    "lightning_gpumem.snapshot": "snapshot.py",
    "lightning_gpumem.layers": "layers.py",
    "lightning_gpumem.tuning.tuner": "tuning/tuner.py",
    "lightning_gpumem.microbatch": "microbatch.py",
}
PURE = [
    "keys.py",
    "_sample.py",
    "_units.py",
    "_checks.py",
    "_files.py",
    "_patching.py",
    "_peak_window.py",
    "_sample_metrics.py",
    "_leaks.py",
    "_summary.py",
    "_snapshot_report.py",
    "tuning/search.py",
]


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


@pytest.mark.parametrize("module", sorted(CALLBACKS))
def test_no_callback_imports_another(module):
    others = set(CALLBACKS) - {module}
    assert not _imports(PACKAGE / CALLBACKS[module]) & others


@pytest.mark.parametrize("name", PURE)
def test_the_pure_parts_import_neither_lightning_nor_the_hardware(name):
    imported = _imports(PACKAGE / name)
    assert not {m for m in imported if m.split(".")[0] in ("lightning", "pytorch_lightning", "torch", "psutil")}


@pytest.mark.parametrize("name", PURE)
def test_a_pure_part_loads_neither_torch_nor_lightning_in_a_fresh_interpreter(name):
    # Direct imports are not enough: a pure module importing a module that imports torch loads torch all the same.
    module = "lightning_gpumem." + name.removesuffix(".py").replace("/", ".")
    heavy = "('torch', 'lightning', 'pytorch_lightning')"
    code = f"import sys, {module}; print(sorted(m for m in {heavy} if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]", f"{module} loads {loaded}"


def test_the_monitor_module_stays_thin():
    assert len((PACKAGE / "monitor.py").read_text(encoding="utf-8").splitlines()) <= 300
