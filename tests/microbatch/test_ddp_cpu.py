"""AutoMicrobatch under DDP on 2 CPU ranks: an OOM on one rank splits on both, weights stay equal, nothing hangs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.ddp import run_script

pytestmark = (
    pytest.mark.ddp
)  # the cases run in one `ddp_microbatch_script.py` rank pair, the hang case in another
SCRIPT = Path(__file__).with_name("ddp_microbatch_script.py")
CASES = ("forward:1", "backward:1", "backward:2")


@pytest.mark.parametrize("case", CASES)
def test_an_oom_on_one_rank_splits_on_both_and_matches_a_run_without_one(case):
    out, output = run_script(SCRIPT, *CASES)
    accumulate = int(case.split(":")[1])
    ranks = [torch.load(out / case.replace(":", "-") / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert ranks[0]["splits"] == ranks[1]["splits"]  # both ranks ran every step with the same split
    assert max(ranks[0]["splits"]) >= 4  # rank 1's batches of 16 fit only at 4 micro-batches of 4
    if accumulate == 1:  # (with accumulation the pressure batches come back in the second epoch)
        assert ranks[0]["splits"][-1] == 1  # grown back after the pressure
    assert ranks[0]["recoveries"] == ranks[1]["recoveries"] >= 2
    for rank in ranks:
        assert rank["global_step"] == 15
        torch.testing.assert_close(
            rank["weights"], ranks[0]["weights"], atol=0, rtol=0
        )  # ranks agree exactly
        torch.testing.assert_close(rank["weights"], rank["reference"], atol=1e-5, rtol=0)
    assert "re-running it as" in output


def test_a_collective_of_the_users_in_training_step_makes_the_run_fail_not_hang(tmp_path):
    """Rank 1 runs out of memory before the user's `all_gather`, rank 0 waits in it: the agreement times out."""
    command = [sys.executable, str(SCRIPT), str(tmp_path), "user-collective"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "did not all reach the agreement" in proc.stderr
