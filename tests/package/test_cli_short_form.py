"""LightningCLI finds the callbacks by their short name (`--trainer.callbacks+=MemoryMonitor`), as docs/monitor.md says.

jsonargparse resolves a short class name among the `Callback` subclasses defined so far; the package's exports are
lazy (PEP 562), so they are defined on `import lightning_gpumem` only where Lightning is imported already. A fresh
interpreter shows what a user's script sees (in this test session the callbacks are defined long before).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("jsonargparse")

SCRIPT = """
import os, sys

os.environ["JSONARGPARSE_DEPRECATION_WARNINGS"] = "off"
if sys.argv[1] == "before":
    import lightning_gpumem  # noqa: F401  (before Lightning: its callbacks stay undefined until first used)
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

if sys.argv[1] == "after":
    import lightning_gpumem  # noqa: F401  (after Lightning: this defines the callbacks)

TRAINER = [
    "fit", "--trainer.accelerator=cpu", "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
    "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={sys.argv[2]}",
]


def cli(*callbacks):
    return LightningCLI(BoringModel, BoringDataModule, save_config_callback=None, args=[*TRAINER, *callbacks])


def ours(cli):
    found = [c for c in cli.trainer.callbacks if type(c).__module__.startswith("lightning_gpumem")]
    return [type(c).__name__ for c in found], found


try:
    names, (monitor, release) = ours(cli(
        "--trainer.callbacks+=MemoryMonitor",
        "--trainer.callbacks.log_every_n_steps=1",
        "--trainer.callbacks+=EmptyCacheOnThreshold",
        "--trainer.callbacks.hooks=[train_batch_end]",
    ))
    print("short", names, monitor._log_every_n_steps, sorted(release.hooks))
except SystemExit:
    print("short refused")
names, _ = ours(cli("--trainer.callbacks+=lightning_gpumem.MemoryMonitor"))
print("full", names)
"""


def _run(order: str, tmp_path) -> list[str]:
    command = [sys.executable, "-c", SCRIPT, order, str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    if "short refused" in result.stdout:
        assert 'Parser key "trainer.callbacks"' in result.stderr, result.stderr[-3000:]
        assert "MemoryMonitor" in result.stderr.split('Parser key "trainer.callbacks"')[1], result.stderr[
            -3000:
        ]
    return [line for line in result.stdout.splitlines() if line.startswith(("short", "full"))]


def test_the_short_form_finds_the_callbacks_after_import_lightning_gpumem(tmp_path):
    assert _run("after", tmp_path) == [
        "short ['MemoryMonitor', 'EmptyCacheOnThreshold'] 1 ['train_batch_end']",
        "full ['MemoryMonitor']",
    ]


def test_imported_before_lightning_only_the_full_path_works(tmp_path):
    assert _run("before", tmp_path) == ["short refused", "full ['MemoryMonitor']"]
