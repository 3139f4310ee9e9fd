"""Batch-size tuning: a pure search (``search.py``) driven by real trials run through Lightning (``tuner.py``)."""

from lightning_gpumem.tuning.search import SearchResult, Trial, search_batch_size
from lightning_gpumem.tuning.tuner import BatchSizeTuner

__all__ = ["BatchSizeTuner", "SearchResult", "Trial", "search_batch_size"]
