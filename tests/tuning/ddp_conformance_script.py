"""Run by test_conformance.py and test_ddp_cpu.py: BatchSizeTuner under DDP, 2 CPU processes (gloo), one pair.

In every fit rank 1 runs out of memory above batch size 24 and rank 0 only above 40, so rank 1 fails trials alone
and the tuner must agree on 24 on both ranks without leaving rank 0 waiting in a collective.

1. The agreement (`tuner_rank<N>.json`): both steps log with `sync_dist=True`, so the OOM rank's agreement
   collective must not pair with the other rank's logging all-reduce.
2. Conformance (`rank<N>.pt`): a tuned fit and the same fit with the size set by hand; the size chosen, the OOM
   trials, and what each fit left (`capture` of the test module), for the test to compare.
3. A token budget (`tokens_rank<N>.json`): a `TokenBudgetSampler` built in the module's hook, which Lightning
   re-creates with its `DistributedSampler` injected, and its `max_tokens` tuned; rank 1 runs out of memory above
   600 padded tokens. The budget chosen, the trials and the indices of every batch of the fit's epoch.
4. `length_fn` (`longest_rank<N>.json`): the same samples at a fixed batch size, the trials on the longest.
5. A length scan cut short on rank 1 alone (`partial_rank<N>.json`): the order each rank's trials drew from.

Usage: python ddp_conformance_script.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_gpumem import BatchSizeTuner, TokenBudgetSampler
from tests.helpers.fakes import close_process_group
from tests.helpers.trainer import quiet_trainer
from tests.helpers.tuning import CPU_SEARCH
from tests.tuning.test_conformance import SEED, Net, capture

INIT = 2


class RankNet(Net):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch.shape[0] > 24:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated on rank 1)")
        return super().training_step(batch, batch_idx)


class RankOOM(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 2
        self.data = RandomDataset(32, 4096)

    def training_step(self, batch, batch_idx):
        if batch.shape[0] > (24 if self.global_rank == 1 else 40):
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (simulated on rank {self.global_rank})")
        out = super().training_step(batch, batch_idx)
        self.log("train_loss", out["loss"], sync_dist=True)
        return out

    def validation_step(self, batch, batch_idx):
        out = super().validation_step(batch, batch_idx)
        self.log("val_loss", out["x"], sync_dist=True)
        return out

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


def agreement(out: Path) -> None:
    tuner = BatchSizeTuner(max_val=CPU_SEARCH)
    model = RankOOM()
    trainer = quiet_trainer(
        out / "agreement",
        devices=2,
        strategy=DDPStrategy(timeout=timedelta(seconds=60)),
        max_steps=3,
        limit_val_batches=1,
        callbacks=[tuner],
    )
    trainer.fit(model)
    result = {
        "rank": trainer.global_rank,
        "batch_size": model.batch_size,
        "trials": [[t.batch_size, t.fits] for t in tuner.trials],
        "global_step": trainer.global_step,
    }
    (out / f"tuner_rank{trainer.global_rank}.json").write_text(json.dumps(result))


class TokenNet(BoringModel):
    """Samples of 4 to 40 tokens (and two of 100); a batch is (padded tokens, indices)."""

    def __init__(self) -> None:
        super().__init__()
        self.lengths = [4 + (i * 7) % 37 for i in range(301)]
        self.lengths[17] = self.lengths[200] = 100
        self.max_tokens = 100
        self.indices: list[list[int]] = []
        self.padded: list[int] = []

    def on_train_start(self) -> None:
        self.indices, self.padded = [], []  # the fit's batches, not the trials'

    def training_step(self, batch, batch_idx):
        tokens, indices = batch
        if self.global_rank == 1 and tokens.numel() > 600:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated on rank 1)")
        self.indices.append(indices.tolist())
        self.padded.append(tokens.numel())
        return super().training_step(torch.ones(len(indices), 32), batch_idx)

    def train_dataloader(self):
        sampler = TokenBudgetSampler(self.lengths, max_tokens=self.max_tokens, seed=3)
        return DataLoader(range(len(self.lengths)), batch_sampler=sampler, collate_fn=self.collate)

    def collate(self, indices: list[int]):
        return torch.zeros(len(indices), max(self.lengths[i] for i in indices)), torch.tensor(indices)


class LongestNet(TokenNet):
    """A fixed batch size over the same samples; rank 1 runs out of memory above 600 padded tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 2

    def train_dataloader(self):
        return DataLoader(
            range(len(self.lengths)), batch_size=self.batch_size, shuffle=True, collate_fn=self.collate
        )


