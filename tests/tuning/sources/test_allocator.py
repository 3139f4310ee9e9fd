"""The caching allocator's model: cases worked by hand from the C++ rules, the cap, expandable segments."""

from __future__ import annotations

import random
import time

import pytest

from lightning_gpumem._core.alloc_events import Event
from lightning_gpumem.tuning.sources.allocator import (
    AllocatorModel,
    Replay,
    get_allocation_size,
    replay,
    round_size,
)

KIB = 2**10
MIB = 2**20
RESIZE = Event("resize", 1, 5)  # type: ignore[arg-type]  # not an action of the stream


def _alloc(block: int, size: int, stream: int = 0) -> Event:
    return Event("alloc", block, size, stream)


def _free(block: int) -> Event:
    return Event("free", block)


@pytest.mark.parametrize(
    ("size", "rounded", "segment"),
    [
        (1, 512, 2 * MIB),
        (512, 512, 2 * MIB),
        (513, 1024, 2 * MIB),
        (MIB, MIB, 2 * MIB),  # the largest small request
        (MIB + 1, MIB + 512, 20 * MIB),
        (10 * MIB - 512, 10 * MIB - 512, 20 * MIB),
        (10 * MIB, 10 * MIB, 10 * MIB),
        (11 * MIB, 11 * MIB, 12 * MIB),
        (12 * MIB + 1, 12 * MIB + 512, 14 * MIB),
    ],
)
def test_requests_round_to_512_bytes_and_segments_to_the_pools_sizes(
    size: int, rounded: int, segment: int
) -> None:
    assert round_size(size) == rounded
    assert round_size(rounded) == rounded  # idempotent: a stream of rounded sizes replays the same
    assert get_allocation_size(rounded) == segment


def test_small_requests_share_one_2_mib_segment() -> None:
    result = replay([_alloc(1, 1000), _alloc(2, 3000), _alloc(3, 512 * KIB), _alloc(4, 500 * KIB)])
    assert result.peak_reserved == 2 * MIB
    assert result.max_segments == 1
    assert result.peak_allocated == 1024 + 3072 + 512 * KIB + 500 * KIB
    assert result.peak_requested == 1000 + 3000 + 512 * KIB + 500 * KIB


def test_a_small_request_past_the_segments_room_gets_a_second_segment() -> None:
    # 3 x 800 KiB: the third does not fit the 448 KiB left of the first segment.
    result = replay([_alloc(1, 800 * KIB), _alloc(2, 800 * KIB), _alloc(3, 800 * KIB)])
    assert (result.peak_reserved, result.max_segments) == (4 * MIB, 2)


def test_a_5_mib_request_makes_a_20_mib_segment_and_a_second_one_reuses_its_remainder() -> None:
    model = AllocatorModel()
    assert model.malloc(1, 5 * MIB)
    assert (model.reserved_bytes, model.allocated_bytes, model.segments) == (20 * MIB, 5 * MIB, 1)
    assert model.malloc(2, 5 * MIB)
    assert (model.reserved_bytes, model.allocated_bytes, model.segments) == (20 * MIB, 10 * MIB, 1)
    assert model.result().device_allocs == 1


def test_an_11_mib_request_gets_a_12_mib_segment_and_holds_all_of_it() -> None:
    # The 1 MiB left is not more than 1 MiB: not split off, so the block (and allocated) is 12 MiB.
    result = replay([_alloc(1, 11 * MIB)])
    assert (result.peak_reserved, result.peak_allocated, result.peak_requested) == (
        12 * MIB,
        12 * MIB,
        11 * MIB,
    )
    split = replay([_alloc(1, 10 * MIB + 512 * KIB), _alloc(2, 1536 * KIB)])
    # 1.5 MiB left is split off and serves the next large request of that size.
    assert (split.peak_reserved, split.peak_allocated, split.max_segments) == (12 * MIB, 12 * MIB, 1)


def test_a_freed_block_is_reused_and_reserved_does_not_grow() -> None:
    result = replay([_alloc(1, 64 * MIB), _free(1), _alloc(2, 64 * MIB), _free(2), _alloc(3, 40 * MIB)])
    assert result.peak_reserved == 64 * MIB
    assert result.device_allocs == 1
    assert result.peak_allocated == 64 * MIB


def test_best_fit_takes_the_smallest_cached_block_that_fits() -> None:
    stream = [
        _alloc(1, 12 * MIB),
        _alloc(2, 30 * MIB),
        _free(1),
        _free(2),
        _alloc(3, 11 * MIB),
        _alloc(4, 25 * MIB),
    ]
    result = replay(stream)
    assert (result.peak_reserved, result.device_allocs) == (42 * MIB, 2)


