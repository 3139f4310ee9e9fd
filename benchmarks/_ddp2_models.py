"""The models and data of ``ddp2.py``: a small GPT-style decoder on random tokens, with simulated OOMs for ``--cpu``.

Deterministic on a GPU under ``Trainer(deterministic=True)``: attention is written out (matmul, mask, softmax)
instead of ``scaled_dot_product_attention``, whose fused backward kernels are not deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    d_model: int
    layers: int
    heads: int
    seq: int


CPU_GPT = GPTConfig(vocab=64, d_model=32, layers=2, heads=2, seq=16)
GPU_GPT = GPTConfig(vocab=8192, d_model=512, layers=6, heads=8, seq=256)  # about 25M parameters
SMALL_GPU_GPT = GPTConfig(vocab=1024, d_model=128, layers=2, heads=4, seq=64)  # reserves well under 0.5 GiB


def simulated_oom(rank: int) -> torch.OutOfMemoryError:
    return torch.cuda.OutOfMemoryError(f"CUDA out of memory (simulated on rank {rank})")


class RandomTokens(Dataset):
    """``n`` samples of ``seq + 1`` random tokens; sample ``i`` is the same in every process."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int = 0) -> None:
        self.n, self.seq, self.vocab, self.seed = n, seq, vocab, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randint(0, self.vocab, (self.seq + 1,), generator=generator)


class RankBatches(Dataset):
    """Whole batches, one per step, chosen per rank: rank 1's batch at ``long_step`` has ``factor`` times the samples.

    Load with ``DataLoader(batch_size=None)`` and ``Trainer(use_distributed_sampler=False)``.
    """

    def __init__(
        self, rank: int, steps: int, batch: int, seq: int, vocab: int, long_step: int | None, factor: int = 4
    ) -> None:
        self.rank, self.steps, self.batch, self.seq, self.vocab = rank, steps, batch, seq, vocab
        self.long_step, self.factor = long_step, factor

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, index: int) -> torch.Tensor:
        size = self.batch * (self.factor if self.rank == 1 and index == self.long_step else 1)
        generator = torch.Generator().manual_seed(1000 * index + self.rank)
        return torch.randint(0, self.vocab, (size, self.seq + 1), generator=generator)


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attention = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (attention @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class TinyGPT(pl.LightningModule):
    """A causal decoder; next-token cross-entropy (a mean over the batch, so a split step equals the unsplit one).

    Args:
        config: the sizes.
        batch_size: the training loader's batch size (what ``BatchSizeTuner`` tunes).
        n: training samples (all ranks together; Lightning's ``DistributedSampler`` halves them per rank).
        oom_above: per rank, the largest batch that "fits" (``--cpu``: larger ones raise ``OutOfMemoryError``).
        optimizer: ``"adamw"`` or ``"sgd"``.
        batches: whole per-rank batches (a `RankBatches`) instead of `RandomTokens`.
    """

    def __init__(
        self,
        config: GPTConfig,
        batch_size: int = 2,
        n: int = 512,
        oom_above: dict[int, int] | None = None,
        optimizer: str = "adamw",
        batches: RankBatches | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.batch_size = batch_size
        self.oom_above = oom_above or {}
        self.optimizer_name = optimizer
        self.data = RandomTokens(n, config.seq, config.vocab)
        self.batches = batches
        self.embed = nn.Embedding(config.vocab, config.d_model)
        self.pos = nn.Parameter(torch.zeros(config.seq, config.d_model))
        self.blocks = nn.ModuleList(Block(config.d_model, config.heads) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        limit = self.oom_above.get(self.global_rank)
        if limit is not None and batch.shape[0] > limit:
            raise simulated_oom(self.global_rank)
        logits = self(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        self.log(
            "train_loss", loss, sync_dist=True
        )  # a collective in the step: must not pair with an agreement
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        if self.batches is not None:
            return DataLoader(self.batches, batch_size=None)
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)


def calibrate(config: GPTConfig, batch: int, device: torch.device) -> tuple[int, int]:
    """Reserved peaks (bytes) of one plain bf16 SGD step at ``batch`` and ``2 * batch`` on ``device``."""
    with torch.cuda.device(device):  # nothing on the process's current device (rank 1 must not touch GPU 0)
        model = TinyGPT(config).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        peaks = []
        for size in (batch, 2 * batch, batch, 2 * batch):  # second round: optimizer state and caches settled
            tokens = torch.randint(0, config.vocab, (size, config.seq + 1), device=device)
            torch.cuda.reset_peak_memory_stats(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, config.vocab), tokens[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del logits, loss, tokens
            torch.cuda.synchronize(device)
            peaks.append(torch.cuda.max_memory_reserved(device))
        del model, optimizer
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return peaks[2], peaks[3]
