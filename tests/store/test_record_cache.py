"""A writer keeps only a bounded number of record blocks in memory (store/record_areas.py, issue 36).

Blocks leave memory once their image is on disk and come back from the segment when a put, a
delete or a confirmation changes them again. With no cache at all (``ssd_record_cache_bytes=0``)
every change reads its block back, so what the disk holds must be exactly what memory held:
a rebuild from the records after it serves every live key's newest bytes and nothing deleted.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import KiB, MiB, payload, small_config
from support.paged import served as served_bytes
from umbp_nvme.store import PageStore
from umbp_nvme.store.index import INDEX_FILE

OBJ = 5000  # 8 KiB slots: 16 records to a block, so a block holds records of several batches


def cfg(mode, cache, **kw):
    kw.setdefault("ssd_capacity_bytes", 32 * MiB)
    kw.setdefault("ssd_segment_size_bytes", 2 * MiB)
    return small_config(ssd_durability_mode=mode, ssd_record_cache_bytes=cache, **kw)


def body(key: str, version: int) -> np.ndarray:
    """Each version of a key has its own bytes: serving an older one shows."""
    return payload(f"{key}@v{version}", OBJ)


async def served(st, want: dict) -> tuple[int, list]:
    return await served_bytes(st, want, OBJ)


async def churn(st, n=600, rounds=3):
    """Puts in batches of 7 (never block-aligned), overwrites and deletes spread over old blocks;
    the expected newest bytes per key (None: deleted)."""
    want: dict = {}
    keys = [f"page-{i:04d}_0_k" for i in range(n)]
    for lo in range(0, n, 7):
        ks = keys[lo : lo + 7]
        assert await st.put_many(ks, [body(k, 0) for k in ks]) == [True] * len(ks)
        want.update((k, body(k, 0)) for k in ks)
    rng = np.random.default_rng(7)
    for r in range(1, rounds + 1):
        gone = [keys[i] for i in rng.choice(n, 40, replace=False).tolist() if want[keys[i]] is not None]
        assert await st.delete_many(gone) == [True] * len(gone)
        want.update((k, None) for k in gone)
        again = [keys[i] for i in rng.choice(n, 30, replace=False).tolist()]
        assert await st.delete_many(again)  # overwrite = delete + put of new bytes
        assert await st.put_many(again, [body(k, r) for k in again]) == [True] * len(again)
        want.update((k, body(k, r)) for k in again)
    return want


@pytest.mark.parametrize("mode", ["strict", "relaxed"])
async def test_without_a_cache_the_records_on_disk_rebuild_exactly_what_was_served(store_dir, mode):
    st = await PageStore.open(store_dir, cfg(mode, 0))
    want = await churn(st)
    live = sum(v is not None for v in want.values())
    assert await served(st, want) == (live, [])
    assert await st.flush()
    areas = st.writer.areas
    assert areas.clean_blocks() == 0 and areas.blocks_in_memory() == 0  # nothing kept once on disk
    s = st.stats()  # every block came back through the read engine, none by a blocking read on the loop
    assert s["record_blocks_read_back"] > 0 and s["record_blocks_read_on_loop"] == 0
    await st.close()
    os.unlink(os.path.join(store_dir, INDEX_FILE))  # the records alone must carry every live key
    st = await PageStore.open(store_dir, cfg(mode, 0))
    assert st.stats()["objects"] == live
    assert await served(st, want) == (live, [])
    await st.close()


async def test_the_cache_holds_what_it_is_given_and_serves_the_same(store_dir):
    cache = 8 * 4 * KiB  # 8 blocks
    st = await PageStore.open(store_dir, cfg("strict", cache))
    want = await churn(st, n=900)
    areas = st.writer.areas
    assert 0 < areas.clean_blocks() <= 8
    assert await st.flush()
    assert areas.blocks_in_memory() <= 8  # nothing is being changed after a flush
    live = sum(v is not None for v in want.values())
    assert await served(st, want) == (live, [])
    await st.close()
    os.unlink(os.path.join(store_dir, INDEX_FILE))
    st = await PageStore.open(store_dir, cfg("strict", cache))
    assert await served(st, want) == (live, [])
    await st.close()


async def test_eviction_at_capacity_reads_old_blocks_back_and_nothing_evicted_comes_back(store_dir):
    """A full store evicts old pages; their tombstones go into blocks that left memory long ago."""
    conf = cfg("strict", 0, ssd_capacity_bytes=8 * MiB, ssd_segment_size_bytes=1 * MiB)
    st = await PageStore.open(store_dir, conf)
    keys = [f"page-{i:05d}_0_k" for i in range(2500)]  # ~2.5x what fits
    for lo in range(0, len(keys), 10):
        ks = keys[lo : lo + 10]
        await st.put_many(ks, [body(k, 0) for k in ks])
    assert st.stats()["evictions"] > 0
    assert st.stats()["record_blocks_read_on_loop"] == 0
    present = await st.exists_many(keys)
    want = {k: body(k, 0) for k, p in zip(keys, present) if p}
    assert 0 < len(want) < len(keys)
    assert await served(st, want) == (len(want), [])
    await st.close()
    os.unlink(os.path.join(store_dir, INDEX_FILE))
    st = await PageStore.open(store_dir, conf)
    back = await st.exists_many(keys)
    assert [k for k, b in zip(keys, back) if b and k not in want] == []  # no evicted page returns
    assert await served(st, want) == (sum(back), [])
    assert sum(back) == len(want)
    await st.close()


async def test_a_reopened_writer_changes_blocks_it_never_read_this_session(store_dir):
    st = await PageStore.open(store_dir, cfg("strict", 0))
    want = await churn(st, rounds=1)
    await st.close()
    st = await PageStore.open(store_dir, cfg("strict", 0))  # every block on disk only
    assert st.writer.areas.blocks_in_memory() == 0
    gone = [k for k, v in list(want.items())[::5] if v is not None]
    assert await st.delete_many(gone) == [True] * len(gone)
    want.update((k, None) for k in gone)
    more = [f"late-{i}" for i in range(20)]
    assert await st.put_many(more, [body(k, 9) for k in more]) == [True] * 20
    want.update((k, body(k, 9)) for k in more)
    await st.close()
    os.unlink(os.path.join(store_dir, INDEX_FILE))
    st = await PageStore.open(store_dir, cfg("strict", 0))
    live = sum(v is not None for v in want.values())
    assert await served(st, want) == (live, [])
    assert st.stats()["objects"] == live
    await st.close()


@pytest.mark.parametrize("mode", ["strict", "relaxed"])
async def test_concurrent_puts_and_deletes_sharing_blocks_lose_no_change(store_dir, mode):
    """Calls whose records share blocks run at once: a block one of them changed while another's
    write of it was in flight must not leave memory before its own image is on disk."""
    import asyncio

    st = await PageStore.open(store_dir, cfg(mode, 0))
    keys = [f"page-{i:04d}_0_k" for i in range(480)]
    want: dict = {}

    async def put(ks, v):
        assert await st.put_many(ks, [body(k, v) for k in ks]) == [True] * len(ks)

    await asyncio.gather(*(put(keys[lo : lo + 5], 0) for lo in range(0, len(keys), 5)))
    want.update((k, body(k, 0)) for k in keys)
    for r in range(1, 4):
        back = [k for k, v in want.items() if v is None]  # deleted last round: put again, new bytes
        gone = [k for k in keys[r::7] if want[k] is not None]

        async def drop(k):
            assert await st.delete_many([k]) == [True]

        await asyncio.gather(*(drop(k) for k in gone), *(put([k], r) for k in back))
        want.update((k, body(k, r)) for k in back)
        want.update((k, None) for k in gone)
    live = sum(v is not None for v in want.values())
    assert await served(st, want) == (live, [])
    await st.close()
    os.unlink(os.path.join(store_dir, INDEX_FILE))
    st = await PageStore.open(store_dir, cfg(mode, 0))
    assert await served(st, want) == (live, [])
    assert st.stats()["objects"] == live
    await st.close()


async def test_blocks_read_back_in_runs_longer_than_one_read_takes(store_dir):
    """A delete of half of a large segment's pages after a reopen reads thousands of consecutive
    blocks back (more than one preadv's iovecs); the other half's records must stay."""
    conf = cfg("relaxed", 0, ssd_capacity_bytes=160 * MiB, ssd_segment_size_bytes=80 * MiB)
    n = 18000  # 4 KiB pages: 1,125 record blocks in one segment
    keys = [f"p{i:05d}" for i in range(n)]
    st = await PageStore.open(store_dir, conf)
    for lo in range(0, n, 1000):
        ks = keys[lo : lo + 1000]
        assert await st.put_many(ks, [payload(k, 4 * KiB) for k in ks]) == [True] * len(ks)
    await st.close()
    st = await PageStore.open(store_dir, conf)
    assert await st.delete_many(keys[::2]) == [True] * (n // 2)
    await st.close()
    os.unlink(os.path.join(store_dir, INDEX_FILE))
    st = await PageStore.open(store_dir, conf)
    assert await st.exists_many(keys) == [i % 2 == 1 for i in range(n)]
    outs = [np.zeros(4 * KiB, np.uint8) for _ in keys[1::2]]
    assert await st.get_many(keys[1::2], outs) == [True] * (n // 2)
    assert all(np.array_equal(o, payload(k, 4 * KiB)) for k, o in zip(keys[1::2], outs))
    await st.close()


async def test_a_read_back_that_raced_a_change_of_its_block_is_not_installed(tmp_path):
    """A put's read-back (``fetch``) is in flight while a delete reads the same block itself,
    tombstones a record, writes it and gives it back: the fetched image predates the tombstone
    and must not become memory's truth (a later write would bring the deleted record back)."""
    import asyncio
    import ctypes

    from umbp_nvme.store.record_areas import RecordAreas
    from umbp_nvme.store.records import R_VALID, RECORD_DTYPE, block_offset, make_records

    seg_bytes, size = 1 * MiB, 8 * KiB
    path = tmp_path / "seg"
    path.write_bytes(bytes(seg_bytes))
    fd = os.open(path, os.O_RDWR)

    class Engine:
        hold: asyncio.Event | None = None

        async def read_many(self, _files, offs, addrs, lens):
            got = [os.pread(fd, int(n), int(o)) for o, n in zip(offs, lens)]  # the image as it is now
            if self.hold is not None:
                await self.hold.wait()
            for a, d in zip(addrs, got):
                ctypes.memmove(int(a), d, len(d))
            return np.array([len(d) for d in got], np.int64)

        async def write_many(self, _files, offs, addrs, lens):
            for o, a, n in zip(offs, addrs, lens):
                os.pwrite(fd, ctypes.string_at(int(a), int(n)), int(o))
            return np.asarray(lens, np.int64)

    class Files:
        def batch(self, segs):
            return segs

    def read_at(seg, offset, bufs):
        return os.preadv(fd, bufs, offset)

    eng, files = Engine(), Files()
    areas = RecordAreas(seg_bytes, read_at, lambda seg: None, cache_bytes=0)
    try:
        offs = np.array([0, size], np.int64)  # slots 0 and 1: one record block
        recs = make_records(np.zeros(2, np.int64), offs, np.full(2, size), np.array([5, 6], np.uint64),
                            np.zeros(2, np.uint32), np.full(2, -1, np.int32), np.zeros(2, np.uint32), [b"a", b"b"],
                            R_VALID)  # fmt: skip
        assert await areas.write(eng, files, areas.put(recs), 5) == set()
        assert not areas.resident(np.zeros(1, np.int64), np.zeros(1, np.int64)).any()  # given back: on disk only
        eng.hold = asyncio.Event()
        fetch = asyncio.ensure_future(areas.fetch(eng, files, [0], [size], [size], 5))  # a put's read-back of slot 1
        await asyncio.sleep(0.01)
        touched, _ = areas.clear([0], [0], [size])  # a delete of slot 0: reads the block itself, meanwhile
        assert await areas.write(eng, files, touched, 5) == set()
        eng.hold.set()
        await fetch
        later = make_records(np.zeros(1, np.int64), offs[1:], np.full(1, size), np.array([7], np.uint64),
                             np.zeros(1, np.uint32), np.full(1, -1, np.int32), np.zeros(1, np.uint32), [b"c"], R_VALID)
        assert await areas.write(eng, files, areas.put(later), 5) == set()  # slot 1 again: its block is written
        blk = np.frombuffer(os.pread(fd, 4 * KiB, block_offset(seg_bytes, 0)), RECORD_DTYPE)
        assert blk["flags"][0] == 0  # the tombstone stands
        assert (blk["generation"][1], bytes(blk["key"][1][:1])) == (7, b"c")
    finally:
        os.close(fd)