def test_split_blocks_merge_back_into_one_when_freed() -> None:
    # 5 + 5 MiB in one 20 MiB segment; both freed, the three free pieces are one 20 MiB block again.
    result = replay([_alloc(1, 5 * MIB), _alloc(2, 5 * MIB), _free(1), _free(2), _alloc(3, 18 * MIB)])
    assert (result.peak_reserved, result.device_allocs) == (20 * MIB, 1)


def test_free_blocks_do_not_merge_across_an_allocated_one() -> None:
    # Free: 5 MiB before block 2 and 10 MiB after it; 12 MiB fits neither, so a 12 MiB segment is made.
    result = replay([_alloc(1, 5 * MIB), _alloc(2, 5 * MIB), _free(1), _alloc(3, 12 * MIB)])
    assert (result.peak_reserved, result.max_segments) == (32 * MIB, 2)


def test_blocks_are_reused_only_by_the_stream_that_made_them() -> None:
    result = replay([_alloc(1, 5 * MIB, stream=0), _free(1), _alloc(2, 5 * MIB, stream=1), _free(2)])
    assert (result.peak_reserved, result.max_segments) == (40 * MIB, 2)
    same = replay([_alloc(1, 5 * MIB, stream=3), _free(1), _alloc(2, 5 * MIB, stream=3)])
    assert same.peak_reserved == 20 * MIB


def test_a_zero_byte_request_asks_nothing_of_the_allocator() -> None:
    model = AllocatorModel()
    assert model.malloc(1, 0)
    assert (model.reserved_bytes, model.allocated_bytes) == (0, 0)
    model.free(1)
    assert model.malloc(1, 0)  # the id is free again


def test_under_a_cap_the_cached_segments_are_given_back_and_the_request_retried() -> None:
    # 30 MiB cached; 32 MiB more would pass the 40 MiB cap: the cached segment goes, the retry fits.
    result = replay([_alloc(1, 30 * MIB), _free(1), _alloc(2, 32 * MIB)], limit_bytes=40 * MIB)
    assert result.fits
    assert (result.retries, result.ooms) == (1, 0)
    assert (result.device_allocs, result.device_frees) == (2, 1)
    assert result.peak_reserved == 32 * MIB
    unlimited = replay([_alloc(1, 30 * MIB), _free(1), _alloc(2, 32 * MIB)])
    assert (unlimited.peak_reserved, unlimited.retries) == (62 * MIB, 0)


def test_the_cap_is_checked_against_reserved_plus_the_new_segment_inclusive() -> None:
    # 20 + 20 MiB is exactly the cap: allowed (the allocator refuses only above it).
    result = replay([_alloc(1, 5 * MIB, stream=0), _alloc(2, 5 * MIB, stream=1)], limit_bytes=40 * MIB)
    assert (result.fits, result.retries, result.peak_reserved) == (True, 0, 40 * MIB)


def test_a_split_segment_is_not_given_back_and_the_request_is_an_oom() -> None:
    stream = [_alloc(1, 5 * MIB), _alloc(2, 5 * MIB), _free(1), _alloc(3, 22 * MIB)]
    result = replay(stream, limit_bytes=40 * MIB)
    assert not result.fits
    assert (result.retries, result.ooms, result.device_frees) == (1, 1, 0)
    assert result.peak_reserved == 20 * MIB


def test_an_oom_is_reported_and_the_replay_stops_there() -> None:
    # After the OOM the step would have raised: the free of an unknown block after it is never read.
    stream = [_alloc(1, 30 * MIB), _alloc(2, 12 * MIB), _free(99)]
    result = replay(stream, limit_bytes=40 * MIB)
    assert (result.fits, result.ooms, result.retries) == (False, 1, 1)
    assert (result.peak_reserved, result.peak_allocated) == (30 * MIB, 30 * MIB)
    model = AllocatorModel(limit_bytes=40 * MIB)
    assert model.malloc(1, 30 * MIB)
    assert not model.malloc(2, 12 * MIB)
    with pytest.raises(ValueError, match=r"free\(block=2\)"):
        model.free(2)  # never served


def test_max_split_size_keeps_oversize_blocks_for_large_requests_and_frees_them_first() -> None:
    stream = [_alloc(1, 40 * MIB), _free(1), _alloc(2, 5 * MIB)]
    # 5 MiB is below max_split_size: the cached 40 MiB block is not split for it.
    assert replay(stream, max_split_size=30 * MIB).peak_reserved == 60 * MIB
    assert replay(stream).peak_reserved == 40 * MIB
    # Under a cap the oversize block is freed before any retry is counted.
    capped = replay(stream, max_split_size=30 * MIB, limit_bytes=50 * MIB)
    assert (capped.fits, capped.retries, capped.device_frees, capped.peak_reserved) == (True, 0, 1, 40 * MIB)


