"""AutoMicrobatch: one batch of 4x longer sequences would end the run; split into micro-batches, it does not.

    python examples/auto_microbatch.py              # 64 steps; batch 8 has sequences 4x longer than the others
    python examples/auto_microbatch.py --without    # the same run without AutoMicrobatch: it dies at batch 8

On a GPU the run is capped with `MemoryBudget` halfway between what a normal batch and the long batch need (both
measured first, outside the fit), so the long batch really runs out of memory. On a CPU there is no allocator to
run out of: a long batch raises the `OutOfMemoryError` a GPU would (`--simulate`, on by default without a GPU).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_gpumem import AutoMicrobatch, MemoryBudget, MemoryMonitor

VOCAB, WIDTH, SEQ, BATCH, STEPS, LONG_BATCH = 512, 128, 64, 16, 64, 8


class Sequences(Dataset):
    """``STEPS`` batches of random tokens, already batched; batch ``LONG_BATCH`` is 4x longer."""

    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, index: int) -> torch.Tensor:
        length = SEQ * (4 if index == LONG_BATCH else 1)
        return torch.randint(0, VOCAB, (BATCH, length + 1), generator=torch.Generator().manual_seed(index))


class TinyLM(L.LightningModule):
    """A small causal transformer; ``simulate_above`` tokens in one (micro-)batch raise an OOM (CPU demo)."""

    def __init__(self, simulate_above: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        # No dropout: a split batch then takes the unsplit step exactly (dropout draws other numbers for a split batch).
        layer = nn.TransformerEncoderLayer(
            WIDTH, nhead=4, dim_feedforward=4 * WIDTH, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.simulate_above = simulate_above

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        return self.head(self.encoder(self.embed(tokens), mask=mask, is_causal=True))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.simulate_above is not None and batch.numel() > self.simulate_above:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (simulated: {batch.numel()} tokens in one batch)"
            )
        logits = self(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Sequences(), batch_size=None)


def step_peak(model: TinyLM, batch: torch.Tensor, autocast: torch.dtype | None = None) -> int:
    """Peak reserved bytes (what a budget caps) of one forward, backward and AdamW step of ``batch`` on the GPU."""
    optimizer = model.configure_optimizers()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=autocast or torch.float32, enabled=autocast is not None):
        loss = model.training_step(batch.cuda(), 0)
    loss.backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_reserved()


def budget_between_normal_and_long(autocast: torch.dtype | None = None) -> str:
    """A budget above a normal batch's peak and below the long batch's, measured on this GPU (``autocast``: under
    mixed precision of that dtype)."""
    model = TinyLM().cuda()
    model.log = lambda *args, **kwargs: None  # outside a Trainer
    normal = step_peak(model, Sequences()[0], autocast)
    long = step_peak(model, Sequences()[LONG_BATCH], autocast)
    del model
    torch.cuda.empty_cache()
    return f"{(normal + long) // 2 // 2**20}MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--without", action="store_true", help="run without AutoMicrobatch (the run dies)")
    parser.add_argument(
        "--simulate", action="store_true", help="simulate the OOM (the default without a GPU)"
    )
    args = parser.parse_args()
    gpu = torch.cuda.is_available() and not args.simulate
    callbacks: list[L.Callback] = [MemoryMonitor(log_every_n_steps=8)]
    if gpu:
        callbacks.append(MemoryBudget(budget_between_normal_and_long()))
    if not args.without:
        callbacks.append(AutoMicrobatch())
    model = TinyLM(simulate_above=None if gpu else 2 * BATCH * (SEQ + 1))
    trainer = L.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        max_steps=STEPS,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        log_every_n_steps=8,
    )
    trainer.fit(model)
    print(f"finished all {trainer.global_step} steps")


if __name__ == "__main__":
    main()
