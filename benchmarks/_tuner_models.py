"""Workloads of ``benchmarks/tuner.py``: models, synthetic data, loss and optimizer, in plain PyTorch.

Plain PyTorch on purpose: the true-maximum probe processes import only this module (no Lightning, which takes
seconds to import), and the Lightning processes wrap the very same model, data, loss and optimizer, so both kinds of
process train the same thing.

Workloads (``--quick`` swaps in tiny versions for a CPU smoke run):

* ``gpt``: a GPT-style decoder (pre-norm blocks, causal ``F.scaled_dot_product_attention``, GELU MLP, tied
  embedding and output head). Full size: d_model 1024, 16 layers, 16 heads, vocabulary 32768, sequence 512, about
  235M parameters. Data: random int64 tokens generated once into a ``TensorDataset`` (inputs and shifted targets come
  from one row of ``seq_len + 1`` tokens).
* ``gpt-longval``: the same GPT, validated on sequences 8x longer (4096 tokens): validation needs more memory per
  sample than training (full-vocabulary logits of 4096 positions), so the largest size is set by validation.
* ``resnet``: torchvision's ResNet-50, 1000 classes, random 224x224 images generated per item from a seeded generator
  (no giant tensor in host memory). ``--quick``: a tiny CNN on 32x32 images, 10 classes.
* ``gpt124``: a GPT-2-small-sized decoder (d_model 768, 12 layers, 12 heads, vocabulary 32768, sequence 512, about
  110M parameters); ``gpt-ckpt``: the ``gpt`` decoder with activation checkpointing around every block
  (``torch.utils.checkpoint``, non-reentrant); ``encoder``: a 12-layer bidirectional transformer encoder (d_model
  768, 12 heads, sequence 512, vocabulary 32768) classifying the mean-pooled sequence into 2 classes; ``vit``:
  timm's ViT-B/16 (``vit_base_patch16_224``, 1000 classes) on random 224x224 images.
* ``hf-gpt2``: Hugging Face transformers' ``GPT2LMHeadModel`` with a GPT-2-medium ``GPT2Config`` (n_embd 1024,
  24 layers, 16 heads, 512 positions, vocabulary 50257; about 355M parameters), randomly initialised (no download),
  the config's defaults otherwise (dropout 0.1, ``use_cache``, the library's default attention); random tokens of
  sequence 512, next-token loss on ``model(input_ids=...).logits`` as for ``gpt``. ``--quick``: n_embd 64, 2
  layers, 4 heads, vocabulary 256, sequence (and n_positions) 32; where ``import transformers`` fails (a CPU machine
  without it), the tiny ``gpt`` decoder stands in, and a line on stderr says so.

All train with AdamW. In ``--quick`` mode every workload has a *simulated* out-of-memory threshold: a step at a batch
size above it raises ``torch.cuda.OutOfMemoryError`` (a CPU never runs out of memory, so without it no search would
ever stop before its upper bound).
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.utils.data import Dataset, TensorDataset

SIMULATED_OOM_MESSAGE = (
    "CUDA out of memory. Tried to allocate 1.00 GiB (simulated by benchmarks/tuner.py --quick)"
)


@dataclass(frozen=True)
class Workload:
    """Everything that defines one workload; ``kind``: ``"gpt"``, ``"hfgpt2"``, ``"resnet"``, ``"vit"``, ``"cnn"``."""

    name: str
    kind: str
    num_samples: int
    search_upper: int  # largest batch size the true-maximum search tries
    num_workers: int = 0  # DataLoader workers of the Lightning runs
    simulated_oom_above: int | None = None  # --quick: batch sizes above this raise an OOM
    simulated_val_oom_above: int | None = None  # --quick: the same in validation (None: simulated_oom_above)
    # GPT and hf-gpt2
    vocab: int = 0
    seq_len: int = 0
    val_seq_len: int = 0  # validation sequences (0: seq_len)
    d_model: int = 0
    layers: int = 0
    heads: int = 0
    # images
    image_size: int = 0
    num_classes: int = 0
    checkpointing: bool = False  # GPT: activation checkpointing around each block
    causal: bool = True  # GPT: False for the encoder (bidirectional attention, a pooled classification head)


def workload(name: str, quick: bool) -> Workload:
    """The workload called ``name`` (see the module docstring), full size or tiny (``quick``)."""
    if name == "gpt-longval":
        if quick:
            return Workload(
                "gpt-longval", "gpt", 4096, 2048, simulated_oom_above=37, simulated_val_oom_above=23, vocab=256,
                seq_len=32, val_seq_len=256, d_model=64, layers=2, heads=4,
            )  # fmt: skip
        return Workload(
            "gpt-longval", "gpt", 16384, 2048, vocab=32768, seq_len=512, val_seq_len=4096, d_model=1024, layers=16,
            heads=16,
        )  # fmt: skip
    if name == "gpt":
        if quick:
            return Workload(
                "gpt",
                "gpt",
                4096,
                2048,
                simulated_oom_above=37,
                vocab=256,
                seq_len=32,
                d_model=64,
                layers=2,
                heads=4,
            )
        # 16384 samples: 50 steps at any plausible size stay inside one epoch; 16384 x 513 int64 is 67 MB.
        return Workload(
            "gpt", "gpt", 16384, 2048, vocab=32768, seq_len=512, d_model=1024, layers=16, heads=16
        )
    if name == "resnet":
        if quick:
            return Workload(
                "resnet", "cnn", 4096, 1024, simulated_oom_above=53, image_size=32, num_classes=10
            )
        workers = max(0, min(6, (os.cpu_count() or 2) // 2))  # 1 ms per generated image: keep the GPU fed
        return Workload(
            "resnet", "resnet", 65536, 1024, num_workers=workers, image_size=224, num_classes=1000
        )
    if name in ("gpt124", "gpt-ckpt", "encoder"):
        if quick:
            return Workload(name, "gpt", 4096, 2048, simulated_oom_above=37, vocab=256, seq_len=32, d_model=64,
                            layers=2, heads=4, checkpointing=name == "gpt-ckpt", causal=name != "encoder")  # fmt: skip
        if name == "gpt-ckpt":
            return Workload(name, "gpt", 16384, 4096, vocab=32768, seq_len=512, d_model=1024, layers=16, heads=16,
                            checkpointing=True)  # fmt: skip
        return Workload(name, "gpt", 16384, 4096, vocab=32768, seq_len=512, d_model=768, layers=12, heads=12,
                        causal=name != "encoder")  # fmt: skip
    if name == "hf-gpt2":
        if quick:
            tiny = {"vocab": 256, "seq_len": 32, "d_model": 64, "layers": 2, "heads": 4}
            kind = (
                "hfgpt2" if _transformers_importable() else "gpt"
            )  # the tiny GPT stands in without transformers
            return Workload(name, kind, 4096, 2048, simulated_oom_above=37, **tiny)
        # 16384 samples as for `gpt`: 50 steps at any plausible size stay inside one epoch (16384 x 513 int64, 67 MB).
        return Workload(
            name, "hfgpt2", 16384, 2048, vocab=50257, seq_len=512, d_model=1024, layers=24, heads=16
        )
    if name == "vit":
        if quick:
            return Workload("vit", "cnn", 4096, 1024, simulated_oom_above=53, image_size=32, num_classes=10)
        workers = max(0, min(6, (os.cpu_count() or 2) // 2))
        return Workload("vit", "vit", 65536, 2048, num_workers=workers, image_size=224, num_classes=1000)
    raise ValueError(
        f"Unknown workload {name!r}; expected one of gpt, gpt-longval, gpt124, gpt-ckpt, encoder, resnet, vit, hf-gpt2."
    )


@functools.cache
def _transformers_importable() -> bool:
    """Whether ``import transformers`` works (``--quick`` only); if not, say once per process on stderr."""
    try:
        import transformers  # noqa: F401
    except Exception as error:
        print(
            f"hf-gpt2 --quick: `import transformers` failed ({type(error).__name__}: {error}); the tiny GPT decoder"
            " of the `gpt` workload stands in for GPT2LMHeadModel",
            file=sys.stderr,
            flush=True,
        )
        return False
    return True


# ---------------------------------------------------------------------------------------------------- models
class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention and a 4x GELU MLP, each with a residual."""

    def __init__(self, d_model: int, heads: int, causal: bool = True) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, final norm, output head tied to the token embedding."""

    def __init__(
        self,
        vocab: int,
        seq_len: int,
        d_model: int,
        layers: int,
        heads: int,
        checkpointing: bool = False,
        causal: bool = True,
        num_classes: int = 0,
    ) -> None:
        super().__init__()
        self.checkpointing = checkpointing
        self.classify = nn.Linear(d_model, num_classes) if num_classes else None  # the encoder's pooled head
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, causal) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            if self.checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if self.classify is not None:
            return self.classify(self.ln(x).mean(dim=1))
        return self.head(self.ln(x))


def tiny_cnn(num_classes: int) -> nn.Module:
    """Two conv layers, global pooling, a linear classifier (the ``--quick`` stand-in for ResNet-50)."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, num_classes),
    )


