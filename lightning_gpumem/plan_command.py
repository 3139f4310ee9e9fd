"""``gpumem plan [--budget SIZE]... SCRIPT fit [ARGS]...``: a LightningCLI script's plan, on any machine.

The script runs as it would (``python SCRIPT fit ARGS``), in a process of its own, with arguments added after
the user's: a CPU Trainer of one process, no logger, and a :class:`~lightning_gpumem.MemoryPlanner` with the
budgets asked for and ``stop=true``, so the fit plans by trace and stops before its first step. This module
imports neither torch nor Lightning: the command starts at once, as ``gpumem report`` does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence

DEFAULT_BUDGETS = ("H100-80GB", "A100-40GB", "24GiB")
SUBCOMMAND = "fit"


class PlanUsageError(ValueError):
    """Arguments that cannot make a plan command (exit status 2)."""


def plan_argv(
    script: str,
    args: Sequence[str],
    budgets: Sequence[str] | None,
    batch_arg_name: str | None = None,
    python: str | None = None,
    ddp: bool = False,
) -> list[str]:
    """The command line that plans ``script``'s fit: the user's arguments, then the planner's.

    ``ddp``: plan one rank of a DDP run (the CPU Trainer's one process wrapped by DDP, whose gradient buckets
    are then counted), else one process with Lightning's default strategy.

    Raises:
        PlanUsageError: ``args`` do not begin with ``fit`` (LightningCLI's subcommand), or a budget is empty.

    Example:
        >>> plan_argv("train.py", ["fit", "--config", "c.yaml"], ["24GiB"], python="python")[:5]
        ['python', 'train.py', 'fit', '--config', 'c.yaml']
    """
    if not args or args[0] != SUBCOMMAND:
        given = args[0] if args else "nothing"
        raise PlanUsageError(
            f"`gpumem plan {script}` got {given!r} after the script. Expected LightningCLI's `fit`"
            f" subcommand first: `gpumem plan {script} fit --config config.yaml`."
        )
    chosen = list(budgets) if budgets else list(DEFAULT_BUDGETS)
    empty = [budget for budget in chosen if not budget.strip()]
    if empty:
        raise PlanUsageError(
            f"--budget {empty[0]!r} is empty. Expected a size (24GiB) or a card (H100-80GB)."
        )
    added = [
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--trainer.num_nodes=1",
        f"--trainer.strategy={'ddp' if ddp else 'auto'}",
        "--trainer.logger=false",
        "--trainer.callbacks+=lightning_gpumem.MemoryPlanner",
        f"--trainer.callbacks.budgets={json.dumps(chosen)}",
        "--trainer.callbacks.stop=true",
    ]
    if batch_arg_name is not None:
        added.append(f"--trainer.callbacks.batch_arg_name={batch_arg_name}")
    return [python or sys.executable, script, *args, *added]


def run_plan(argv: Sequence[str]) -> int:
    """Run the command line of :func:`plan_argv`, its output passed through; its exit status."""
    return subprocess.run(list(argv), check=False).returncode