def test_expandable_segments_grow_by_20_mib_pages_where_segments_would_add_up() -> None:
    stream = [_alloc(1, 5 * MIB), _alloc(2, 30 * MIB)]
    expandable = replay(stream, expandable_segments=True)
    # 5 MiB maps one 20 MiB page; 30 MiB takes the 15 MiB left and one more page.
    assert (expandable.peak_reserved, expandable.max_segments, expandable.device_allocs) == (40 * MIB, 1, 2)
    assert replay(stream).peak_reserved == 50 * MIB  # a 20 MiB and a 30 MiB segment


def test_expandable_segments_map_the_small_pool_in_2_mib_pages_one_segment_per_pool() -> None:
    stream = [_alloc(1, 800 * KIB), _alloc(2, 800 * KIB), _alloc(3, 800 * KIB), _alloc(4, 12 * MIB)]
    result = replay(stream, expandable_segments=True)
    # Small: 2 pages of 2 MiB; large: one 20 MiB page. Two segments: one per pool.
    assert (result.peak_reserved, result.max_segments) == (24 * MIB, 2)
    assert replay(stream).max_segments == 3


def test_expandable_best_fit_passes_over_the_block_at_the_mapped_end() -> None:
    # Free: 6 MiB at the start and 4 MiB at the end of the mapped page (followed by unmapped space).
    stream = [_alloc(1, 6 * MIB), _alloc(2, 5 * MIB), _alloc(3, 5 * MIB), _free(1)]
    # 4 MiB counts the end block as 4 MiB plus the unmapped space: it takes 4 of the 6 MiB instead, so
    # 6 MiB then finds no block and maps a second page.
    result = replay([*stream, _alloc(4, 4 * MIB), _alloc(5, 6 * MIB)], expandable_segments=True)
    assert result.peak_reserved == 40 * MIB


def test_expandable_segments_under_a_cap_unmap_free_pages_and_release_the_empty_segment() -> None:
    stream = [_alloc(1, 5 * MIB), _alloc(2, 30 * MIB), _free(1), _free(2), _alloc(3, 50 * MIB, stream=1)]
    result = replay(stream, expandable_segments=True, limit_bytes=60 * MIB)
    # 40 MiB mapped and free; 40 + 50 passes the cap, so both pages are unmapped (the stream's segment goes)
    # and the retry maps three 20 MiB pages on stream 1.
    assert result.fits
    assert (result.retries, result.device_frees, result.peak_reserved) == (1, 1, 60 * MIB)
    model = AllocatorModel(expandable_segments=True, limit_bytes=60 * MIB)
    assert model.malloc(1, 5 * MIB)
    assert model.malloc(2, 30 * MIB)
    model.free(1)
    model.free(2)
    assert model.malloc(3, 50 * MIB, stream=1)
    assert (model.reserved_bytes, model.segments) == (60 * MIB, 1)  # stream 0's segment is gone


def test_expandable_segments_unmap_only_whole_free_pages() -> None:
    model = AllocatorModel(expandable_segments=True)
    for block in range(4):
        assert model.malloc(block, 10 * MIB)  # two 20 MiB pages, full
    model.free(1)
    model.free(2)  # free: 10..30 MiB, page 1 (20..40) is half used
    model.empty_cache()
    assert model.reserved_bytes == 40 * MIB
    model.free(3)  # now 10..40 MiB free: page 1 is whole
    model.empty_cache()
    assert (model.reserved_bytes, model.result().device_frees) == (20 * MIB, 1)


def test_each_mark_begins_a_phase_whose_peaks_count_from_what_is_held_then() -> None:
    stream = [
        Event("mark", label="forward"),
        _alloc(1, 5 * MIB),
        _alloc(2, 5 * MIB),
        _free(2),
        Event("mark", label="backward"),
        _alloc(3, KIB),
        _free(1),
        Event("mark", label="forward"),
        _alloc(4, 11 * MIB),
    ]
    result = replay(stream)
    assert result.phase_peaks == {
        "forward": (11 * MIB + KIB, 22 * MIB),
        "backward": (5 * MIB + KIB, 22 * MIB),
    }
    assert (result.peak_allocated, result.peak_reserved) == (11 * MIB + KIB, 22 * MIB)
    assert replay(stream[1:4]).phase_peaks == {}


