"""The user's Lightning step traced at any batch size, from a fit's start: sizes, steps, optimizers, precision."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpumem._core.alloc_events import Event
from lightning_gpumem._core.kernels import H100
from lightning_gpumem._hw.trace import Trace
from lightning_gpumem.tuning.sources.allocator import replay
from lightning_gpumem.tuning.sources.lightning_step import (
    MANUAL,
    NO_LOSS,
    autocast_caches,
    batch_size_of,
    lightning_tracer,
    resize_batch,
)

FEATURES, WIDTH, CLASSES = 32, 512, 4


class MLP(LightningModule):
    """Features to classes; what its steps do (log, return a dict, read a value) is set by its arguments."""

    def __init__(
        self,
        log: bool = False,
        as_dict: bool = False,
        item: bool = False,
        none: bool = False,
        configure: Any = None,
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.ReLU(), nn.Linear(WIDTH, CLASSES))
        self.log_it, self.as_dict, self.item, self.none, self.configure = log, as_dict, item, none, configure

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if self.log_it:
            self.log("train_loss", loss)
            self.log_dict({"train_again": loss, "step": float(self.trainer.global_step)})
        if self.item:
            loss.item()
        if self.none:
            return None
        return {"loss": loss} if self.as_dict else loss

    def configure_optimizers(self):
        if self.configure is not None:
            return self.configure(self)
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(
            TensorDataset(torch.randn(32, FEATURES), torch.randint(0, CLASSES, (32,))), batch_size=4
        )


class ValMLP(MLP):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("val_loss", loss)

    def val_dataloader(self):
        return self.train_dataloader()


class Manual(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = F.cross_entropy(self.net(batch[0]), batch[1])
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()


class Tokens(LightningModule):
    """Token ids [B, T] through an embedding: ids resized must stay valid."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50)

    def training_step(self, batch, batch_idx):
        ids = batch["ids"]
        return F.cross_entropy(self.head(self.embed(ids)).flatten(0, 1), ids.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        ids = torch.randint(0, 50, (12, 7))
        return DataLoader([{"ids": row} for row in ids], batch_size=3)


class TraceAtStart(Callback):
    """Traces at ``sizes`` in ``on_fit_start``; keeps what the module, optimizer and Trainer were after."""

    def __init__(self, sizes: tuple[int, ...], val: bool = False) -> None:
        self.sizes, self.val = sizes, val
        self.traces: dict[int, Trace] = {}

    def on_fit_start(self, trainer, pl_module):
        batch = next(iter(pl_module.train_dataloader()))
        val_batch = next(iter(pl_module.train_dataloader())) if self.val else None
        self.params = {name: p.detach().clone() for name, p in pl_module.named_parameters()}
        with warnings.catch_warnings(record=True) as self.warned:
            warnings.simplefilter("always")
            trace_at = lightning_tracer(trainer, pl_module, batch, val_batch=val_batch)
            self.traces = {size: trace_at(size) for size in self.sizes}
        self.params_after = {name: p.detach().clone() for name, p in pl_module.named_parameters()}
        self.grads_after = [p.grad for p in pl_module.parameters()]
        self.optimizer_state = dict(trainer.optimizers[0].state) if trainer.optimizers else {}
        self.metrics = {**trainer.callback_metrics, **trainer.logged_metrics}


def _fit(make_trainer, module: LightningModule, sizes=(8, 16), val: bool = False, **options) -> TraceAtStart:
    callback = TraceAtStart(sizes, val)
    trainer = make_trainer(**{"max_steps": 1, "limit_val_batches": 0, "callbacks": [callback], **options})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*configure_optimizers.*returned `None`.*")
        warnings.filterwarnings("ignore", message=".*`training_step` returned `None`.*")
        trainer.fit(module)
    return callback


def _setup_bytes(events: list[Event]) -> int:
    """Bytes allocated before the first mark: parameters, buffers, optimizer state."""
    total = 0
    for event in events:
        if event.action == "mark":
            return total
        total += event.size
    return total


# the cuBLAS workspaces a traced step keeps: its forward's and its backward's first matrix multiply
WORKSPACES = sum(H100.forward_workspaces) + sum(H100.backward_workspaces)


def _live_at_end(events: list[Event]) -> int:
    live: dict[int, int] = {}
    for event in events:
        if event.action == "alloc":
            live[event.block] = event.size
        elif event.action == "free":
            del live[event.block]
    return sum(live.values())


def _transient(events: list[Event], label: str = "train", occurrence: int = 1) -> int:
    """Bytes allocated and freed within a phase (its ``occurrence``-th, from 0): the batch's, activations."""
    seen, total = -1, 0
    current: dict[int, int] | None = None  # the phase's live allocations
    for event in events:
        if event.action == "mark":
            seen += event.label == label
            current = {} if event.label == label and seen == occurrence else None
        elif current is not None and event.action == "alloc":
            current[event.block] = event.size
        elif current is not None and event.action == "free" and event.block in current:
            total += current.pop(event.block)
    return total


def _labels(trace: Trace) -> list[str]:
    return [event.label for event in trace.events if event.action == "mark"]


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_activations_double_with_the_batch_and_parameters_and_adamw_state_do_not(make_trainer):
    module = MLP()
    traces = _fit(make_trainer, module).traces
    small, large = traces[8], traces[16]
    assert small.cannot_trace is None
    assert large.cannot_trace is None
    assert _labels(small) == ["train", "optimizer"] * 3
    params = _param_bytes(module)
    assert _setup_bytes(small.events) == _setup_bytes(large.events) == params
    # after two steps: parameters, gradients, AdamW's exp_avg and exp_avg_sq (its step counters: host memory),
    # and the cuBLAS workspaces of the forward's and the backward's first matrix multiply
    assert _live_at_end(small.events) == _live_at_end(large.events) == 4 * params + WORKSPACES
    for occurrence in (0, 1, 2):
        activations = _transient(small.events, occurrence=occurrence)
        assert activations > 8 * WIDTH * 4  # at least the hidden layer's output
        assert _transient(large.events, occurrence=occurrence) == pytest.approx(2 * activations, rel=0.01)
    # the replay sees it too: the training phase's peak grows by the activations
    peaks = [replay(trace.events).phase_peaks["train"][0] for trace in (small, large)]
    assert peaks[1] > peaks[0]


def test_the_users_module_optimizer_and_trainer_are_untouched(make_trainer):
    callback = _fit(make_trainer, MLP(log=True))
    assert callback.traces[16].cannot_trace is None
    for name, param in callback.params_after.items():
        assert torch.equal(param, callback.params[name])
    assert callback.grads_after == [None] * len(callback.grads_after)
    assert callback.optimizer_state == {}
    # `self.log` and `self.log_dict` ran in the step, silenced: nothing logged, nothing warned
    assert callback.metrics == {}
    assert not [str(w.message) for w in callback.warned if "log" in str(w.message)]


def test_a_dict_with_the_loss_traces_as_the_loss(make_trainer):
    traces = _fit(make_trainer, MLP(as_dict=True)).traces
    plain = _fit(make_trainer, MLP()).traces
    assert traces[8].cannot_trace is None
    assert traces[8].events == plain[8].events


def test_manual_optimisation_is_not_traced(make_trainer):
    traces = _fit(make_trainer, Manual()).traces
    assert traces[8].cannot_trace == MANUAL
    assert traces[8].events == []


def test_a_value_read_in_the_step_ends_the_trace_naming_the_op(make_trainer):
    trace = _fit(make_trainer, MLP(item=True)).traces[8]
    assert trace.cannot_trace is not None
    assert "_local_scalar_dense" in trace.cannot_trace
    assert trace.events  # what came before the op


def test_a_step_returning_none_is_not_traced(make_trainer):
    assert _fit(make_trainer, MLP(none=True)).traces[8].cannot_trace == NO_LOSS


def test_bf16_mixed_activations_are_smaller_than_32_true(make_trainer):
    sizes = (256, 512)
    full = _fit(make_trainer, MLP(), sizes=sizes, precision="32-true").traces
    mixed = _fit(make_trainer, MLP(), sizes=sizes, precision="bf16-mixed").traces
    assert all(trace.cannot_trace is None for trace in (*full.values(), *mixed.values()))
    assert _setup_bytes(mixed[256].events) == _setup_bytes(full[256].events)  # float32 parameters either way
    # what 256 more samples add: the hidden activations in bf16 (the logits and the loss stay float32)
    added_full = _transient(full[512].events) - _transient(full[256].events)
    added_mixed = _transient(mixed[512].events) - _transient(mixed[256].events)
    assert added_mixed < 0.7 * added_full


def test_bf16_true_makes_the_steps_new_tensors_bf16(make_trainer):
    class Ones(MLP):
        def training_step(self, batch, batch_idx):
            x, y = batch
            scale = torch.ones(x.shape[0], FEATURES)  # no dtype: the default dtype, bf16 under bf16-true
            return F.cross_entropy(self.net(x * scale), y)

    trace = _fit(make_trainer, Ones(), precision="bf16-true").traces[8]
    assert trace.cannot_trace is None
    ones = 8 * FEATURES * 2
    assert any(event.size == ones for event in trace.events if event.action == "alloc")
    assert torch.get_default_dtype() == torch.float32


def test_token_ids_resized_stay_valid_ids(make_trainer):
    traces = _fit(make_trainer, Tokens(), sizes=(3, 8, 64)).traces
    assert all(trace.cannot_trace is None for trace in traces.values())
    assert _transient(traces[64].events) > _transient(traces[8].events) > _transient(traces[3].events)


@pytest.mark.parametrize(
    "configure",
    [
        lambda m: torch.optim.AdamW(m.parameters()),
        lambda m: [torch.optim.AdamW(m.parameters())],
        lambda m: ([torch.optim.AdamW(m.parameters())], []),
        lambda m: {"optimizer": torch.optim.AdamW(m.parameters())},
        lambda m: [{"optimizer": torch.optim.AdamW(m.parameters())}],
        lambda m: _with_scheduler(torch.optim.AdamW(m.parameters())),
        lambda m: ([o := torch.optim.AdamW(m.parameters())], [torch.optim.lr_scheduler.StepLR(o, 1)]),
    ],
    ids=["optimizer", "list", "lists", "dict", "list of dicts", "dict with a scheduler", "with a scheduler"],
)
@pytest.mark.parametrize("fitting", [True, False], ids=["at fit start", "before setup"])
def test_every_form_configure_optimizers_returns_gives_its_optimizer(make_trainer, configure, fitting):
    module = MLP(configure=configure)
    if fitting:
        trace = _fit(make_trainer, module).traces[8]
    else:  # no optimizers in the Trainer yet: configure_optimizers() is asked, on the module
        trace = lightning_tracer(Trainer(accelerator="cpu", logger=False), module, _batch(4))(8)
    assert trace.cannot_trace is None
    assert (
        _live_at_end(trace.events) == 4 * _param_bytes(module) + WORKSPACES
    )  # AdamW's state: the one given


def _with_scheduler(optimizer):
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize("fitting", [True, False], ids=["at fit start", "before setup"])
def test_no_optimizer_traces_without_a_step(make_trainer, fitting):
    module = MLP(configure=lambda m: None)
    if fitting:
        trace = _fit(make_trainer, module).traces[8]
    else:
        trace = lightning_tracer(Trainer(accelerator="cpu", logger=False), module, _batch(4))(8)
    assert trace.cannot_trace is None
    assert _live_at_end(trace.events) == 2 * _param_bytes(module) + WORKSPACES  # parameters and gradients


def test_two_optimizers_and_unknown_forms_are_not_traced():
    trainer = Trainer(accelerator="cpu", logger=False)
    two = MLP(
        configure=lambda m: [torch.optim.SGD(m.parameters(), lr=1), torch.optim.SGD(m.parameters(), lr=1)]
    )
    assert (
        lightning_tracer(trainer, two, _batch(4))(8).cannot_trace
        == "2 optimizers: automatic optimisation takes one"
    )
    odd = MLP(configure=lambda m: "adam")
    reason = lightning_tracer(trainer, odd, _batch(4))(8).cannot_trace
    assert reason == "configure_optimizers returned 'adam', not a form Lightning takes"


def test_validation_is_traced_where_a_batch_is_given(make_trainer):
    with_val = _fit(make_trainer, ValMLP(), val=True).traces
    assert _labels(with_val[8])[-1] == "val"
    assert _transient(with_val[16].events, "val", 0) == pytest.approx(
        2 * _transient(with_val[8].events, "val", 0), rel=0.02
    )
    without = _fit(make_trainer, ValMLP()).traces[8]
    assert "val" not in _labels(without)
    no_step = _fit(make_trainer, MLP(), val=True, limit_val_batches=0).traces[
        8
    ]  # no validation_step of its own
    assert "val" not in _labels(no_step)


def test_validation_starts_as_lightnings_with_the_gradients_freed(make_trainer):
    module = ValMLP()
    events = _fit(make_trainer, module, val=True).traces[8].events
    start = max(i for i, e in enumerate(events) if e.action == "mark" and e.label == "val")
    # on_validation_model_zero_grad: the gradients live until validation, and not after it
    gradients = sum(p.numel() * p.element_size() for p in module.parameters())
    assert _live_at_end(events[:start]) - _live_at_end(events) == gradients


def _batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, FEATURES), torch.randint(0, CLASSES, (size,))


