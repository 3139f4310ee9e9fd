"""MemoryMonitor is configurable from LightningCLI YAML."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
pytestmark = [
    pytest.mark.filterwarnings("ignore:LightningCLI's args parameter"),
    pytest.mark.filterwarnings("ignore:No seed found"),
]
pytest.importorskip("jsonargparse")

from lightning.pytorch.cli import LightningCLI  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel  # noqa: E402

from lightning_gpumem import MemoryMonitor  # noqa: E402

CONFIG = """
trainer:
  accelerator: cpu
  max_steps: 4
  limit_val_batches: 0
  enable_progress_bar: false
  enable_checkpointing: false
  default_root_dir: {root}
  callbacks:
    - class_path: lightning_gpumem.MemoryMonitor
      init_args:
        log_every_n_steps: {every}
        verbose: true
"""


def test_monitor_from_yaml(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(root=tmp_path, every=2))
    cli = LightningCLI(BoringModel, BoringDataModule, args=["fit", "--config", str(config)])
    (monitor,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, MemoryMonitor)]
    assert monitor._log_every_n_steps == 2
    assert monitor._verbose is True
    assert cli.trainer.global_step == 4


def test_invalid_yaml_value_is_rejected(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(root=tmp_path, every="often"))
    with pytest.raises(SystemExit):
        LightningCLI(BoringModel, BoringDataModule, args=["fit", "--config", str(config)])
