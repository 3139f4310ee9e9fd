"""Write the key tables of the docs from ``lightning_gpumem.keys``: ``python tools/key_tables.py [--check]``.

A table sits between ``<!-- keys: <Writer> -->`` and ``<!-- /keys -->`` in a page under ``docs/``; its rows
are the keys that ``<Writer>`` (a callback's class name) logs. ``--check`` writes nothing and exits 1 when a
table differs (``tests/package/test_keys.py`` runs the same check).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_gpumem import keys

DOCS = Path(__file__).resolve().parents[1] / "docs"
BLOCK = re.compile(r"(<!-- keys: (\w+) -->\n)(.*?)(<!-- /keys -->)", re.DOTALL)


def render(text: str) -> str:
    """``text`` with every key table regenerated."""
    return BLOCK.sub(lambda m: f"{m.group(1)}{keys.markdown_table(m.group(2))}\n{m.group(4)}", text)


def tables(text: str) -> list[str]:
    """The writers whose tables ``text`` holds."""
    return [m.group(2) for m in BLOCK.finditer(text)]


def main(check: bool) -> int:
    """Regenerate the tables (or with ``check`` only compare them); the exit status."""
    stale = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        fresh = render(text)
        if fresh != text:
            stale.append(page.name)
            if not check:
                page.write_text(fresh, encoding="utf-8")
    if stale:
        print(("stale: " if check else "rewrote: ") + ", ".join(stale))
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main("--check" in sys.argv[1:]))
