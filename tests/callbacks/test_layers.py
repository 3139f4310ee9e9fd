"""LayerMemoryProfiler with a fake allocator under a real CPU Trainer: every layer's bytes are known."""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger, Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpumem import LayerMemoryProfiler, keys
from lightning_gpumem._core.units import MIB
from tests.helpers.fakes import FakeProbe, FakeProfiler
from tests.helpers.models import LayerNet as Net
from tests.helpers.trainer import quiet_trainer


def _trainer(tmp_path, callbacks, **overrides) -> Trainer:
    return quiet_trainer(**{"logger": CSVLogger(tmp_path), "callbacks": callbacks, **overrides})


def _fit(tmp_path, callback, model, steps=3):
    _trainer(tmp_path, [callback], max_steps=steps).fit(model)


def _saved_tensors_hooks_active() -> bool:
    """Whether a ``saved_tensors_hooks`` context is active: a tensor saved for backward now already has hooks."""
    x = torch.ones(2, requires_grad=True)
    y = x * x  # kept alive: (older torch) the graph's saved tensors are freed with its output
    saved = y.grad_fn._raw_saved_self  # the documented SavedTensor of a grad_fn
    try:
        saved.register_hooks(
            lambda t: t, lambda t: t
        )  # one pair per saved tensor: refused if default hooks set one
    except RuntimeError as error:
        if "already been set" not in str(error):
            raise
        return True
    return False


def _no_hooks_left(model: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_each_layer_gets_its_activations_params_grads_and_peaks(tmp_path):
    fake = FakeProbe(base=100 * MIB)
    profiler = FakeProfiler(fake, at_step=1, top_k=3)
    _fit(tmp_path, profiler, Net(fake))
    by_name = {r.name: r for r in profiler.records}
    assert list(by_name) == ["fc1", "keep1", "fc2", "keep2"]  # leaves, in forward order
    assert by_name["keep1"].activation_bytes == 3 * MIB
    assert by_name["keep1"].forward_peak_bytes == 5 * MIB  # the temporary, freed before the forward returned
    assert by_name["keep2"].activation_bytes == 1 * MIB
    assert by_name["fc1"].param_bytes == (8 * 16 + 16) * 4
    assert by_name["fc1"].grad_bytes == by_name["fc1"].param_bytes
    assert by_name["keep1"].param_bytes == 0
    table = profiler.table
    assert table is not None
    assert (
        table.splitlines()[0]
        == "Layer memory at step 1 (MiB; top 3 of 4 layers by memory saved for backward)"
    )
    assert "saved for backward" in table
    assert "measured peak" in table
    csv_files = list(tmp_path.rglob("layer_memory_step1.csv"))
    assert len(csv_files) == 1
    assert csv_files[0].read_text().splitlines()[2].startswith("keep1,Keep,0,0,3145728,5242880")


class SavedNet(LightningModule):
    """Real tensors on the CPU: fc1 (8->64) saves its input batch, ReLU its output, fc2 (64->16) its input (ReLU's
    output: already counted), the loss's pow its input (outside any module)."""

    def __init__(self, watch_hooks: bool = False) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 16)
        self.watch_hooks = (
            watch_hooks  # look for a saved-tensors context at the profiled step (a tensor it saves)
        )
        self.hooks_active: dict[str, bool] = {}

    def training_step(self, batch, batch_idx):
        loss = self.fc2(self.act(self.fc1(batch[0]))).pow(2).mean()
        if self.watch_hooks and self.global_step == 1:
            self.hooks_active["forward"] = _saved_tensors_hooks_active()
        return loss

    def on_before_backward(self, loss):  # after the callbacks' `on_before_backward`
        if self.watch_hooks and self.global_step == 1:
            self.hooks_active["backward"] = _saved_tensors_hooks_active()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(96, 8)), batch_size=32)


def test_memory_saved_for_backward_is_counted_once_per_storage_for_the_layer_that_saved_it(tmp_path):
    fake = FakeProbe(base=100 * MIB)  # device: cpu, so the saved CPU tensors count
    profiler = FakeProfiler(fake, at_step=1)
    _fit(tmp_path, profiler, SavedNet())
    saved = {r.name: r.saved_bytes for r in profiler.records}
    assert saved["fc1"] == 32 * 8 * 4  # its input (the batch); the weight is a parameter, not counted
    assert saved["act"] == 32 * 64 * 4  # its output
    assert saved["fc2"] == 0  # its input is ReLU's output, counted there
    assert (
        "saved outside layers 0.0" in profiler.table
    )  # pow's input (32x16 floats): 2 KiB, shown as 0.0 MiB
    model = SavedNet(watch_hooks=True)
    _fit(tmp_path, FakeProfiler(FakeProbe(base=100 * MIB), at_step=1), model)
    assert model.hooks_active == {"forward": True, "backward": False}  # the hooks were left before backward
    assert not _saved_tensors_hooks_active()


