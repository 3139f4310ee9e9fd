from lightning_gpumem._summary import RunMemory, advice, format_summary
from lightning_gpumem._units import GIB


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
