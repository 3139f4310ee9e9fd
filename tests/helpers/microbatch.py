"""The models of the AutoMicrobatch tests: simulated OOMs in the forward, the backward or the optimizer step.

`Net` is shared by the CPU tests (tests/microbatch/test_callback.py) and the DDP script beside them;
`watched_step` by the CPU and GPU tests of `UpdateWatch`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpumem.microbatch.split import UpdateWatch

STEPS = 30


def oom_error() -> torch.OutOfMemoryError:
    """The error torch raises when an allocation fails (simulated)."""
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")


class RaiseInBackward(torch.autograd.Function):
    """Identity whose backward runs out of memory when asked to."""

    @staticmethod
    def forward(ctx, x, fail):
        ctx.fail = fail
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.fail:
            raise oom_error()
        return grad, None


class FlakySGD(torch.optim.SGD):
    """SGD whose step runs out of memory, before changing anything, at the steps listed (once each)."""

    def __init__(self, params, fail_at, **kwargs):
        super().__init__(params, **kwargs)
        self.fail_at, self.calls = set(fail_at), 0

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.calls += 1
        if self.calls - 1 in self.fail_at:
            self.fail_at.discard(self.calls - 1)
            raise oom_error()
        super().step()
        return loss


class Net(LightningModule):
    """Regression; a (micro)batch larger than ``limit`` runs out of memory at ``where`` in the ``pressure`` batches."""

    def __init__(self, limit=None, where="forward", pressure=(), optimizer_fails=(), batch_size=16):
        super().__init__()
        self.layer = nn.Linear(8, 4)
        self.head = nn.Linear(4, 1)
        self.limit, self.where, self.pressure = limit, where, set(pressure)
        self.optimizer_fails = optimizer_fails
        self.batch_size = batch_size
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.sizes.append(len(x))
        too_big = self.limit is not None and batch_idx in self.pressure and len(x) > self.limit
        if self.where == "forward" and too_big:
            raise oom_error()
        hidden = RaiseInBackward.apply(torch.tanh(self.layer(x)), self.where == "backward" and too_big)
        loss = F.mse_loss(self.head(hidden).squeeze(-1), y)
        self.log("train_loss", loss)
        self.log("samples", float(len(x)), reduce_fx="sum", on_step=True)
        self.log("epoch_loss", loss, on_step=False, on_epoch=True)  # each batch counted once, by its size
        return loss

    def configure_optimizers(self):
        optimizer = FlakySGD(self.parameters(), self.optimizer_fails, lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 7, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(
            torch.randn(self.batch_size * STEPS, 8, generator=generator),
            torch.randn(self.batch_size * STEPS, generator=generator),
        )
        return DataLoader(data, batch_size=self.batch_size)


def watched_step(optimizer_class, device="cpu", frozen_first=False, **kwargs):
    """Whether UpdateWatch calls a step of ``optimizer_class`` changed (first step: state created in it)."""
    params = [
        torch.nn.Parameter(torch.randn(4, 3, device=device)),
        torch.nn.Parameter(torch.randn(3, device=device)),
    ]
    optimizer = optimizer_class(params, lr=0.1, **kwargs)
    watch = UpdateWatch()
    results = []
    for _ in range(2):
        for param in (
            params[1:] if frozen_first else params
        ):  # a parameter without a gradient is skipped by the step
            param.grad = torch.ones_like(param)
        watch.start()
        watch.note(optimizer)  # as `on_before_optimizer_step` does
        results.append(watch.changed())  # no update yet
        optimizer.step()
        results.append(watch.changed())
    return results
