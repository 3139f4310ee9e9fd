"""Private attributes of foreign objects are touched only in the modules CONTRIBUTING lists, each guarded.

A scan of the package's syntax trees finds every private name it reaches on an object that is not its own
(``x._name`` with ``x`` not ``self``/``cls``, ``getattr(x, "_name")``, ``from torch... import _name``, a private
module's path, ``from torch._x import ...``, and private names spelt as strings, as patching and state tables do). Each must be listed for its module in CONTRIBUTING's
"Private access" table, and each listed name must appear in ``test_lightning_internals.py``, the test that fails
loudly when a Lightning or torch upgrade removes it.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_gpumem"
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
INTERNALS_TEST = ROOT / "tests" / "pl" / "test_lightning_internals.py"
# namedtuple's documented API, and `os._exit` (a forked child's documented way out), public despite the underscore
PUBLIC_UNDERSCORED = {"_fields", "_replace", "_asdict", "_make", "_exit"}
_IDENTIFIER = re.compile(r"_[A-Za-z][A-Za-z0-9_]*")


def _is_private(name: str) -> bool:
    return bool(_IDENTIFIER.fullmatch(name)) and not name.endswith("__") and name not in PUBLIC_UNDERSCORED


def _own(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def private_names(source: str) -> set[str]:
    """The private names a module reaches on objects that are not its own."""
    found: set[str] = set()
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and not _own(node.value):
            found.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if not node.module.startswith("lightning_gpumem"):
                found |= {alias.name for alias in node.names if _is_private(alias.name)}
                found |= {part for part in node.module.split(".") if _is_private(part)}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if not alias.name.startswith("lightning_gpumem"):
                    found |= {part for part in alias.name.split(".") if _is_private(part)}
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _ATTRIBUTE_CALLS
        ):
            if node.args and _own(node.args[0]):
                continue
            found |= {
                a.value for a in node.args[1:2] if isinstance(a, ast.Constant) and _is_private(str(a.value))
            }
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_private(node.value):  # noqa: SIM102
            if not _is_text(node, parents) and not _names_own_attribute(node, parents):
                found.add(
                    node.value
                )  # a private name as data: a patch target, a table of attributes to save
    return found


_ATTRIBUTE_CALLS = {"getattr", "setattr", "hasattr", "delattr"}
_TEXT_METHODS = {
    "startswith",
    "endswith",
    "removeprefix",
    "removesuffix",
    "split",
    "join",
    "replace",
    "format",
}


def _names_own_attribute(node: ast.Constant, parents: dict[ast.AST, ast.AST]) -> bool:
    """``getattr(self, "_name")`` and its kin: the object's own attribute."""
    parent = parents.get(node)
    return (
        isinstance(parent, ast.Call)
        and isinstance(parent.func, ast.Name)
        and parent.func.id in _ATTRIBUTE_CALLS
        and bool(parent.args)
        and _own(parent.args[0])
    )


def _is_text(node: ast.Constant, parents: dict[ast.AST, ast.AST]) -> bool:
    """A piece of text (an f-string part, a suffix compared or matched), not an attribute's name."""
    parent = parents.get(node)
    if isinstance(parent, (ast.JoinedStr, ast.Compare, ast.BinOp)):
        return True
    return (
        isinstance(parent, ast.Call)
        and isinstance(parent.func, ast.Attribute)
        and parent.func.attr in _TEXT_METHODS
    )


def _used() -> dict[str, set[str]]:
    used = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        names = private_names(path.read_text(encoding="utf-8"))
        if names:
            used[str(path.relative_to(PACKAGE))] = names
    return used


def _listed() -> dict[str, set[str]]:
    text = CONTRIBUTING.read_text(encoding="utf-8")
    section = text.split("<!-- private-access:start -->")[1].split("<!-- private-access:end -->")[0]
    listed: dict[str, set[str]] = defaultdict(set)
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        module = re.fullmatch(r"`([\w/]+\.py)`", cells[0]) if len(cells) == 3 else None
        if module:
            listed[module[1]] |= set(re.findall(r"`(_\w+)`", cells[1]))
    return dict(listed)


USED = _used()


@pytest.mark.parametrize("module", sorted(USED))
def test_a_module_reaches_only_the_private_names_contributing_lists_for_it(module):
    missing = USED[module] - _listed().get(module, set())
    assert not missing, (
        f"{module} uses {sorted(missing)}: not listed for it under 'Private access' in CONTRIBUTING"
    )


def test_contributing_lists_no_private_access_that_is_gone():
    listed = _listed()
    stale = {module: names - USED.get(module, set()) for module, names in listed.items()}
    assert not {module: names for module, names in stale.items() if names}


def test_every_listed_private_name_is_guarded_by_the_internals_test():
    guarded = INTERNALS_TEST.read_text(encoding="utf-8")
    unguarded = {name for names in _listed().values() for name in names if name not in guarded}
    assert not unguarded, f"{sorted(unguarded)}: add a check to {INTERNALS_TEST.name}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("trainer._logger_connector", {"_logger_connector"}),
        ("self._own", set()),
        ("getattr(loop, '_results', None)", {"_results"}),
        ("getattr(self, '_own', None)", set()),
        (
            "from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter",
            {"_MultiProcessingDataLoaderIter"},
        ),
        ("from lightning_gpumem._core.units import GIB", set()),
        ("from torch._subclasses.fake_tensor import FakeTensorMode", {"_subclasses"}),
        ("import torch._dynamo", {"_dynamo"}),
        ("patch(loop, '_on_before_zero_grad', f)", {"_on_before_zero_grad"}),
        ("point._fields; obj.__class__", set()),
        ("NAMES = ('_update_count', '_computed')", {"_update_count", "_computed"}),
        ("f'{name}_max'; suffix == '_rank'; key.startswith('_rank')", set()),
    ],
)
def test_the_scan_finds_private_access_on_foreign_objects(source, expected):
    assert private_names(source) == expected
