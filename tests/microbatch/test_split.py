"""AutoMicrobatch's pure parts: splitting a batch, combining the micro-batches' logs, the policy, `UpdateWatch`."""

from __future__ import annotations

import pytest
import torch

from lightning_gpumem.microbatch.split import LogCall, MicrobatchPolicy, combine_logs, split_batch
from tests.helpers.microbatch import watched_step


@pytest.mark.parametrize(
    ("optimizer_class", "kwargs"),
    [
        (torch.optim.AdamW, {"foreach": True}),
        (torch.optim.AdamW, {"foreach": False}),
        (torch.optim.Adam, {"foreach": True}),
        (torch.optim.SGD, {"momentum": 0.9, "foreach": True}),
        (torch.optim.SGD, {"momentum": 0.9, "foreach": False}),
    ],
)
def test_update_watch_sees_every_real_optimizer_update(optimizer_class, kwargs):
    assert watched_step(optimizer_class, **kwargs) == [False, True, False, True]
    assert watched_step(optimizer_class, frozen_first=True, **kwargs) == [False, True, False, True]


def test_split_keeps_nested_structure_and_leaves_other_leaves_whole():
    batch = {"x": torch.arange(10).view(5, 2), "pair": (torch.arange(5), torch.tensor(3.0)), "name": "b"}
    chunks = split_batch(batch, 2)
    assert [n for _, n in chunks] == [3, 2]
    assert chunks[1][0]["x"].tolist() == [[6, 7], [8, 9]]
    assert chunks[0][0]["pair"][1] is batch["pair"][1]
    assert chunks[0][0]["name"] == "b"


def test_logs_combine_as_one_unsplit_step():
    calls = [
        LogCall("loss", torch.tensor(2.0), {}, 3),
        LogCall("n", 3.0, {"reduce_fx": "sum"}, 3),
        LogCall("loss", torch.tensor(6.0), {}, 1),
        LogCall("n", 1.0, {"reduce_fx": "sum"}, 1),
    ]
    combined = {name: float(value) for name, value, _ in combine_logs(calls)}
    assert combined == {"loss": 3.0, "n": 4.0}


def test_policy_grows_back_and_waits_longer_after_a_failed_try():
    policy = MicrobatchPolicy(grow_after=3)
    assert policy.after_oom(10, 16) == 2
    assert [policy.next_k(s) for s in (11, 12, 13)] == [2, 2, 1]  # a try at step 13
    assert policy.after_oom(13, 16) == 2  # failed: back, and the wait doubles
    assert policy.wait == 6
    assert [policy.next_k(s) for s in range(14, 20)] == [2] * 5 + [1]
    policy.after_success(19)
    assert (policy.k, policy.wait) == (1, 3)


def test_split_refuses_a_batch_of_per_sample_tensors():
    with pytest.raises(ValueError, match=r"do not share their first dimension \(3 and \[5\]\)"):
        split_batch([torch.zeros(3, 4, 4), torch.zeros(5, 4, 4)], 2)