@dataclass
class Sample:
    x: torch.Tensor
    mask: torch.Tensor
    name: str


def test_a_batch_resizes_its_batch_sized_tensors_in_any_structure():
    ids = torch.arange(12).reshape(4, 3)
    batch = {
        "ids": ids,
        "pair": (torch.zeros(4, 2, dtype=torch.bool), torch.ones(3)),
        "n": 4,
        "s": Sample(ids.float(), torch.ones(5, 5), "a"),
    }
    assert batch_size_of(batch) == 4
    for size in (1, 4, 9):
        resized = resize_batch(batch, size)
        assert resized["ids"].shape == (size, 3)
        assert resized["ids"].dtype == torch.int64
        assert all(torch.equal(row, ids[0]) for row in resized["ids"])  # real rows: valid ids
        assert resized["pair"][0].shape == (size, 2)
        assert resized["pair"][0].dtype == torch.bool
        assert resized["pair"][1].shape == (3,)  # not of the batch's size: kept
        assert resized["n"] == 4
        assert isinstance(resized["s"], Sample)
        assert resized["s"].x.shape == (size, 3)
        assert resized["s"].name == "a"
        assert resized["s"].mask.shape == (5, 5)
    large = resize_batch(torch.zeros(2, 3, 224, 224), 4096)  # 2.5 GB if made: a view of one row
    assert large.shape == (4096, 3, 224, 224)
    assert large.untyped_storage().nbytes() == 3 * 224 * 224 * 4
    assert large.stride()[0] == 0
    assert resize_batch({"a": torch.zeros(3), "b": torch.zeros(5, 2)}, 7, batch_size=5)["b"].shape == (7, 2)


