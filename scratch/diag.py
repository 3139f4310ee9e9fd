"""Diagnostic: what the tuner leaves in the allocator (segments with live blocks) vs a fresh fit; where fits OOM."""

import sys, json, time
import torch
from lightning.pytorch import Callback, Trainer

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
from lightning_gpumem import BatchSizeTuner
from lightning_gpumem._units import GIB
from tests.gpu.test_tuner_gpu import WideMLP


def segs(tag):
    torch.cuda.synchronize()
    snap = torch.cuda.memory_snapshot()
    big = []
    for s in snap:
        active = [b["size"] for b in s["blocks"] if b["state"] == "active_allocated"]
        if s["total_size"] >= 2**21:
            big.append(
                (s["total_size"] >> 20, s["allocated_size"] >> 20, len(active), sorted(active, reverse=True)[:3])
            )
    big.sort(reverse=True)
    print(
        f"[{tag}] alloc={torch.cuda.memory_allocated() / 2**20:.0f}MiB reserved={torch.cuda.memory_reserved() / 2**20:.0f}MiB "
        f"segments(>=2MiB: total MiB, alloc MiB, nactive, top active bytes)={big[:12]} n={len(snap)}",
        flush=True,
    )


class Watch(Callback):
    def __init__(self, budget):
        self.budget = budget
        self.step = 0

    def on_fit_start(self, trainer, pl_module):
        segs("after tuner / fit start")

    def on_train_start(self, trainer, pl_module):
        torch.cuda.set_per_process_memory_fraction(self.budget / torch.cuda.get_device_properties(0).total_memory)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.step += 1
        s = torch.cuda.memory_stats()
        print(
            f"  step {self.step} bs={batch[0].shape[0]} peak_res={s['reserved_bytes.all.peak'] / 2**20:.0f} res={s['reserved_bytes.all.current'] / 2**20:.0f} inactive_split={s['inactive_split_bytes.all.current'] / 2**20:.0f}",
            flush=True,
        )
        if self.step <= 2:
            segs(f"after step {self.step}")

    def on_validation_end(self, trainer, pl_module):
        segs("after val")

    def on_exception(self, trainer, pl_module, exc):
        print("EXC at step", self.step + 1, repr(exc)[:200])
        segs("at OOM")


def run(bs=None, budget=2 * GIB):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = WideMLP(batch_size=bs or 2)
    cbs = [] if bs else [BatchSizeTuner(budget=budget)]
    w = Watch(budget)
    t = Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=5,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=cbs + [w],
    )
    try:
        t.fit(model)
        print("FIT OK", model.batch_size)
    except torch.OutOfMemoryError as e:
        print("FIT OOM", model.batch_size)
    if cbs:
        print(
            "trials",
            [
                (
                    x.batch_size,
                    x.fits,
                    x.peak_bytes and round(x.peak_bytes / 2**20),
                    x.allocated_bytes and round(x.allocated_bytes / 2**20),
                )
                for x in cbs[0].trials
            ],
        )
    torch.cuda.set_per_process_memory_fraction(1.0)
    return model.batch_size


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "tuned":
        run()
    else:
        run(bs=int(sys.argv[2]))