def test_only_the_chosen_step_is_profiled_and_hooks_are_removed(tmp_path):
    fake = FakeProbe(base=100 * MIB)
    model = Net(fake)
    profiler = FakeProfiler(fake, at_step=0)
    _fit(tmp_path, profiler, model, steps=2)
    assert profiler.table is not None
    assert profiler.table.startswith("Layer memory at step 0")
    assert _no_hooks_left(model)


def test_on_cpu_it_warns_once_and_does_nothing(tmp_path):
    profiler = LayerMemoryProfiler()
    with pytest.warns(UserWarning, match="LayerMemoryProfiler: `cpu` has no allocator statistics"):
        _fit(tmp_path, profiler, BoringModel())
    assert profiler.table is None
    assert not list(tmp_path.rglob("layer_memory_*.csv"))


@pytest.mark.parametrize(("kwargs", "match"), [({"at_step": -1}, r"at_step=-1"), ({"top_k": 0}, r"top_k=0")])
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=r"LayerMemoryProfiler\(" + match):
        LayerMemoryProfiler(**kwargs)


class Boom(Exception):
    """The user's error."""


class FailingNet(Net):
    """Net whose training step runs its forward through the layers, then ends as `how` says at step 1."""

    def __init__(self, fake: FakeProbe, how: str) -> None:
        super().__init__(fake)
        self.how = how
        self.error = Boom("the user's error at step 1") if how == "raises" else KeyboardInterrupt()
        self.hooked_at_epoch_end: list[bool] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step != 1:
            return loss
        if self.how in ("raises", "interrupted in the step"):
            raise self.error  # the forward ran: the saved-tensors context is entered
        if self.how == "backward skipped":
            return None  # Lightning skips backward and the optimizer step; the batch still ends
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        if self.how.startswith("skipped") and self.global_step == 1 and self.current_epoch == 0:
            return -1  # after the callbacks' `on_train_batch_start`: the rest of the epoch, this step too, is skipped
        return None

    def on_train_epoch_end(self):  # after the callbacks' `on_train_epoch_end`
        self.hooked_at_epoch_end.append(not _no_hooks_left(self))


class InterruptAfterTheStep(Callback):
    """Ctrl-C at the end of step 1, before the profiler (after it in the callbacks) gets `on_train_batch_end`."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2:  # step 1 has just run (`global_step` counts it already)
            raise pl_module.error


def _fit_inside_the_users_saved_tensors_hooks(fit: Callable[[], object]) -> None:
    """Run `fit` inside the user's own ``saved_tensors_hooks``; then the profiler's must have been left exactly once.

    Left at all: after `fit` the user's hooks are on top again (a tensor saved goes through their pack hook). Left
    once: the user's are still there (not left in the profiler's place), and after them none is active.
    """
    seen: list[torch.Size] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        seen.append(tensor.shape)
        return tensor

    sigint = signal.getsignal(signal.SIGINT)  # Lightning ignores Ctrl-C while it shuts down after one
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            fit()
            before = len(seen)
            x = torch.ones(3, requires_grad=True)
            (x * x).sum()  # saves x twice
            assert len(seen) == before + 2
        assert not _saved_tensors_hooks_active()
    finally:
        signal.signal(signal.SIGINT, sigint)


@pytest.mark.filterwarnings("ignore:.*`training_step` returned `None`")
@pytest.mark.parametrize(
    "how",
    [
        "normal",
        "backward skipped",
        "raises",
        "interrupted in the step",
        "interrupted after the step",
        "skipped, then profiled next epoch",
        "skipped in the last epoch",
    ],
)
def test_the_saved_tensors_hooks_are_left_exactly_once_on_every_way_out_of_the_step(tmp_path, how):
    fake = FakeProbe(base=100 * MIB)
    profiler = FakeProfiler(fake, at_step=1)
    model = FailingNet(fake, how)
    callbacks = [InterruptAfterTheStep(), profiler] if how == "interrupted after the step" else [profiler]
    trainer = _trainer(
        tmp_path, callbacks, max_steps=3, max_epochs=1 if how == "skipped in the last epoch" else 2
    )

    def fit() -> None:
        if how == "raises":
            with pytest.raises(Boom) as raised:
                trainer.fit(model)
            assert raised.value is model.error  # the user's error, unchanged
            assert str(raised.value) == "the user's error at step 1"
        elif how.startswith("interrupted"):
            with pytest.raises(SystemExit):  # Lightning's graceful shutdown after Ctrl-C
                trainer.fit(model)
        else:
            trainer.fit(model)

    _fit_inside_the_users_saved_tensors_hooks(fit)
    assert _no_hooks_left(model)
    assert not any(model.hooked_at_epoch_end)  # a skipped step's hooks are gone by the epoch's end
    if how in ("normal", "backward skipped", "skipped, then profiled next epoch"):
        assert profiler.table is not None
        assert profiler.table.startswith("Layer memory at step 1")
    else:
        assert profiler.table is None
    if how != "skipped in the last epoch":
        assert [r.activation_bytes for r in profiler.records] == [0, 3 * MIB, 0, 1 * MIB]  # the forward ran
        backward_ran = how not in ("backward skipped", "raises", "interrupted in the step")
        params = [r.param_bytes for r in profiler.records if r.param_bytes]
        assert [r.grad_bytes for r in profiler.records if r.param_bytes] == (
            params if backward_ran else [0, 0]
        )
    else:
        assert (profiler.records, profiler.step_peak_bytes) == ([], None)  # nothing was measured


class FailingProbe(FakeProbe):
    """A probe that fails once armed: at the recorder's start (resetting the peaks) or its end (reading them)."""

    def __init__(self, when: str) -> None:
        super().__init__(base=100 * MIB)
        self.when, self.armed = when, when == "start"

    def reset_peaks(self) -> None:
        if self.armed and self.when == "start":
            raise OSError("the driver went away")
        super().reset_peaks()

    def read_peaks(self) -> tuple[int, int]:
        if self.armed and self.when == "end":
            raise OSError("the driver went away")
        return super().read_peaks()