def test_batch_size_of_reads_the_first_tensor_of_a_dimension():
    assert batch_size_of([torch.tensor(3.0), {"x": torch.zeros(6, 2)}]) == 6
    assert batch_size_of(("text", 5)) is None
    assert batch_size_of(torch.zeros(0, 3)) == 0


def test_bad_arguments_name_the_argument_and_what_was_expected():
    trainer, module = Trainer(accelerator="cpu", logger=False), MLP()
    with pytest.raises(TypeError, match="needs a Lightning `Trainer`"):
        lightning_tracer(object(), module, _batch(2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`lightning_tracer\(module=Linear.*Expected a `LightningModule`"):
        lightning_tracer(trainer, nn.Linear(2, 2), _batch(2))  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"`lightning_tracer\(steps=0\)` is not valid. Expected an integer >= 1"
    ):
        lightning_tracer(trainer, module, _batch(2), steps=0)
    with pytest.raises(ValueError, match=r"`lightning_tracer\(batch_size=0\)`"):
        lightning_tracer(trainer, module, _batch(2), batch_size=0)
    with pytest.raises(
        ValueError, match=r"`lightning_tracer\(batch=\('a', 1\)\)` is not valid. Expected a batch"
    ):
        lightning_tracer(trainer, module, ("a", 1))
    with pytest.raises(ValueError, match=r"`lightning_tracer\(batch=tensor\(\[\], size=\(0, 2\)\)\)`"):
        lightning_tracer(trainer, module, torch.zeros(0, 2))
    trace_at = lightning_tracer(trainer, module, _batch(2))
    with pytest.raises(ValueError, match=r"`trace_at\(size=0\)` is not valid"):
        trace_at(0)
    with pytest.raises(ValueError, match=r"`resize_batch\(size=True\)` is not valid"):
        resize_batch(_batch(2), True)


def _trace_as(precision: str, module: LightningModule, size: int) -> Trace:
    """The trace at ``size`` with ``trainer.precision`` reading ``precision`` (a plugin not usable on the CPU)."""
    trainer = Trainer(accelerator="cpu", logger=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(trainer), "precision", property(lambda self: precision))
        return lightning_tracer(trainer, module, _batch(2))(size)


def test_16_mixed_traces_under_float16_autocast():
    # Lightning takes 16-mixed on the CPU as bf16-mixed; on a GPU it is float16 autocast, of the same sizes
    half, bf16 = _trace_as("16-mixed", MLP(), 64), _trace_as("bf16-mixed", MLP(), 64)
    assert half.cannot_trace is None
    assert [e.size for e in half.events] == [e.size for e in bf16.events]
    assert _transient(half.events) < _transient(_trace_as("32-true", MLP(), 64).events)


def test_a_precision_not_modelled_is_not_traced():
    # transformer-engine is not installed here: only the plugin's precision string is read
    reason = _trace_as("transformer-engine", MLP(), 4).cannot_trace
    assert reason is not None
    assert "'transformer-engine' is not modelled" in reason


def test_torchmetrics_in_the_step_are_idle_and_the_users_are_untouched(make_trainer):
    torchmetrics = pytest.importorskip("torchmetrics")

    class Scored(MLP):
        def __init__(self) -> None:
            super().__init__()
            self.accuracy = torchmetrics.classification.MulticlassAccuracy(CLASSES)

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self.net(x)
            self.log("accuracy", self.accuracy(logits, y))  # its update counts with `bincount`
            self.accuracy.update(logits, y)
            return F.cross_entropy(logits, y) + 0 * self.accuracy.compute()

    module = Scored()
    before = {name: value.clone() for name, value in module.accuracy.metric_state.items()}
    callback = TraceAtStart((8,))
    trainer = Trainer(accelerator="cpu", logger=False)
    callback.on_fit_start(trainer, module)  # before any fit: the optimizer from configure_optimizers()
    assert callback.traces[8].cannot_trace is None
    assert all(torch.equal(module.accuracy.metric_state[name], value) for name, value in before.items())
    assert module.accuracy.update_count == 0


def test_pytorch_lightning_modules_and_trainers_trace_alike():
    pytorch_lightning = pytest.importorskip("pytorch_lightning")

    class Old(pytorch_lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(FEATURES, CLASSES)

        def training_step(self, batch, batch_idx):
            self.log("loss", 1.0)
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            self.log("val", 1.0)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    trainer = pytorch_lightning.Trainer(accelerator="cpu", logger=False)
    trace = lightning_tracer(trainer, Old(), _batch(2), val_batch=_batch(3))(8)
    assert trace.cannot_trace is None
    assert _labels(trace)[-1] == "val"


def test_a_validation_batch_without_a_sized_tensor_is_given_as_it_is():
    class Constant(ValMLP):
        def validation_step(self, batch, batch_idx):
            assert batch == ("no tensors", 3)
            self.net(torch.zeros(2, FEATURES))

    trace = lightning_tracer(
        Trainer(accelerator="cpu", logger=False), Constant(), _batch(2), val_batch=("no tensors", 3)
    )(8)
    assert trace.cannot_trace is None
    assert _labels(trace)[-1] == "val"


class _Autocasting(Precision):
    def __init__(self, cache: bool) -> None:
        self.cache = cache

    def autocast_context_manager(self):
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=self.cache)


@pytest.mark.parametrize("cache", [True, False])
def test_the_autocast_cache_is_read_from_the_precision_plugin(cache):
    assert autocast_caches(_Autocasting(cache)) is cache
    assert autocast_caches(Precision()) is True  # no autocast: nothing to cache, the trace's default
    assert autocast_caches(object()) is True