def build_model(w: Workload) -> nn.Module:
    """A freshly initialised model of ``w`` on the CPU (seed it first for identical weights)."""
    if w.kind == "gpt":
        classes = 2 if not w.causal else 0
        return GPT(
            w.vocab,
            max(w.seq_len, w.val_seq_len),
            w.d_model,
            w.layers,
            w.heads,
            w.checkpointing,
            w.causal,
            classes,
        )
    if w.kind == "hfgpt2":
        from transformers import GPT2Config, GPT2LMHeadModel  # only the hf-gpt2 workload needs it

        config = GPT2Config(
            vocab_size=w.vocab, n_positions=w.seq_len, n_embd=w.d_model, n_layer=w.layers, n_head=w.heads,
            bos_token_id=w.vocab - 1, eos_token_id=w.vocab - 1,  # GPT-2's 50256 at full size; inside a tiny vocabulary
        )  # fmt: skip
        return GPT2LMHeadModel(config)
    if w.kind == "vit":
        import timm  # only the ViT workload needs it

        return timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=w.num_classes)
    if w.kind == "resnet":
        import torchvision  # only the full-size image workload needs it

        return torchvision.models.resnet50(weights=None, num_classes=w.num_classes)
    return tiny_cnn(w.num_classes)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with the library's default implementation choice (``foreach`` on CUDA)."""
    return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)


