"""``gpumem plan``: a LightningCLI script's traced plan from the command line, with no code change."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from lightning_gpumem import cli
from lightning_gpumem.plan_command import DEFAULT_BUDGETS, PlanUsageError, plan_argv
from tests.tuning.test_traced_planner import CLI_MODEL

SCRIPT = CLI_MODEL + textwrap.dedent(
    """

    class Planned(Model):
        def on_fit_end(self):
            planner = next(c for c in self.trainer.callbacks if type(c).__name__ == "MemoryPlanner")
            found = [(p.budget >> 30, p.how) for p in planner.predictions]
            print("planned", self.trainer.global_step, self.trainer.logger, found)


    LightningCLI(Planned, save_config_callback=None)
    """
)


def test_the_planner_and_a_cpu_trainer_come_after_the_users_arguments():
    argv = plan_argv("train.py", ["fit", "--config", "c.yaml"], ["24GiB", "A100-40GB"], python="py")
    assert argv[:5] == ["py", "train.py", "fit", "--config", "c.yaml"]
    assert "--trainer.accelerator=cpu" in argv
    assert "--trainer.devices=1" in argv
    assert argv[-3:] == [
        "--trainer.callbacks+=lightning_gpumem.MemoryPlanner",
        '--trainer.callbacks.budgets=["24GiB", "A100-40GB"]',
        "--trainer.callbacks.stop=true",
    ]
    assert f"--trainer.callbacks.budgets={list(DEFAULT_BUDGETS)}".replace("'", '"') in plan_argv(
        "train.py", ["fit"], None
    )


@pytest.mark.parametrize("args", [[], ["validate"], ["--config", "c.yaml"]])
def test_arguments_that_do_not_begin_with_fit_are_refused_with_exit_status_2(args, capsys):
    with pytest.raises(PlanUsageError, match="Expected LightningCLI's `fit`"):
        plan_argv("train.py", args, None)
    assert cli.main(["plan", "train.py", *args]) == 2
    assert "gpumem plan: error: `gpumem plan train.py` got" in capsys.readouterr().err


def test_an_empty_budget_is_refused(capsys):
    assert cli.main(["plan", "--budget", " ", "train.py", "fit"]) == 2
    assert "--budget ' ' is empty" in capsys.readouterr().err


def test_gpumem_plan_runs_a_lightning_cli_script_to_a_traced_plan_and_no_step(tmp_path):
    pytest.importorskip("jsonargparse")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT, encoding="utf-8")
    command = [
        sys.executable,
        "-m",
        "lightning_gpumem",
        "plan",
        "--budget",
        "24GiB",
        "--budget",
        "A100-40GB",
    ]
    command += [str(script), "fit", "--model.batch_size=4", f"--trainer.default_root_dir={tmp_path}"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "planned 0 None [(39, 'traced'), (24, 'traced')]" in done.stdout, done.stdout[-3000:]
    assert "gpumem plan: " in done.stderr
    assert "--trainer.callbacks.stop=true" in done.stderr


def test_ddp_plans_one_rank_wrapped_by_ddp():
    assert "--trainer.strategy=ddp" in plan_argv("train.py", ["fit"], None, ddp=True)
    assert "--trainer.strategy=auto" in plan_argv("train.py", ["fit"], None)
