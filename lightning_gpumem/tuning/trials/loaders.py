"""The fit's dataloaders as the trials need them.

Built, dropped, rebuilt at a new size, their workers stopped. Where the samples' lengths are known, the
trials' loaders draw the longest samples first.

Lightning has no public API to drop a fit loop's loaders and build them again at another batch size, and
torch none to stop a ``DataLoader``'s workers without waiting for them: this module reaches into the fit
loop's ``_data_source``, ``_combined_loader`` and ``_data_fetcher``, Lightning's ``_ModeIterator`` and
torch's ``_MultiProcessingDataLoaderIter``, and rebuilds a loader with another sampler by Lightning's
``_update_dataloader``. Each access carries a ``# private:`` comment;
``tests/pl/test_lightning_internals.py`` fails loudly when an upgrade breaks one.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.data import _set_sampler_epoch

from lightning_gpumem._pl.patching import patched


def train_source_is_module(trainer: pl.Trainer) -> bool:
    """Whether the training dataloader comes from a LightningModule or DataModule method.

    If so, it can be rebuilt.
    """
    return bool(trainer.fit_loop._data_source.is_module())  # private: the fit loop's `_DataLoaderSource`


def dataset_length(loaders: Any) -> int | None:
    """Samples in the dataset of the first of ``loaders`` (``None``: no length)."""
    dataset = getattr(_first_loader(loaders), "dataset", None)
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return None
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return None


MAX_DRAWS = 16
"""With ``length_fn``, a sampler that draws more than this many times its dataset's samples an epoch (or
without end) is left as it is: its draws are not counted."""


def samples_per_rank(loaders: Any, world_size: int) -> int | None:
    """Samples an epoch of the first of ``loaders`` draws on each rank (``None``: not known).

    Its sampler's length, else its dataset's: a sampler that draws a part of the dataset
    (``SubsetRandomSampler``) or draws with replacement (``WeightedRandomSampler(num_samples=...)``) bounds
    the batch a loader can fill, not the dataset. The user's own ``DistributedSampler`` draws one rank's
    share already; any other sampler is split by Lightning's, which pads every rank to the same count.
    """
    loader = _first_loader(loaders)
    sampler = getattr(loader, "sampler", None)
    samples = None
    if isinstance(loader, torch.utils.data.DataLoader) and loader.batch_size is not None:
        with suppress(TypeError):  # a sampler without a length
            samples = len(sampler)  # type: ignore[arg-type]
    samples = dataset_length(loaders) if samples is None else samples
    if samples is None or isinstance(sampler, torch.utils.data.DistributedSampler):
        return samples
    return math.ceil(samples / max(1, world_size))


def drops_last(loaders: Any) -> bool:
    """Whether the first of ``loaders`` drops a last batch that is not full.

    As ``DataLoader(drop_last=True)`` does.
    """
    return bool(getattr(_first_loader(loaders), "drop_last", False))


def _first_loader(loaders: Any) -> Any:
    if isinstance(loaders, dict):
        return _first_loader(next(iter(loaders.values()), None))
    if isinstance(loaders, (list, tuple)):
        return _first_loader(loaders[0]) if loaders else None
    if hasattr(loaders, "iterables"):  # a CombinedLoader
        return _first_loader(loaders.iterables)
    return loaders


def dataloaders_loaded(trainer: pl.Trainer) -> bool:
    """Whether the fit loop has built its training dataloader yet (not before the loop starts running)."""
    return trainer.fit_loop._combined_loader is not None  # private attribute of the fit loop


def unload_dataloaders(trainer: pl.Trainer, stopping: list[Any] | None = None) -> None:
    """Stop the loaders' iterators and workers (an OOM skips the loops' own teardown) and drop the loaders.

    The fit loop then builds them itself when it starts, as it would have without tuning. With ``stopping``,
    worker processes are told to exit but not waited for (a worker finishes the batch it is collating first,
    0.4 s for ResNet-50's 531 images): their iterators go to ``stopping`` for :func:`join_workers` to reap
    later.
    """
    for loop in (trainer.fit_loop, trainer.fit_loop.epoch_loop.val_loop):
        if stopping is not None:
            stopping.extend(_signal_workers_to_exit(loop._combined_loader))  # private, see below
        fetcher = getattr(loop, "_data_fetcher", None)  # private: the loop's `_DataFetcher`
        if fetcher is not None:
            fetcher.teardown()
            loop._data_fetcher = None  # private: `setup_data` makes a new one with the new loader
        combined = loop._combined_loader  # private
        if combined is not None:
            combined.reset()
        # private: force a reload (Lightning's `_reset_dataloaders` does the same)
        loop._combined_loader = None


def _signal_workers_to_exit(combined: Any) -> list[Any]:
    """Tell the worker processes of ``combined``'s iterators to exit, without joining them.

    Returns the iterators. The first half of torch's ``_MultiProcessingDataLoaderIter._shutdown_workers``
    (private; the second half, in :func:`join_workers`, is that method itself). On any surprise in those
    internals nothing is signalled and the loop's own teardown stops the workers, waiting for them.
    """
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    if combined is None:
        return []
    # private: Lightning's `_ModeIterator` of the running loop
    mode_iterator = getattr(combined, "_iterator", None)
    candidates = list(getattr(mode_iterator, "iterators", None) or [])
    for loader in combined.flattened:
        # persistent workers
        if isinstance(getattr(loader, "_iterator", None), _MultiProcessingDataLoaderIter):
            candidates.append(loader._iterator)
            loader._iterator = None
    signalled = []
    for iterator in {id(it): it for it in candidates}.values():
        if not isinstance(iterator, _MultiProcessingDataLoaderIter) or iterator._shutdown:
            continue
        # torch internals: `join_workers` (or `__del__`) shuts the workers down in full
        with suppress(Exception):
            iterator._workers_done_event.set()
            for worker_id in range(len(iterator._workers)):
                if iterator._persistent_workers or iterator._workers_status[worker_id]:
                    iterator._mark_worker_as_unavailable(worker_id, shutdown=True)
        signalled.append(iterator)
    return signalled


def join_workers(stopping: list[Any]) -> None:
    """Reap the worker processes :func:`unload_dataloaders` told to exit (by now, they have)."""
    while stopping:
        stopping.pop()._shutdown_workers()


def reload_dataloaders(trainer: pl.Trainer, validation: bool) -> None:
    """Rebuild the train (and val) dataloaders so they use the batch size just written."""
    unload_dataloaders(trainer)
    trainer.fit_loop.setup_data()  # Lightning's `_reset_dataloaders` does the same
    if validation:
        trainer.fit_loop.epoch_loop.val_loop.setup_data()


def set_sampler_epochs(trainer: pl.Trainer, epoch: int) -> None:
    """Set ``epoch`` on the samplers of the fit loop's training loaders.

    As the loop does on those it builds.
    """
    for loader in trainer.fit_loop._combined_loader.flattened:  # type: ignore[union-attr]  # private
        _set_sampler_epoch(loader, epoch)


def loader_generators(trainer: pl.Trainer) -> list[torch.Generator]:
    """The ``torch.Generator`` objects of the user's train and val dataloaders (and their samplers)."""
    sources = [trainer.fit_loop._data_source]  # private, see `train_source_is_module`
    if trainer.enable_validation:
        sources.append(trainer.fit_loop.epoch_loop.val_loop._data_source)  # private
    found: dict[int, torch.Generator] = {}
    for source in sources:
        if not source.is_module():
            continue
        try:
            loaders = source.dataloader()
        except Exception:  # noqa: S112 - a loader that cannot be built now holds no generator to keep
            continue
        for loader in _flatten_loaders(loaders):
            for owner in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
                for candidate in (
                    getattr(owner, "generator", None),
                    getattr(getattr(owner, "sampler", None), "generator", None),
                ):
                    if isinstance(candidate, torch.Generator):
                        found[id(candidate)] = candidate
    return list(found.values())


def _flatten_loaders(loaders: Any) -> Iterator[Any]:
    if isinstance(loaders, dict):
        for value in loaders.values():
            yield from _flatten_loaders(value)
    elif isinstance(loaders, (list, tuple)):
        for value in loaders:
            yield from _flatten_loaders(value)
    elif hasattr(loaders, "flattened"):
        yield from loaders.flattened
    elif loaders is not None:
        yield loaders


class _InOrder(torch.utils.data.DistributedSampler):
    """Yields the given indices in order (a trial's longest samples first).

    It yields this rank's every ``num_replicas``-th. A ``DistributedSampler``, so that Lightning takes it as
    the loader's distributed sampler and does not wrap it in its own, which shuffles a training loader's
    order.
    """

    def __init__(self, dataset: Any, order: list[int], num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
        self.order = order[rank::num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


@contextmanager
def longest_first(trainer: pl.Trainer, order_for: Callable[[Any], list[int] | None]) -> Iterator[list[str]]:
    """While in the block, the fit's train and val dataloaders draw their samples in ``order_for(dataset)``.

    The user's ``*_dataloader`` hook builds each loader as usual; a ``DataLoader`` with a batch size and a
    map-style dataset is then built again with the same arguments but a sampler yielding
    ``order_for(dataset)`` (Lightning's own re-instantiation). Only the indices the loader's own sampler
    yields are drawn (a ``SubsetRandomSampler``'s split, a ``DistributedSampler``'s share); under DDP, where
    the loader's sampler is not distributed yet, each rank takes every ``world_size``-th of that order, so
    every rank's trials run some of the longest samples. Loaders with a batch sampler of their own, iterable
    datasets and datasets ``order_for`` gives no order for are left as they are. Yields why loaders were left
    as they are, for a warning.
    """
    from lightning.pytorch.utilities.data import _update_dataloader

    skipped: list[str] = []
    kwargs = trainer.distributed_sampler_kwargs or {}  # what Lightning gives its DistributedSampler
    replicas, rank = int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))

    def reorder(loader: Any) -> Any:
        if not isinstance(loader, torch.utils.data.DataLoader):
            return loader
        if loader.batch_size is None:
            skipped.append(
                f"{type(loader.batch_sampler).__name__}, the loader's batch sampler, decides its batches"
            )
            return loader
        dataset = loader.dataset
        if isinstance(dataset, torch.utils.data.IterableDataset):
            skipped.append(f"{type(dataset).__name__} is an iterable dataset: its order is its own")
            return loader
        order = order_for(dataset)
        if order is None:
            return loader
        base = loader.sampler
        split = isinstance(base, torch.utils.data.DistributedSampler)
        whole = isinstance(base, (torch.utils.data.SequentialSampler, torch.utils.data.RandomSampler))
        if not (whole and len(base) == len(dataset)):  # type: ignore[arg-type]  # a split: only its samples
            # a sampler without a length may draw without end
            cap = MAX_DRAWS * max(1, len(dataset))  # type: ignore[arg-type]
            # the session puts back the RNG streams it draws
            drawn = Counter(itertools.islice(iter(base), cap + 1))
            if sum(drawn.values()) > cap:
                skipped.append(
                    f"{type(base).__name__}, the loader's sampler, draws more than {MAX_DRAWS}x its dataset"
                )
                return loader
            # as often as the sampler draws it (replacement)
            order = [i for i in order for _ in range(drawn[i])]
        sampler = _InOrder(dataset, order) if split else _InOrder(dataset, order, replicas, rank)
        try:
            return _update_dataloader(loader, sampler)  # private: Lightning's re-instantiation
        except Exception as error:  # a loader Lightning cannot rebuild: its trials draw what it yields first
            skipped.append(f"{type(loader).__name__} could not be rebuilt ({error!r})")
            return loader

    def wrap(source: Any) -> Callable[[], Any]:
        built = source.dataloader

        def dataloader() -> Any:
            return apply_to_collection(built(), torch.utils.data.DataLoader, reorder)

        return dataloader

    sources = [trainer.fit_loop._data_source, trainer.fit_loop.epoch_loop.val_loop._data_source]  # private
    with ExitStack() as stack:
        for source in sources:
            if source.is_module():
                stack.enter_context(patched(source, "dataloader", wrap(source)))
        yield skipped


def token_sampler(loaders: Any) -> Any:
    """The ``TokenBudgetSampler`` of the first of ``loaders``, if any.

    The class is :class:`~lightning_gpumem.tuning.lengths.token_budget.TokenBudgetSampler`.
    """
    from lightning_gpumem.tuning.lengths.token_budget import TokenBudgetSampler

    sampler = getattr(_first_loader(loaders), "batch_sampler", None)
    return sampler if isinstance(sampler, TokenBudgetSampler) else None


def first_batch(loaders: Any) -> Any:
    """The first batch of the first of ``loaders`` (``None``: it makes none)."""
    loader = _first_loader(loaders)
    if loader is None:
        return None
    return next(iter(loader), None)


def val_loaders(trainer: pl.Trainer) -> Any:
    """The user's validation dataloaders, built by their hook now (``None``: there are none)."""
    source = trainer.fit_loop.epoch_loop.val_loop._data_source  # private, as the training one's
    return source.dataloader() if source.is_defined() else None


def train_loaders(trainer: pl.Trainer) -> Any:
    """The user's training dataloaders, built by their hook now (``None``: they cannot be built)."""
    return trainer.fit_loop._data_source.dataloader()  # private, see `train_source_is_module`
