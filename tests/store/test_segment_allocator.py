"""The size-class allocator: slots, segment reuse across classes, rebuild from the index."""

from __future__ import annotations

import numpy as np
import pytest

from umbp_nvme.store.segments import SegmentAllocator

KiB, MiB = 1 << 10, 1 << 20


def test_slots_are_class_sized_aligned_and_sequential():
    a = SegmentAllocator(2, 1 * MiB)
    slots = a.alloc_many(64 * KiB, 20)
    assert slots[:16] == [(0, i * 64 * KiB) for i in range(16)]
    assert slots[16:] == [(1, i * 64 * KiB) for i in range(4)]
    assert a.used_bytes == 20 * 64 * KiB
    assert a.alloc(64 * KiB) == (1, 4 * 64 * KiB)


def test_full_allocator_returns_none_and_a_freed_segment_serves_another_class():
    a = SegmentAllocator(2, 1 * MiB)
    slots = a.alloc_many(512 * KiB, 4)
    assert None not in slots and a.alloc(512 * KiB) is None and a.alloc(4 * KiB) is None
    a.free(*slots[0])
    assert a.alloc(4 * KiB) is None  # segment 0 still holds one 512 KiB object
    a.free(*slots[1])
    assert a.free_segments() == 1
    assert a.alloc(4 * KiB) == (0, 0)
    assert a.class_counts() == {4 * KiB: 1, 512 * KiB: 2}


def test_rebuild_marks_used_slots_and_drops_damaged_records():
    a = SegmentAllocator(4, 1 * MiB)
    segs = np.array([0, 0, 0, 1, 1, 9, 2], np.uint32)
    offs = np.array([0, 64 * KiB, 64 * KiB, 0, 4 * KiB, 0, 5], np.uint64)
    lens = np.array([65536, 60000, 65536, 4096, 4096, 4096, 4096], np.uint32)
    gens = np.array([1, 2, 3, 4, 5, 6, 7], np.uint64)
    keep = a.rebuild(segs, offs, lens, gens)
    # dup slot (0, 64K): the newest wins; seg 9 is past capacity; offset 5 is misaligned
    assert keep.tolist() == [True, False, True, True, True, False, False]
    assert a.used_bytes == 2 * 64 * KiB + 2 * 4 * KiB
    assert a.alloc(64 * KiB) == (0, 128 * KiB)
    assert a.alloc(4 * KiB) == (1, 8 * KiB)
    assert a.alloc(128 * KiB) == (2, 0)


def test_a_segment_being_opened_on_a_worker_is_not_answered_open_before_its_fd_is_set(tmp_path):
    """precreate() installs a segment on a worker thread while ensure() answers on the loop from
    `files` without the lock: ensure must never say True while fds[i] is still -1 (a put would
    then write to fd -1). The stand-in file's fd read is where a thread switch lands."""
    import threading

    from umbp_nvme.engine.files import PAGE_CACHE
    from umbp_nvme.store.segments import SegmentFiles

    sf = SegmentFiles(str(tmp_path), 1 << 20, readonly=False, o_direct=False, n_segments=4)
    reading_fd, looked = threading.Event(), threading.Event()

    class SlowFile:
        direct, align, facts = False, 4096, PAGE_CACHE

        @property
        def fd(self):  # the install stops here until the test has looked (was: 200 ms, hoping it looked)
            reading_fd.set()
            looked.wait(30)
            return 99

    t = threading.Thread(target=sf.install, args=(1, SlowFile()))
    t.start()
    assert reading_fd.wait(30)
    seen = (1 in sf.files, int(sf.fds[1]))
    looked.set()
    t.join()
    assert seen == (False, -1), seen  # not published while its fd is unset
    assert (1 in sf.files, int(sf.fds[1])) == (True, 99)


def test_disk_bytes_while_a_worker_installs_a_segment(tmp_path):
    """stats() sums disk_bytes() on the loop while precreate() may install the next segment on a
    worker: iterating `files` then raised 'dictionary changed size during iteration' out of stats.
    The stand-in file's fd read is where the worker's install lands."""
    import os

    from umbp_nvme.store.segments import SegmentFiles

    sf = SegmentFiles(str(tmp_path), 1 << 20, readonly=False, o_direct=False, n_segments=4)
    assert sf.ensure(0)
    real = sf.files[0]

    class Installing:
        direct, align = False, 4096

        @property
        def fd(self):
            if 1 not in sf.files:
                sf.install(1, real)  # as precreate(1) would, from its worker thread
            return real.fd

    sf.files[0] = Installing()
    assert sf.disk_bytes() == os.fstat(real.fd).st_blocks * 512
    assert 1 in sf.files
    sf.files.pop(1)
    sf.files[0] = real
    sf.close()


def test_a_batch_over_segments_hands_the_engines_the_facts_of_its_own_files(tmp_path):
    """SegmentFiles.batch: the files of the batch's segments with their O_DIRECT facts; the one set
    every segment shares, or, once a segment's differ, the merge over that batch's segments only."""
    from umbp_nvme.engine.files import PAGE_CACHE, open_data_file
    from umbp_nvme.store.segments import SegmentFiles

    sf = SegmentFiles(str(tmp_path), 1 << 20, readonly=False, o_direct=True, n_segments=4)
    try:
        assert sf.ensure(0) and sf.ensure(2)
        direct = sf.files[0].facts
        if not sf.files[0].direct:
            pytest.skip("O_DIRECT unsupported here")
        got = sf.batch(np.array([2, 0, 2], np.int64))
        assert got.fds.tolist() == [sf.files[2].fd, sf.files[0].fd, sf.files[2].fd] and got.facts == direct
        # a segment the file system served buffered after all: only batches that touch it say so
        sf.install(1, open_data_file(sf.path(1), create=True, size=1 << 20, direct=False))
        assert sf.batch(np.array([0, 2], np.int64)).facts == direct
        assert sf.batch(np.array([1], np.int64)).facts == PAGE_CACHE
        assert sf.batch(np.array([0, 1], np.int64)).facts == direct.merge(PAGE_CACHE)
    finally:
        sf.close()


@pytest.mark.parametrize("seed", range(6))
def test_a_rebuild_in_passes_keeps_and_heals_exactly_what_one_pass_does(seed, monkeypatch):
    """The rebuild takes its records a chunk at a time (segments.REBUILD_CHUNK); damage spread over
    chunks (a segment named with two classes in different chunks, a slot named twice, records out
    of range or misaligned) must be dropped as a single pass drops it."""
    from umbp_nvme.store import segments

    rng = np.random.default_rng(seed)
    n = 400
    segs = rng.integers(0, 7, n).astype(np.uint32)  # 6 segments: some records beyond them
    cls = np.where(rng.random(n) < 0.15, 64 * KiB, 16 * KiB)  # a minority of another class
    offs = (rng.integers(0, 20, n) * cls).astype(np.uint64)  # slots named twice, some past the segment's room
    offs[rng.random(n) < 0.05] += 512  # misaligned
    lens = (cls - rng.integers(0, 100, n)).astype(np.uint32)
    gens = rng.permutation(n).astype(np.uint64) + 1

    def state(chunk):
        monkeypatch.setattr(segments, "REBUILD_CHUNK", chunk)
        a = SegmentAllocator(6, 1 * MiB)
        keep = a.rebuild(segs, offs, lens, gens)
        return keep.tolist(), a.seg_class, a.seg_used, a.used_bytes, a.free_segments(), a.class_counts()

    one = state(1 << 20)
    assert 0 < sum(one[0]) < n  # the damage is there and some records survive it
    for chunk in (1, 7, 64):
        assert state(chunk) == one
