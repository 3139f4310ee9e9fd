"""Batches under a cost budget (pure): the plan's invariants by brute force over random lengths, DDP shares, errors."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import numpy as np
import pytest

from lightning_gpumem._core.batching import batch_cost, heaviest_first, padding_fraction, plan_batches


def zipf_lengths(n: int, seed: int, cap: int = 512) -> list[int]:
    """Heavy-tailed: most samples short, a few near ``cap``."""
    rng = random.Random(seed)
    return [min(cap, int(4 * rng.paretovariate(1.1))) for _ in range(n)]


def skewed_lengths(n: int, seed: int) -> list[int]:
    """Mostly 1 to 32 tokens, a handful of 300, and some empty samples."""
    rng = random.Random(seed)
    lengths = [rng.randint(1, 32) for _ in range(n)]
    for index in rng.sample(range(n), max(1, n // 50)):
        lengths[index] = 300
    for index in rng.sample(range(n), max(1, n // 100)):
        lengths[index] = 0
    return lengths


def uniform_lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 200) for _ in range(n)]


LENGTHS = {
    "zipf": zipf_lengths(700, 0),
    "skewed": skewed_lengths(500, 1),
    "uniform": uniform_lengths(300, 2),
    "equal": [16] * 97,
    "one": [7],
}
# (cost, quadratic, budget as a multiple of the longest sample's own cost, max_samples)
SETTINGS = [
    ("padded", 0.0, 1.0, None),
    ("padded", 0.0, 4.5, None),
    ("tokens", 0.0, 3.0, None),
    ("padded", 0.01, 2.0, None),
    ("tokens", 0.5, 1.7, None),
    ("padded", 0.0, 50.0, 8),
    ("tokens", 0.0, 50.0, 1),
]


def _budget(lengths: list[int], cost: str, quadratic: float, times: float) -> float:
    return times * max(1.0, batch_cost([max(lengths)], cost=cost, quadratic=quadratic))


def _cases():
    for (name, lengths), (cost, quadratic, times, max_samples) in itertools.product(
        LENGTHS.items(), SETTINGS
    ):
        kwargs = dict(cost=cost, quadratic=quadratic, max_samples=max_samples)
        yield pytest.param(
            lengths, _budget(lengths, cost, quadratic, times), kwargs, id=f"{name}-{cost}-{times}"
        )


@pytest.mark.parametrize(("lengths", "max_cost", "kwargs"), list(_cases()))
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_sample_once_every_batch_within_the_budget(lengths, max_cost, kwargs, shuffle):
    for epoch in (0, 1):
        batches = plan_batches(lengths, max_cost, shuffle=shuffle, seed=5, epoch=epoch, **kwargs)
        assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
        assert all(batches), "no empty batch"
        for batch in batches:
            sizes = [lengths[i] for i in batch]
            assert batch_cost(sizes, cost=kwargs["cost"], quadratic=kwargs["quadratic"]) <= max_cost
            assert kwargs["max_samples"] is None or len(batch) <= kwargs["max_samples"]


@pytest.mark.parametrize(("lengths", "max_cost", "kwargs"), list(_cases()))
def test_the_packing_is_greedy_each_batch_could_not_take_the_next_sample(lengths, max_cost, kwargs):
    # Unshuffled, the batches come in length order: each one's successor's first sample would not have fitted.
    batches = plan_batches(lengths, max_cost, shuffle=False, **kwargs)
    flat = [i for batch in batches for i in batch]
    assert [lengths[i] for i in flat] == sorted(lengths)
    assert flat == sorted(range(len(lengths)), key=lambda i: (lengths[i], i))  # stable: ties in index order
    for batch, following in itertools.pairwise(batches):
        grown = [lengths[i] for i in [*batch, following[0]]]
        over = batch_cost(grown, cost=kwargs["cost"], quadratic=kwargs["quadratic"]) > max_cost
        assert over or len(batch) == kwargs["max_samples"]


def test_the_plan_depends_on_seed_and_epoch_only():
    lengths = zipf_lengths(400, 3)
    plan = plan_batches(lengths, 600, seed=2, epoch=4)
    assert plan == plan_batches(list(lengths), 600, seed=2, epoch=4)  # the same on every rank
    assert plan == plan_batches(
        tuple(lengths), 600, seed=1, epoch=5
    )  # the generator is seeded by seed + epoch
    assert plan != plan_batches(lengths, 600, seed=2, epoch=5)
    assert plan != plan_batches(lengths, 600, seed=3, epoch=4)
    orders = {tuple(map(tuple, plan_batches(lengths, 600, epoch=epoch))) for epoch in range(5)}
    assert len(orders) == 5
    unshuffled = plan_batches(lengths, 600, shuffle=False, epoch=0)
    assert unshuffled == plan_batches(lengths, 600, shuffle=False, epoch=3)


def test_shuffled_batches_stay_sorted_inside_and_their_order_is_random():
    lengths = uniform_lengths(600, 4)
    batches = plan_batches(lengths, 1000, seed=0)
    assert all([lengths[i] for i in b] == sorted(lengths[i] for i in b) for b in batches)
    longest = [max(lengths[i] for i in b) for b in batches]
    assert longest != sorted(longest)
    assert longest != sorted(longest, reverse=True)


def _shares(lengths, max_cost, replicas, **kwargs):
    plan = plan_batches(lengths, max_cost, num_replicas=replicas, **kwargs)
    return plan, [plan[rank::replicas] for rank in range(replicas)]


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("name", ["zipf", "skewed", "uniform", "one"])
def test_ddp_ranks_get_as_many_batches_disjoint_but_for_the_repeats(replicas, name):
    lengths = LENGTHS[name]
    alone = plan_batches(lengths, 4 * max(lengths), seed=7, epoch=1)
    plan, shares = _shares(lengths, 4 * max(lengths), replicas, seed=7, epoch=1)
    assert len({len(share) for share in shares}) == 1
    assert len(plan) % replicas == 0
    missing = -len(alone) % replicas
    assert plan == alone + alone[:missing] if len(alone) >= missing else alone + [alone[0]] * missing
    counts = Counter(i for share in shares for batch in share for i in batch)
    assert set(counts) == set(range(len(lengths)))  # the union covers every sample
    repeated = {i for batch in plan[len(alone) :] for i in batch}
    assert {
        i for i, n in counts.items() if n > 1
    } <= repeated  # disjoint, but for the repeated first batches
    assert sum(counts.values()) == len(lengths) + sum(len(b) for b in plan[len(alone) :])


@pytest.mark.parametrize("replicas", [2, 3])
def test_drop_last_drops_the_last_batches_and_their_samples(replicas):
    lengths = skewed_lengths(300, 5)
    alone = plan_batches(lengths, 500, seed=1)
    plan, shares = _shares(lengths, 500, replicas, seed=1, drop_last=True)
    kept = len(alone) - len(alone) % replicas
    assert plan == alone[:kept]
    assert len(plan) % replicas == 0
    assert len({len(share) for share in shares}) == 1
    seen = Counter(i for batch in plan for i in batch)
    assert max(seen.values()) == 1
    assert set(seen) == set(range(len(lengths))) - {i for batch in alone[kept:] for i in batch}
    assert plan_batches([5], 10, num_replicas=2, drop_last=True) == []  # fewer batches than ranks: none


def test_a_plan_without_samples_is_empty():
    assert plan_batches([], 10, num_replicas=3) == []
    assert heaviest_first([], []) == []
    assert padding_fraction([], []) == 0.0


def test_a_sample_that_alone_exceeds_the_budget_is_named():
    lengths = [3, 9, 4, 12, 12]
    with pytest.raises(ValueError, match=r"max_cost=10\).*sample 3 of length 12 alone costs 12"):
        plan_batches(lengths, 10)
    with pytest.raises(ValueError, match=r"sample 1 of length 9 alone costs 49.5"):
        plan_batches(lengths[:3], 40, quadratic=0.5)  # 9 + 0.5 * 81
    assert plan_batches(lengths[:3], 49.5, quadratic=0.5, shuffle=False) == [
        [0, 2],
        [1],
    ]  # 2 x 4 + 0.5 x 2 x 16


def test_the_quadratic_term_weighs_long_samples():
    assert batch_cost([2, 4], quadratic=0.25) == 2 * 4 + 0.25 * 2 * 16
    assert batch_cost([2, 4], cost="tokens", quadratic=0.25) == 6 + 0.25 * (4 + 16)
    assert batch_cost([]) == 0.0
    lengths = [10] * 20 + [100] * 5
    linear = plan_batches(lengths, 400, shuffle=False)
    quadratic = plan_batches(
        lengths, 400, shuffle=False, quadratic=0.02
    )  # a 100-token sample alone costs 300
    assert [len(b) for b in linear] == [20, 4, 1]
    assert [len(b) for b in quadratic] == [20, 1, 1, 1, 1, 1]  # 20 x (10 + 2) = 240; 2 x (100 + 200) > 400


def _check_heaviest(batches, lengths, cost="padded", quadratic=0.0):
    ordered = heaviest_first(batches, lengths, cost=cost, quadratic=quadratic)
    assert sorted(map(tuple, ordered)) == sorted(
        map(tuple, batches)
    )  # the same batches, none twice, none lost
    costs = [batch_cost([lengths[i] for i in b], cost=cost, quadratic=quadratic) for b in ordered]
    longest = [max(lengths[i] for i in b) for b in ordered]
    sizes = [len(b) for b in ordered]
    assert costs[0] == max(costs)
    leaders = 1
    if longest[0] < max(longest):  # else the costliest holds a longest sample already
        assert longest[1] == max(longest)
        leaders += 1
    if max(sizes[:leaders]) < max(sizes):  # else a batch taken already is (one of) the fullest
        assert sizes[leaders] == max(sizes)
        leaders += 1
    assert costs[leaders:] == sorted(costs[leaders:], reverse=True)
    return ordered


def test_heaviest_first_runs_the_costliest_the_longest_and_the_fullest_batch_first():
    lengths = [10, 10, 10, 10, 30, 1, 1, 1, 1, 1, 1, 5]
    batches = [[11], [5, 6, 7, 8, 9, 10], [4], [0, 1, 2, 3]]  # costs 5, 6, 30, 40
    assert heaviest_first(batches, lengths) == [[0, 1, 2, 3], [4], [5, 6, 7, 8, 9, 10], [11]]
    # The costliest batch holds a sample as long as any: the next is the fullest, not another batch of that length.
    assert heaviest_first([[2], [0, 1], [3, 4, 5, 6, 7]], [8, 8, 8, 1, 1, 1, 1, 1]) == [
        [0, 1],
        [3, 4, 5, 6, 7],
        [2],
    ]
    # By tokens the fullest batch is also the costliest: no batch twice.
    assert heaviest_first(batches, lengths, cost="tokens") == [[0, 1, 2, 3], [4], [5, 6, 7, 8, 9, 10], [11]]
    for seed in range(20):
        lengths = zipf_lengths(300, seed)
        for cost, quadratic in (("padded", 0.0), ("tokens", 0.0), ("padded", 0.05)):
            budget = 3 * batch_cost([max(lengths)], cost=cost, quadratic=quadratic)
            batches = plan_batches(lengths, budget, cost=cost, quadratic=quadratic, seed=seed)
            _check_heaviest(batches, lengths, cost, quadratic)


def test_padding_fraction_counts_padded_positions():
    lengths = uniform_lengths(200, 6)
    batches = plan_batches(lengths, 800, seed=0)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert padding_fraction(batches, lengths) == pytest.approx((padded - sum(lengths)) / padded)
    assert padding_fraction([[0, 1, 2]], [4, 4, 4]) == 0.0
    assert padding_fraction([[0, 1]], [0, 0]) == 0.0
    rng = random.Random(0)
    unsorted = list(range(200))
    rng.shuffle(unsorted)
    starts = itertools.accumulate([0] + [len(b) for b in batches])
    at_random = [
        unsorted[i : i + len(b)] for i, b in zip(starts, batches)
    ]  # the same sizes, samples at random
    assert padding_fraction(batches, lengths) < padding_fraction(at_random, lengths) / 3  # sorting pays


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"max_cost": -1}, ValueError, "max_cost=-1"),
        ({"max_cost": 0}, ValueError, "max_cost=0"),
        ({"max_cost": float("inf")}, ValueError, "max_cost=inf"),
        ({"max_cost": True}, ValueError, "max_cost=True"),
        ({"max_cost": "10"}, ValueError, "max_cost='10'"),
        ({"cost": "max"}, ValueError, "cost='max'"),
        ({"quadratic": -0.1}, ValueError, "quadratic=-0.1"),
        ({"quadratic": float("nan")}, ValueError, "quadratic=nan"),
        ({"max_samples": 0}, ValueError, "max_samples=0"),
        ({"max_samples": 2.0}, ValueError, "max_samples=2.0"),
        ({"max_samples": True}, ValueError, "max_samples=True"),
        ({"num_replicas": 0}, ValueError, "num_replicas=0"),
        ({"num_replicas": True}, ValueError, "num_replicas=True"),
        ({"epoch": -1}, ValueError, "epoch=-1"),
        ({"seed": 1.5}, ValueError, "seed=1.5"),
        ({"shuffle": 1}, TypeError, "shuffle=1"),
        ({"drop_last": None}, TypeError, "drop_last=None"),
        ({"lengths": [1, -2]}, ValueError, r"lengths\[1\] is -2"),
        ({"lengths": [1, True]}, TypeError, r"lengths\[1\] is True"),
        ({"lengths": [1, 2.0]}, TypeError, r"lengths\[1\] is 2.0"),
        ({"lengths": 5}, TypeError, "lengths=5"),
        ({"lengths": iter([1, 2])}, TypeError, "lengths=<list_iterator"),
        # issue 41: astronomically long lengths, huge quadratic terms and rank counts, arrays where a name belongs
        ({"lengths": [1, 10**400], "max_cost": 10**401}, ValueError, r"lengths\[1\] is 1000.*up to 2\*\*53"),
        ({"lengths": [1, 2**64], "max_cost": 2**65}, ValueError, r"lengths\[1\] is 18446744073709551616"),
        ({"quadratic": 10**400}, ValueError, "quadratic=1000"),  # was taken, then OverflowError
        ({"quadratic": 1e308}, ValueError, r"quadratic=1e\+308\).*alone costs more than a float holds"),
        (
            {"cost": np.array(["padded", "tokens"])},
            ValueError,
            r"cost=array\(\['padded', 'tokens'\]",
        ),  # ambiguous
        (
            {"num_replicas": 2**21},
            ValueError,
            r"num_replicas=2097152\).*from 1 to 1048576",
        ),  # was 2**21 batches
    ],
)
def test_a_bad_argument_is_named_with_its_value(kwargs, error, name):
    arguments = {"lengths": [1, 2, 3], "max_cost": 10, **kwargs}
    with pytest.raises(error, match=rf"`plan_batches\(.*{name}"):
        plan_batches(**arguments)


def test_batch_cost_and_heaviest_first_check_the_cost():
    with pytest.raises(ValueError, match=r"`batch_cost\(cost='square'\)` is not valid"):
        batch_cost([1], cost="square")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`heaviest_first\(quadratic=-1\)` is not valid"):
        heaviest_first([[0]], [1], quadratic=-1)


def test_batch_cost_names_lengths_beyond_a_float_and_the_largest_taken_are_planned():
    with pytest.raises(ValueError, match=r"`batch_cost\(lengths=\[1000.*beyond a float's range"):
        batch_cost([10**400])  # was a raw OverflowError
    with pytest.raises(ValueError, match=r"`batch_cost\(quadratic=1000"):
        batch_cost([3], quadratic=10**400)  # type: ignore[arg-type]
    assert batch_cost([2**53], quadratic=1e300) == float("inf")  # a float's own overflow: its infinity
    assert plan_batches([3, 2**53], max_cost=10**400) == [
        [0, 1]
    ]  # the longest length, a budget beyond floats
    assert len(plan_batches([1, 2, 3], max_cost=3, num_replicas=2**20)) == 2**20
