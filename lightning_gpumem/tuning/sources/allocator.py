"""A model of PyTorch's CUDA caching allocator: replay an allocation stream, get the memory it would reserve.

Why a model and not a margin on live tensors: what the caching allocator reserves depends on the order of the
requests. It rounds each one, packs small requests into 2 MiB segments and those of 1 to 10 MiB into 20 MiB
ones, keeps freed blocks cached for their stream, splits and merges them, and when ``cudaMalloc`` (or the cap
set by ``set_per_process_memory_fraction``) refuses a segment, gives its unsplit cached segments back and
tries once more. Replaying the requests through the same rules is the only exact answer, and it needs no GPU:
this module is pure Python (stdlib only) so "will it fit?" can be answered anywhere.

The rules are those of ``c10/cuda/CUDACachingAllocator.cpp`` in torch 2.4 to 2.11 at default settings
(``max_split_size`` unlimited, no garbage-collection threshold, ``roundup_power2_divisions`` off), one
function here per function there (named in each docstring):

* ``round_size``: requests round up to a multiple of 512 bytes. ``get_allocation_size``: a new segment is
  2 MiB for a request of at most 1 MiB (small pool), 20 MiB below 10 MiB, else the request rounded up to
  2 MiB (large pool).
* Free blocks are kept per pool in the order (stream, size, address) and the best fit is the first at or
  after (stream, size): a block is only reused by its own stream. ``should_split``: the remainder is split
  off when at least 512 bytes (small pool, or expandable segments) or more than 1 MiB (large pool). A freed
  block merges with free neighbours of its segment.
* ``malloc``: cached block, else a new segment, else (with ``max_split_size``) free oversize cached segments
  and retry, else free every unsplit cached segment (``release_cached_blocks``, one ``num_alloc_retries``)
  and retry, else OOM (``num_ooms``). The cap is checked as the allocator does: reserved bytes plus the new
  segment's size against the allowed bytes (``total_allocated_memory + size > allowed_memory_maximum``).
* ``expandable_segments:True``: one segment per stream and pool, a range of address space whose pages are
  mapped as needed (2 MiB pages for the small pool, 20 MiB for the large), so reserved grows by whole pages;
  the best fit counts a block followed by unmapped space as that much larger, and a retry unmaps every free
  page.

Simplifications: no CUDA graphs or private pools, no ``record_stream`` (a free is final at once: the stream
fed here should carry the allocator's ``free_completed``, not ``free_requested``), no garbage collection, no
``roundup_power2_divisions``, no failure of ``cudaMalloc`` itself (only the cap refuses; give the usable
device memory as the cap to ask "will it fit?"). Segment addresses are handed out as ``cudaMalloc`` gave them
out in most recorded H100 histories: the large pool's top down (a later segment below the earlier ones), the
small pool's 2 MiB segments bottom up (15 of the 20 complete recorded streams of ``cudaMalloc`` segments
replay exactly with these, 14 with all addresses increasing or all decreasing:
``benchmarks/allocator_fidelity.py --check --addresses``). The driver's own placement is more involved, and
the address only breaks ties between free blocks of equal size (the lowest address first), so a replay can
differ from a run there and nowhere else: given the recorded addresses (``addresses``), every complete
recorded stream of ``cudaMalloc`` segments replays exactly, the five the model's own addresses miss included
(``tests/tuning/sources/test_allocator_fidelity.py``). An expandable segment has 1 TiB of address space (the
allocator takes 1.125 times the device's memory), so it never runs out of it. With a cap and expandable
segments the allocator checks the request's segment size (``get_allocation_size``) but maps whole pages, so
reserved may pass the cap by part of a page, as it does on the GPU.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable
from dataclasses import dataclass, field

from lightning_gpumem._core.alloc_events import Event
from lightning_gpumem._core.checks import require_flags, require_int

MIN_BLOCK_BYTES = 512  # kMinBlockSize: every request rounds up to a multiple of this
SMALL_SIZE_BYTES = 1 << 20  # kSmallSize: the largest request of the small pool
SMALL_BUFFER_BYTES = 2 << 20  # kSmallBuffer: a small pool's segment (and its expandable page)
MIN_LARGE_ALLOC_BYTES = 10 << 20  # kMinLargeAlloc: requests above 1 MiB and below this get 20 MiB
LARGE_BUFFER_BYTES = 20 << 20  # kLargeBuffer: that segment (and the large pool's expandable page)
ROUND_LARGE_BYTES = 2 << 20  # kRoundLarge: larger requests get a segment rounded up to this
ADDRESS_SPACE_BYTES = 1 << 40  # an expandable segment's address space (the allocator: 1.125x the device)
ADDRESS_TOP = 1 << 56  # where the first segment ends: room below for any replay's segments
_UNLIMITED = 2**64 - 1  # SIZE_MAX: max_split_size when not set


def round_size(size: int) -> int:
    """The size of the block a request of ``size`` bytes gets (``round_size``): a multiple of 512, in bytes.

    >>> round_size(1), round_size(512), round_size(513)
    (512, 512, 1024)
    """
    if size < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    return MIN_BLOCK_BYTES * ((size + MIN_BLOCK_BYTES - 1) // MIN_BLOCK_BYTES)


def get_allocation_size(size: int) -> int:
    """The size of the segment a block of ``size`` bytes makes when none is cached (``get_allocation_size``).

    >>> [get_allocation_size(n) // 2**20 for n in (4096, 5 * 2**20, 11 * 2**20)]
    [2, 20, 12]
    """
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return ROUND_LARGE_BYTES * ((size + ROUND_LARGE_BYTES - 1) // ROUND_LARGE_BYTES)


@dataclass(frozen=True)
class Replay:
    """What the caching allocator would have done with a stream: its peaks (in bytes) and counters.

    Attributes:
        peak_allocated: peak of the blocks handed out (``allocated_bytes.all.peak``): each request counts its
            block's size, its size after ``round_size`` or the whole segment where the remainder was too
            small to split off (an 11 MiB request holds a 12 MiB block).
        peak_requested: peak of the bytes requested, before rounding (``requested_bytes.all.peak``).
        peak_reserved: peak of the memory held from the device (``reserved_bytes.all.peak``): the number a
            cap (``set_per_process_memory_fraction``) limits.
        max_segments: most segments held at once: ``cudaMalloc`` segments (``segment.all.peak``), or with
            expandable segments the expandable segments (one per stream and pool).
        device_allocs: ``cudaMalloc`` calls, or page mappings with expandable segments
            (``num_device_alloc``).
        device_frees: ``cudaFree`` calls, or page unmappings (``num_device_free``).
        retries: times the cached segments were given back to retry a refused segment
            (``num_alloc_retries``).
        ooms: requests refused even then (``num_ooms``); :func:`replay` stops at the first, as the step
            would.
        phase_peaks: for each mark's label, the peaks ``(allocated, reserved)`` while its phase ran, counted
            from what was held when it began; a label marked more than once keeps the largest.
    """

    peak_allocated: int
    peak_requested: int
    peak_reserved: int
    max_segments: int
    device_allocs: int
    device_frees: int
    retries: int
    ooms: int
    phase_peaks: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        """Whether every request was served: no OOM."""
        return self.ooms == 0


class AllocatorModel:
    """The caching allocator of one device, in memory: serve requests, free them, report its state.

    Args:
        limit_bytes: the cap in bytes (``set_per_process_memory_fraction``: the fraction times the device's
            memory); ``None`` for none.
        expandable_segments: model ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
        max_split_size: ``max_split_size_mb`` in bytes (above 20 MiB); ``None`` (the default) for unlimited.
        addresses: the segments' start addresses in the order ``cudaMalloc`` gave them (a recorded history's
            ``segment_alloc`` events), in place of the model's own while they last; they break ties between
            free blocks of one size as on the device. Not with ``expandable_segments``.

    Example:
        >>> model = AllocatorModel()
        >>> model.malloc(1, 5 * 2**20)
        True
        >>> model.reserved_bytes // 2**20, model.allocated_bytes // 2**20
        (20, 5)
        >>> model.free(1)
        >>> model.reserved_bytes // 2**20, model.allocated_bytes
        (20, 0)
    """

    def __init__(
        self,
        *,
        limit_bytes: int | None = None,
        expandable_segments: bool = False,
        max_split_size: int | None = None,
        addresses: Iterable[int] | None = None,
    ) -> None:
        if limit_bytes is not None:
            require_int("AllocatorModel", "limit_bytes", limit_bytes, 0)
        require_flags("AllocatorModel", expandable_segments=expandable_segments)
        if max_split_size is not None:
            require_int("AllocatorModel", "max_split_size", max_split_size, LARGE_BUFFER_BYTES + 1)
        if addresses is not None and expandable_segments:
            raise ValueError(
                "`AllocatorModel(addresses=..., expandable_segments=True)` is not valid. Expected addresses"
                " only for `cudaMalloc` segments (expandable segments map pages into their own range)."
            )
        self._given = None if addresses is None else iter(addresses)
        self._limit = limit_bytes
        self._expandable = expandable_segments
        self._max_split = _UNLIMITED if max_split_size is None else max_split_size
        self._small = _Pool(small=True)
        self._large = _Pool(small=False)
        self._live: dict[int, _Block] = {}
        self._empty: set[int] = set()  # live ids of 0 bytes: torch asks the allocator nothing for them
        self._next_address = ADDRESS_TOP  # the large pool's segments: top down
        self._next_small = 1 << 32  # the small pool's: bottom up
        self._allocated = self._requested = self._reserved = self._segments = 0
        self._peak_allocated = self._peak_requested = self._peak_reserved = self._max_segments = 0
        self._device_allocs = self._device_frees = self._retries = self._ooms = 0
        self._phase: str | None = None
        self._phase_allocated = self._phase_reserved = 0
        self._phase_peaks: dict[str, tuple[int, int]] = {}

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the blocks handed out now (``memory_allocated``)."""
        return self._allocated

    @property
    def requested_bytes(self) -> int:
        """Bytes requested by the live blocks, before rounding."""
        return self._requested

    @property
    def reserved_bytes(self) -> int:
        """Bytes held from the device now (``memory_reserved``)."""
        return self._reserved

    @property
    def segments(self) -> int:
        """Segments held now: ``cudaMalloc`` segments, or expandable segments."""
        return self._segments

    def malloc(self, block: int, size: int, stream: int = 0) -> bool:
        """Serve a request of ``size`` bytes on ``stream`` as the allocator's ``malloc`` does.

        Args:
            block: an id for the request, not live now; :meth:`free` names it.
            size: bytes requested (0: nothing is asked of the allocator, as in torch).
            stream: the stream's id; blocks are reused only by the stream that made them.

        Returns:
            ``True`` where the request was served, ``False`` where the allocator would raise its OOM.

        Raises:
            ValueError: ``block`` is live or not an integer, ``size`` is not an integer >= 0, ``stream`` is
                not an integer.
        """
        if type(block) is not int or block in self._live or block in self._empty:
            raise _Refused("malloc", "block", block, "Expected an integer id that is not live.")
        if type(size) is not int or size < 0:
            raise _Refused("malloc", "size", size, "Expected an integer >= 0.")
        if type(stream) is not int:
            raise _Refused("malloc", "stream", stream, "Expected an integer.")
        if size == 0:
            self._empty.add(block)
            return True
        rounded = round_size(size)
        pool = self._small if rounded <= SMALL_SIZE_BYTES else self._large
        found = self._get_free_block(pool, stream, rounded)
        if found is None:
            alloc_size = get_allocation_size(rounded)
            found = self._alloc_block(pool, stream, rounded, alloc_size, retry=False)
            if found is None and self._release_available_cached_blocks(pool, stream, rounded):
                found = self._alloc_block(pool, stream, rounded, alloc_size, retry=False)
            if found is None:
                self._release_cached_blocks()
                found = self._alloc_block(pool, stream, rounded, alloc_size, retry=True)
            if found is None:
                self._ooms += 1
                return False
        if self._should_split(found, rounded):
            found = self._split(found, rounded)
        found.allocated = True
        found.requested = size
        self._live[block] = found
        self._allocated += found.size
        self._requested += size
        if self._allocated > self._phase_allocated:
            self._phase_allocated = self._allocated
            if self._allocated > self._peak_allocated:
                self._peak_allocated = self._allocated
        if self._requested > self._peak_requested:
            self._peak_requested = self._requested
        return True

    def free(self, block: int) -> None:
        """Give back the request ``block``: its memory goes back to the cache, merged with free neighbours.

        Raises:
            ValueError: ``block`` is not live.
        """
        if block in self._empty:
            self._empty.discard(block)
            return
        found = self._live.pop(block, None) if type(block) is int else None
        if found is None:
            raise _Refused(
                "free", "block", block, "Expected a live block: one malloc served and not freed since."
            )
        found.allocated = False
        self._allocated -= found.size
        self._requested -= found.requested
        self._merge(found, found.prev)
        self._merge(found, found.next)
        self._cache(found)

    def mark(self, label: str) -> None:
        """Begin the phase ``label``: its peaks start from what is held now (``reset_peak_memory_stats``)."""
        self._end_phase(self._phase_peaks)
        self._phase = label
        self._phase_allocated = self._allocated
        self._phase_reserved = self._reserved

    def empty_cache(self) -> None:
        """Give back every unsplit cached segment and every free page (``torch.cuda.empty_cache``)."""
        self._release_cached_blocks()

    def layout(self) -> tuple[tuple[tuple[int, bool, bool, int], ...], ...]:
        """Every segment held, in address order: its blocks' (size, allocated, mapped, stream), in order.

        Two equal layouts serve the same requests the same way (the replay's steady state); the addresses
        themselves are left out, as a segment given back and taken again gets a new one.
        """
        blocks = [*self._live.values()]
        for pool in (self._large, self._small):
            blocks += [entry[3] for entry in pool.blocks] + [entry[2] for entry in pool.unmapped]
        heads = sorted({id(b): b for b in blocks if b.prev is None}.values(), key=lambda b: b.address)
        segments = []
        for head in heads:
            parts = []
            block: _Block | None = head
            while block is not None:
                parts.append((block.size, block.allocated, block.mapped, block.stream))
                block = block.next
            segments.append(tuple(parts))
        return tuple(segments)

    def result(self) -> Replay:
        """The peaks and counters so far."""
        phase_peaks = dict(self._phase_peaks)
        self._end_phase(phase_peaks)
        return Replay(
            peak_allocated=self._peak_allocated,
            peak_requested=self._peak_requested,
            peak_reserved=self._peak_reserved,
            max_segments=self._max_segments,
            device_allocs=self._device_allocs,
            device_frees=self._device_frees,
            retries=self._retries,
            ooms=self._ooms,
            phase_peaks=phase_peaks,
        )

    # The allocator's own steps, named as in CUDACachingAllocator.cpp.

    def _get_free_block(self, pool: _Pool, stream: int, size: int) -> _Block | None:
        """``get_free_block``: the best-fitting cached block of the stream, taken out of the cache."""
        blocks = pool.blocks
        at = bisect_left(blocks, (stream, size, -1))
        if at == len(blocks) or blocks[at][0] != stream:
            return None
        if blocks[at][3].segment is not None:
            # A block followed by unmapped space counts as the size it can grow to: prefer less growth.
            last = len(blocks) - 1
            while (
                at < last
                and blocks[at + 1][0] == stream
                and _expandable_size(blocks[at + 1][3]) < _expandable_size(blocks[at][3])
            ):
                at += 1
        found = blocks[at][3]
        if size < self._max_split <= found.size:
            return None  # no oversize block for a request below max_split_size
        if size >= self._max_split and found.size >= size + LARGE_BUFFER_BYTES:
            return None  # an oversize block serves only requests within 20 MiB of its size
        del blocks[at]
        return found

    def _should_split(self, block: _Block, size: int) -> bool:
        """``should_split``: whether the remainder of ``block`` past ``size`` bytes becomes a free block."""
        remaining = block.size - size
        if block.small or self._expandable:
            return remaining >= MIN_BLOCK_BYTES
        return size < self._max_split and remaining > SMALL_SIZE_BYTES

    def _split(self, remaining: _Block, size: int) -> _Block:
        """``alloc_found_block``'s split: a block of ``size`` bytes before ``remaining``, which is cached."""
        block = _Block(remaining.address, size, remaining.stream, remaining.small, remaining.segment)
        block.prev = remaining.prev
        if block.prev is not None:
            block.prev.next = block
        block.next = remaining
        remaining.prev = block
        remaining.address += size
        remaining.size -= size
        self._cache(remaining)
        return block

    def _alloc_block(
        self, pool: _Pool, stream: int, size: int, alloc_size: int, *, retry: bool
    ) -> _Block | None:
        """``alloc_block``: a segment of ``alloc_size`` bytes (pages for ``size``) unless the cap refuses."""
        if retry:
            self._retries += 1
        if self._limit is not None and self._reserved + alloc_size > self._limit:
            return None
        if self._expandable:
            return self._try_allocate_expandable_block(pool, stream, size)
        block = _Block(self._take_addresses(alloc_size, pool.small), alloc_size, stream, pool.small)
        self._segments += 1
        self._max_segments = max(self._max_segments, self._segments)
        self._device_allocs += 1
        self._grow(alloc_size)
        return block

    def _release_available_cached_blocks(self, pool: _Pool, stream: int, size: int) -> bool:
        """``release_available_cached_blocks``: free oversize cached segments (with ``max_split_size``)."""
        if self._max_split == _UNLIMITED or self._expandable:
            return False
        blocks = pool.blocks
        key_size = max(size, self._max_split)
        at = bisect_left(blocks, (stream, key_size, -1))
        if at < len(blocks) and blocks[at][0] == stream:
            self._release_block(blocks.pop(at)[3])
            return True
        released = 0
        at -= 1  # the largest block of the stream, where there is one
        while (
            at >= 0 and released < key_size and blocks[at][0] == stream and blocks[at][1] >= self._max_split
        ):
            block = blocks.pop(at)[3]
            released += block.size
            self._release_block(block)
            at -= 1
        return released >= key_size

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks``: free every unsplit cached segment, unmap every free page."""
        for pool in (self._large, self._small):
            kept = []
            to_unmap = []
            for entry in pool.blocks:
                block = entry[3]
                if block.segment is not None:
                    to_unmap.append(block)
                    kept.append(entry)
                elif block.prev is None and block.next is None:
                    self._release_block(block)
                else:
                    kept.append(entry)
            pool.blocks = kept
            for block in to_unmap:
                self._unmap_block(block)
                if not block.mapped and block.prev is None and block.next is None:
                    self._release_expandable_segment(block)

    def _release_block(self, block: _Block) -> None:
        """``release_block``: ``cudaFree`` a whole cached segment (already out of the cache)."""
        self._segments -= 1
        self._device_frees += 1
        self._reserved -= block.size

    # Expandable segments.

    def _try_allocate_expandable_block(self, pool: _Pool, stream: int, size: int) -> _Block:
        """``try_allocate_expandable_block``: map pages until a free block of ``size`` bytes exists."""
        candidate = self._find_expandable_block(pool, stream, size)
        if not candidate.mapped:
            self._map_block(candidate, min(candidate.size, size))
        while candidate.size < size:
            following = candidate.next
            assert following is not None  # the search found the room: unmapped space follows
            self._map_block(following, min(size - candidate.size, following.size))
            candidate = following  # it took ``candidate`` in
        self._uncache(candidate)
        return candidate

    def _find_expandable_block(self, pool: _Pool, stream: int, size: int) -> _Block:
        """``find_expandable_block``: the lowest free or unmapped room for ``size`` bytes, or new space."""
        unmapped = pool.unmapped
        at = bisect_left(unmapped, (stream, -1))
        while at < len(unmapped) and unmapped[at][0] == stream:
            candidate = unmapped[at][2]
            if candidate.prev is not None and not candidate.prev.allocated:
                candidate = candidate.prev
            room = 0
            block: _Block | None = candidate
            while room < size and block is not None and not block.allocated:
                room += block.size
                block = block.next
            if room >= size:
                return candidate
            at += 1
        page = SMALL_BUFFER_BYTES if pool.small else LARGE_BUFFER_BYTES
        space = page * -(-ADDRESS_SPACE_BYTES // page)
        segment = _Segment(self._take_addresses(space, pool.small), page)
        candidate = _Block(segment.base, space, stream, pool.small, segment, mapped=False)
        insort(unmapped, (stream, candidate.address, candidate))
        self._segments += 1
        self._max_segments = max(self._max_segments, self._segments)
        return candidate

    def _map_block(self, block: _Block, size: int) -> None:
        """``map_block``: map the pages covering the first ``size`` bytes of the unmapped ``block``."""
        segment = block.segment
        assert segment is not None  # only expandable blocks are unmapped
        offset = block.address - segment.base
        mapped = -(-(offset + size) // segment.page) * segment.page - offset
        self._uncache(block)
        block.mapped = True
        if mapped < block.size:
            rest = _Block(
                block.address + mapped, block.size - mapped, block.stream, block.small, segment, False
            )
            _link(rest, block, block.next)
            self._cache(rest)
            block.size = mapped
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._cache(block)
        self._device_allocs += 1
        self._grow(mapped)

    def _unmap_block(self, block: _Block) -> None:
        """``unmap_block``: unmap the whole pages inside the free ``block``; the rest of it stays cached."""
        segment = block.segment
        assert segment is not None  # only expandable blocks are unmapped
        start = block.address - segment.base
        first = -(-start // segment.page)
        last = (start + block.size) // segment.page
        if first >= last:
            return
        self._uncache(block)
        unmapped_address = segment.base + first * segment.page
        unmapped = (last - first) * segment.page
        before = unmapped_address - block.address
        if before > 0:
            head = _Block(block.address, before, block.stream, block.small, segment)
            _link(head, block.prev, block)
            self._cache(head)
        after = block.size - before - unmapped
        if after > 0:
            tail = _Block(unmapped_address + unmapped, after, block.stream, block.small, segment)
            _link(tail, block, block.next)
            self._cache(tail)
        block.address = unmapped_address
        block.size = unmapped
        block.mapped = False
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._cache(block)
        self._device_frees += 1
        self._reserved -= unmapped

    def _release_expandable_segment(self, block: _Block) -> None:
        """``release_expandable_segment``: drop a segment with nothing mapped (``block`` spans all of it)."""
        self._uncache(block)
        self._segments -= 1

    # Bookkeeping.

    def _merge(self, block: _Block, other: _Block | None) -> None:
        """``try_merge_blocks``: take in the neighbour ``other`` where it is free and mapped alike."""
        if other is None or other.allocated or other.mapped != block.mapped:
            return
        self._uncache(other)
        if block.prev is other:
            block.address = other.address
            block.prev = other.prev
            if block.prev is not None:
                block.prev.next = block
        else:
            block.next = other.next
            if block.next is not None:
                block.next.prev = block
        block.size += other.size

    def _cache(self, block: _Block) -> None:
        """Put a free block in its pool's free set (mapped) or unmapped set."""
        pool = self._small if block.small else self._large
        if block.mapped:
            insort(pool.blocks, (block.stream, block.size, block.address, block))
        else:
            insort(pool.unmapped, (block.stream, block.address, block))

    def _uncache(self, block: _Block) -> None:
        """Take a free block out of its pool's free set or unmapped set."""
        pool = self._small if block.small else self._large
        if block.mapped:
            del pool.blocks[bisect_left(pool.blocks, (block.stream, block.size, block.address))]
        else:
            del pool.unmapped[bisect_left(pool.unmapped, (block.stream, block.address))]

    def _grow(self, size: int) -> None:
        """Reserved grew by ``size`` bytes: keep the peaks."""
        self._reserved += size
        if self._reserved > self._phase_reserved:
            self._phase_reserved = self._reserved
            if self._reserved > self._peak_reserved:
                self._peak_reserved = self._reserved

    def _take_addresses(self, size: int, small: bool) -> int:
        """A fresh range of ``size`` bytes of addresses: its start.

        The next of the addresses given, else the small pool's segments above every one it took before, the
        large pool's below.
        """
        given = None if self._given is None else next(self._given, None)
        if given is not None:
            return given
        if small:
            self._next_small += size
            return self._next_small - size
        self._next_address -= size
        return self._next_address

    def _end_phase(self, phase_peaks: dict[str, tuple[int, int]]) -> None:
        """Fold the running phase's peaks into ``phase_peaks``."""
        if self._phase is None:
            return
        allocated, reserved = phase_peaks.get(self._phase, (0, 0))
        phase_peaks[self._phase] = (
            max(allocated, self._phase_allocated),
            max(reserved, self._phase_reserved),
        )


