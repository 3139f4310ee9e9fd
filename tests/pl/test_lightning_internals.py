"""Breaks loudly when a Lightning upgrade changes the internals `_logging.py` relies on."""

import lightning
import pytest
from lightning.pytorch import Callback
from lightning.pytorch.demos.boring_classes import BoringModel
from packaging.version import Version

from lightning_gpumem._pl.logging import batches_that_stepped, is_accumulating, is_logging_step
from tests.helpers.trainer import quiet_trainer


def test_batches_that_stepped_is_the_step_lightning_logs_at(tmp_path):
    seen = []

    class Spy(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            # the private counter must exist: the fallback (global_step) is only a safety net
            assert isinstance(trainer.fit_loop.epoch_loop._batches_that_stepped, int)
            seen.append((batches_that_stepped(trainer), is_logging_step(trainer, 2)))

    trainer = quiet_trainer(max_steps=4, callbacks=[Spy()], limit_val_batches=0, accumulate_grad_batches=1)
    trainer.fit(BoringModel())
    assert [step for step, _ in seen] == [0, 1, 2, 3]
    assert [flag for _, flag in seen[:3]] == [False, True, False]


def test_progress_bar_metrics_is_a_persistent_dict(tmp_path):
    trainer = quiet_trainer(max_steps=1, enable_progress_bar=None)
    trainer.fit(BoringModel())
    trainer.progress_bar_metrics["mem"] = "1.0/2.0 GiB"
    assert trainer.progress_bar_metrics["mem"] == "1.0/2.0 GiB"


def test_is_accumulating_matches_lightning_optimizer_steps():
    seen = []

    class Spy(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            assert callable(trainer.fit_loop._should_accumulate)  # private: see _logging.py
            seen.append(is_accumulating(trainer))

    trainer = quiet_trainer(
        max_epochs=1,
        limit_train_batches=5,
        limit_val_batches=0,
        accumulate_grad_batches=2,
        callbacks=[Spy()],
    )
    trainer.fit(BoringModel())
    assert seen == [True, False, True, False, False]  # Lightning steps on the final batch
    assert trainer.global_step == 3


_METRIC_DICTS = ("_callback_metrics", "_logged_metrics", "_progress_bar_metrics")


_LIGHTNING_2_6 = Version(lightning.__version__) >= Version("2.6")


def test_private_loop_attributes_the_tuner_uses_exist():
    """`lightning_gpumem/tuning/_session.py` relies on these; a Lightning upgrade that renames one fails here."""
    import lightning.pytorch as pl

    from lightning_gpumem.tuning.trials import loaders, saved_run
    from lightning_gpumem.tuning.trials import session as _session

    trainer = quiet_trainer(max_steps=1, enable_model_summary=None)
    trainer.fit(BoringModel())
    fit_loop = trainer.fit_loop
    assert hasattr(fit_loop, "_combined_loader")
    assert hasattr(fit_loop.epoch_loop.val_loop, "_combined_loader")
    assert callable(trainer._checkpoint_connector.restore)
    assert isinstance(fit_loop, pl.loops.loop._Loop)
    flags = saved_run.loop_flags(fit_loop)
    assert {fit_loop, fit_loop.epoch_loop, fit_loop.epoch_loop.val_loop} <= set(flags)
    for values in flags.values():  # `_restarting` everywhere; the other two arrived during Lightning 2.5
        assert "_restarting" in values
        assert set(values) <= set(saved_run.LOOP_FLAGS)
        assert set(values) == set(saved_run.LOOP_FLAGS) or not _LIGHTNING_2_6
        assert all(isinstance(b, bool) for b in values.values())
    assert hasattr(fit_loop.epoch_loop._results, "batch")
    assert hasattr(fit_loop.epoch_loop.val_loop._results, "batch")
    _session._drop_trial_references(trainer)
    assert hasattr(trainer.lightning_module, "_current_fx_name")
    assert hasattr(trainer.lightning_module, "_param_requires_grad_state")
    assert hasattr(trainer._checkpoint_connector, "_loaded_checkpoint")
    connector = trainer._logger_connector
    assert all(isinstance(getattr(connector, n), dict) for n in _METRIC_DICTS)
    assert loaders.train_source_is_module(trainer)
    assert hasattr(fit_loop, "_data_fetcher")
    assert hasattr(fit_loop.epoch_loop.val_loop, "_data_fetcher")
    assert loaders.dataloaders_loaded(trainer)
    loaders.unload_dataloaders(trainer)
    assert not loaders.dataloaders_loaded(trainer)


def test_ddp_strategy_keeps_its_ddp_kwargs():
    """`_registry.summary_context` reads `DDPStrategy._ddp_kwargs` for the gradient_as_bucket_view advice."""
    from lightning.pytorch.strategies import DDPStrategy

    assert DDPStrategy(gradient_as_bucket_view=True)._ddp_kwargs == {"gradient_as_bucket_view": True}


def test_current_fx_name_names_the_running_hook():
    """`BatchSizeTuner.scale` reads `LightningModule._current_fx_name` to refuse hooks it cannot run from."""
    from lightning_gpumem.tuning.trials import session as _session

    seen = {}

    class Spy(Callback):
        def on_fit_start(self, trainer, pl_module):
            seen["on_fit_start"] = _session.current_hook(trainer)

        def on_train_epoch_start(self, trainer, pl_module):
            seen["on_train_epoch_start"] = _session.current_hook(trainer)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen["on_train_batch_start"] = _session.current_hook(trainer)

    trainer = quiet_trainer(max_steps=1, callbacks=[Spy()], enable_model_summary=None)
    trainer.fit(BoringModel())
    assert seen == {name: name for name in ("on_fit_start", "on_train_epoch_start", "on_train_batch_start")}


def test_dataloader_workers_told_to_exit_are_gone_without_a_join():
    """`loaders._signal_workers_to_exit` relies on torch's and Lightning's private iterator attributes."""
    import time

    import torch
    from lightning.pytorch.utilities.combined_loader import CombinedLoader
    from torch.utils.data import DataLoader

    from lightning_gpumem.tuning.trials import loaders

    loader = DataLoader(torch.arange(64.0), batch_size=4, num_workers=2)
    combined = CombinedLoader(loader, "max_size_cycle")
    iter(combined)
    next(combined)
    iterator = combined._iterator.iterators[0]  # private: the `_ModeIterator`'s DataLoader iterators
    workers = list(iterator._workers)
    for name in (
        "_workers_done_event",
        "_persistent_workers",
        "_workers_status",
        "_shutdown",
    ):  # tuning/loaders.py
        assert hasattr(iterator, name)
    assert all(w.is_alive() for w in workers)
    stopping = loaders._signal_workers_to_exit(combined)
    assert stopping == [iterator]
    deadline = time.monotonic() + 10
    while any(w.is_alive() for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(w.is_alive() for w in workers), "the workers did not exit on the signal alone"
    combined.reset()
    loaders.join_workers(stopping)
    assert stopping == []
    assert iterator._shutdown


def test_automatic_optimization_internals_that_auto_microbatch_wraps():
    """`AutoMicrobatch` wraps the loop's `run`, `_on_before_zero_grad`, `_optimizer_zero_grad`, copies and puts back
    the `optim_progress` step and zero-grad trackers' fields and files buffered logs under `_current_fx_name`."""
    import inspect

    seen = {}

    class Spy(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            loop = trainer.fit_loop.epoch_loop.automatic_optimization
            seen["run"] = list(inspect.signature(loop.run).parameters)
            seen["zero"] = list(inspect.signature(loop._optimizer_zero_grad).parameters)
            seen["before_zero"] = list(inspect.signature(loop._on_before_zero_grad).parameters)
            state = loop.optim_progress.state_dict()
            loop.optim_progress.load_state_dict(state)
            seen["progress"] = loop.optim_progress.optimizer.step.total.completed
            seen["fields"] = sorted(vars(loop.optim_progress.optimizer.zero_grad.current))
            seen["fx"] = pl_module._current_fx_name

    trainer = quiet_trainer(max_steps=1, callbacks=[Spy()], limit_val_batches=0)
    trainer.fit(BoringModel())
    assert seen["run"] == ["optimizer", "batch_idx", "kwargs"]
    assert seen["zero"] == ["batch_idx", "optimizer"]
    assert seen["before_zero"] == ["optimizer"]
    assert seen["progress"] == 0
    assert seen["fields"] == ["completed", "ready", "started"]
    assert seen["fx"] == "on_train_batch_start"


def test_log_binds_the_arguments_the_package_sets_by_name():
    """`_pl/patching.log_arguments` binds `LightningModule.log` through its signature; the names it sets must exist."""
    import inspect

    from lightning.pytorch import LightningModule

    from lightning_gpumem._pl.patching import log_arguments, with_log_argument

    parameters = inspect.signature(LightningModule.log).parameters
    assert {"name", "value", "enable_graph", "sync_dist"} <= set(parameters)
    module = BoringModel()
    assert log_arguments(module.log, ("loss", 1.0, True), {"sync_dist": True}) == {
        "name": "loss",
        "value": 1.0,
        "prog_bar": True,
        "sync_dist": True,
    }
    args, kwargs = with_log_argument(
        module.log, ("loss", 1.0, False, True, None, None, "mean", False, True), {}, "sync_dist", False
    )
    assert args == ()
    assert kwargs["sync_dist"] is False
    assert kwargs["logger"] is True


def test_torch_and_torchmetrics_privates_the_package_uses_exist():
    """Private torch and torchmetrics names read on any build (the CUDA-only ones: the GPU test below)."""
    import torch
    import torch.cuda.memory
    from torch.utils.data import dataloader

    assert callable(torch.cuda.memory._record_memory_history)  # _hw/allocator.py: OOMSnapshot's history
    assert callable(torch.cuda.memory._snapshot)
    assert isinstance(dataloader._MultiProcessingDataLoaderIter, type)  # tuning/loaders.py
    assert callable(dataloader._MultiProcessingDataLoaderIter._mark_worker_as_unavailable)
    assert callable(dataloader._MultiProcessingDataLoaderIter._shutdown_workers)
    assert isinstance(
        torch.zeros(1)._version, int
    )  # microbatch/split.py: an in-place write since the attempt began
    assert hasattr(torch.nn.Linear(1, 1).state_dict(), "_metadata")  # tuning/model_state.py: module versions
    scaler = torch.amp.GradScaler("cpu")
    assert isinstance(
        scaler._per_optimizer_states, dict
    )  # microbatch/callback.py: a failed attempt's unscale_

    torchmetrics = pytest.importorskip("torchmetrics")
    metric = torchmetrics.MeanMetric()
    from lightning_gpumem.tuning.trials.saved_run import TORCHMETRICS_COUNTERS

    assert TORCHMETRICS_COUNTERS == ("_update_count", "_computed", "_forward_cache")
    assert all(hasattr(metric, name) for name in TORCHMETRICS_COUNTERS)
    assert set(metric.metric_state) == {"mean_value", "weight"}


def test_torch_fake_tensor_privates_the_trace_uses_exist():
    """_hw/trace.py: torch._subclasses.fake_tensor and torch.utils._python_dispatch, on every supported torch."""
    import weakref

    import torch
    from torch._subclasses import fake_tensor
    from torch.utils._python_dispatch import TorchDispatchMode

    for name in (
        "FakeTensorMode",
        "DataDependentOutputException",
        "DynamicOutputShapeException",
        "UnsupportedFakeTensorException",
        "UnsupportedOperatorException",
    ):
        assert isinstance(getattr(fake_tensor, name), type), name
    assert isinstance(TorchDispatchMode, type)
    assert callable(torch.native_dropout)
    assert torch.ops.aten.lift_fresh.default is not None
    assert torch.ops.aten.lift_fresh_copy.default is not None
    with fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
        matrix = torch.empty(2, 3)
        assert matrix.t()._is_view()  # the trace sums a view's gradient out of place
        assert not matrix._is_view()
        tensor = torch.empty(4)
        storage = weakref.ref(tensor.untyped_storage())
        assert storage() is not None  # alive while its tensor is: the trace's frees follow storages
        del tensor
    assert storage() is None


def test_lightning_private_helpers_the_package_imports_exist():
    from lightning.fabric.utilities.data import _set_sampler_epoch  # tuning/loaders.py
    from lightning.fabric.utilities.optimizer import _optimizers_to_device  # tuning/trials.py

    assert callable(_set_sampler_epoch)
    assert callable(_optimizers_to_device)
    trainer = quiet_trainer(max_steps=1, enable_model_summary=None)
    trainer.fit(BoringModel())
    loop = trainer.fit_loop
    assert loop._data_source.is_module()
    assert loop.epoch_loop.val_loop._data_source.is_module()
    assert isinstance(loop.epoch_loop.val_loop._has_run, bool)  # tuning/saved_run.py
    for flag in (
        "_restarting",
        "_loaded_from_state_dict",
        "_resuming_from_checkpoint",
    ):  # saved_run.LOOP_FLAGS
        assert isinstance(getattr(loop, flag, False), bool)


def test_lightning_rebuilds_a_hooks_dataloader_with_another_sampler():
    """`tuning/loaders.longest_first`: `_update_dataloader(loader, sampler)` keeps the loader's arguments (its
    `collate_fn`, its batch size) and takes the sampler, for a loader built inside Lightning's dataloader request."""
    from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader
    from lightning.pytorch.utilities.data import _update_dataloader

    trainer = quiet_trainer(max_steps=1, enable_model_summary=None)
    trainer.fit(BoringModel())
    loader = _request_dataloader(trainer.fit_loop._data_source)
    rebuilt = _update_dataloader(loader, list(reversed(range(len(loader.dataset)))))
    assert rebuilt.batch_size == loader.batch_size
    assert rebuilt.collate_fn is loader.collate_fn
    assert list(rebuilt.sampler)[:2] == [len(loader.dataset) - 1, len(loader.dataset) - 2]


@pytest.mark.gpu
def test_cuda_allocator_privates_exist():
    """`_hw/allocator.py`: the OOM observer and the cuBLAS workspace release exist on CUDA builds."""
    import torch

    assert callable(torch._C._cuda_attach_out_of_memory_observer)
    assert callable(torch._C._cuda_clearCublasWorkspaces)
