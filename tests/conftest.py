import gc
import logging
import sys
import warnings

import pytest
import torch

from tests.helpers.trainer import make_trainer

__all__ = ["make_trainer"]  # the fixture, for every test under tests/


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _quiet_lightning():
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*isinstance.*LeafSpec.*")
        warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
        warnings.filterwarnings("ignore", message=".*litlogger.*")
        yield


@pytest.fixture(autouse=True)
def _gpu_given_back(request: pytest.FixtureRequest):
    """After a GPU test, pass or fail, the next one starts with the whole card and an empty cache.

    A failed test's frames (its trainer, model and CUDA tensors) stay alive through ``sys.last_traceback``,
    which pytest sets for post-mortem debugging, and a memory fraction it set stays set: the next test's
    budget would be eaten by them.
    """
    yield
    if "gpu" not in request.keywords or not torch.cuda.is_available():
        return
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    gc.collect()
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()
