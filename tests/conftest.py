import logging
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
