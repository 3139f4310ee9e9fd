"""The package's floors: code imports only down them, no feature imports another, the pure parts load no torch.

Floors, bottom up: ``keys`` and ``_core/`` (stdlib only), ``_hw/`` (the hardware: torch, NVML), ``_pl/`` (Lightning
glue), then the features (``monitor/``, ``tuning/``, ``microbatch/``, the small callbacks, ``report/``), each its
own room. The package's front door (``__init__``, ``cli``, ``plan_command``, ``__main__``) may import any of
them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_gpumem"
FLOORS = {"keys": 0, "_core": 0, "_hw": 1, "_pl": 2}
FEATURE = 3
FRONT_DOOR = {"__init__", "cli", "__main__", "plan_command"}
CALLBACKS = ["monitor", "release", "budget", "snapshot", "layers", "tuning", "microbatch"]
# Loaded in a fresh interpreter, each leaves neither torch nor Lightning in `sys.modules`.
PURE = [
    "keys.py",
    "plan_command.py",
    *sorted(str(path.relative_to(PACKAGE)) for path in (PACKAGE / "_core").glob("*.py")),
    "monitor/peak_window.py",
    "monitor/metrics.py",
    *sorted(str(path.relative_to(PACKAGE)) for path in (PACKAGE / "tuning" / "search").glob("*.py")),
    "tuning/sources/allocator.py",
    "tuning/sources/affine.py",
    "tuning/sources/steps.py",
    *sorted(str(path.relative_to(PACKAGE)) for path in (PACKAGE / "report").glob("*.py")),
]
MODULES = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py"))


def _room(module: str) -> str:
    """``_core``, ``monitor``, ``release``...: the top-level folder or module a dotted name lives in."""
    return module.removeprefix("lightning_gpumem.").split(".")[0]


def _floor(room: str) -> int:
    return FLOORS.get(room, FEATURE)


def _imports(path: Path) -> set[str]:
    """The modules a file imports, dotted; ``from package import module`` names the module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                relative = Path(*candidate.split(".")[1:])
                is_module = (PACKAGE / relative).with_suffix(".py").exists() or (PACKAGE / relative).is_dir()
                found.add(
                    candidate if candidate.startswith("lightning_gpumem.") and is_module else node.module
                )
    return found


def _own(path: Path) -> set[str]:
    return {m for m in _imports(path) if m.startswith("lightning_gpumem.")}


@pytest.mark.parametrize("name", MODULES)
def test_code_imports_only_down_its_floors_and_not_from_another_feature(name):
    room = name.split("/")[0].removesuffix(".py")
    if room in FRONT_DOOR:
        return
    for imported in _own(PACKAGE / name):
        other = _room(imported)
        if other == room:
            continue
        assert _floor(other) < _floor(room), f"{name} imports {imported}: {other} is not below {room}"


def test_the_floors_are_the_ones_the_test_knows():
    # A new top-level folder or module is placed on a floor here, in CONTRIBUTING and docs/design.md.
    rooms = {path.name.removesuffix(".py") for path in PACKAGE.iterdir() if not path.name.startswith("__py")}
    rooms.discard("py.typed")
    assert rooms == set(FLOORS) | set(CALLBACKS) | FRONT_DOOR | {"report"}


@pytest.mark.parametrize("name", [m for m in MODULES if m.startswith("_hw/")])
def test_the_hardware_floor_knows_no_trainer(name):
    assert not {
        m for m in _imports(PACKAGE / name) if m.split(".")[0] == "pytorch_lightning" or "pytorch" in m
    }


@pytest.mark.parametrize("name", PURE)
def test_the_pure_parts_import_neither_lightning_nor_the_hardware(name):
    imported = _imports(PACKAGE / name)
    assert not {
        m for m in imported if m.split(".")[0] in ("lightning", "pytorch_lightning", "torch", "psutil")
    }


def test_the_pure_parts_load_neither_torch_nor_lightning_in_a_fresh_interpreter():
    # Direct imports are not enough: a pure module importing a module that imports torch loads torch all the same.
    modules = ["lightning_gpumem." + name.removesuffix(".py").replace("/", ".") for name in PURE]
    code = (
        "import importlib, sys\n"
        "heavy = ('torch', 'lightning', 'pytorch_lightning', 'psutil')\n"
        f"for module in {modules!r}:\n"
        "    importlib.import_module(module)\n"
        "    loaded = sorted(m for m in heavy if m in sys.modules)\n"
        "    assert not loaded, f'{module} loads {loaded}'\n"
        "print(len(sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_layering_rule_catches_an_import_up_the_floors(tmp_path):
    # The rule itself can fail: a core module importing the probe is reported.
    bad = tmp_path / "bad.py"
    bad.write_text("from lightning_gpumem._hw.probe import make_probe\n", encoding="utf-8")
    assert _own(bad) == {"lightning_gpumem._hw.probe"}
    assert _floor(_room("lightning_gpumem._hw.probe")) > _floor("_core")
