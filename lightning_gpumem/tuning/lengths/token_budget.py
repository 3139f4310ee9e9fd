"""TokenBudgetSampler: batches of variable-length samples under a token budget.

For Lightning, its CLI and DDP. A fixed batch size must fit the longest batch an epoch can draw, so every
shorter batch leaves memory unused. Batching by a budget of (padded) tokens keeps every step near the memory
the budget was tuned for; the plan is :func:`lightning_gpumem._core.batching.plan_batches`.

Why it is built this way:

- Under DDP every rank plans the same global list of batches (same lengths, seed and epoch) and takes
  ``batches[rank::num_replicas]``: the ranks agree on the number of batches without a collective.
- Lightning, under DDP with ``Trainer(use_distributed_sampler=True)``, re-instantiates a ``BatchSampler``
  subclass created in a ``*_dataloader`` hook with ``sampler=DistributedSampler(...)``. The sampler takes the
  rank, the number of replicas and the seed from it and ignores its order (the plan covers every sample).
  Lightning calls ``set_epoch`` on ``dataloader.batch_sampler.sampler``, so ``sampler`` always has one: the
  injected ``DistributedSampler``, or a small one of its own, and each ``__iter__`` reads the epoch from it.
- ``max_tokens`` is a plain attribute (a tuner changes it between trials): the plan is made again when it
  changes, and kept while nothing changes, so ``len()`` and ``iter()`` agree and ``len()`` is cheap.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler, Sampler

from lightning_gpumem._core import batching
from lightning_gpumem._core.batching import COSTS, MAX_LENGTH, MAX_REPLICAS, Cost, batch_cost
from lightning_gpumem._core.checks import (
    as_integer,
    as_real,
    as_whole_number,
    is_collection,
    require_flags,
    require_int,
    require_int_or_none,
    shown,
)

_OWNER = "TokenBudgetSampler"
_PLANS_KEPT = 2  # plans kept (by what they depend on): this epoch's, and one at a budget asked about


class TokenBudgetSampler(BatchSampler):
    """A batch sampler that yields batches of variable size, each costing at most ``max_tokens``.

    Samples of similar length are batched together (sorted within the epoch, then the batches shuffled), and
    each batch holds as many samples as fit the budget: ``n * max(L) <= max_tokens`` padded tokens
    (``cost="padded"``) or ``sum(L) <= max_tokens`` (``cost="tokens"``), plus ``quadratic`` times the squared
    lengths for attention whose memory grows with ``L**2``. Every sample is drawn once per epoch. Use it as a
    ``DataLoader``'s ``batch_sampler``, created in a ``*_dataloader`` hook (so that Lightning can give it the
    ranks under DDP).

    Under DDP each rank runs ``batches[rank::num_replicas]`` of one global plan. The number of batches is
    rounded to a multiple of ``num_replicas``: up, by running the epoch's first batches again
    (``drop_last=False``), or down, by skipping the epoch's last batches, whose samples are then not seen
    that epoch (``drop_last=True``).

    Loss: the number of samples (and tokens) varies from batch to batch, so a mean over the batch's samples
    weighs a batch of 4 long samples as much as one of 200 short ones. Prefer a token mean (the loss summed
    over the batch's real tokens divided by their number) or ``reduction="sum"`` divided by a constant; tune
    the learning rate for the average tokens per batch, which ``max_tokens`` sets.

    Args:
        lengths: every sample's length, by dataset index (a list, a numpy array or a tensor of whole numbers
            from 0 to 2**53, of any numeric type: ``3.0`` is taken, ``3.5``, NaN and ``True`` are not);
            copied.
        max_tokens: the budget of one batch, in tokens (see ``cost``): an integer (Python's, numpy's or a 0-d
            tensor) of at least :attr:`min_tokens`. A plain attribute: changing it takes effect at the next
            ``iter()``/``len()``.
        sampler: where Lightning injects its ``DistributedSampler``: its ``num_replicas``, ``rank``, ``seed``
            and epoch are used and its order is ignored. Any other sampler is ignored (Lightning injects the
            loader's ``SequentialSampler`` when predicting). ``None``: the sampler keeps the epoch itself.
        cost: ``"padded"`` (``n * max(L)``: padded batches) or ``"tokens"`` (``sum(L)``: packed or nested
            batches).
        quadratic: weight of a term in ``L**2`` per sample: ``n * max(L)**2`` (padded) or ``sum(L**2)``
            (tokens); a finite number >= 0 small enough that the whole dataset's cost is a finite float.
        max_samples: at most this many samples in a batch (``None``: only the budget limits it).
        shuffle: shuffle the samples within a length and the order of the batches, differently each epoch.
        seed: the shuffle's seed; the same on every rank (a ``DistributedSampler``'s replaces it).
        drop_last: under DDP, round the number of batches down (skipping samples) instead of up (repeating
            some).
        num_replicas: the number of ranks, at most 2**20 (``None``: ``torch.distributed``'s world size when
            initialized, else 1).
        rank: this rank (``None``: ``torch.distributed``'s rank when initialized, else 0).

    Raises:
        TypeError: ``lengths`` is not a collection of whole numbers, a flag is not a ``bool``, or ``sampler``
            is not a sampler.
        ValueError: any other argument is not valid (each message names the argument, its value and what was
            expected), ``max_tokens`` is below :attr:`min_tokens`, or ``quadratic`` makes a cost beyond a
            float's range.

    Attributes:
        heaviest_first: yield this rank's batches heaviest first (the costliest, the one with the longest
            sample, the one with the most samples, then by cost), as all samplers do within
            :func:`heaviest_batches_first` (the tuner's trials).

    Example:
        >>> sampler = TokenBudgetSampler([3, 5, 2, 8, 4], max_tokens=10, shuffle=False)
        >>> list(sampler), len(sampler), sampler.min_tokens
        ([[2, 0], [4, 1], [3]], 3, 8)
        >>> rank1 = TokenBudgetSampler([3, 5, 2, 8, 4], max_tokens=10, shuffle=False, num_replicas=2, rank=1)
        >>> # the global plan's 2nd and 4th batches: the first batch again, to even the ranks out
        >>> list(rank1)
        [[4, 1], [2, 0]]

        In a ``LightningDataModule`` (``pad`` pads the samples of a batch to its longest)::

            def train_dataloader(self):
                sampler = TokenBudgetSampler(self.lengths, max_tokens=self.hparams.max_tokens)
                return DataLoader(self.train_set, batch_sampler=sampler, collate_fn=pad)
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        sampler: Sampler | None = None,
        *,
        cost: Cost = "padded",
        quadratic: float = 0.0,
        max_samples: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        # `BatchSampler.__init__` is not called: it requires a `batch_size`, which this sampler does not
        # have.
        self.lengths: list[int] = _as_lengths(lengths)
        # a numpy or tensor integer as an `int`; anything else is refused below
        max_tokens = _integer(max_tokens)
        require_int(_OWNER, "max_tokens", max_tokens, 1)
        if not isinstance(cost, str) or cost not in COSTS:
            raise ValueError(f"`{_OWNER}(cost={shown(cost)})` is not valid. Expected 'padded' or 'tokens'.")
        weight = as_real(quadratic)
        if weight is None or not 0 <= weight < math.inf:  # NaN fails too
            raise ValueError(
                f"`{_OWNER}(quadratic={shown(quadratic)})` is not valid. Expected a finite number >= 0."
            )
        max_samples = _integer(max_samples)
        require_int_or_none(_OWNER, "max_samples", max_samples, 1, "let only the budget limit a batch")
        require_flags(_OWNER, shuffle=shuffle, drop_last=drop_last)
        seed = _integer(seed)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"`{_OWNER}(seed={shown(seed)})` is not valid. Expected an integer.")
        num_replicas, rank = _integer(num_replicas), _integer(rank)
        require_int_or_none(
            _OWNER,
            "num_replicas",
            num_replicas,
            1,
            "use torch.distributed's world size",
            maximum=MAX_REPLICAS,
        )
        require_int_or_none(
            _OWNER, "rank", rank, 0, "use torch.distributed's rank", maximum=MAX_REPLICAS - 1
        )
        if sampler is not None and not isinstance(sampler, Sampler) and not _is_order(sampler):
            raise TypeError(
                f"`{_OWNER}(sampler={shown(sampler)})` is not valid. Expected None or a sampler (Lightning"
                " injects its `DistributedSampler` here under DDP)."
            )
        self.sampler: DistributedSampler[Any] | _EpochSampler
        # Lightning's, under DDP: its ranks and seed, not its order
        if isinstance(sampler, DistributedSampler):
            _check_dataset_size(sampler, len(self.lengths))
            self.sampler = sampler
            num_replicas, rank, seed = sampler.num_replicas, sampler.rank, sampler.seed
        else:  # none, or one Lightning injects when predicting: the plan covers every sample in any case
            self.sampler = _EpochSampler(len(self.lengths))
        if num_replicas is not None and rank is not None and rank >= num_replicas:
            raise ValueError(
                f"`{_OWNER}(rank={rank})` is not valid. Expected a rank < num_replicas={num_replicas}."
            )
        _check_finite_cost(self.lengths, cost, weight)
        self.max_tokens = max_tokens
        self.cost: Cost = cost
        self.quadratic = weight
        self.max_samples = max_samples
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.heaviest_first = False
        self._num_replicas = num_replicas
        self._rank = rank
        self._plans: dict[tuple[Any, ...], list[list[int]]] = {}  # the last plans, by what they depend on
        self._check_budget(max_tokens)

    # ------------------------------------------------------------------ the plan
    @property
    def num_replicas(self) -> int:
        """The number of ranks sharing the plan."""
        return self._num_replicas if self._num_replicas is not None else _world()[0]

    @property
    def rank(self) -> int:
        """This rank's index."""
        return self._rank if self._rank is not None else _world()[1]

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` plans, as set by ``set_epoch``.

        ``set_epoch`` is called on this sampler or on ``sampler``.
        """
        return int(getattr(self.sampler, "epoch", 0))

    @property
    def min_tokens(self) -> int:
        """The smallest valid ``max_tokens``: the cost of the longest sample alone, rounded up.

        0 where there are no samples.
        """
        if not self.lengths:
            return 0
        return math.ceil(batch_cost([max(self.lengths)], cost=self.cost, quadratic=self.quadratic))

    def set_epoch(self, epoch: int) -> None:
        """Plan ``epoch`` at the next ``iter()``.

        Also reached through ``sampler.set_epoch``, as Lightning calls it.
        """
        require_int(f"{_OWNER}.set_epoch", "epoch", epoch, 0)
        self.sampler.set_epoch(epoch)

    def plan(self, max_tokens: int | None = None) -> list[list[int]]:
        """This epoch's global plan: every rank's batches, rank ``r`` running ``plan()[r::num_replicas]``.

        Args:
            max_tokens: plan for this budget instead of the sampler's own (what a budget would give, e.g. to
                log the padding at a budget a tuner chose); ``None``: ``self.max_tokens``.
        """
        budget = self.max_tokens if max_tokens is None else max_tokens
        num_replicas, rank = self.num_replicas, self.rank
        if rank >= num_replicas:
            raise ValueError(
                f"`{_OWNER}(rank={rank})` is not valid. Expected a rank < num_replicas={num_replicas}."
            )
        key = (
            self.epoch,
            budget,
            self.cost,
            self.quadratic,
            self.max_samples,
            self.shuffle,
            self.seed,
            self.drop_last,
            num_replicas,
        )
        plan = self._plans.get(key)
        if plan is None:
            plan = batching.plan_batches(
                self.lengths,
                self._check_budget(budget),
                cost=self.cost,
                quadratic=self.quadratic,
                max_samples=self.max_samples,
                shuffle=self.shuffle,
                seed=self.seed,
                epoch=self.epoch,
                drop_last=self.drop_last,
                num_replicas=num_replicas,
            )
            # Mutated, never reassigned (Lightning replays the attributes set in a dataloader hook); a few
            # plans kept.
            while len(self._plans) >= _PLANS_KEPT:
                del self._plans[next(iter(self._plans))]
            self._plans[key] = plan
        return plan

    def padding_fraction(self, max_tokens: int | None = None) -> float:
        """The fraction of this epoch's padded positions that are padding (all ranks' batches).

        Args:
            max_tokens: at this budget instead of the sampler's own (``None``: ``self.max_tokens``).
        """
        return batching.padding_fraction(self.plan(max_tokens), self.lengths)

    def worst_cost(self, max_tokens: int | None = None) -> float:
        """The cost of this epoch's costliest batch (all ranks' batches), in tokens.

        Args:
            max_tokens: at this budget instead of the sampler's own (``None``: ``self.max_tokens``).
        """
        lengths, cost, quadratic = self.lengths, self.cost, self.quadratic
        costs = (
            batch_cost([lengths[i] for i in b], cost=cost, quadratic=quadratic)
            for b in self.plan(max_tokens)
        )
        return max(costs, default=0.0)

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.plan()[self.rank :: self.num_replicas]
        if self.heaviest_first or _TRIALS[0]:
            batches = batching.heaviest_first(
                batches, self.lengths, cost=self.cost, quadratic=self.quadratic
            )
        return iter([list(batch) for batch in batches])  # copies: the plan is kept for `len()`

    def __len__(self) -> int:
        return len(self.plan()) // self.num_replicas

    def _check_budget(self, max_tokens: object) -> int:
        """``max_tokens`` as an ``int`` that holds the longest sample.

        ``max_tokens`` is the plain attribute, or a budget asked about.
        """
        budget = _integer(max_tokens)
        require_int(_OWNER, "max_tokens", budget, 1)
        if budget < self.min_tokens:
            longest = max(self.lengths)
            raise ValueError(
                f"`{_OWNER}(max_tokens={budget})` is not valid: sample {self.lengths.index(longest)} of"
                f" length {longest} alone costs {self.min_tokens} ({self.cost!r} cost). Expected an integer"
                f" >= {self.min_tokens} (`min_tokens`: the cost of the longest sample alone)."
            )
        return budget


_TRIALS = [0]  # open `heaviest_batches_first` blocks


@contextmanager
def heaviest_batches_first() -> Iterator[None]:
    """Within the block, every :class:`TokenBudgetSampler` yields its batches heaviest first.

    For a tuner's trials. A switch of the class, not an attribute of one sampler: the trials' samplers are
    built by the user's ``*_dataloader`` hooks, and Lightning re-creates them under DDP, after any attribute
    could be set.
    """
    _TRIALS[0] += 1
    try:
        yield
    finally:
        _TRIALS[0] -= 1


class _EpochSampler(Sampler[int]):
    """The epoch, where Lightning sets it (``batch_sampler.sampler.set_epoch``).

    Iterates the indices in order.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.size))

    def __len__(self) -> int:
        return self.size


def _world() -> tuple[int, int]:
    """``(world size, rank)`` of ``torch.distributed`` where initialized, else ``(1, 0)``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


def _as_lengths(lengths: object) -> list[int]:
    """``lengths`` as a list of ``int``.

    Any collection (list, numpy array, tensor) of whole numbers, 0 to 2**53.
    """
    if not is_collection(lengths) or isinstance(lengths, (AbstractSet, Mapping)):  # a set has no index order
        raise TypeError(
            f"`{_OWNER}(lengths={shown(lengths)})` is not valid. Expected a sequence of non-negative"
            " integers."
        )
    tolist = getattr(lengths, "tolist", None)  # numpy arrays and tensors: Python numbers at once
    values = tolist() if callable(tolist) else list(lengths)
    if not isinstance(values, list):  # a `tolist` that is not numpy's or torch's
        values = list(lengths)
    found = []
    for index, value in enumerate(values):
        number = as_whole_number(value)
        if number is None:
            raise TypeError(
                f"`{_OWNER}(lengths=...)` is not valid: lengths[{index}] is {shown(value)}. Expected a"
                " non-negative integer (a whole number of any numeric type)."
            )
        if not 0 <= number <= MAX_LENGTH:
            raise ValueError(
                f"`{_OWNER}(lengths=...)` is not valid: lengths[{index}] is {shown(value)}. Expected a"
                " non-negative integer up to 2**53 (the longest length a float holds exactly: costs are"
                " floats)."
            )
        found.append(number)
    return found


def _integer(value: Any) -> Any:
    """An integer of any type (numpy's, a 0-d tensor) as an ``int``.

    Anything else as it is, for the checks.
    """
    number = as_integer(value)
    return value if number is None else number


def _is_order(value: object) -> bool:
    """Whether ``value`` could be a ``DataLoader``'s sampler although no ``Sampler``.

    That is, an iterable of indices.
    """
    return isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping))


def _check_finite_cost(lengths: list[int], cost: Cost, quadratic: float) -> None:
    """Every batch's cost is a finite float: the whole dataset's is.

    The whole dataset's cost is the largest any batch (or a tuner) can ask.
    """
    if math.isinf(batch_cost(lengths, cost=cost, quadratic=quadratic)):
        longest = max(lengths)
        raise ValueError(
            f"`{_OWNER}(quadratic={quadratic!r})` is not valid: with samples of up to {longest} tokens the"
            f" cost of the {len(lengths)} samples together is beyond a float's range. Expected a smaller"
            " finite number >= 0 (the weight of a term in L**2 per sample)."
        )


def _check_dataset_size(sampler: DistributedSampler[Any], size: int) -> None:
    """The injected sampler's dataset has as many samples as ``lengths`` (where it has a length)."""
    try:
        samples = len(sampler.dataset)  # type: ignore[arg-type]
    except TypeError:
        return
    if samples != size:
        raise ValueError(
            f"`{_OWNER}(sampler={type(sampler).__name__}(...))` is not valid: its dataset has {samples}"
            f" samples and `lengths` has {size}. Expected `lengths` to hold the length of every sample of"
            " the loader's dataset."
        )
