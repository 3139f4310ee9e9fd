"""Trials under any sampler: a trial runs the batch size it claims, and "validated" means a trial ran that size.

Samplers that repeat samples (``WeightedRandomSampler(replacement=True)``, a list of indices with repeats) or draw a
part of the dataset bound the batch a loader can fill; with ``length_fn`` the longest-first order keeps each sample as
often as the sampler draws it.
"""

from __future__ import annotations

import random

import pytest
import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, IterableDataset, Sampler, WeightedRandomSampler

from lightning_gpumem import BatchSizeTuner, MemoryPlanner
from lightning_gpumem._core.units import GIB, MIB
from tests.helpers.tuning import CPU_SEARCH, CappedFakeProbe, Texts, pad, tuner_trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore:`weights_only` was not set"),
    pytest.mark.filterwarnings("ignore:BatchSizeTuner. stopped at the upper bound"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
]
N = 200


def lengths() -> list[int]:
    rng = random.Random(0)
    return [rng.randint(4, 32) for _ in range(N)]


def samplers() -> dict[str, object]:
    rng = random.Random(1)
    return {
        "weighted-replacement": WeightedRandomSampler([1.0] * N, num_samples=N, replacement=True),
        "indices-with-repeats": [rng.randrange(N // 4) for _ in range(N)],  # 200 draws of 50 samples
        "weighted-fewer-draws": WeightedRandomSampler([1.0] * N, num_samples=60, replacement=True),
    }


class TextModel(LightningModule):
    """Simulated OOM above ``limit`` padded tokens; with ``probe``, a fake allocator of ``per_token`` bytes a token."""

    def __init__(self, sampler: object, limit: int = 10**9, probe: CappedFakeProbe | None = None) -> None:
        super().__init__()
        self.sampler, self.limit, self.fake = sampler, limit, probe
        self.batch_size = 2
        self.layer = torch.nn.Embedding(2, 4)
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        self.sizes.append(batch.shape[0])
        if batch.numel() > self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        if self.fake is not None:
            need = batch.shape[0] * 10 * MIB
            if self.fake.allocated + need > self.fake.cap:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake allocator)")
            self.fake.spike(need)
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(Texts(lengths()), batch_size=self.batch_size, sampler=self.sampler, collate_fn=pad)


@pytest.mark.parametrize("name", list(samplers()))
def test_the_tuner_with_length_fn_runs_the_sizes_it_tries_under_any_sampler(name):
    # was: "`batch_size` does not set the training dataloader's batch size" (trials ran the distinct samples only)
    sampler = samplers()[name]
    model = TextModel(sampler, limit=24 * 32)
    tuner = BatchSizeTuner(length_fn="input_ids", max_val=CPU_SEARCH, include_validation=False)
    tuner_trainer(tuner, max_steps=1, limit_val_batches=0).fit(model)
    draws = len(sampler)  # type: ignore[arg-type]
    for trial in tuner.trials:  # every trial ran the size it claims (a full first batch)
        assert trial.samples == trial.batch_size, trial
        assert trial.batch_size <= draws
    assert tuner.optimal_batch_size is not None
    assert tuner.optimal_batch_size <= min(24, draws)


@pytest.mark.parametrize("name", list(samplers()))
def test_the_planner_validates_only_sizes_a_trial_ran(name):
    # was: a size marked validated that no trial ran (the trial's batch held the distinct samples only)
    sampler = samplers()[name]
    probe = CappedFakeProbe(base=GIB, total=24 * GIB)
    model = TextModel(sampler, probe=probe)
    planner = MemoryPlanner(length_fn="input_ids", budgets=["2GiB", "3GiB"], stop=True)
    planner.fake = probe  # type: ignore[attr-defined]
    tuner_trainer(planner).fit(model)
    draws = len(sampler)  # type: ignore[arg-type]
    assert planner.plan is not None
    assert max(p.size for p in planner.plan.probes) <= draws
    for prediction in planner.predictions:
        if prediction.validated:
            assert prediction.largest in model.sizes  # a trial's batch had exactly that many samples
            assert prediction.largest <= draws


# ---------------------------------------------------------------------- data that ends before a size: no length known
class EvenIndices(Sampler):
    """Draws 50 of 200 samples and has no length: nothing says how many an epoch draws until it ends."""

    def __iter__(self):
        return iter(range(0, 100, 2))


class Stream(IterableDataset):
    """A finite stream of 100 samples: no length either."""

    def __iter__(self):
        return iter(torch.ones(100, 32))


class Unsized(LightningModule):
    """10 MiB a sample on a fake allocator; its loader holds fewer samples than the searches would try."""

    def __init__(self, probe: CappedFakeProbe, data: str) -> None:
        super().__init__()
        self.fake, self.data, self.batch_size = probe, data, 2
        self.layer = torch.nn.Linear(32, 2)
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        self.sizes.append(batch.shape[0])
        self.fake.spike(batch.shape[0] * 10 * MIB)
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        if self.data == "stream":
            return DataLoader(Stream(), batch_size=self.batch_size)
        return DataLoader(torch.ones(200, 32), batch_size=self.batch_size, sampler=EvenIndices())


@pytest.mark.parametrize("data", ["stream", "sampler-without-length"])
def test_the_tuner_stops_where_the_data_ends_without_a_false_error(data):
    # was: "`batch_size` does not set the training dataloader's batch size" (two sizes past the data, one batch)
    probe = CappedFakeProbe(base=GIB, total=24 * GIB)
    model = Unsized(probe, data)
    tuner = BatchSizeTuner(max_val=10**6, include_validation=False)
    tuner.fake = probe  # type: ignore[attr-defined]
    tuner_trainer(tuner, max_steps=1, limit_val_batches=0).fit(model)
    held = 100 if data == "stream" else 50
    assert tuner.optimal_batch_size == held  # the largest batch the data can make
    assert all(t.samples == t.batch_size for t in tuner.trials if t.batch_size <= held)


@pytest.mark.parametrize("data", ["stream", "sampler-without-length"])
def test_the_planner_plans_up_to_where_the_data_ends(data):
    probe = CappedFakeProbe(base=GIB, total=24 * GIB)
    model = Unsized(probe, data)
    planner = MemoryPlanner(budgets=["24GiB", "1.5GiB"], stop=True)
    planner.fake = probe  # type: ignore[attr-defined]
    tuner_trainer(planner, limit_val_batches=0).fit(model)
    held = 100 if data == "stream" else 50
    assert planner.plan is not None
    assert planner.plan.verdict == "settled"
    assert max(p.size for p in planner.plan.probes) == held
    large, small = planner.predictions
    assert large.largest == held  # no batch is larger than the data
    assert large.validated
    assert small.largest == (int(1.5 * GIB) - 300 * MIB - GIB) // (10 * MIB)  # 20: under the budget
    assert small.validated
    assert small.largest in model.sizes


# ---------------------------------------------------------------------- found on review
class Words(LightningModule):
    """Batches of strings (`collate_fn=list`), tokenized in the step: no tensor to count a batch by."""

    def __init__(self, probe: CappedFakeProbe) -> None:
        super().__init__()
        self.fake, self.batch_size = probe, 2
        self.embedding = torch.nn.Embedding(64, 8)

    def training_step(self, batch, batch_idx):
        self.fake.spike(len(batch) * 50 * MIB)
        return self.embedding(torch.tensor([len(text) for text in batch])).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader([f"sample {i}" for i in range(500)], batch_size=self.batch_size, collate_fn=list)


@pytest.mark.parametrize("which", ["tuner", "planner"])
def test_batches_without_a_tensor_to_count_are_not_taken_for_data_that_ended(which):
    # was: samples=-1 read as "the data ended": "an empty batch" (tuner), batch_size=-1 (planner)
    probe = CappedFakeProbe(base=GIB, total=24 * GIB)
    callback = BatchSizeTuner(max_val=4096) if which == "tuner" else MemoryPlanner(stop=True)
    callback.fake = probe  # type: ignore[attr-defined]
    tuner_trainer(callback, max_steps=1, limit_val_batches=0).fit(Words(probe))
    if isinstance(callback, BatchSizeTuner):
        assert all(t.samples is None for t in callback.trials)  # not counted
        assert callback.optimal_batch_size is not None
        assert callback.optimal_batch_size > 400
    else:
        assert callback.plan is not None
        assert callback.plan.verdict == "settled"


class DropLastStream(Unsized):
    """The stream of 100 samples through a loader that drops a batch that is not full."""

    def train_dataloader(self):
        return DataLoader(Stream(), batch_size=self.batch_size, drop_last=True)


def test_a_trial_that_ran_no_batch_is_not_a_size_that_ran():
    # was: drop_last on a stream: sizes past the data ran no batch, were accepted, and the fit trained 0 steps
    probe = CappedFakeProbe(base=GIB, total=24 * GIB)
    tuner = BatchSizeTuner(max_val=4096, include_validation=False)
    tuner.fake = probe  # type: ignore[attr-defined]
    trainer = tuner_trainer(tuner, max_steps=1, limit_val_batches=0)
    trainer.fit(DropLastStream(probe, "stream"))
    assert trainer.global_step == 1
    assert tuner.optimal_batch_size is not None
    assert tuner.optimal_batch_size <= 100
    assert all(t.samples == 0 for t in tuner.trials if t.batch_size > 100)

    probe = CappedFakeProbe(base=GIB, total=24 * GIB)
    planner = MemoryPlanner(budgets=["24GiB"], stop=True)
    planner.fake = probe  # type: ignore[attr-defined]
    model = DropLastStream(probe, "stream")
    tuner_trainer(planner, limit_val_batches=0).fit(model)
    (prediction,) = planner.predictions
    assert prediction.largest is not None
    assert prediction.largest <= 100
    assert prediction.validated
    assert prediction.largest in model.sizes  # validated: a trial's batch held that many samples


def test_the_users_own_distributed_sampler_draws_one_ranks_share_already():
    # was: its length (already per rank) divided by the world size again: half the sizes under DDP
    from torch.utils.data import DistributedSampler

    from lightning_gpumem.tuning.trials.loaders import samples_per_rank

    data = torch.ones(100, 2)
    own = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    assert samples_per_rank(own, world_size=2) == 50
    assert (
        samples_per_rank(DataLoader(data, batch_size=2), world_size=2) == 50
    )  # Lightning's sampler splits it
    assert samples_per_rank(DataLoader(data, batch_size=2), world_size=1) == 100


class Endless(Sampler):
    """Draws without end and has no length."""

    def __iter__(self):
        while True:
            yield from range(0, 100, 2)


def test_length_fn_with_a_sampler_that_never_ends_leaves_it_and_says_so(recwarn):
    # was: the longest-first order counted the sampler's draws forever (the fit hung)
    lengths_ = lengths()

    class EndlessTexts(TextModel):
        def train_dataloader(self):
            return DataLoader(Texts(lengths_), batch_size=self.batch_size, sampler=Endless(), collate_fn=pad)

    tuner = BatchSizeTuner(length_fn="input_ids", max_val=64, include_validation=False)
    tuner_trainer(tuner, max_steps=3, limit_val_batches=0, limit_train_batches=5).fit(EndlessTexts(None))
    assert tuner.optimal_batch_size == 64
    assert any(
        "`length_fn` was not applied" in str(w.message) and "draws more than" in str(w.message)
        for w in recwarn
    )
