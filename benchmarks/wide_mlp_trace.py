"""The GPU tests' WideMLP under a cap: the tuner's moves and trials, then the 5-step fit (an OOM caught, described).

On a GPU, from the repository root (results: ``benchmarks/results/wide-mlp-h100.log``)::

    PYTHONPATH=. python3 benchmarks/wide_mlp_trace.py BUDGET_GIB INIT_VAL HEADROOM [FRESH_SIZE]

With ``FRESH_SIZE``: no tuner, a plain 5-step fit at that size under the cap.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.getcwd())

import torch

from lightning_gpumem import BatchSizeTuner
from lightning_gpumem.tuning.search import policy
from tests.helpers.trainer import quiet_trainer
from tests.tuning.test_callback_gpu import CapDuringFit, Capture, WideMLP, _warm_up

GIB = 2**30


def traced_moves() -> None:
    """Print each move of the search with its bracket and reason."""
    chosen = policy.next_move

    def traced(bracket, evidence, tolerance):
        proposal = chosen(bracket, evidence, tolerance)
        print(f"  move lo={bracket.lo} hi={bracket.hi} -> {proposal}", flush=True)
        return proposal

    policy.next_move = traced


def fresh_fit(size: int, budget: int) -> None:
    _warm_up()
    trainer = quiet_trainer(
        accelerator="gpu", devices=1, max_steps=5, limit_val_batches=2, num_sanity_val_steps=0,
        callbacks=[CapDuringFit(budget)],
    )  # fmt: skip
    try:
        trainer.fit(WideMLP(batch_size=size))
        print("FRESH fit OK at", size, "max_reserved", torch.cuda.max_memory_reserved())
    except torch.OutOfMemoryError as error:
        print("FRESH fit OOM at", size, str(error)[:300])


def tuned_fit(budget: int, init_val: int, headroom: float) -> None:
    traced_moves()
    _warm_up()
    before, after = Capture(), Capture()
    tuner = BatchSizeTuner(budget=budget, init_val=init_val, headroom=headroom)
    trainer = quiet_trainer(
        accelerator="gpu", devices=1, max_steps=5, limit_val_batches=2, num_sanity_val_steps=0,
        callbacks=[before, tuner, after, CapDuringFit(budget)],
    )  # fmt: skip
    ok = True
    try:
        trainer.fit(WideMLP())
    except torch.OutOfMemoryError as error:
        ok = False
        stats = torch.cuda.memory_stats()
        print("FIT OOM:", str(error)[:400])
        print(
            "  alloc", stats["allocated_bytes.all.current"], "reserved", stats["reserved_bytes.all.current"]
        )
    for t in tuner.trials:
        print(
            f"  trial {t.batch_size:6d} fits={t.fits!s:5} res={t.peak_bytes} live={t.allocated_bytes}"
            f" train={t.train_peak_bytes} val={t.val_peak_bytes} retries={t.retries} {t.seconds:.2f}s"
        )
    print(
        "RESULT", tuner.optimal_batch_size, tuner.result.reason, "trials", len(tuner.trials), "ooms",
        tuner.result.num_ooms, "fit_ok", ok, "steps", trainer.global_step,
    )  # fmt: skip


def main() -> None:
    budget = int(float(sys.argv[1]) * GIB)
    init_val, headroom = int(sys.argv[2]), float(sys.argv[3])
    fresh = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    if fresh:
        fresh_fit(fresh, budget)
    else:
        tuned_fit(budget, init_val, headroom)


if __name__ == "__main__":
    main()
