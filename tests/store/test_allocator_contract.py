"""The slot allocator's contract, against a model of live slots (issue 17).

SegmentAllocator hands out slots of a size class in segments of one class each. Whatever the
sequence of alloc / alloc_many / alloc_array / free / free_many / rebuild:

- live slots never overlap, are class-aligned and lie inside their segment;
- a segment holds one class; a segment with no live slot is free for any class again;
- used_bytes and class_counts() are exactly the live slots' classes;
- an allocation fails only when there is no room: every freed slot is reusable, capacity never
  shrinks by leaking;
- rebuild() from the records of the live slots reproduces the same occupancy, and drops the
  damaged records that would make later slots overlap.
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from umbp_nvme.store.segments import SLOT_ALIGN_BYTES, SegmentAllocator, segment_name, size_class, size_classes

K = 1024  # KiB
P = 4096  # one 4 KiB block
SEG = 64 * K  # 16 pages of 4 KiB
CLASSES = [4 * K, 8 * K, 12 * K, 16 * K, 20 * K]  # 12 K and 20 K leave a tail no slot may use


class Model:
    """The live slots the allocator handed out and the test has not freed: (seg, off) -> class."""

    def __init__(self, alloc: SegmentAllocator):
        self.a = alloc
        self.live: dict[tuple[int, int], int] = {}

    def seg_classes(self) -> dict[int, int]:
        out = {}
        for (s, _), c in self.live.items():
            assert out.setdefault(s, c) == c, f"segment {s} holds classes {out[s]} and {c}"
        return out

    def room(self, cls: int) -> int:
        """Slots of class `cls` the allocator must still be able to hand out."""
        a = self.a
        if cls > a.segment_bytes:
            return 0
        per_seg = a.segment_bytes // cls
        seg_cls = self.seg_classes()
        used = Counter(s for s in (k[0] for k in self.live))
        same = sum(per_seg - used[s] for s, c in seg_cls.items() if c == cls)
        return same + (a.n_segments - len(seg_cls)) * per_seg

    def take(self, slot, cls):
        seg, off = int(slot[0]), int(slot[1])
        assert 0 <= seg < self.a.n_segments
        assert off % cls == 0 and 0 <= off and off + cls <= self.a.segment_bytes, (seg, off, cls)
        assert (seg, off) not in self.live, f"slot {(seg, off)} handed out twice"
        self.live[(seg, off)] = cls

    def check(self):
        a = self.a
        seg_cls = self.seg_classes()
        assert a.used_bytes == sum(self.live.values())
        assert a.class_counts() == dict(Counter(self.live.values()))
        assert a.free_segments() == a.n_segments - len(seg_cls)
        free = [s for s in range(a.n_segments) if s not in seg_cls]
        assert a.next_free_segment() == (min(free) if free else None)
        assert a.capacity_bytes == a.n_segments * a.segment_bytes


ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.sampled_from(CLASSES), st.just(1)),
        st.tuples(st.just("many"), st.sampled_from(CLASSES), st.integers(0, 20)),
        st.tuples(st.just("array"), st.sampled_from(CLASSES), st.integers(0, 20)),
        st.tuples(st.just("free"), st.integers(0, 10**6), st.just(1)),
        st.tuples(st.just("free_many"), st.integers(0, 10**6), st.integers(0, 12)),
        st.tuples(st.just("rebuild"), st.just(0), st.just(0)),
    ),
    max_size=40,
)


def apply(model: Model, op, rng_pick):
    a = model.a
    kind, x, n = op
    if kind == "alloc":
        room = model.room(x)
        slot = a.alloc(x)
        assert (slot is None) == (room == 0), f"alloc({x}) gave {slot} with room for {room}"
        if slot is not None:
            model.take(slot, x)
    elif kind == "many":
        room = model.room(x)
        slots = a.alloc_many(x, n)
        assert len(slots) == n
        got = [s for s in slots if s is not None]
        assert len(got) == min(n, room), f"alloc_many({x}, {n}) gave {len(got)} with room for {room}"
        assert slots[: len(got)] == got, "None only after the last slot"
        for s in got:
            model.take(s, x)
    elif kind == "array":
        room = model.room(x)
        segs, offs = a.alloc_array(x, n)
        assert segs.dtype == np.int64 and offs.dtype == np.int64 and len(segs) == len(offs) == n
        k = min(n, room)
        assert (segs[:k] >= 0).all() and (offs[:k] >= 0).all(), f"alloc_array({x}, {n}) short of room {room}"
        assert (segs[k:] == -1).all() and (offs[k:] == -1).all()
        for s, o in zip(segs[:k].tolist(), offs[:k].tolist()):
            model.take((s, o), x)
    elif kind in ("free", "free_many") and model.live:
        keys = sorted(model.live)
        chosen = rng_pick(keys, x, n)
        if kind == "free":
            a.free(*chosen[0])
        else:
            a.free_many(np.array([c[0] for c in chosen], np.int64), np.array([c[1] for c in chosen], np.int64))
        for c in chosen:
            del model.live[c]
    elif kind == "rebuild":
        keys = sorted(model.live)
        segs = np.array([s for s, _ in keys], np.uint32)
        offs = np.array([o for _, o in keys], np.uint64)
        lens = np.array([model.live[k] - (k[1] % 3) * 100 for k in keys], np.uint32)  # any length in the class
        gens = np.arange(len(keys), dtype=np.uint64)
        fresh = SegmentAllocator(a.n_segments, a.segment_bytes)
        keep = fresh.rebuild(segs, offs, lens, gens)
        assert keep.dtype == bool and keep.all(), "rebuild dropped a sound record"
        model.a = fresh
    model.check()


def pick(keys, x, n):
    start = x % len(keys)
    step = 1 + x % 5
    out = []
    for i in range(max(1, n)):
        k = keys[(start + i * step) % len(keys)]
        if k not in out:
            out.append(k)
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_segments=st.integers(1, 4), program=ops)
def test_any_program_keeps_the_slot_invariants(n_segments, program):
    model = Model(SegmentAllocator(n_segments, SEG))
    model.check()
    for op in program:
        apply(model, op, pick)
    # Everything freed: the whole capacity is back, for any class.
    keys = sorted(model.live)
    model.a.free_many([k[0] for k in keys], [k[1] for k in keys])
    model.live.clear()
    model.check()
    for cls in CLASSES:
        got = [s for s in model.a.alloc_many(cls, 1000) if s is not None]
        assert sorted(got) == [(s, o) for s in range(n_segments) for o in range(0, (SEG // cls) * cls, cls)]
        model.a.free_many([s for s, _ in got], [o for _, o in got])
        assert model.a.used_bytes == 0 and model.a.free_segments() == n_segments


def test_a_freed_slot_is_handed_out_again_before_the_segment_fills_up():
    a = SegmentAllocator(1, SEG)
    slots = a.alloc_many(16 * K, 4)
    assert slots == [(0, 0), (0, 16 * K), (0, 32 * K), (0, 48 * K)]
    assert a.alloc(16 * K) is None
    a.free(0, 32 * K)
    assert a.used_bytes == 3 * 16 * K and a.class_counts() == {16 * K: 3}
    assert a.alloc(16 * K) == (0, 32 * K)
    a.free_many(np.array([0, 0]), np.array([0, 48 * K]))
    assert a.used_bytes == 2 * 16 * K
    segs, offs = a.alloc_array(16 * K, 3)
    assert sorted(zip(segs[:2].tolist(), offs[:2].tolist())) == [(0, 0), (0, 48 * K)]
    assert (segs[2], offs[2]) == (-1, -1)


def test_free_many_is_a_rollback_of_alloc_array():
    # The store allocates a batch, fails to publish it, and gives the slots back with free_many.
    a = SegmentAllocator(3, SEG)
    kept = a.alloc_array(8 * K, 5)
    before = (a.used_bytes, a.class_counts(), a.free_segments(), a.next_free_segment())
    segs, offs = a.alloc_array(8 * K, 12)
    assert (segs >= 0).all()
    a.free_many(segs, offs)
    assert (a.used_bytes, a.class_counts(), a.free_segments(), a.next_free_segment()) == before
    a.free_many(np.array([], np.int64), np.array([], np.int64))
    assert a.used_bytes == 5 * 8 * K
    a.free_many(*kept)
    assert a.used_bytes == 0 and a.class_counts() == {} and a.free_segments() == 3


def test_alloc_array_matches_alloc_many():
    for cls in CLASSES:
        for n in (0, 1, 3, 5, 16, 40):
            x, y = SegmentAllocator(3, SEG), SegmentAllocator(3, SEG)
            x.alloc_many(cls, 2)
            y.alloc_array(cls, 2)
            many = x.alloc_many(cls, n)
            segs, offs = y.alloc_array(cls, n)
            assert [(-1, -1) if s is None else s for s in many] == list(zip(segs.tolist(), offs.tolist()))
            assert (x.used_bytes, x.class_counts(), x.free_segments()) == (y.used_bytes, y.class_counts(), y.free_segments())


def test_fresh_segments_are_taken_lowest_first_and_filled_from_offset_zero():
    a = SegmentAllocator(3, SEG)
    assert a.alloc(8 * K) == (0, 0)
    assert a.alloc(12 * K) == (1, 0)
    assert a.alloc_many(12 * K, 6) == [(1, 12 * K), (1, 24 * K), (1, 36 * K), (1, 48 * K), (2, 0), (2, 12 * K)]
    a.free(0, 0)
    assert a.next_free_segment() == 0 and a.free_segments() == 1
    assert a.alloc(20 * K) == (0, 0)
    assert a.next_free_segment() is None


def test_a_class_larger_than_a_segment_never_fits():
    a = SegmentAllocator(2, SEG)
    assert a.alloc(SEG + K) is None
    assert a.alloc_many(SEG + K, 2) == [None, None]
    segs, offs = a.alloc_array(SEG + K, 2)
    assert segs.tolist() == offs.tolist() == [-1, -1]
    assert a.free_segments() == 2 and a.used_bytes == 0
    assert a.alloc(SEG) == (0, 0)  # exactly one segment: one slot


def test_ensure_file_is_asked_for_each_fresh_segment_and_a_refusal_leaves_it_free():
    asked = []

    def ensure(seg):
        asked.append(seg)
        return seg != 1

    a = SegmentAllocator(3, SEG)
    assert a.alloc_many(32 * K, 2, ensure) == [(0, 0), (0, 32 * K)]
    assert asked == [0]
    assert a.alloc(32 * K, ensure) is None
    assert asked == [0, 1] and a.free_segments() == 2 and a.next_free_segment() == 1
    assert a.alloc_many(32 * K, 2, ensure) == [None, None]
    segs, offs = a.alloc_array(32 * K, 2, ensure)
    assert segs.tolist() == [-1, -1]
    assert a.used_bytes == 2 * 32 * K and a.free_segments() == 2
    # a free slot of the class needs no new file
    a.free(0, 0)
    asked.clear()
    assert a.alloc(32 * K, ensure) == (0, 0) and asked == []
    assert a.alloc(32 * K, lambda s: True) == (1, 0)


# ------------------------------------------------------------------------------------- rebuild


def rebuild(n_segments, records, seg_bytes=SEG):
    segs = np.array([r[0] for r in records], np.uint32)
    offs = np.array([r[1] for r in records], np.uint64)
    lens = np.array([r[2] for r in records], np.uint32)
    gens = np.array([r[3] if len(r) > 3 else i for i, r in enumerate(records)], np.uint64)
    a = SegmentAllocator(n_segments, seg_bytes)
    keep = a.rebuild(segs, offs, lens, gens)
    return a, keep.tolist()


def occupied(a: SegmentAllocator, cls: int) -> set:
    """Slots of class cls that the allocator will not hand out (allocates all, then frees them)."""
    got = [s for s in a.alloc_many(cls, 10_000) if s is not None]
    for s in got:
        a.free(*s)
    return got


def test_rebuild_keeps_the_majority_class_of_a_segment_and_no_slot_overlaps_a_kept_record():
    # Segment 0: three 8 KiB records and one 4 KiB record (damage); the 4 KiB one must go, or a
    # later 8 KiB slot at 0 would overlap it.
    records = [(0, 8 * K, 8 * K), (0, 16 * K, 8 * K), (0, 4 * K, 4 * K), (0, 24 * K, 7000), (1, 0, 4 * K)]
    a, keep = rebuild(2, records)
    assert keep == [True, True, False, True, True]
    assert a.class_counts() == {8 * K: 3, 4 * K: 1}
    assert a.used_bytes == 3 * 8 * K + 4 * K
    free8 = [s for s in a.alloc_many(8 * K, 100) if s is not None]
    assert sorted(free8) == [(0, 0)] + [(0, o) for o in range(32 * K, SEG, 8 * K)]
    # minority first in the segment's records, and in a second segment
    records = [(1, 0, 4 * K), (1, 12 * K, 12 * K), (1, 24 * K, 12 * K), (0, 0, 16 * K), (0, 4 * K, 4 * K), (0, 32 * K, 16 * K)]
    a, keep = rebuild(2, records)
    assert keep == [False, True, True, True, False, True]
    assert a.class_counts() == {12 * K: 2, 16 * K: 2}
    assert a.free_segments() == 0


def test_rebuild_keeps_only_the_newest_record_of_a_slot():
    records = [(0, 0, 4 * K, 5), (0, 0, 4 * K, 9), (0, 0, 4 * K, 7), (0, 4 * K, 4 * K, 1), (0, 4 * K, 4 * K, 0)]
    a, keep = rebuild(1, records)
    assert keep == [False, True, False, True, False]
    assert a.used_bytes == 2 * 4 * K and a.class_counts() == {4 * K: 2}


def test_rebuild_drops_records_that_cannot_be_slots():
    records = [
        (0, 0, 0),  # empty
        (2, 0, 4 * K),  # past the current segments (capacity shrank)
        (0, 4 * K, SEG + 1),  # larger than a segment
        (0, 6 * K, 4 * K),  # misaligned for its class
        (1, 60 * K, 12 * K),  # 12 KiB slot at 60 KiB runs past the segment end
        (1, 48 * K, 12 * K),  # the last whole 12 KiB slot
        (0, 60 * K, 4 * K),  # the last 4 KiB slot
    ]
    a, keep = rebuild(2, records)
    assert keep == [False, False, False, False, False, True, True]
    assert a.class_counts() == {12 * K: 1, 4 * K: 1}
    assert a.used_bytes == 16 * K
    assert a.free_segments() == 0


def test_rebuild_of_nothing_or_only_damage_resets_the_allocator():
    a = SegmentAllocator(2, SEG)
    a.alloc_many(8 * K, 10)
    keep = a.rebuild(np.array([], np.uint32), np.array([], np.uint64), np.array([], np.uint32), np.array([], np.uint64))
    assert keep.tolist() == []
    assert a.used_bytes == 0 and a.class_counts() == {} and a.free_segments() == 2 and a.next_free_segment() == 0
    a.alloc_many(8 * K, 10)
    a2, keep = rebuild(2, [(5, 0, 4 * K), (0, 1, 4 * K)])
    assert keep == [False, False]
    assert a2.used_bytes == 0 and a2.free_segments() == 2
    assert a2.alloc(16 * K) == (0, 0)


def test_rebuild_free_slots_are_exactly_the_unrecorded_ones():
    # segment 0 class 8 KiB with records at 0, 24K, 56K; segment 2 full of 16 KiB; segment 1 empty
    records = [(0, 0, 8 * K), (0, 24 * K, 8 * K), (0, 56 * K, 8 * K)] + [(2, o, 16 * K) for o in range(0, SEG, 16 * K)]
    a, keep = rebuild(3, records)
    assert all(keep)
    assert a.free_segments() == 1 and a.next_free_segment() == 1
    assert a.class_counts() == {8 * K: 3, 16 * K: 4}
    assert a.used_bytes == 3 * 8 * K + 4 * 16 * K
    got = occupied(a, 8 * K)
    assert sorted(s for s in got if s[0] == 0) == [(0, o) for o in (8 * K, 16 * K, 32 * K, 40 * K, 48 * K)]
    assert sorted(s for s in got if s[0] != 0) == [(1, o) for o in range(0, SEG, 8 * K)]
    assert a.alloc(16 * K) == (1, 0)  # segment 2 is full: the free one
    # the rebuilt state frees like a live one: empty a segment and it serves another class
    for o in (0, 24 * K, 56 * K):
        a.free(0, o)
    assert a.next_free_segment() == 0 and a.alloc(4 * K) == (0, 0)


def test_size_class_helpers_round_up_to_4_kib():
    assert SLOT_ALIGN_BYTES == 4096
    for n, c in [(1, P), (P - 1, P), (P, P), (P + 1, 2 * P), (60000, 15 * P), (64 * P, 64 * P)]:
        assert size_class(n) == c
    assert size_classes(np.array([1, P, P + 1, 60000], np.uint32)).tolist() == [P, P, 2 * P, 15 * P]
    assert size_classes(np.array([4 * 10**9], np.uint32)).tolist() == [size_class(4 * 10**9)]
    assert segment_name(0) == "seg-00000.dat" and segment_name(123) == "seg-00123.dat"


def test_rebuild_keeps_records_from_one_byte_up_to_a_whole_segment():
    a, keep = rebuild(2, [(0, 0, 1), (1, 0, SEG)])
    assert keep == [True, True]
    assert a.class_counts() == {4 * K: 1, SEG: 1} and a.used_bytes == 4 * K + SEG
    assert a.alloc(SEG) is None and a.alloc(4 * K) == (0, 4 * K)


def test_rebuild_majority_is_decided_per_segment_even_next_to_a_full_segment():
    # segment 0: one record filling it; segment 1: three 8 KiB records and one damaged 4 KiB one.
    records = [(0, 0, SEG), (1, 0, 8 * K), (1, 8 * K, 8 * K), (1, 16 * K, 8 * K), (1, 28 * K, 4 * K)]
    a, keep = rebuild(2, records)
    assert keep == [True, True, True, True, False]
    assert a.class_counts() == {SEG: 1, 8 * K: 3}
    assert a.free_segments() == 0


def test_rebuild_of_two_records_in_one_slot_keeps_the_newest():
    for gens, expected in (((3, 8), [False, True]), ((8, 3), [True, False])):
        a, keep = rebuild(1, [(0, 8 * K, 8 * K, gens[0]), (0, 8 * K, 8 * K, gens[1])])
        assert keep == expected
        assert a.used_bytes == 8 * K and a.class_counts() == {8 * K: 1}
    # a shared slot after a record of its own
    a, keep = rebuild(1, [(0, 0, 8 * K, 1), (0, 8 * K, 8 * K, 5), (0, 8 * K, 8 * K, 4)])
    assert keep == [True, True, False]
    assert a.used_bytes == 2 * 8 * K


# The sizes come from the store's manifest (segment_bytes) and capacity // segment_bytes; a damaged
# or hand-edited manifest must stop the open with an error that names the bad value, not build an
# allocator whose slots overlap or run past the segment files.
@pytest.mark.parametrize("bad", [0, -P, 1, P - 1, P + 1, 5000, 16 * K + 1, float(SEG), str(SEG), None, True])
def test_a_segment_size_that_is_not_a_positive_int_multiple_of_4_kib_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=re.escape(f"segment_bytes={bad!r} must be a positive multiple of 4096")):
        SegmentAllocator(2, bad)


@pytest.mark.parametrize("bad", [-1, -5, 2.0, "3", None])
def test_a_segment_count_that_is_not_a_non_negative_int_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=re.escape(f"n_segments={bad!r} must be a non-negative integer")):
        SegmentAllocator(bad, SEG)


def test_the_smallest_valid_sizes_are_accepted():
    # one 4 KiB slot per segment, one segment
    a = SegmentAllocator(1, P)
    assert a.capacity_bytes == P and a.alloc(P) == (0, 0) and a.alloc(P) is None
    # no segment at all is a valid (empty) allocator: nothing fits, every record is dropped
    a = SegmentAllocator(0, SEG)
    assert a.capacity_bytes == 0 and a.free_segments() == 0 and a.next_free_segment() is None
    assert a.alloc(4 * K) is None and a.alloc_many(4 * K, 2) == [None, None]
    segs, offs = a.alloc_array(4 * K, 2)
    assert segs.tolist() == [-1, -1] and offs.tolist() == [-1, -1]
    _, keep = rebuild(0, [(0, 0, 4 * K)])
    assert keep == [False]


def test_freeing_a_slot_that_is_not_allocated_is_refused_by_name_and_changes_nothing():
    a = SegmentAllocator(2, SEG)
    with pytest.raises(RuntimeError, match=re.escape("slot 8192 of segment 1 is not allocated")):
        a.free(1, 8 * K)  # never handed out
    seg, off = a.alloc(8 * K)
    a.free(seg, off)
    with pytest.raises(RuntimeError, match=re.escape(f"slot {off} of segment {seg} is not allocated")):
        a.free(seg, off)  # double free of a segment's last slot
    assert a.used_bytes == 0 and a.class_counts() == {} and a.free_segments() == 2
    assert sorted(a.alloc_many(8 * K, 16)) == [(s, o) for s in (0, 1) for o in range(0, SEG, 8 * K)]


def test_a_double_free_inside_a_busy_segment_is_refused_and_the_live_slot_stays_out_of_use():
    a = SegmentAllocator(1, 64 * 1024)
    first, second = a.alloc(8192), a.alloc(8192)
    assert (first, second) == ((0, 0), (0, 8192))
    for off in (4096, 64 * 1024, -8192):  # inside slot 0 but not its start; the segment's end; negative
        with pytest.raises(RuntimeError, match=f"slot {off} of segment 0 is not allocated"):
            a.free(0, off)
    assert a.seg_used[0] == 2 and a.used_bytes == 2 * 8192  # nothing was freed
    a.free(*first)
    with pytest.raises(RuntimeError, match="slot 0 of segment 0 is not allocated"):
        a.free(*first)  # the segment still holds `second`: the old check let this through
    with pytest.raises(RuntimeError, match="not allocated"):
        a.free(0, 4096)  # not a slot boundary of the 8 KiB class
    assert a.used_bytes == 8192 and a.seg_used[0] == 1
    taken = [a.alloc(8192) for _ in range(7)]
    assert second not in taken and len(set(taken)) == 7 and a.alloc(8192) is None
