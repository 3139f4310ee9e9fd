"""What the tuner's tests share: a tuner on a fake probe, models that drive the fake allocator, a quiet Trainer."""

from __future__ import annotations

import torch
from lightning.pytorch import Trainer
from torch.utils.data import Dataset

from lightning_gpumem import BatchSizeTuner
from tests.helpers.fakes import FakeProbe
from tests.helpers.models import OOMModel
from tests.helpers.trainer import quiet_trainer

__all__ = [
    "CPU_SEARCH",
    "CappedFakeProbe",
    "FakeTuner",
    "FragileModel",
    "MemoryModel",
    "OOMModel",
    "Texts",
    "pad",
    "tuner_trainer",
]

CPU_SEARCH = 10**6
"""A ``max_val`` above every test dataset: on a CPU the tuner searches only where ``max_val`` asks it to (the tests'
simulated OOMs bound the search), and keeps the user's size otherwise."""


class FakeTuner(BatchSizeTuner):
    def __init__(self, probe: FakeProbe, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fake = probe


class MemoryModel(OOMModel):
    """Drives a fake allocator: `per_sample` bytes per sample on top of the fake's base."""

    def __init__(self, probe: FakeProbe, per_sample: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fake, self.per_sample = probe, per_sample

    def training_step(self, batch, batch_idx):
        need = batch.shape[0] * self.per_sample
        if self.fake.allocated + need > getattr(self.fake, "cap", self.fake.total):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake allocator)")
        self.fake.spike(need)
        return super().training_step(batch, batch_idx)


def tuner_trainer(tuner, **kwargs) -> Trainer:
    """A quiet one-epoch CPU Trainer with ``tuner`` as its callback (``kwargs`` override)."""
    return quiet_trainer(**{"max_epochs": 1, "callbacks": [tuner], **kwargs})


class CappedFakeProbe(FakeProbe):
    """A fake CUDA allocator with a per-process cap; sizes in `holes` run out of memory although larger ones run
    (an allocator layout that happens to fragment at that size)."""

    def __init__(self, holes: tuple[int, ...] = (), **kwargs) -> None:
        super().__init__(**kwargs)
        self.device = torch.device("cuda")  # only its type is read; nothing runs on it
        self.cap = self.total
        self.fractions: list[float] = []
        self.holes = holes

    def set_memory_fraction(self, fraction: float) -> float:
        previous = self.cap / self.total
        self.fractions.append(fraction)
        self.cap = fraction * self.total
        return previous


class FragileModel(MemoryModel):
    def training_step(self, batch, batch_idx):
        if batch.shape[0] in self.fake.holes:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake fragmentation at this size)")
        return super().training_step(batch, batch_idx)


class Texts(Dataset):
    """Samples of ``lengths[i]`` ones under ``input_ids``: variable-length text, padded by :func:`pad`."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.ones(self.lengths[index], dtype=torch.long)}


def pad(samples: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """The collate function of :class:`Texts`: ``input_ids`` padded to the longest sample."""
    return torch.nn.utils.rnn.pad_sequence([s["input_ids"] for s in samples], batch_first=True)