def longest(out: Path) -> None:
    """`length_fn` under DDP: the training loader's longest-first order is not reshuffled by Lightning's sampler."""
    model = LongestNet()
    tuner = BatchSizeTuner(
        max_val=CPU_SEARCH, length_fn=lambda i: model.lengths[i], include_validation=False
    )
    trainer = quiet_trainer(
        out / "longest", devices=2, strategy="ddp", max_epochs=1, limit_val_batches=0, callbacks=[tuner]
    )
    trainer.fit(model)  # a batch holding a 100-token sample on rank 1 above 6 samples ends the fit
    result = {"batch_size": model.batch_size, "padded": model.padded}
    (out / f"longest_rank{trainer.global_rank}.json").write_text(json.dumps(result))


def partial(out: Path) -> None:
    """Rank 1's length scan stops after its first 64 samples (its time limit), rank 0's scans them all."""
    from lightning_gpumem.tuning.lengths import longest as module

    scan = module.scan_lengths

    def cut_on_rank1(dataset, length_fn):
        rank = torch.distributed.get_rank()
        return scan(dataset, length_fn, max_seconds=0.0 if rank == 1 else 60.0)

    module.scan_lengths = cut_on_rank1  # type: ignore[assignment]
    try:
        model = LongestNet()
        tuner = BatchSizeTuner(length_fn=lambda i: model.lengths[i], include_validation=False, max_val=8)
        trainer = quiet_trainer(
            out / "partial", devices=2, strategy="ddp", max_steps=1, limit_val_batches=0, callbacks=[tuner]
        )
        trainer.fit(model)
    finally:
        module.scan_lengths = scan  # type: ignore[assignment]
    full = scan(range(301), lambda i: model.lengths[i]).order
    result = {"orders": list(tuner.searched.longest._orders.values()), "full": full}
    (out / f"partial_rank{trainer.global_rank}.json").write_text(json.dumps(result))


def tokens(out: Path) -> None:
    tuner = BatchSizeTuner(max_val=CPU_SEARCH, batch_arg_name="max_tokens", include_validation=False)
    model = TokenNet()
    trainer = quiet_trainer(
        out / "tokens", devices=2, strategy="ddp", max_epochs=1, limit_val_batches=0, callbacks=[tuner]
    )
    trainer.fit(model)
    result = {
        "max_tokens": model.max_tokens,
        "trials": [[t.batch_size, t.fits] for t in tuner.trials],
        "indices": model.indices,
        "padded": model.padded,
        "samples": len(model.lengths),
    }
    (out / f"tokens_rank{trainer.global_rank}.json").write_text(json.dumps(result))


def fit(root: Path, batch_size: int, tuner: BatchSizeTuner | None) -> tuple[Trainer, dict]:
    seed_everything(SEED)
    model = RankNet(batch_size=batch_size, train_limit=40, n=128)
    trainer = quiet_trainer(
        root,
        devices=2,
        strategy="ddp",
        max_epochs=2,
        max_steps=5,
        log_every_n_steps=1,
        logger=CSVLogger(root / "logs", name="fit1", version=0),
        callbacks=[*([tuner] if tuner else []), ModelCheckpoint(dirpath=root / "ckpt")],
        enable_checkpointing=True,
    )
    trainer.fit(model)
    return trainer, capture(trainer, root)


def main(out_dir: str) -> None:
    out = Path(out_dir)
    agreement(out)
    tokens(out)
    longest(out)
    partial(out)
    tuner = BatchSizeTuner(max_val=CPU_SEARCH)
    trainer, tuned = fit(out / "tuned", INIT, tuner)
    _, by_hand = fit(out / "by_hand", tuner.optimal_batch_size, None)
    result = {
        "init": INIT,
        "chosen": tuner.optimal_batch_size,
        "ooms": sum(not t.fits for t in tuner.trials),
        "tuned": tuned,
        "by_hand": by_hand,
    }
    torch.save(result, out / f"rank{trainer.global_rank}.pt")
    close_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
