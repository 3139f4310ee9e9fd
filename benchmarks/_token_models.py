"""Data and model of ``benchmarks/token_budget.py``: variable-length token sequences and a GPT-style decoder.

Plain PyTorch (no Lightning), like ``_tuner_models.py``, whose ``GPT`` and ``Block`` it reuses.

* **Lengths** (:func:`make_lengths`, numpy generator seeded by ``seed``): ``zipf``: ``min(max_len, 16 * zipf(a))``
  (``a`` 1.3 by default: most samples short, a heavy tail clipped at ``max_len``); ``skewed``: 98% uniform in
  ``[16, 128]``, 2% exactly ``max_len``.
* **Dataset** (:class:`Tokens`): sample ``i`` is ``{"input_ids": LongTensor[L_i]}``, random ids in ``[1, vocab)``
  (0 is the padding id), sliced from one tensor generated once (``torch.Generator`` seeded by ``seed``), so a length
  scan (``BatchSizeTuner(length_fn="input_ids")``) costs microseconds per sample.
* **Collate** (:func:`collate`): pads to the batch's longest sample with id 0; the causal-LM inputs are the first
  ``L_max - 1`` positions, the targets the last ``L_max - 1`` with padding set to -100 (ignored by the loss); also
  ``"lengths"`` (the samples' lengths, on the CPU, for the benchmark's own counts).
* **Model** (:func:`build_model`): ``_tuner_models.GPT`` (pre-norm blocks, GELU MLP, tied head), whose positional
  table has ``max_len`` rows and whose forward takes any length up to it. ``attention="sdpa"``: its blocks'
  causal ``F.scaled_dot_product_attention`` (flash or memory-efficient kernels: memory linear in ``L``);
  ``"eager"``: :class:`EagerBlock`, ``softmax(Q K^T / sqrt(d_head))`` materialised per head (memory quadratic in
  ``L``).
* **Loss** (:func:`compute_loss`): next-token cross-entropy, a token mean: the sum of the real target tokens'
  losses over their number (``ignore_index=-100``), whatever the batch's size.
* **Simulated OOM** (``--quick``; a CPU never runs out of memory): :func:`check_simulated_oom` raises
  ``torch.cuda.OutOfMemoryError`` where a batch's simulated memory, ``n * L_max * (1 + q * L_max)`` "token units"
  (``q`` the model's :func:`auto_quadratic` with eager attention, 0 with sdpa), is above ``Setup.simulated_limit``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from _tuner_models import GPT, Block
from torch import nn
from torch.utils.data import Dataset

PAD_ID = 0
IGNORE_INDEX = -100
DATASETS = ("zipf", "skewed")
ATTENTIONS = ("sdpa", "eager")
DEFAULT_SAMPLES = 8000  # full size: (sdpa, zipf) epochs of about 20-30 s on an H100 (see token_budget.py)
QUICK_SAMPLES = 600
SIMULATED_OOM_MESSAGE = (
    "CUDA out of memory: too many padded tokens in the batch (simulated, token_budget.py --quick)"
)


@dataclass(frozen=True)
class Setup:
    """The model's and the data's sizes; ``simulated_limit`` (``--quick``): the simulated memory, in token units."""

    vocab: int
    d_model: int
    layers: int
    heads: int
    max_len: int
    samples: int
    zipf_a: float = 1.3
    seed: int = 0
    simulated_limit: int | None = None


def setup(quick: bool, samples: int | None, max_len: int | None, zipf_a: float = 1.3) -> Setup:
    """Full size (d_model 768, 12 layers, 12 heads, vocabulary 32768: about 110M parameters) or tiny (``quick``)."""
    if quick:
        return Setup(256, 64, 2, 4, max_len or 256, samples or QUICK_SAMPLES, zipf_a, simulated_limit=4096)
    return Setup(32768, 768, 12, 12, max_len or 2048, samples or DEFAULT_SAMPLES, zipf_a)


def describe(s: Setup) -> str:
    return f"GPT d_model={s.d_model} layers={s.layers} heads={s.heads} vocab={s.vocab} max_len={s.max_len}"


# ---------------------------------------------------------------------------------------------------- data
def make_lengths(dataset: str, s: Setup) -> list[int]:
    """The ``s.samples`` lengths of ``dataset`` (``zipf`` or ``skewed``), each in ``[16, s.max_len]``."""
    rng = np.random.default_rng(s.seed)
    n = s.samples
    if dataset == "zipf":
        lengths = np.minimum(s.max_len, 16 * rng.zipf(s.zipf_a, n))
    elif dataset == "skewed":
        lengths = rng.integers(16, min(128, s.max_len) + 1, n)
        lengths[rng.choice(n, max(1, round(0.02 * n)), replace=False)] = s.max_len
    else:
        raise ValueError(f"Unknown data set {dataset!r}; expected one of {DATASETS}.")
    return [int(x) for x in lengths]


def length_stats(lengths: list[int], max_len: int) -> dict[str, Any]:
    array = np.asarray(lengths)
    return {
        "samples": len(lengths),
        "tokens": int(array.sum()),
        "mean": float(array.mean()),
        "median": float(np.median(array)),
        "p99": float(np.percentile(array, 99)),
        "max": int(array.max()),
        "fraction_at_max_len": float((array == max_len).mean()),
    }


class Tokens(Dataset):
    """Random token sequences of the given lengths: ``{"input_ids": LongTensor[L]}`` (ids in ``[1, vocab)``)."""

    def __init__(self, lengths: list[int], vocab: int, seed: int = 0) -> None:
        self.lengths = lengths
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(1, vocab, (int(self.offsets[-1]),), generator=generator)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[self.offsets[index] : self.offsets[index + 1]]}


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pad to the batch's longest sample (id 0); causal-LM inputs and targets (padding -100), and the lengths."""
    sequences = [s["input_ids"] for s in samples]
    lengths = torch.tensor([len(x) for x in sequences])
    padded = nn.utils.rnn.pad_sequence(sequences, batch_first=True, padding_value=PAD_ID)
    targets = padded[:, 1:].clone()
    positions = torch.arange(targets.shape[1])
    targets[positions[None, :] >= (lengths[:, None] - 1)] = IGNORE_INDEX
    return {"input_ids": padded[:, :-1], "targets": targets, "lengths": lengths}


