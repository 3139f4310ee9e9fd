"""Cross-rank reductions through ``trainer.strategy``: no ``torch.distributed`` calls scattered in callbacks.

The gathers here are collectives: all ranks must call them at the same point with the same number of values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import lightning.pytorch as pl
import torch


def gather_values(trainer: pl.Trainer, values: Sequence[float | None]) -> list[list[float | None]]:
    """Gather ``values`` from every rank: ``result[rank][i]`` is rank ``rank``'s ``values[i]``.

    ``None`` travels as NaN and comes back as ``None``. With one process, nothing is communicated.
    """
    if trainer.world_size <= 1:
        return [list(values)]
    local = torch.tensor(
        [math.nan if v is None else float(v) for v in values],
        dtype=torch.float64,
        device=trainer.strategy.root_device,
    )
    gathered = trainer.strategy.all_gather(local)
    rows = gathered.reshape(trainer.world_size, len(values)).cpu().tolist()
    return [[None if math.isnan(v) else v for v in row] for row in rows]


def gather_named(
    trainer: pl.Trainer, values: Mapping[str, float | None], collective: bool = True
) -> dict[str, tuple[float | None, float | None]]:
    """Every rank's ``values`` by name: ``{name: (largest, smallest)}`` over ranks (``None`` ignored).

    Every rank must pass the same names in the same order (they travel as one tensor). ``collective=False``
    uses this rank's values alone (where the other ranks may not get here, as after an exception).
    """
    names = list(values)
    rows = (
        gather_values(trainer, [values[name] for name in names]) if collective else [list(values.values())]
    )
    return {name: max_min(rows, column) for column, name in enumerate(names)}


def max_min(rows: list[list[float | None]], column: int) -> tuple[float | None, float | None]:
    """Largest and smallest value of ``column`` over ranks, ignoring ranks where it is ``None``.

    >>> max_min([[1.0, None], [3.0, None]], 0), max_min([[1.0, None], [3.0, None]], 1)
    ((3.0, 1.0), (None, None))
    """
    present = [row[column] for row in rows if row[column] is not None]
    if not present:
        return None, None
    return max(present), min(present)  # type: ignore[type-var]


def side_group(timeout_s: float) -> object | None:
    """A gloo group of every rank, apart from the strategy's, whose collectives fail after ``timeout_s``.

    Collective: every rank must call it. ``None`` without an initialised process group. For agreements that
    must not hang forever when one rank is stuck elsewhere (in a collective of the user's own, say).
    """
    import datetime

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def all_reduce_max(values: Sequence[float], group: object | None) -> list[float]:
    """The largest of each value over ranks, through ``group`` (a :func:`side_group`); collective."""
    import torch.distributed as dist

    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()
