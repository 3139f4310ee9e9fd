"""MemoryMonitor's leak warning on a real GPU (`pytest -m gpu`): a loss kept with its graph, and one detached."""

from __future__ import annotations

import pytest

from lightning_gpumem import MemoryMonitor
from tests.helpers.models import CudaMLP, free_cuda_memory
from tests.helpers.trainer import quiet_trainer

pytestmark = pytest.mark.gpu


def test_a_loss_kept_with_its_graph_is_flagged_within_50_steps():
    free_cuda_memory()
    monitor = MemoryMonitor(summary=False)
    with pytest.warns(UserWarning, match=r"allocated memory keeps growing") as record:
        quiet_trainer(
            accelerator="gpu",
            devices=1,
            max_steps=60,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            callbacks=[monitor],
        ).fit(CudaMLP(keep="graph", batch_size=512))
    assert monitor.leak is not None
    assert monitor.leak.last_step <= 50
    message = next(str(w.message) for w in record if "keeps growing" in str(w.message))
    assert "float32[512, 1024]" in message  # the activations the kept graphs hold, found by the gc scan
    print(f"\n{message}")
    free_cuda_memory()


def test_the_same_module_with_detach_is_not_flagged_over_300_steps():
    free_cuda_memory()
    monitor = MemoryMonitor(summary=False)
    quiet_trainer(
        accelerator="gpu",
        devices=1,
        max_steps=300,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[monitor],
    ).fit(CudaMLP(keep="detached", batch_size=512))
    assert monitor.leak is None