# ---------------------------------------------------------------------------------------------------- model
class EagerBlock(Block):
    """``Block`` with attention materialised: ``softmax(Q K^T / sqrt(d_head))`` per head, causal mask, then ``@ V``.

    Under bf16 autocast the scores are bf16, the softmax runs (and is kept for backward) in fp32, and its bf16 copy is
    kept for the product with ``V``: 6 bytes per head and (query, key) pair stay alive until the backward.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        head = c // self.heads
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, head).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head))
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attention = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        y = attention @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def build_model(s: Setup, attention: str) -> GPT:
    """A freshly initialised decoder on the CPU (seed first for identical weights); ``attention``: sdpa or eager."""
    if attention not in ATTENTIONS:
        raise ValueError(f"Unknown attention {attention!r}; expected one of {ATTENTIONS}.")
    model = GPT(s.vocab, s.max_len, s.d_model, s.layers, s.heads)
    if attention == "eager":
        blocks = []
        for block in model.blocks:
            eager = EagerBlock(s.d_model, s.heads)
            eager.load_state_dict(block.state_dict())
            blocks.append(eager)
        model.blocks = nn.ModuleList(blocks)
    return model


def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Token-mean next-token cross-entropy: summed over the real target tokens, divided by their number."""
    logits = model(batch["input_ids"])
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1), ignore_index=IGNORE_INDEX
    )


# ---------------------------------------------------------------------------------------------------- memory model
def bytes_per_token(s: Setup) -> int:
    """Estimated activation bytes per padded position, under bf16 autocast (see :func:`auto_quadratic`)."""
    return 38 * s.d_model * s.layers + 12 * s.vocab


def bytes_per_token_squared(s: Setup) -> int:
    """Estimated bytes of eager attention per sample and (query, key) pair (see :func:`auto_quadratic`)."""
    return 6 * s.layers * s.heads


def auto_quadratic(s: Setup) -> float:
    """The sampler's ``quadratic`` for eager attention, from the architecture: an estimate, not a measurement.

    A sample of length ``L`` keeps about ``a * L + b * L**2`` bytes of activations for the backward, so its cost in
    the sampler's units (tokens) is ``L + (b / a) * L**2``, and ``quadratic = b / a``:

    * ``a = 38 * d_model * layers + 12 * vocab`` bytes per token. Per block (bf16 autocast): the fp32 residual
      stream at the block's input and after attention (2 x 4d), the bf16 inputs of the four linear layers (2d, 2d,
      2d, 8d), the qkv output (6d), the attention output (2d) and the MLP's hidden pre-activation (8d): 38d. The
      head: the fp32 log-softmax over the vocabulary kept for backward (4V) and, at the peak (the start of the
      backward), the fp32 gradient of the logits and its bf16 copy (about 8V).
    * ``b = 6 * layers * heads`` bytes per (query, key) pair: each layer keeps, per head, the fp32 softmax (4 bytes)
      and its bf16 copy for the product with ``V`` (2 bytes); the transient scores and masked scores are not kept.

    Weights, gradients and optimizer states do not depend on the batch and are left out (a budget tuned or measured
    on the GPU accounts for them). For d_model 768, 12 layers, 12 heads and vocabulary 32768: ``a`` = 743,424,
    ``b`` = 864, ``quadratic`` = 0.00116 (at ``L`` = 2048 the attention matrices are 2.4x the rest).
    """
    return bytes_per_token_squared(s) / bytes_per_token(s)


def batch_cost(n: int, longest: int, quadratic: float) -> float:
    """The padded cost of a batch of ``n`` samples whose longest is ``longest``: ``n * L + q * n * L**2``."""
    return n * longest + quadratic * n * longest * longest


def padded_shape(batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    """``(n, L_max)`` of a collated batch (``L_max``: the longest sample, one more than the model's positions)."""
    n, positions = batch["input_ids"].shape
    return int(n), int(positions) + 1


def check_simulated_oom(s: Setup, attention: str, batch: dict[str, torch.Tensor]) -> None:
    """``--quick``: raise the simulated OOM where the batch's simulated memory is above ``s.simulated_limit``."""
    if s.simulated_limit is None:
        return
    q = auto_quadratic(s) if attention == "eager" else 0.0
    if batch_cost(*padded_shape(batch), q) > s.simulated_limit:
        raise torch.cuda.OutOfMemoryError(SIMULATED_OOM_MESSAGE)
