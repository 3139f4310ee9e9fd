"""MemoryMonitor's logic with a fake allocator under a real CPU Trainer: every number is known in advance."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gpumem import MemoryMonitor
from lightning_gpumem._core.units import GIB
from tests.helpers.fakes import FakeMonitor, FakeProbe, SpikeModel, column, read_csv_metrics
from tests.helpers.trainer import csv_epoch_trainer


def _trainer(tmp_path, monitor, **overrides) -> Trainer:
    """One epoch of 8 training and 2 validation batches, every step logged to a CSVLogger in `tmp_path`."""
    return csv_epoch_trainer(tmp_path, **{"callbacks": [monitor], "limit_train_batches": 8, **overrides})


@pytest.mark.parametrize("value", [0, -3, 1.5, True, "10"])
def test_log_every_n_steps_is_validated(value):
    with pytest.raises(
        ValueError, match=r"MemoryMonitor\(log_every_n_steps=.*Expected an integer >= 1, or None"
    ):
        MemoryMonitor(log_every_n_steps=value)


@pytest.mark.parametrize("name", ["verbose", "nvml", "host", "progress_bar", "summary"])
def test_flags_must_be_bool(name):
    with pytest.raises(TypeError, match=rf"MemoryMonitor\({name}='yes'\).*Expected True or False"):
        MemoryMonitor(**{name: "yes"})


def test_peak_is_reset_every_batch(tmp_path):
    probe = FakeProbe(base=GIB)
    model = SpikeModel(probe, train_spikes={3: GIB})
    _trainer(tmp_path, FakeMonitor(probe)).fit(model)
    peaks = column(read_csv_metrics(tmp_path), "gpumem/train_peak_allocated_gib")
    assert sorted(peaks) == list(range(8))
    assert peaks[3] == pytest.approx(2.0)
    assert peaks[2] == pytest.approx(1.0)
    assert peaks[4] == pytest.approx(1.0)  # without the reset, batch 4 would still show the spike


def test_unlogged_batches_still_count_in_the_running_maximum(tmp_path):
    probe = FakeProbe(base=GIB)
    model = SpikeModel(probe, train_spikes={2: 3 * GIB})
    monitor = FakeMonitor(probe, log_every_n_steps=4)
    _trainer(tmp_path, monitor, limit_val_batches=0).fit(model)
    rows = read_csv_metrics(tmp_path)
    peaks = column(rows, "gpumem/train_peak_allocated_gib")
    assert sorted(peaks) == [3, 7]  # Lightning's own rule: (step + 1) % n == 0
    assert max(peaks.values()) == pytest.approx(1.0)
    assert monitor.peaks["train"][0] == 4 * GIB  # the spike of unlogged batch 2 is in the maximum
    assert probe.reads == 2  # nothing read on the other six batches


def test_gradient_accumulation_logs_once_per_optimizer_step_with_its_whole_peak(tmp_path):
    probe = FakeProbe(base=GIB)
    model = SpikeModel(probe, train_spikes={2: GIB}, by_batch_idx=True)  # first micro-batch of step 1
    monitor = FakeMonitor(probe)
    _trainer(tmp_path, monitor, accumulate_grad_batches=2, limit_val_batches=0).fit(model)
    rows = read_csv_metrics(tmp_path)
    peaks = column(rows, "gpumem/train_peak_allocated_gib")
    assert sorted(peaks) == sorted(column(rows, "loss")) == [0, 1, 2, 3]
    assert sum(1 for r in rows if r.get("gpumem/train_peak_allocated_gib")) == 4
    assert peaks == pytest.approx({0: 1.0, 1: 2.0, 2: 1.0, 3: 1.0})
    assert probe.resets == 1 + 4  # train start, then one window per optimizer step (not per micro-batch)


def test_progress_bar_is_left_alone_without_a_progress_bar(tmp_path):
    probe = FakeProbe()
    trainer = _trainer(tmp_path, FakeMonitor(probe), limit_val_batches=0)
    trainer.fit(SpikeModel(probe))
    assert "mem" not in trainer.progress_bar_metrics


def test_steps_line_up_with_lightning_metrics(tmp_path):
    probe = FakeProbe()
    _trainer(tmp_path, FakeMonitor(probe), log_every_n_steps=3, limit_val_batches=0).fit(SpikeModel(probe))
    rows = read_csv_metrics(tmp_path)
    assert sorted(column(rows, "gpumem/train_peak_allocated_gib")) == sorted(column(rows, "loss")) == [2, 5]


def test_validation_reports_the_loop_peak_and_skips_sanity_check(tmp_path):
    probe = FakeProbe(base=GIB)
    monitor = FakeMonitor(probe)
    trainer = _trainer(tmp_path, monitor, max_epochs=2, limit_train_batches=3, num_sanity_val_steps=2)
    trainer.fit(SpikeModel(probe, val_spike=2 * GIB))
    rows = read_csv_metrics(tmp_path)
    val = column(rows, "gpumem/val_peak_allocated_gib")
    assert list(val.values()) == pytest.approx([3.0, 3.0])  # one value per epoch, sanity check not logged
    assert max(column(rows, "gpumem/train_peak_allocated_gib").values()) == pytest.approx(1.0)
    assert monitor.peaks["val"][0] == 3 * GIB


def test_device_wide_metrics_and_progress_bar(tmp_path):
    probe = FakeProbe(base=2 * GIB, total=16 * GIB)
    monitor = FakeMonitor(probe, verbose=True)
    trainer = _trainer(tmp_path, monitor, limit_val_batches=0, enable_progress_bar=True)
    trainer.fit(SpikeModel(probe))
    rows = read_csv_metrics(tmp_path)
    last = next(r for r in reversed(rows) if r.get("gpumem/nvml_total_gib"))
    assert float(last["gpumem/nvml_total_gib"]) == pytest.approx(16.0)
    assert float(last["gpumem/non_torch_gib"]) == pytest.approx(300 / 1024)
    assert float(last["gpumem/host_rss_gib"]) == pytest.approx(2.0)
    assert float(last["gpumem/gpu_util_pct"]) == pytest.approx(50.0)
    assert float(last["gpumem/allocator/allocated_bytes.all.current"]) == 2 * GIB
    assert trainer.progress_bar_metrics["mem"] == "2.0/16.0 GiB"


@pytest.mark.parametrize(("interval", "expected_nvml_steps"), [(0, list(range(8))), (3600, [0])])
def test_nvml_and_host_are_read_at_most_every_interval(tmp_path, interval, expected_nvml_steps):
    probe = FakeProbe()
    monitor = FakeMonitor(probe, nvml_host_interval_s=interval)
    _trainer(tmp_path, monitor, limit_val_batches=0).fit(SpikeModel(probe))
    rows = read_csv_metrics(tmp_path)
    assert sorted(column(rows, "gpumem/train_peak_allocated_gib")) == list(
        range(8)
    )  # the allocator: every step
    assert sorted(column(rows, "gpumem/nvml_used_gib")) == expected_nvml_steps
    assert sorted(column(rows, "gpumem/host_rss_gib")) == expected_nvml_steps


@pytest.mark.parametrize("value", [-1, "1s", True])
def test_nvml_host_interval_is_validated(value):
    with pytest.raises(ValueError, match=r"nvml_host_interval_s=.*seconds >= 0"):
        MemoryMonitor(nvml_host_interval_s=value)


def test_nvml_and_host_can_be_switched_off(tmp_path):
    probe = FakeProbe()
    _trainer(tmp_path, FakeMonitor(probe, nvml=False, host=False), limit_val_batches=0).fit(
        SpikeModel(probe)
    )
    keys = {k for row in read_csv_metrics(tmp_path) for k, v in row.items() if v}
    assert "gpumem/train_peak_allocated_gib" in keys
    assert not {k for k in keys if "nvml" in k or "host" in k or "util" in k}


def test_test_loop_logs_its_peak_and_device_wide_keys(tmp_path):
    probe = FakeProbe(base=GIB)
    trainer = _trainer(tmp_path, FakeMonitor(probe))
    trainer.test(SpikeModel(probe, val_spike=GIB), verbose=False)
    rows = read_csv_metrics(tmp_path)
    assert list(column(rows, "gpumem/test_peak_allocated_gib").values()) == pytest.approx([2.0])
    assert column(rows, "gpumem/nvml_used_gib")


def test_summary_gives_advice_only_with_evidence(tmp_path):
    probe = FakeProbe(base=14 * GIB, total=24 * GIB)  # 58% of the device, no retries: nothing to advise
    monitor = FakeMonitor(probe)
    _trainer(tmp_path, monitor).fit(SpikeModel(probe))
    assert monitor.summary_text is not None
    assert "train" in monitor.summary_text
    assert "14.00 GiB" in monitor.summary_text
    assert "advice" not in monitor.summary_text

    probe = FakeProbe(base=23 * GIB, total=24 * GIB, retries=7)
    monitor = FakeMonitor(probe)
    _trainer(tmp_path, monitor).fit(SpikeModel(probe))
    assert "7 allocator retries" in monitor.summary_text
    assert "expandable_segments:True" in monitor.summary_text
    assert "96% of the device" in monitor.summary_text


def test_the_summary_sample_in_the_docs_is_laid_out_as_the_monitor_prints_it(tmp_path):
    """docs/monitor.md's table, numbers aside: the same lines and stage names (``val``, not ``validate``)."""
    page = (Path(__file__).parents[2] / "docs" / "monitor.md").read_text(encoding="utf-8")
    sample = page.split("```\nMemoryMonitor summary (", 1)[1].split("\n```", 1)[0].splitlines()[1:]
    probe = FakeProbe(base=GIB // 16, total=140 * GIB)  # a tiny model on a large device, as in the sample
    monitor = FakeMonitor(probe)
    _trainer(tmp_path, monitor).fit(SpikeModel(probe))
    assert monitor.summary_text is not None
    printed = monitor.summary_text.splitlines()[1:]

    def masked(lines):
        return [re.sub(r"\d+(\.\d+)?", "#", line) for line in lines]

    assert masked(sample) == masked(printed)
    assert [line.split()[0] for line in sample[1:3]] == ["train", "val"]


def test_summary_can_be_switched_off(tmp_path):
    probe = FakeProbe()
    monitor = FakeMonitor(probe, summary=False)
    _trainer(tmp_path, monitor).fit(SpikeModel(probe))
    assert monitor.summary_text is None


def test_no_summary_block_when_nothing_was_measured(tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringModel

    monitor = MemoryMonitor()  # on a CPU: host memory only, sampled on logging steps
    trainer = _trainer(tmp_path, monitor, log_every_n_steps=50, limit_val_batches=0)  # 8 steps: none logged
    trainer.fit(BoringModel())
    assert monitor.summary_text is None


class Boom(RuntimeError):
    pass


def test_a_fit_that_raises_still_prints_what_was_measured_marked_as_interrupted(tmp_path):
    probe = FakeProbe(base=3 * GIB)

    class Failing(SpikeModel):
        def training_step(self, batch, batch_idx):
            if batch_idx == 5:
                raise Boom("the user's own error")
            return super().training_step(batch, batch_idx)

    monitor = FakeMonitor(probe)
    with pytest.raises(Boom, match="the user's own error"):  # propagates unchanged
        _trainer(tmp_path, monitor).fit(Failing(probe))
    assert monitor.summary_text is not None
    assert "interrupted by Boom" in monitor.summary_text
    assert "3.00 GiB" in monitor.summary_text


def test_an_error_outside_fit_does_not_reprint_the_fit_summary(tmp_path):
    probe = FakeProbe(base=3 * GIB)

    class FailingValidation(SpikeModel):
        def validation_step(self, batch, batch_idx):
            if not self.trainer.training and self.trainer.state.fn == "validate":
                raise Boom("validate failed")
            return super().validation_step(batch, batch_idx)

    monitor = FakeMonitor(probe)
    trainer = _trainer(tmp_path, monitor)
    model = FailingValidation(probe)
    trainer.fit(model)
    after_fit = monitor.summary_text
    with pytest.raises(Boom):
        trainer.validate(model, verbose=False)
    assert monitor.summary_text == after_fit
    assert "interrupted" not in after_fit


def test_other_callbacks_add_to_the_advice_through_summary_context(tmp_path):
    from lightning.pytorch import Callback

    class Tuned(Callback):  # what BatchSizeTuner says once it chose a size
        def gpumem_summary_context(self):
            return {"tuned": True}

    probe = FakeProbe(base=2 * GIB, total=24 * GIB)  # 8% of the device: advice to tune the batch size...
    monitor = FakeMonitor(probe)
    _trainer(tmp_path, monitor).fit(SpikeModel(probe))
    assert "BatchSizeTuner" in monitor.summary_text
    monitor = FakeMonitor(probe)
    _trainer(tmp_path, monitor, callbacks=[monitor, Tuned()]).fit(SpikeModel(probe))
    assert "BatchSizeTuner" not in monitor.summary_text  # ...unless a tuner already chose it


def test_no_logger_warns_once_and_still_measures(tmp_path):
    probe = FakeProbe(base=GIB)
    monitor = FakeMonitor(probe)
    with pytest.warns(UserWarning, match="no logger") as record:
        _trainer(tmp_path, monitor, logger=False).fit(SpikeModel(probe, train_spikes={1: GIB}))
    assert sum("no logger" in str(w.message) for w in record) == 1
    assert monitor.peaks["train"][0] == 2 * GIB


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")  # resumed in place
def test_running_maxima_survive_a_checkpoint_resume(tmp_path):
    probe = FakeProbe(base=GIB)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = _trainer(tmp_path, None, callbacks=[FakeMonitor(probe), ckpt], enable_checkpointing=True)
    trainer.fit(SpikeModel(probe, train_spikes={2: 5 * GIB}))

    fresh_probe = FakeProbe(base=GIB)
    resumed = FakeMonitor(fresh_probe)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = _trainer(tmp_path, None, max_epochs=2, callbacks=[resumed, ckpt], enable_checkpointing=True)
    trainer.fit(SpikeModel(fresh_probe), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert resumed.peaks["train"][0] == 6 * GIB  # from the first run; the resumed epoch peaked at 1 GiB
    assert "6.00 GiB" in resumed.summary_text


def test_a_monitor_reused_for_a_second_fit_reports_that_fit_only(tmp_path):
    # A fit after one with a 4 GiB spike reported the first fit's peak in its summary (maxima set in __init__ only).
    probe = FakeProbe(base=GIB)
    monitor = FakeMonitor(probe)
    _trainer(tmp_path / "first", monitor).fit(SpikeModel(probe, train_spikes={3: 4 * GIB}))
    assert monitor.peaks["train"][0] == 5 * GIB
    probe.release_cache()  # as `torch.cuda.empty_cache()` between the fits: the cache held 5 GiB reserved
    _trainer(tmp_path / "second", monitor).fit(SpikeModel(probe))
    assert monitor.peaks["train"] == (GIB, GIB)
    assert monitor.summary_text is not None
    assert "5.0" not in monitor.summary_text, monitor.summary_text


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")  # resumed in place
def test_a_reused_monitor_resuming_from_a_checkpoint_continues_its_maxima(tmp_path):
    # The reset at fit start comes before Lightning loads the callback's state from the checkpoint.
    probe = FakeProbe(base=GIB)
    monitor = FakeMonitor(probe)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    _trainer(tmp_path, None, callbacks=[monitor, ckpt], enable_checkpointing=True).fit(
        SpikeModel(probe, train_spikes={2: 5 * GIB})
    )
    probe.release_cache()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = _trainer(tmp_path, None, max_epochs=2, callbacks=[monitor, ckpt], enable_checkpointing=True)
    trainer.fit(SpikeModel(probe), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert monitor.peaks["train"][0] == 6 * GIB


def test_the_tuner_and_the_layer_profiler_say_what_they_add_to_the_summary():
    from lightning_gpumem import BatchSizeTuner, LayerMemoryProfiler
    from lightning_gpumem.layers import LayerRecord

    tuner = BatchSizeTuner()
    assert tuner.gpumem_summary_context() == {}
    tuner.optimal_batch_size = 32
    assert tuner.gpumem_summary_context() == {"tuned": True}
    profiler = LayerMemoryProfiler()
    assert profiler.gpumem_summary_context() == {}
    profiler.records = [LayerRecord("a", "Linear", saved_bytes=1), LayerRecord("b", "GELU", saved_bytes=0)]
    profiler.records.append(LayerRecord("c", "Linear", saved_bytes=5))
    assert profiler.gpumem_summary_context() == {"top_layers": [("c", 5), ("a", 1)]}
