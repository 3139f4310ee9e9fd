"""Pure, stdlib only: one model of memory against the batch size, the plan, the search and its headroom.

``model.py`` (points, lines, growth, the largest size under a limit), ``plan.py`` (the planner's verdict,
band and budgets), ``moves.py`` and ``policy.py`` (the search), ``probes.py`` (the planner's probes),
``headroom.py``.
"""

from lightning_gpumem.tuning.search.headroom import largest_held, leave_headroom, walk_down
from lightning_gpumem.tuning.search.model import MemoryModel, Point, Trial, TrialSource, accepted
from lightning_gpumem.tuning.search.moves import Move, Proposal
from lightning_gpumem.tuning.search.policy import (
    Guess,
    SearchResult,
    search_batch_size,
    search_by_plan,
    until_data_ends,
)

__all__ = [
    "Guess",
    "MemoryModel",
    "Move",
    "Point",
    "Proposal",
    "SearchResult",
    "Trial",
    "TrialSource",
    "accepted",
    "largest_held",
    "leave_headroom",
    "search_batch_size",
    "search_by_plan",
    "until_data_ends",
    "walk_down",
]
