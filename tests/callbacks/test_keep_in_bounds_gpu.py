"""EmptyCacheOnThreshold and MemoryBudget on a real GPU (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback

from lightning_gpumem import EmptyCacheOnThreshold, MemoryBudget, MemoryProbe
from lightning_gpumem._core.units import GIB, MIB
from tests.helpers.models import CudaMLP, free_cuda_memory
from tests.helpers.trainer import quiet_trainer

pytestmark = pytest.mark.gpu


class Reading(Callback):
    """Reserved and NVML process memory at validation end (placed before and after the release callback)."""

    def __init__(self) -> None:
        self.probe = MemoryProbe(torch.device("cuda", torch.cuda.current_device()), nvml=True, host=False)
        self.reserved: list[int] = []
        self.nvml: list[int | None] = []

    def on_validation_end(self, trainer, pl_module):
        torch.cuda.synchronize()
        sample = self.probe.read(nvml=True, host=False)
        self.reserved.append(sample.reserved_bytes)
        self.nvml.append(sample.nvml_process_bytes)


def test_a_validation_spike_of_several_gib_is_given_back_to_the_device():
    free_cuda_memory()
    before, after = Reading(), Reading()
    release = EmptyCacheOnThreshold(threshold=0.25)  # of an 8 GiB budget: 2 GiB
    trainer = quiet_trainer(
        accelerator="gpu",
        devices=1,
        max_steps=8,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        callbacks=[MemoryBudget("8GiB"), before, release, after],
        val_check_interval=4,
    )
    trainer.fit(CudaMLP(val_spike=4 * GIB))
    assert release.releases == 2  # once per validation (steps 4 and 8), not on the training steps
    assert release.released_bytes >= 2 * 4 * GIB
    for held, freed in zip(before.reserved, after.reserved, strict=True):
        assert held - freed >= 4 * GIB  # the allocator's reserved memory dropped by the spike
    if before.nvml[0] is not None:  # NVML sees this process: what nvidia-smi shows dropped too
        for held, freed in zip(before.nvml, after.nvml, strict=True):
            assert held - freed >= 4 * GIB - 64 * MIB
    ms = release.release_seconds * 1e3
    print(
        f"\nreleased {release.released_bytes / GIB:.2f} GiB in {ms:.1f} ms; NVML {before.nvml} -> {after.nvml}"
    )


def test_memory_budget_caps_the_process_until_teardown():
    free_cuda_memory()
    outcomes: dict[str, object] = {}

    class TryAllocations(Callback):
        def on_train_start(self, trainer, pl_module):
            try:
                torch.empty(3 * GIB, dtype=torch.uint8, device="cuda")
                outcomes["3GiB"] = "ok"
            except torch.OutOfMemoryError:
                outcomes["3GiB"] = "oom"
            one = torch.empty(GIB, dtype=torch.uint8, device="cuda")
            one.fill_(1)
            outcomes["1GiB"] = "ok"
            del one

    budget = MemoryBudget("2GiB")
    quiet_trainer(
        accelerator="gpu",
        devices=1,
        max_steps=2,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        callbacks=[budget, TryAllocations()],
    ).fit(CudaMLP())
    assert outcomes == {"3GiB": "oom", "1GiB": "ok"}
    assert budget.budget_bytes == 2 * GIB
    big = torch.empty(3 * GIB, dtype=torch.uint8, device="cuda")  # the cap was undone at teardown
    del big
    free_cuda_memory()
