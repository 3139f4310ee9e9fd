"""BatchSizeTuner under DDP with 2 CPU processes (gloo): the ranks agree on one size when one rank alone fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.ddp import run_script
from tests.helpers.fakes import kept

pytestmark = (
    pytest.mark.ddp
)  # reads the `ddp_conformance_script.py` run the conformance matrix's DDP row reads


def test_tuner_agrees_across_ranks_when_only_one_rank_runs_out_of_memory():
    # Also the tuner review's finding 4: with `self.log(..., sync_dist=True)` in both steps, the OOM rank's agreement
    # collective paired with the other rank's logging all-reduce and gloo aborted ("collective mismatch").
    tmp_path, _ = run_script(Path(__file__).with_name("ddp_conformance_script.py"))
    rank0 = json.loads((tmp_path / "tuner_rank0.json").read_text())
    rank1 = json.loads((tmp_path / "tuner_rank1.json").read_text())
    assert (
        rank0["batch_size"] == rank1["batch_size"] == kept(24)
    )  # the smaller rank's limit, less the headroom
    assert rank0["trials"] == rank1["trials"]  # every rank ran the same trials with the same verdicts
    assert [24, True] in rank0["trials"]
    assert any(
        size > 24 and not fits for size, fits in rank0["trials"]
    )  # failed on rank 1 only, agreed on both
    assert rank0["global_step"] == rank1["global_step"] == 3
    assert not list(tmp_path.glob(".gpumem_tuner_*.ckpt"))  # the snapshot checkpoint is removed


def test_a_token_budget_is_agreed_and_the_ranks_share_one_plan():
    tmp_path, _ = run_script(Path(__file__).with_name("ddp_conformance_script.py"))
    rank0 = json.loads((tmp_path / "tokens_rank0.json").read_text())
    rank1 = json.loads((tmp_path / "tokens_rank1.json").read_text())
    assert rank0["max_tokens"] == rank1["max_tokens"] <= 600  # rank 1's limit, agreed on both
    assert rank0["trials"] == rank1["trials"]
    assert rank0["trials"][0] == [100, True]  # the first budget tried holds the longest sample alone
    assert (
        len(rank0["indices"]) == len(rank1["indices"]) > 1
    )  # the same number of batches, with no collective
    assert max(rank0["padded"] + rank1["padded"]) <= rank0["max_tokens"]
    batches0 = {tuple(b) for b in rank0["indices"]}
    batches1 = {tuple(b) for b in rank1["indices"]}
    seen = [i for batch in rank0["indices"] + rank1["indices"] for i in batch]
    assert set(seen) == set(range(rank0["samples"]))  # every sample in the epoch
    # an odd number of batches: the plan's first batch runs again, on the other rank, to even out the counts
    assert len(batches0 & batches1) <= 1
    assert len(seen) - rank0["samples"] == sum(len(b) for b in batches0 & batches1)


def test_length_fn_trials_run_the_longest_samples_on_every_rank():
    # Lightning wraps a training loader's sampler in a shuffling DistributedSamplerWrapper: the longest-first order
    # must not be shuffled away, or rank 1's trials never meet the two 100-token samples.
    tmp_path, _ = run_script(Path(__file__).with_name("ddp_conformance_script.py"))
    rank0 = json.loads((tmp_path / "longest_rank0.json").read_text())
    rank1 = json.loads((tmp_path / "longest_rank1.json").read_text())
    assert rank0["batch_size"] == rank1["batch_size"] <= 6  # 6 x 100 padded tokens: rank 1's limit
    assert max(rank1["padded"]) <= 600  # the whole epoch ran on rank 1


def test_a_length_scan_cut_short_on_one_rank_gives_every_rank_the_same_order():
    # The ranks agree on the samples every rank scanned (the first 64 of the seeded scan order), not each its own.
    tmp_path, _ = run_script(Path(__file__).with_name("ddp_conformance_script.py"))
    rank0 = json.loads((tmp_path / "partial_rank0.json").read_text())
    rank1 = json.loads((tmp_path / "partial_rank1.json").read_text())
    assert len(rank0["orders"]) == 1
    assert rank0["orders"] == rank1["orders"]
    assert sorted(rank0["orders"][0]) == list(range(301))
    assert rank0["orders"][0] != rank0["full"]  # rank 0 scanned all 301 but kept the 64 rank 1 scanned
