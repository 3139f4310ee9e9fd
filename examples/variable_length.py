"""Variable-length text: tune a token budget (or a worst-case batch size), then train a whole epoch without an OOM.

    python examples/variable_length.py                  # TokenBudgetSampler + its max_tokens tuned for a 4 GiB budget
    python examples/variable_length.py --mode batch     # a fixed batch size, tuned on the longest samples
    python examples/variable_length.py --mode first     # a fixed batch size tuned on the first batches (the trap)

Most of the dataset's samples are 16 to 64 tokens long and one in 200 is 512 (text is skewed like that). With a fixed
batch size tuned on whatever batches come first, a batch holding a long sample later in the epoch runs out of memory
(``--mode first``; the tuner warns that the batches changed shape). ``length_fn`` makes the trials run the longest
samples, so the batch size holds for the worst batch (``--mode batch``), but most batches then use a fraction of the
memory. A :class:`TokenBudgetSampler` forms batches of about ``max_tokens`` padded tokens each, and the tuner finds
the largest ``max_tokens`` whose heaviest batches fit (``--mode tokens``): more tokens per step for the same memory.

On a GPU the trials are capped at the budget and run out of memory for real. On a CPU (or with ``--simulate``) a
simulated GPU stands in (``examples/_simulated_gpu.py``): every padded token of a batch takes
``SIMULATED_TOKEN_BYTES`` of it, and past the cap the model raises the ``OutOfMemoryError`` a GPU would. The search,
its trials and the size chosen are the tuner's own; the memory is simulated.
"""

from __future__ import annotations

import argparse
import logging
import time

import lightning as L
import numpy as np
import torch
from _simulated_gpu import GIB, MIB, SimulatedGPU
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_gpumem import BatchSizeTuner, TokenBudgetSampler
from lightning_gpumem._core.units import parse_budget

VOCAB, MAX_LEN = 1024, 512
SIMULATED_TOKEN_BYTES = 2 * MIB  # the activations of one padded token on the simulated GPU


def skewed_lengths(n: int, seed: int = 0) -> list[int]:
    """Most samples 16 to 64 tokens long, one in 200 ``MAX_LEN`` long."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(16, 65, n)
    lengths[rng.choice(n, n // 200, replace=False)] = MAX_LEN
    return [int(x) for x in lengths]


class Texts(Dataset):
    """Random token sequences of the given lengths (drawn from the index, so a sample is the same every time)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(index)
        return {"input_ids": torch.randint(1, VOCAB, (self.lengths[index],), generator=g)}


def pad(samples: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """Pad to the batch's longest sample (id 0)."""
    return nn.utils.rnn.pad_sequence([s["input_ids"] for s in samples], batch_first=True)


class TinyLM(L.LightningModule):
    """A one-layer transformer language model; ``simulated``: it moves that GPU's memory per padded token."""

    def __init__(
        self, mode: str, batch_size: int = 2, max_tokens: int = 1024, simulated: SimulatedGPU | None = None
    ):
        super().__init__()
        self.save_hyperparameters(ignore="simulated")  # the tuner writes what it finds to hparams
        self.lengths = skewed_lengths(2048)
        self.embed = nn.Embedding(VOCAB, 64)
        self.layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
        self.head = nn.Linear(64, VOCAB)
        self.simulated = simulated
        self.tokens = 0  # real (not padded) tokens trained on

    def on_train_start(self):
        self.tokens = 0  # the fit's tokens, not the tuner's trials' (which skip this hook)

    def training_step(self, batch, batch_idx):
        if self.simulated is not None:
            self.simulated.spike(
                batch.numel() * SIMULATED_TOKEN_BYTES
            )  # raises OutOfMemoryError past the cap
        inputs, targets = batch[:, :-1], batch[:, 1:]
        mask = nn.Transformer.generate_square_subsequent_mask(inputs.shape[1])
        logits = self.head(self.layer(self.embed(inputs), src_mask=mask, is_causal=True))
        # a token mean: every real token weighs the same, whatever the batch's size (targets of 0 are padding)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=0)
        self.tokens += int((batch != 0).sum())
        self.log("train_loss", loss, batch_size=len(batch))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        data = Texts(self.lengths)
        if self.hparams.mode == "tokens":
            sampler = TokenBudgetSampler(self.lengths, max_tokens=self.hparams.max_tokens, seed=0)
            return DataLoader(data, batch_sampler=sampler, collate_fn=pad)
        return DataLoader(data, batch_size=self.hparams.batch_size, shuffle=True, collate_fn=pad)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=("tokens", "batch", "first"), default="tokens")
    parser.add_argument("--budget", default="4GiB", help="memory budget: '24GiB', '16GB' or bytes")
    parser.add_argument("--simulate", action="store_true", help="simulate the GPU (the default without one)")
    parser.add_argument(
        "--seed", type=int, default=0, help="the shuffle's seed: the same batches on every run"
    )
    args = parser.parse_args()
    L.seed_everything(args.seed)
    logging.getLogger("lightning.pytorch").setLevel(logging.INFO)

    simulated = None
    if args.simulate or not torch.cuda.is_available():
        simulated = SimulatedGPU(
            total=80 * GIB, limit=parse_budget(args.budget, 80 * GIB, "variable_length")
        )
        simulated.install()
        print(
            f"simulated: {simulated.why}; a simulated 80 GiB card capped at {simulated.limit / GIB:.1f} GiB stands"
            f" in, each padded token taking {SIMULATED_TOKEN_BYTES // MIB} MiB of it."
        )
    tuner = {
        "tokens": BatchSizeTuner(budget=args.budget, batch_arg_name="max_tokens"),
        "batch": BatchSizeTuner(budget=args.budget, length_fn="input_ids"),
        "first": BatchSizeTuner(budget=args.budget),
    }[args.mode]
    model = TinyLM(args.mode, simulated=simulated)
    trainer = L.Trainer(
        accelerator="cpu" if simulated else "auto",
        max_epochs=1,
        logger=False,
        callbacks=[tuner],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    try:
        trainer.fit(model)
    except torch.OutOfMemoryError as error:
        print(f"\nthe epoch ran out of memory at step {trainer.global_step}: {error}")
        raise SystemExit(1) from None
    seconds = time.perf_counter() - start
    what = (
        f"max_tokens={model.hparams.max_tokens}"
        if args.mode == "tokens"
        else f"batch_size={model.hparams.batch_size}"
    )
    print(
        f"\n{what}: one epoch, {trainer.global_step} steps, {model.tokens} tokens, no OOM ({seconds:.1f} s)"
    )
    print(f"tokens per step: {model.tokens / max(1, trainer.global_step):.0f}")
    if simulated:
        print(f"(simulated: {simulated.why}; the memory above is the simulated GPU's, not measured)")


if __name__ == "__main__":
    main()