@pytest.mark.parametrize(
    ("stream", "match"),
    [
        ([_free(7)], r"events\[0\]=Event\(action='free', block=7.*Expected a live block"),
        ([_alloc(1, 5), _free(1), _free(1)], r"events\[2\]=.*block=1.*Expected a live block"),
        ([_alloc(1, -1)], r"events\[0\]=Event\(action='alloc', block=1, size=-1.*Expected an integer >= 0"),
        ([_alloc(1, 5), _alloc(1, 5)], r"events\[1\]=.*Expected an integer id that is not live"),
        ([RESIZE], r"events\[0\]=Event\(action='resize'.*Expected an action"),
    ],
)
def test_a_bad_event_is_refused_naming_its_index_and_value(stream: list[Event], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        replay(stream)


def test_bad_arguments_to_the_model_are_refused_by_name() -> None:
    model = AllocatorModel()
    with pytest.raises(
        ValueError, match=r"`AllocatorModel.free\(block=3\)` is not valid. Expected a live block"
    ):
        model.free(3)
    with pytest.raises(ValueError, match=r"`AllocatorModel.malloc\(size=-5\)` is not valid"):
        model.malloc(1, -5)
    with pytest.raises(ValueError, match=r"`AllocatorModel.malloc\(size=1.5\)` is not valid"):
        model.malloc(1, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`AllocatorModel\(limit_bytes=-1\)` is not valid"):
        AllocatorModel(limit_bytes=-1)
    with pytest.raises(ValueError, match=r"`AllocatorModel\(max_split_size=1048576\)` is not valid"):
        AllocatorModel(max_split_size=MIB)
    with pytest.raises(TypeError, match=r"`AllocatorModel\(expandable_segments='yes'\)` is not valid"):
        AllocatorModel(expandable_segments="yes")  # type: ignore[arg-type]


def _random_stream(seed: int, length: int) -> list[Event]:
    rng = random.Random(seed)
    live: list[int] = []
    stream = []
    for block in range(length):
        if live and rng.random() < 0.45:
            stream.append(_free(live.pop(rng.randrange(len(live)))))
        else:
            kind = rng.random()
            if kind < 0.5:
                size = rng.randint(1, MIB)
            elif kind < 0.9:
                size = rng.randint(MIB, 12 * MIB)
            else:
                size = rng.randint(10 * MIB, 60 * MIB)
            stream.append(_alloc(block, size, rng.choice([0, 0, 0, 5])))
            live.append(block)
        if rng.random() < 0.01:
            stream.append(Event("mark", label=rng.choice(["forward", "backward"])))
    return stream + [_free(block) for block in live]


@pytest.mark.parametrize("expandable", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_on_random_streams_allocated_stays_within_reserved_and_everything_comes_back(
    seed: int, expandable: bool
) -> None:
    stream = _random_stream(seed, 1500)
    model = AllocatorModel(expandable_segments=expandable)
    for event in stream:
        if event.action == "alloc":
            assert model.malloc(event.block, event.size, event.stream)
        elif event.action == "free":
            model.free(event.block)
        else:
            model.mark(event.label)
        assert model.requested_bytes <= model.allocated_bytes <= model.reserved_bytes
    result = model.result()
    assert result == replay(stream, expandable_segments=expandable)
    assert result.peak_requested <= result.peak_allocated <= result.peak_reserved
    assert all(allocated <= reserved for allocated, reserved in result.phase_peaks.values())
    assert max(reserved for _, reserved in result.phase_peaks.values()) <= result.peak_reserved
    assert (model.allocated_bytes, model.requested_bytes) == (0, 0)
    # Every free block merged back into whole segments (whole pages): emptying the cache gives all back.
    model.empty_cache()
    assert (model.reserved_bytes, model.segments) == (0, 0)
    if not expandable:
        assert model.result().device_frees == model.result().device_allocs


@pytest.mark.parametrize("expandable", [False, True])
def test_under_a_cap_a_random_stream_never_reserves_past_it_without_expandable_pages(
    expandable: bool,
) -> None:
    stream = _random_stream(11, 3000)
    free_run = replay(stream, expandable_segments=expandable)
    limit = free_run.peak_reserved * 3 // 4
    capped = replay(stream, limit_bytes=limit, expandable_segments=expandable)
    assert capped.retries >= 1
    if expandable:
        assert capped.peak_reserved <= limit + 20 * MIB  # checked per request, mapped by the page
    else:
        assert capped.peak_reserved <= limit


def test_a_100k_event_stream_replays_in_well_under_a_second_per_mode() -> None:
    stream = _random_stream(3, 100_000)
    for expandable in (False, True):
        started = time.perf_counter()
        result = replay(stream, expandable_segments=expandable)
        assert isinstance(result, Replay)
        assert time.perf_counter() - started < 3.0  # about 0.2 s on a laptop; the bound is for slow CI
