from lightning_gpumem._core.summary import RunMemory, advice, format_summary
from lightning_gpumem._core.units import GIB


def test_fragmentation_advice_needs_a_large_inactive_share():
    run = RunMemory("gpu", total_bytes=80 * GIB, stage_peaks={"train": (40 * GIB, 60 * GIB)})
    assert advice(run) == []
    run.max_inactive_split_bytes, run.max_reserved_bytes = 3 * GIB, 10 * GIB
    (line,) = advice(run)
    assert "3.0 GiB of 10.0 GiB" in line
    assert "expandable_segments:True" in line
    run.max_inactive_split_bytes = GIB // 2  # small in absolute terms: no advice
    assert advice(run) == []


def test_large_headroom_is_reported_with_its_share():
    run = RunMemory("gpu", total_bytes=100 * GIB, stage_peaks={"train": (10 * GIB, 20 * GIB)})
    (line,) = advice(run)
    assert "only 20% of the device" in line


def test_table_lists_each_stage_and_headroom():
    run = RunMemory(
        "NVIDIA H200 (cuda:0)",
        total_bytes=100 * GIB,
        stage_peaks={"train": (50 * GIB, 60 * GIB), "validate": (30 * GIB, 60 * GIB)},
        max_non_torch_bytes=GIB,
        world_size=2,
    )
    text = format_summary(run)
    assert "max over 2 ranks" in text
    assert "train" in text
    assert "50.00 GiB" in text
    assert "validate" in text
    assert "30.00 GiB" in text
    assert "headroom 39.0 GiB (39%)" in text
    assert "non-PyTorch share 1.00 GiB" in text


def test_an_fp32_run_near_its_budget_is_told_about_bf16_with_the_numbers():
    run = RunMemory(
        "gpu",
        total_bytes=80 * GIB,
        stage_peaks={"train": (20 * GIB, 23 * GIB)},
        budget_bytes=24 * GIB,
        precision="32-true",
    )
    (line,) = advice(run)
    assert "96% of the budget" in line
    assert "precision='32-true'" in line
    assert "bf16-mixed" in line
    run.precision = "bf16-mixed"
    (line,) = advice(run)
    assert "activation checkpointing" in line
    assert "bf16" not in line


def test_profiled_layers_are_named_as_checkpointing_candidates_only_when_memory_is_tight():
    layers = [("net.3", 2 * GIB), ("net.1", GIB), ("net.5", GIB // 2), ("net.7", GIB // 4)]
    tight = RunMemory(
        "gpu", total_bytes=24 * GIB, stage_peaks={"train": (20 * GIB, 22 * GIB)}, top_layers=layers
    )
    line = next(line for line in advice(tight) if "LayerMemoryProfiler" in line)
    assert "net.3 (2.00 GiB), net.1 (1.00 GiB), net.5 (0.50 GiB)" in line
    assert "net.7" not in line
    roomy = RunMemory(
        "gpu", total_bytes=24 * GIB, stage_peaks={"train": (5 * GIB, 6 * GIB)}, top_layers=layers
    )
    assert not any("LayerMemoryProfiler" in line for line in advice(roomy))


def test_ddp_without_bucket_view_is_told_with_the_gradient_size():
    run = RunMemory("gpu", total_bytes=80 * GIB, stage_peaks={"train": (50 * GIB, 60 * GIB)})
    run.ddp_bucket_view, run.gradient_bytes = False, 2 * GIB
    (line,) = advice(run)
    assert "2.00 GiB of gradients" in line
    assert "gradient_as_bucket_view=True" in line
    run.ddp_bucket_view = True
    assert advice(run) == []


def test_large_headroom_points_at_the_tuner_unless_it_already_chose():
    run = RunMemory("gpu", total_bytes=100 * GIB, stage_peaks={"train": (10 * GIB, 20 * GIB)})
    (line,) = advice(run)
    assert "BatchSizeTuner" in line
    run.tuned = True
    assert advice(run) == []


def test_the_tuners_planned_ooms_and_retries_are_not_the_runs():
    from lightning_gpumem._core.summary import RunMemory, advice

    run = RunMemory(
        "GPU", total_bytes=80 * GIB, alloc_retries=19, num_ooms=7, planned_retries=19, planned_ooms=7
    )
    assert not [line for line in advice(run) if "retries" in line or "out-of-memory" in line]
    run.alloc_retries, run.num_ooms = 21, 8  # two retries and one OOM after the trials
    lines = advice(run)
    assert any(line.startswith("2 allocator retries") for line in lines)
    assert "1 out-of-memory error(s) were raised in this process (caught somewhere)." in lines
