"""Variable-length data on a real GPU (`pytest -m gpu`): a token budget and a worst-case batch size, each tuned under
a 2 GiB cap, then a whole shuffled epoch under the same cap with no OOM; the planner's largest size, the same way."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_gpumem import BatchSizeTuner, MemoryPlanner, TokenBudgetSampler
from lightning_gpumem._core.units import GIB
from lightning_gpumem._hw.allocator import expandable_segments
from lightning_gpumem.tuning.lengths.longest import SHAPE_MARGIN, SHAPE_MARGIN_EXPANDABLE
from tests.helpers.trainer import quiet_trainer

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:`weights_only` was not set")]
BUDGET = 2 * GIB


def lengths(n: int = 3000, seed: int = 0) -> list[int]:
    """Mostly 16 to 128 tokens, and 1% of 1024."""
    rng = random.Random(seed)
    out = [rng.randint(16, 128) for _ in range(n)]
    for index in rng.sample(range(n), n // 100):
        out[index] = 1024
    return out


class Texts(Dataset):
    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        return {"input_ids": torch.randint(1, 4096, (self.lengths[index],), generator=generator)}


def pad(samples):
    return nn.utils.rnn.pad_sequence([s["input_ids"] for s in samples], batch_first=True)


class TextLM(LightningModule):
    """A 2-layer transformer LM whose activations grow with the padded tokens of a batch."""

    def __init__(self, tokens: bool, batch_size: int = 2, max_tokens: int = 2048) -> None:
        super().__init__()
        self.tokens, self.batch_size, self.max_tokens = tokens, batch_size, max_tokens
        self.lengths = lengths()
        self.embed = nn.Embedding(4096, 256)
        self.body = nn.TransformerEncoder(nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True), 2)
        self.head = nn.Linear(256, 4096)
        self.padded: list[int] = []

    def on_train_start(self):
        self.padded = []  # the fit's batches, not the trials'

    def training_step(self, batch, batch_idx):
        self.padded.append(batch.numel())
        logits = self.head(self.body(self.embed(batch[:, :-1]), is_causal=False))
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), ignore_index=0)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        if self.tokens:
            sampler = TokenBudgetSampler(self.lengths, max_tokens=self.max_tokens, seed=0)
            return DataLoader(Texts(self.lengths), batch_sampler=sampler, collate_fn=pad)
        return DataLoader(Texts(self.lengths), batch_size=self.batch_size, shuffle=True, collate_fn=pad)


class CapDuringFit(Callback):
    """Holds the real fit to the budget, so a budget or size that does not fit its worst batch runs out of memory."""

    def on_train_start(self, trainer, pl_module):
        torch.cuda.set_per_process_memory_fraction(BUDGET / torch.cuda.get_device_properties(0).total_memory)

    def on_train_end(self, trainer, pl_module):
        torch.cuda.set_per_process_memory_fraction(1.0)


@pytest.fixture(autouse=True)
def _clean():
    yield
    torch.cuda.set_per_process_memory_fraction(1.0)
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("tokens", [True, False], ids=["token_budget", "length_fn"])
def test_the_tuned_value_runs_a_whole_shuffled_epoch_under_the_budget(tokens):
    model = TextLM(tokens)
    if tokens:
        tuner = BatchSizeTuner(budget=BUDGET, batch_arg_name="max_tokens", include_validation=False)
    else:
        tuner = BatchSizeTuner(budget=BUDGET, length_fn="input_ids", include_validation=False)
    trainer = quiet_trainer(
        accelerator="gpu", devices=1, max_epochs=1, limit_val_batches=0, callbacks=[tuner, CapDuringFit()]
    )
    trainer.fit(model)  # an OOM in the epoch fails the test
    assert trainer.global_step == len(model.padded) > 0
    # shapes vary: the trials ran under the budget less the margin left for the allocator's fragmentation
    assert tuner.searched.margin == (SHAPE_MARGIN_EXPANDABLE if expandable_segments() else SHAPE_MARGIN)
    assert max(t.peak_bytes for t in tuner.trials if t.fits) <= (1 - tuner.searched.margin) * BUDGET
    if tokens:
        assert model.max_tokens == tuner.optimal_batch_size >= 2 * 1024  # the longest sample, twice at least
        assert max(model.padded) <= model.max_tokens  # every batch within the budget
        assert tuner.trials[0].batch_size == 1024  # the first budget tried holds the longest sample alone
    else:
        assert model.batch_size == tuner.optimal_batch_size >= 2
        assert any(t.fits is False for t in tuner.trials)  # the budget, not the dataset, bounded the search


def test_the_planners_largest_size_with_length_fn_runs_a_whole_shuffled_epoch_under_the_budget():
    # The planner's answer for the budget (its probes on the longest samples, the shape margin left free), set as the
    # run's batch size: the fit's epoch of shuffled, varying batches then runs under the budget with no OOM.
    planner = MemoryPlanner(budgets=[BUDGET], length_fn="input_ids", include_validation=False, stop=True)
    planning = quiet_trainer(
        accelerator="gpu", devices=1, max_epochs=1, limit_val_batches=0, callbacks=[planner]
    )
    planning.fit(TextLM(False))
    assert planner.plan is not None
    assert planner.plan.verdict == "settled"
    (prediction,) = planner.predictions
    assert prediction.validated
    assert prediction.largest is not None
    assert prediction.largest >= 2
    assert planner.plan.margin == (SHAPE_MARGIN_EXPANDABLE if expandable_segments() else SHAPE_MARGIN)
    model = TextLM(False, batch_size=prediction.largest)
    trainer = quiet_trainer(
        accelerator="gpu", devices=1, max_epochs=1, limit_val_batches=0, callbacks=[CapDuringFit()]
    )
    trainer.fit(model)  # an OOM in the epoch fails the test
    assert trainer.global_step == len(model.padded) > 0
    assert max(model.padded) >= 1024  # the epoch met the longest samples