def replay(
    events: Iterable[Event],
    *,
    limit_bytes: int | None = None,
    expandable_segments: bool = False,
    max_split_size: int | None = None,
    addresses: Iterable[int] | None = None,
) -> Replay:
    """Replay an allocation stream through a fresh :class:`AllocatorModel` and report its peaks.

    The replay stops at the first request the allocator refuses, as the step would (``Replay.ooms`` is then
    1).

    Args:
        events: the stream, in order: ``"alloc"`` (``size`` bytes on ``stream``), ``"free"`` (of an alloc's
            ``block``) and ``"mark"`` (a phase ``label`` begins).
        limit_bytes: the cap in bytes (``set_per_process_memory_fraction``); ``None`` for none.
        expandable_segments: model ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
        max_split_size: ``max_split_size_mb`` in bytes; ``None`` (the default) for unlimited.
        addresses: the segments' start addresses as ``cudaMalloc`` gave them (:class:`AllocatorModel`).

    Returns:
        The peaks (bytes) and counters; :attr:`Replay.fits` says whether every request was served.

    Raises:
        ValueError: an event is not valid (a free of a block that is not live, a negative size, an unknown
            action), named by its index.

    Example:
        >>> from lightning_gpumem._core.alloc_events import Event
        >>> stream = [Event("alloc", 1, 1000), Event("alloc", 2, 3000), Event("free", 1)]
        >>> stream.append(Event("alloc", 3, 11 << 20))
        >>> result = replay(stream)
        >>> result.peak_reserved // 2**20, result.peak_allocated, result.max_segments
        (14, 12585984, 2)
        >>> replay(stream, limit_bytes=12 << 20).fits
        False
    """
    model = AllocatorModel(
        limit_bytes=limit_bytes,
        expandable_segments=expandable_segments,
        max_split_size=max_split_size,
        addresses=addresses,
    )
    for index, event in enumerate(events):
        try:
            action = event.action
            if action == "alloc":
                if not model.malloc(event.block, event.size, event.stream):
                    break
            elif action == "free":
                model.free(event.block)
            elif action == "mark":
                model.mark(event.label)
            else:
                raise _Refused("replay", "action", action, "Expected an action 'alloc', 'free' or 'mark'.")
        except _Refused as error:
            raise ValueError(f"`replay(events[{index}]={event!r})` is not valid. {error.expected}") from None
    return model.result()


