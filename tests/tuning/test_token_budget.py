"""TokenBudgetSampler: its plan per epoch and rank, a budget changed between epochs, heaviest-first trials, Lightning's
injection of a DistributedSampler (under DDP) and a real fit on the CPU."""

from __future__ import annotations

import math
import random
from collections import Counter
from unittest import mock

import numpy as np
import pytest
import torch
from lightning.fabric.utilities.data import _replace_dunder_methods, _set_sampler_epoch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, SequentialSampler

from lightning_gpumem._core import batching
from lightning_gpumem._core.batching import batch_cost, heaviest_first, plan_batches
from lightning_gpumem.tuning.lengths import token_budget
from lightning_gpumem.tuning.lengths.token_budget import TokenBudgetSampler
from tests.helpers.trainer import quiet_trainer


def skewed_lengths(n: int = 300, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    lengths = [rng.randint(2, 40) for _ in range(n)]
    for index in rng.sample(range(n), 5):
        lengths[index] = 200
    return lengths


class Texts(Dataset):
    """Sample ``i`` is ``(i, ones(lengths[i]))``."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        return index, torch.ones(self.lengths[index])


def pad(samples: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    indices = torch.tensor([i for i, _ in samples])
    return indices, torch.nn.utils.rnn.pad_sequence([x for _, x in samples], batch_first=True)


def _flat(batches) -> list[int]:
    return [i for batch in batches for i in batch]


# ---------------------------------------------------------------------- the plan
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"shuffle": False},
        {"cost": "tokens", "quadratic": 0.005},
        {"max_samples": 4},
        {"num_replicas": 3, "rank": 2},
        {"num_replicas": 2, "rank": 0, "drop_last": True},
    ],
)
def test_len_matches_the_batches_iterated_and_each_batch_is_within_the_budget(kwargs):
    lengths = skewed_lengths()
    sampler = TokenBudgetSampler(lengths, max_tokens=400, **kwargs)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(sampler) == len(batches) > 0
        cost, quadratic = sampler.cost, sampler.quadratic
        assert all(
            batch_cost([lengths[i] for i in b], cost=cost, quadratic=quadratic) <= 400 for b in batches
        )
        assert max(len(b) for b in batches) <= kwargs.get("max_samples", len(lengths))
    if "num_replicas" not in kwargs:
        assert sorted(_flat(batches)) == list(range(len(lengths)))  # every sample once


def test_the_epoch_set_on_the_inner_sampler_changes_the_order():
    # Lightning calls `set_epoch` on `dataloader.batch_sampler.sampler`, not on the batch sampler.
    sampler = TokenBudgetSampler(skewed_lengths(), max_tokens=400, seed=1)
    first = list(sampler)
    assert list(sampler) == first  # the same epoch: the same batches
    sampler.sampler.set_epoch(1)
    assert sampler.epoch == 1
    second = list(sampler)
    assert second != first
    assert sorted(_flat(second)) == sorted(_flat(first))
    sampler.set_epoch(0)  # the batch sampler's own `set_epoch` reaches the same place
    assert sampler.sampler.epoch == 0
    assert list(sampler) == first
    assert first == plan_batches(sampler.lengths, 400, seed=1, epoch=0)
    _set_sampler_epoch(DataLoader(Texts(skewed_lengths()), batch_sampler=sampler), 7)  # as Lightning does it
    assert sampler.epoch == 7


def test_unshuffled_batches_are_the_same_every_epoch():
    sampler = TokenBudgetSampler(skewed_lengths(), max_tokens=400, shuffle=False)
    first = list(sampler)
    sampler.set_epoch(3)
    assert list(sampler) == first


def test_heaviest_first_yields_this_ranks_batches_heaviest_first_until_reset():
    lengths = skewed_lengths()
    sampler = TokenBudgetSampler(lengths, max_tokens=400, num_replicas=2, rank=1, quadratic=0.001)
    usual = list(sampler)
    sampler.heaviest_first = True
    heavy = list(sampler)
    assert heavy == heaviest_first(usual, lengths, cost="padded", quadratic=0.001)
    assert len(heavy) == len(sampler)
    assert sorted(heavy) == sorted(usual)
    cost = lambda b: batch_cost([lengths[i] for i in b], quadratic=0.001)  # noqa: E731
    assert (
        cost(heavy[0]) == max(cost(b) for b in usual) <= sampler.worst_cost()
    )  # the worst may be the other rank's
    sampler.heaviest_first = False
    assert list(sampler) == usual


def test_a_new_max_tokens_replans_and_an_unchanged_one_is_planned_once():
    lengths = skewed_lengths()
    sampler = TokenBudgetSampler(lengths, max_tokens=400)
    with mock.patch.object(batching, "plan_batches", side_effect=plan_batches) as spy:
        small = len(sampler)
        assert len(sampler) == small
        assert len(list(sampler)) == small
        assert spy.call_count == 1  # `len()` and `iter()` share one plan
        sampler.max_tokens = 1600
        large = list(sampler)
        assert spy.call_count == 2
    assert len(large) == len(sampler) < small
    assert max(batch_cost([lengths[i] for i in b]) for b in large) > 400
    assert sampler.worst_cost() <= 1600
    with mock.patch.object(batching, "plan_batches", side_effect=plan_batches) as spy:
        at_800 = sampler.padding_fraction(800)  # another budget, asked about: this epoch's plan is kept
        assert sampler.worst_cost(800) <= 800
        assert len(sampler) == len(large)
        assert spy.call_count == 1
    assert at_800 == TokenBudgetSampler(lengths, max_tokens=800).padding_fraction()
    with pytest.raises(ValueError, match=r"max_tokens=150\).*costs 200"):
        sampler.padding_fraction(150)
    sampler.max_tokens = 100  # below the longest sample alone: refused when planned
    with pytest.raises(ValueError, match=r"max_tokens=100\).*costs 200.*integer >= 200 \(`min_tokens`"):
        len(sampler)


def test_two_ranks_share_one_global_plan_with_as_many_batches_each():
    lengths = skewed_lengths(301)
    ranks = [TokenBudgetSampler(lengths, max_tokens=300, seed=4, num_replicas=2, rank=r) for r in (0, 1)]
    for epoch in (0, 1):
        for sampler in ranks:
            sampler.set_epoch(epoch)
        assert ranks[0].plan() == ranks[1].plan()
        shares = [list(sampler) for sampler in ranks]
        assert len(shares[0]) == len(shares[1]) == len(ranks[0])
        plan = ranks[0].plan()
        assert shares == [plan[0::2], plan[1::2]]
        seen = Counter(_flat(shares[0] + shares[1]))
        assert set(seen) == set(range(len(lengths)))
        alone = plan_batches(lengths, 300, seed=4, epoch=epoch)
        assert sum(seen.values()) == len(lengths) + (len(alone) % 2) * len(
            alone[0]
        )  # the first batch, repeated


def test_the_ranks_come_from_torch_distributed_when_not_given():
    sampler = TokenBudgetSampler(skewed_lengths(), max_tokens=400)
    assert (sampler.num_replicas, sampler.rank) == (1, 0)
    with mock.patch.object(token_budget, "_world", return_value=(4, 3)):
        assert (sampler.num_replicas, sampler.rank) == (
            4,
            3,
        )  # read when planned: it may be built before DDP starts
        assert list(sampler) == sampler.plan()[3::4]
    given = TokenBudgetSampler(skewed_lengths(), max_tokens=400, num_replicas=2, rank=1)
    with mock.patch.object(token_budget, "_world", return_value=(4, 3)):
        assert (given.num_replicas, given.rank) == (2, 1)


def test_lengths_from_numpy_and_torch_and_the_summaries():
    lengths = skewed_lengths()
    for given in (np.array(lengths), torch.tensor(lengths), np.array(lengths, dtype=float), tuple(lengths)):
        sampler = TokenBudgetSampler(given, max_tokens=400, seed=2)
        assert sampler.lengths == lengths
        assert all(type(n) is int for n in sampler.lengths)
        assert list(sampler) == plan_batches(lengths, 400, seed=2)
    assert sampler.min_tokens == 200
    assert TokenBudgetSampler([3, 5], max_tokens=100, quadratic=0.5).min_tokens == 18  # 5 + 12.5, rounded up
    padded = sum(len(b) * max(lengths[i] for i in b) for b in sampler.plan())
    assert sampler.padding_fraction() == pytest.approx(1 - sum(lengths) / padded)
    assert sampler.worst_cost() == max(batch_cost([lengths[i] for i in b]) for b in sampler.plan())
    empty = TokenBudgetSampler([], max_tokens=10)
    assert (list(empty), len(empty), empty.min_tokens, empty.worst_cost(), empty.padding_fraction()) == (
        [],
        0,
        0,
        0,
        0,
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lengths": 7}, TypeError, r"lengths=7\)"),
        ({"lengths": [1, -1]}, ValueError, r"lengths\[1\] is -1"),
        ({"lengths": [1, 2.5]}, TypeError, r"lengths\[1\] is 2.5"),
        ({"lengths": [True, 2]}, TypeError, r"lengths\[0\] is True"),
        ({"lengths": np.ones((2, 2))}, TypeError, r"lengths\[0\] is \[1.0, 1.0\]"),
        ({"max_tokens": 0}, ValueError, r"max_tokens=0\)"),
        ({"max_tokens": 100.0}, ValueError, r"max_tokens=100.0\)"),
        ({"max_tokens": True}, ValueError, r"max_tokens=True\)"),
        ({"max_tokens": 30}, ValueError, r"max_tokens=30\).*sample 2 of length 40 alone costs 40"),
        ({"cost": "square"}, ValueError, r"cost='square'\)"),
        ({"quadratic": -1}, ValueError, r"quadratic=-1\)"),
        ({"quadratic": "0.1"}, ValueError, r"quadratic='0.1'\)"),
        ({"max_samples": 0}, ValueError, r"max_samples=0\)"),
        ({"shuffle": "yes"}, TypeError, r"shuffle='yes'\)"),
        ({"drop_last": 0}, TypeError, r"drop_last=0\)"),
        ({"seed": None}, ValueError, r"seed=None\)"),
        ({"num_replicas": 0}, ValueError, r"num_replicas=0\)"),
        ({"rank": -1}, ValueError, r"rank=-1\)"),
        ({"rank": 2, "num_replicas": 2}, ValueError, r"rank=2\).*< num_replicas=2"),
    ],
)
def test_a_bad_argument_is_named_with_its_value(kwargs, error, match):
    arguments = {"lengths": [10, 20, 40], "max_tokens": 100, **kwargs}
    with pytest.raises(error, match=rf"`TokenBudgetSampler\(.*{match}"):
        TokenBudgetSampler(**arguments)


def test_a_rank_beyond_the_world_and_a_bad_epoch_are_refused_when_planned():
    sampler = TokenBudgetSampler([10, 20], max_tokens=100, rank=1)
    with pytest.raises(ValueError, match=r"rank=1\).*< num_replicas=1"):
        len(sampler)
    with pytest.raises(ValueError, match=r"`TokenBudgetSampler.set_epoch\(epoch=-1\)`"):
        sampler.set_epoch(-1)


# ---------------------------------------------------------------------- hostile values (issue 41)
HUGE = 10**400


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"lengths": [10, HUGE]},
            ValueError,
            r"lengths=\.\.\.\).*lengths\[1\] is 1000.*up to 2\*\*53",
        ),  # OverflowError
        ({"lengths": [10, 2**64]}, ValueError, r"lengths\[1\] is 18446744073709551616.*up to 2\*\*53"),
        ({"lengths": [10, 2**53 + 1]}, ValueError, r"lengths\[1\] is 9007199254740993"),
        ({"lengths": [10, 1e300]}, ValueError, r"lengths\[1\] is 1e\+300"),
        ({"lengths": np.array([10, 2**63 - 1])}, ValueError, r"lengths\[1\] is 9223372036854775807"),
        ({"quadratic": 1e308}, ValueError, r"quadratic=1e\+308\).*beyond a float's range"),  # OverflowError
        ({"quadratic": 1e306, "max_tokens": HUGE}, ValueError, r"quadratic=1e\+306\)"),  # OverflowError
        (
            {"cost": np.array(["padded", "tokens"])},
            ValueError,
            r"cost=array\(\['padded', 'tokens'\]",
        ),  # ambiguous
        ({"max_tokens": np.int64(-5)}, ValueError, r"max_tokens=-5\)"),
        (
            {"num_replicas": 2**21},
            ValueError,
            r"num_replicas=2097152\).*from 1 to 1048576",
        ),  # was a plan of 2**21
        ({"num_replicas": HUGE}, ValueError, r"num_replicas=1000"),  # was a plan never done (its memory)
        ({"rank": HUGE}, ValueError, r"rank=1000"),  # was taken, refused only when planned
        ({"sampler": 5}, TypeError, r"sampler=5\).*Expected None or a sampler"),  # was ignored
        ({"sampler": "sequential"}, TypeError, r"sampler='sequential'\)"),
        ({"sampler": {"rank": 0}}, TypeError, r"sampler=\{'rank': 0\}\)"),
    ],
    ids=lambda value: value if isinstance(value, str) else repr(value)[:40],
)
def test_a_hostile_argument_is_refused_by_name_never_a_raw_error(kwargs, error, match):
    # tests/package/test_bad_arguments.py tries every argument with many more values
    arguments = {"lengths": [10, 20, 40], "max_tokens": 100, **kwargs}
    with pytest.raises(error, match=rf"`TokenBudgetSampler\(.*{match}"):
        TokenBudgetSampler(**arguments)


def test_integers_of_any_type_are_taken_as_python_ints():
    sampler = TokenBudgetSampler(
        np.array([10, 20, 40], dtype=np.uint16),
        max_tokens=np.int64(100),
        quadratic=np.float32(0.0),
        max_samples=torch.tensor(3),
        seed=np.int32(4),
        num_replicas=np.int64(2),
        rank=np.int8(1),
    )
    assert (sampler.max_tokens, sampler.max_samples, sampler.seed, sampler.num_replicas, sampler.rank) == (
        100,
        3,
        4,
        2,
        1,
    )
    assert all(type(value) is int for value in (sampler.max_tokens, sampler.max_samples, sampler.seed))
    assert type(sampler.quadratic) is float
    assert (
        list(sampler)
        == TokenBudgetSampler([10, 20, 40], 100, max_samples=3, seed=4, num_replicas=2, rank=1).plan()[1::2]
    )
    assert TokenBudgetSampler([3, 5], 10, sampler=[0, 1]).plan() == [[0, 1]]  # another sampler: ignored


def test_the_longest_length_taken_is_2_53_and_every_cost_is_a_finite_float():
    longest = TokenBudgetSampler([3, 2**53], max_tokens=HUGE)  # a budget no batch reaches: taken
    assert longest.min_tokens == 2**53
    assert longest.plan() == [[0, 1]]
    assert math.isfinite(longest.worst_cost())
    heavy = TokenBudgetSampler([3, 2**53], max_tokens=HUGE, quadratic=1e270)
    whole = batch_cost(
        heavy.lengths, cost=heavy.cost, quadratic=heavy.quadratic
    )  # the tuner's largest budget
    assert math.isfinite(whole)
    assert math.isfinite(heavy.min_tokens)
    assert math.isfinite(heavy.worst_cost())
    assert TokenBudgetSampler([], max_tokens=10, quadratic=1e308).plan() == []  # no sample: no cost
    with pytest.raises(
        ValueError, match=r"lengths\[1\] is 9007199254740993\. Expected a non-negative integer up to"
    ):
        TokenBudgetSampler([3, 2**53 + 1], max_tokens=HUGE)  # was taken: costs are floats, exact up to 2**53


def test_a_budget_set_by_hand_may_be_any_integer_and_nothing_else():
    sampler = TokenBudgetSampler([10, 20], max_tokens=100)
    sampler.max_tokens = np.int64(20)  # was refused when planned
    assert sampler.plan() == plan_batches([10, 20], 20)
    for bad in (float("inf"), 1e303, "100", np.float64(100.0), None):
        sampler.max_tokens = bad
        with pytest.raises(ValueError, match=r"`TokenBudgetSampler\(max_tokens="):
            len(sampler)
    sampler.max_tokens = HUGE
    assert len(sampler) == 1


# ---------------------------------------------------------------------- Lightning's DistributedSampler injection
def _hook_loader(lengths: list[int], **kwargs) -> DataLoader:
    """A loader built as Lightning builds one in a `*_dataloader` hook: its arguments captured to build it again."""
    with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
        sampler = TokenBudgetSampler(lengths, 400, seed=9, **kwargs)
        sampler.max_tokens = 500  # set in the hook: Lightning replays it on the new sampler
        return DataLoader(Texts(lengths), batch_sampler=sampler, collate_fn=pad)


def test_an_injected_distributed_sampler_gives_the_ranks_the_seed_and_the_epoch():
    lengths = skewed_lengths()
    loader = _hook_loader(lengths, max_samples=16)
    injected = DistributedSampler(loader.dataset, num_replicas=2, rank=1, shuffle=True, seed=3)
    new = _update_dataloader(loader, injected)
    sampler = new.batch_sampler
    assert isinstance(sampler, TokenBudgetSampler)
    assert sampler is not loader.batch_sampler
    assert sampler.sampler is injected
    assert (sampler.num_replicas, sampler.rank, sampler.seed) == (2, 1, 3)
    assert (sampler.max_tokens, sampler.max_samples) == (500, 16)
    _set_sampler_epoch(new, 4)  # what Lightning's fit loop does at each epoch
    assert injected.epoch == sampler.epoch == 4
    expected = plan_batches(lengths, 500, max_samples=16, seed=3, epoch=4, num_replicas=2)[1::2]
    assert [indices.tolist() for indices, _ in new] == expected
    assert len(new) == len(expected)


def test_when_predicting_lightning_injects_a_plain_sampler_that_changes_nothing():
    lengths = skewed_lengths()
    loader = _hook_loader(lengths, drop_last=True)
    new = _update_dataloader(loader, SequentialSampler(loader.dataset), mode=RunningStage.PREDICTING)
    sampler = new.batch_sampler._batch_sampler  # Lightning's `_IndexBatchSamplerWrapper` around it
    assert isinstance(sampler, TokenBudgetSampler)
    assert sampler.drop_last is False
    assert list(new.batch_sampler) == plan_batches(lengths, 500, seed=9)


def test_an_injected_sampler_of_another_dataset_is_refused():
    lengths = skewed_lengths()
    loader = _hook_loader(lengths)
    with pytest.raises(ValueError, match=r"its dataset has 10 samples and `lengths` has 300"):
        _update_dataloader(loader, DistributedSampler(Texts(lengths[:10]), num_replicas=2, rank=0))


def test_a_sampler_built_outside_a_hook_gets_lightnings_advice_under_ddp():
    # No `batch_size`: Lightning does not try `cls(sampler, batch_size=..., drop_last=...)` (which would pass its
    # sampler as `lengths`) but says what to do.
    lengths = skewed_lengths()
    loader = DataLoader(Texts(lengths), batch_sampler=TokenBudgetSampler(lengths, 400), collate_fn=pad)
    with pytest.raises(
        TypeError, match=r"can't inject a \(distributed\) sampler.*use_distributed_sampler=False"
    ):
        _update_dataloader(loader, DistributedSampler(loader.dataset, num_replicas=2, rank=0))


# ---------------------------------------------------------------------- a real fit
class Data(LightningDataModule):
    def __init__(self, lengths: list[int], max_tokens: int) -> None:
        super().__init__()
        self.lengths, self.max_tokens = lengths, max_tokens

    def train_dataloader(self) -> DataLoader:
        sampler = TokenBudgetSampler(self.lengths, max_tokens=self.max_tokens, seed=5)
        return DataLoader(Texts(self.lengths), batch_sampler=sampler, collate_fn=pad)


class Recorder(LightningModule):
    """Records the indices of every training batch, by epoch; a token-mean loss."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: dict[int, list[list[int]]] = {}

    def training_step(self, batch, batch_idx):
        indices, padded = batch
        self.seen.setdefault(self.current_epoch, []).append(indices.tolist())
        real = padded != 0
        return (self.layer(padded.unsqueeze(-1)).squeeze(-1) * real).sum() / real.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_fit_sees_every_sample_once_per_epoch_in_a_new_order_each_epoch():
    lengths = skewed_lengths(200)
    model = Recorder()
    trainer = quiet_trainer(max_epochs=2, limit_val_batches=0)
    trainer.fit(model, datamodule=Data(lengths, max_tokens=400))
    assert sorted(model.seen) == [0, 1]
    for epoch, batches in model.seen.items():
        assert sorted(_flat(batches)) == list(range(len(lengths)))
        assert batches == plan_batches(lengths, 400, seed=5, epoch=epoch)
        assert all(batch_cost([lengths[i] for i in b]) <= 400 for b in batches)
    assert model.seen[0] != model.seen[1]  # `set_epoch` reached the sampler
    assert trainer.num_training_batches == len(model.seen[1])


def test_jsonargparse_reads_the_signature():
    # LightningCLI builds its parsers with jsonargparse: the typed signature must resolve.
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(TokenBudgetSampler, "sampler")
    config = parser.parse_args(
        ["--sampler.lengths=[3, 5, 8]", "--sampler.max_tokens=16", "--sampler.cost=tokens"]
    )
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in 4.49
    built = instantiate(config).sampler
    assert isinstance(built, TokenBudgetSampler)
    assert (built.max_tokens, built.cost) == (16, "tokens")