# ---------------------------------------------------------------------------------------------------- data
class RandomImages(Dataset):
    """``length`` random images and labels, each generated on access from a generator seeded by its index."""

    def __init__(self, length: int, size: int, num_classes: int, seed: int = 0) -> None:
        self.length = length
        self.size = size
        self.num_classes = num_classes
        self.seed = seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = torch.randn(3, self.size, self.size, generator=generator)
        label = int(torch.randint(self.num_classes, (1,), generator=generator))
        return image, label


def build_dataset(w: Workload) -> Dataset:
    """The synthetic training (and validation) set of ``w``."""
    if w.kind in ("gpt", "hfgpt2"):
        generator = torch.Generator().manual_seed(0)
        return TensorDataset(torch.randint(w.vocab, (w.num_samples, w.seq_len + 1), generator=generator))
    return RandomImages(w.num_samples, w.image_size, w.num_classes)


def build_val_dataset(w: Workload) -> Dataset:
    """The validation set of ``w``: the training set, or 2048 longer sequences where ``val_seq_len`` is set."""
    if w.kind == "gpt" and w.val_seq_len:
        generator = torch.Generator().manual_seed(1)
        return TensorDataset(torch.randint(w.vocab, (2048, w.val_seq_len + 1), generator=generator))
    return build_dataset(w)


def first_batch(w: Workload, dataset: Dataset, batch_size: int) -> list[torch.Tensor]:
    """The first ``batch_size`` items collated as a DataLoader would (a list of tensors)."""
    items = [dataset[i] for i in range(batch_size)]
    return torch.utils.data.default_collate(items)


def batch_length(batch: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> int:
    """Samples in a batch."""
    return int(batch[0].shape[0])


def compute_loss(
    w: Workload,
    model: nn.Module,
    batch: list[torch.Tensor] | tuple[torch.Tensor, ...],
    validation: bool = False,
) -> torch.Tensor:
    """Next-token cross-entropy (GPTs) or classification cross-entropy (images); raises a simulated OOM in --quick."""
    check_simulated_oom(w, batch_length(batch), validation)
    if w.kind == "hfgpt2":
        tokens = batch[0]
        logits = model(input_ids=tokens[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    if w.kind == "gpt":
        tokens = batch[0]
        logits = model(tokens[:, :-1])
        if not w.causal:  # the encoder: a label per sequence, from its first token's parity
            return F.cross_entropy(logits, tokens[:, 0] % 2)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def check_simulated_oom(w: Workload, batch_size: int, validation: bool = False) -> None:
    """Raise the simulated OOM of ``--quick`` when ``batch_size`` is above the workload's threshold."""
    above = w.simulated_val_oom_above if validation and w.simulated_val_oom_above else w.simulated_oom_above
    if above is not None and batch_size > above:
        raise torch.cuda.OutOfMemoryError(SIMULATED_OOM_MESSAGE)


# The messages of lightning_gpumem/_oom.py: OOMs raised as plain RuntimeError (cuBLAS/cuDNN workspaces and others).
_OOM_MESSAGES = (
    "out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.",
    "DefaultCPUAllocator: can't allocate memory",
)


def is_oom(error: BaseException) -> bool:
    """Whether ``error`` is an out-of-memory error (real or simulated), as ``lightning_gpumem`` recognises them.

    A copy of ``lightning_gpumem._hw.oom.is_oom_error``: importing that module imports the package and with it
    Lightning, which the probe workers avoid.
    """
    oom_types = tuple(
        t for t in (getattr(torch, "OutOfMemoryError", None), torch.cuda.OutOfMemoryError) if t
    )
    if isinstance(error, oom_types):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _OOM_MESSAGES)


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def describe(w: Workload) -> str:
    """One line describing the workload."""
    if w.kind == "hfgpt2":
        return (
            f"Hugging Face GPT2LMHeadModel (random init) n_embd={w.d_model} n_layer={w.layers} n_head={w.heads}"
            f" vocab={w.vocab} seq={w.seq_len}, {w.num_samples} random-token samples"
        )
    if w.kind == "gpt":
        kind = "GPT" if w.causal else "encoder"
        kind += " with activation checkpointing" if w.checkpointing else ""
        kind += " (stand-in for hf-gpt2: transformers not importable)" if w.name == "hf-gpt2" else ""
        return (
            f"{kind} d_model={w.d_model} layers={w.layers} heads={w.heads} vocab={w.vocab} seq={w.seq_len},"
            f"{f' validation seq={w.val_seq_len},' if w.val_seq_len else ''} {w.num_samples} random-token samples"
        )
    model = {"resnet": "ResNet-50", "vit": "ViT-B/16 (timm)"}.get(w.kind, "tiny CNN")
    return f"{model} {w.image_size}x{w.image_size}, {w.num_classes} classes, {w.num_samples} random images"