class ArmsTheProbe(Net):
    """At step 1, arms the probe after the forward and skips backward: the next reading is at the step's end."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step != 1:
            return loss
        self.keep1.fake.armed = True
        return None


@pytest.mark.filterwarnings("ignore:.*`training_step` returned `None`")
@pytest.mark.parametrize("when", ["start", "end"])
def test_a_recorder_whose_probe_fails_leaves_nothing_behind(tmp_path, when):
    fake = FailingProbe(when)
    model = ArmsTheProbe(fake)

    def fit() -> None:
        with pytest.raises(OSError, match="the driver went away"):
            _fit(tmp_path, FakeProfiler(fake, at_step=1), model)

    _fit_inside_the_users_saved_tensors_hooks(fit)
    assert _no_hooks_left(model)


def test_a_step_that_raises_leaves_what_it_measured_and_a_later_fit_profiles(tmp_path):
    fake = FakeProbe(base=100 * MIB)
    profiler = FakeProfiler(fake, at_step=1)
    with pytest.raises(Boom):
        _fit(tmp_path, profiler, FailingNet(fake, "raises"))
    assert [r.activation_bytes for r in profiler.records] == [0, 3 * MIB, 0, 1 * MIB]  # the forward ran
    assert profiler.step_peak_bytes == 104 * MIB + 5 * MIB  # keep1's temporary over what step 0 left (4 MiB)
    model = Net(fake)
    _fit(tmp_path, profiler, model)
    assert profiler.table is not None
    assert _no_hooks_left(model)


class TableLogger(Logger):
    """A logger that takes tables (as W&B's): the keys and steps it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[tuple[str, int]] = []

    @property
    def name(self):
        return "tables"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_table(self, key, columns, data, step):
        self.tables.append((key, step))


def test_the_table_is_logged_under_its_key_from_the_schema(tmp_path):
    fake = FakeProbe(base=100 * MIB)
    logger = TableLogger()
    _trainer(tmp_path, [FakeProfiler(fake, at_step=1, dirpath=tmp_path)], max_steps=3, logger=logger).fit(
        Net(fake)
    )
    assert logger.tables == [(keys.LAYER_MEMORY.format(), 2)]  # at the step's end: `global_step` counts it
    assert keys.LAYER_MEMORY.format() == "gpumem/layer_memory"


def test_the_docstrings_logged_metrics_are_the_schemas():
    doc = LayerMemoryProfiler.__doc__ or ""
    assert "{logged_metrics}" not in doc
    assert keys.rst_table("LayerMemoryProfiler") in doc


def test_teardown_stops_a_recording_the_step_never_ended(tmp_path):
    fake = FakeProbe(base=100 * MIB)
    profiler, model = FakeProfiler(fake, at_step=0), Net(fake)
    trainer = _trainer(tmp_path, [profiler], max_steps=1)
    profiler.setup(trainer, model, "fit")
    profiler.on_train_batch_start(trainer, model, None, 0)  # `global_step` is 0: the recording starts
    assert _saved_tensors_hooks_active()
    assert not _no_hooks_left(model)
    profiler.teardown(trainer, model, "fit")
    assert not _saved_tensors_hooks_active()
    assert _no_hooks_left(model)
    assert (profiler.table, profiler.records, profiler.step_peak_bytes) == (None, [], None)


class KeepsAGraph(Net):
    """At step 1 an extra forward through fc1 whose graph outlives the step; its backward runs at step 2."""

    def training_step(self, batch, batch_idx):
        if self.global_step == 1:
            self.kept = self.fc1(batch[0])
        if self.global_step == 2:
            resets = self.keep1.fake.resets
            self.kept.sum().backward()  # through the grad_fn pre-hook the recorder put on fc1's output at step 1
            self.resets_in_kept_backward = self.keep1.fake.resets - resets
        return super().training_step(batch, batch_idx)


def test_a_graph_kept_past_the_step_does_not_reach_the_stopped_recorder(tmp_path):
    fake = FakeProbe(base=100 * MIB)
    profiler, model = FakeProfiler(fake, at_step=1), KeepsAGraph(fake)
    _fit(tmp_path, profiler, model)
    assert profiler.table is not None
    assert model.resets_in_kept_backward == 0  # nobody else's peak counters are reset after the step