class _Refused(ValueError):
    """A bad argument to the model: the message names the call, the argument and the value."""

    def __init__(self, call: str, name: str, value: object, expected: str) -> None:
        super().__init__(f"`AllocatorModel.{call}({name}={value!r})` is not valid. {expected}")
        self.expected = expected


class _Segment:
    """An expandable segment: address space from ``base``, mapped in pages of ``page`` bytes."""

    __slots__ = ("base", "page")

    def __init__(self, base: int, page: int) -> None:
        self.base = base
        self.page = page


class _Block:
    """A range of a segment (``Block``): free or handed out, mapped or not (expandable segments only)."""

    __slots__ = (
        "address",
        "allocated",
        "mapped",
        "next",
        "prev",
        "requested",
        "segment",
        "size",
        "small",
        "stream",
    )

    def __init__(
        self,
        address: int,
        size: int,
        stream: int,
        small: bool,
        segment: _Segment | None = None,
        mapped: bool = True,
    ) -> None:
        self.address = address
        self.size = size
        self.stream = stream
        self.small = small
        self.segment = segment  # None: a cudaMalloc segment
        self.mapped = mapped
        self.allocated = False
        self.requested = 0
        self.prev: _Block | None = None
        self.next: _Block | None = None


class _Pool:
    """``BlockPool``: free mapped blocks by (stream, size, address), unmapped ones by (stream, address)."""

    __slots__ = ("blocks", "small", "unmapped")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.blocks: list[tuple[int, int, int, _Block]] = []
        self.unmapped: list[tuple[int, int, _Block]] = []


def _expandable_size(block: _Block) -> int:
    """The size ``block`` can grow to: with the unmapped space right after it."""
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)


def _link(block: _Block, before: _Block | None, after: _Block | None) -> None:
    """``Block::splice``: put ``block`` between its neighbours ``before`` and ``after``."""
    if before is not None:
        before.next = block
    block.prev = before
    if after is not None:
        after.prev = block
    block.next = after
