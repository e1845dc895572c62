"""A get reads its objects in parts: a small batch in parts of at most ~PART_BYTES (16 MiB) all in flight at once, a large
one a few parts at a time; each part is verified as it completes, and the call never returns
(not even cancelled) while a part's read may still write the caller's memory."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from conftest import KiB, MiB, damage_object, payload, small_config
from support.faults import EngineHooks
from support.waits import until
from umbp_nvme.store import PageStore, get_path, get_verify
from umbp_nvme.store.get_path import read_parts


def held_read(release: asyncio.Event, started: list, in_flight: list, nth: int | None = None):
    """A read hook: the nth read (every one when None) behaves like a read the kernel still owns,
    so cancelling it waits for ``release``; ``started`` gets each read's length, ``in_flight[0]`` counts."""
    async def hook(real, *a):
        started.append(len(a[3]))
        in_flight[0] += 1
        try:
            if nth is None or len(started) == nth:
                try:
                    await release.wait()
                except asyncio.CancelledError:
                    await release.wait()
                    raise
            return await real(*a)
        finally:
            in_flight[0] -= 1
    return hook


@pytest.mark.parametrize("sizes", [[64 * KiB] * 256, [128 * KiB] * 256, [200 * KiB + 7 * i for i in range(160)],
                                   [4096] * 3 + [40 * MiB] + [4096] * 50, [256 * KiB] * 240])  # fmt: skip
def test_a_small_batch_is_in_parts_of_at_most_part_bytes_all_in_flight(sizes):
    lens = np.asarray(sizes, np.int64)
    bounds, window = read_parts(lens)
    assert bounds[0] == 0 and bounds[-1] == len(lens) and all(a < b for a, b in zip(bounds, bounds[1:]))
    assert window == len(bounds) - 1  # every part in flight at once
    parts = [int(lens[a:b].sum()) for a, b in zip(bounds, bounds[1:])]
    want = min(get_path.SMALL_PARTS_MAX, -(-int(lens.sum()) // get_path.PART_BYTES))
    assert len(parts) == want if len(set(sizes)) == 1 else 1 < len(parts) <= want  # one big op may take a cut's place
    mean = lens.sum() / len(parts)
    assert all(p <= mean + lens.max() for p in parts)  # equal bytes, an op never split
    assert all(p <= get_path.PART_BYTES + lens.max() for p in parts)  # a part's fixed cost spread over <= PART_BYTES


def test_tiny_and_large_batches():
    assert read_parts(np.zeros(0, np.int64)) == ([0], 1)
    assert read_parts(np.full(10, 4096, np.int64)) == ([0, 10], 1)
    big = np.full(256, 1 * MiB, np.int64)  # 256 MiB: the large-batch shape, a few parts at a time
    bounds, window = read_parts(big)
    assert bounds == get_path.part_bounds(256, int(big.sum())) and window == get_path.READ_PARTS_IN_FLIGHT


async def test_parts_return_exact_bytes_and_a_damaged_object_fails_alone(store_dir):
    cfg = small_config(ssd_capacity_bytes=96 * MiB, ssd_segment_size_bytes=8 * MiB)
    st = await PageStore.open(store_dir, cfg)
    keys = [f"p{i}" for i in range(256)]
    vals = [payload(k, 96 * KiB + 512 * (i % 3)) for i, k in enumerate(keys)]  # ~24 MiB: 2 parts, some bounced
    assert await st.put_many(keys, vals) == [True] * len(keys)
    assert len(read_parts(np.asarray([len(v) for v in vals], np.int64))[0]) > 2
    damage_object(store_dir, st, "p50", 100, b"\xde\xad")
    outs = [np.zeros(len(v), np.uint8) for v in vals]
    assert await st.get_many(keys, outs) == [k != "p50" for k in keys]
    assert all(np.array_equal(o, v) for k, o, v in zip(keys, outs, vals) if k != "p50")
    assert st.stats()["crc_errors"] == 1
    await st.close()


async def test_a_cancelled_get_waits_for_every_part_in_flight(store_dir):
    hooks = EngineHooks()
    st = await PageStore.open(store_dir, small_config(ssd_capacity_bytes=96 * MiB, ssd_segment_size_bytes=8 * MiB),
                              engine_factory=hooks.engine_factory())  # fmt: skip
    keys = [f"c{i}" for i in range(224)]
    vals = [payload(k, 256 * KiB) for k in keys]  # 56 MiB: 4 parts
    assert await st.put_many(keys, vals) == [True] * len(keys)
    release, started, in_flight = asyncio.Event(), [], [0]

    hooks.read = held_read(release, started, in_flight, nth=3)
    outs = [np.zeros(256 * KiB, np.uint8) for _ in keys]
    task = asyncio.ensure_future(st.get_many(keys, outs))
    # all parts submitted at once; the other three end, one stays held (a real read each: no bound)
    assert len(read_parts(np.full(len(keys), 256 * KiB, np.int64))[0]) == 5
    assert await until(lambda: len(started) == 4 and in_flight[0] == 1, 30)
    task.cancel()
    for _ in range(20):
        await asyncio.sleep(0.005)
    assert not task.done()  # the held part may still write outs[112:168]
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert in_flight[0] == 0
    hooks.read = None
    outs = [np.zeros(256 * KiB, np.uint8) for _ in keys]
    assert await st.get_many(keys, outs) == [True] * len(keys)  # nothing left pinned or broken
    assert all(np.array_equal(o, v) for o, v in zip(outs, vals))
    await st.close()


async def test_one_part_checked_in_chunks_on_the_loop_catches_damage_in_every_chunk(store_dir):
    st = await PageStore.open(store_dir, small_config(ssd_capacity_bytes=96 * MiB, ssd_segment_size_bytes=8 * MiB))
    keys = [f"q{i}" for i in range(256)]
    vals = [payload(k, 64 * KiB) for k in keys]  # 16 MiB: one part, four CRC calls of 4 MiB
    assert read_parts(np.full(256, 64 * KiB, np.int64)) == ([0, 256], 1)
    assert 256 * 64 * KiB // get_verify.INLINE_VERIFY_BYTES == 4 and 256 * 64 * KiB <= get_verify.INLINE_PART_BYTES
    assert await st.put_many(keys, vals) == [True] * len(keys)
    bad = {0, 63, 64, 130, 255}  # the first and last object, both sides of a chunk's edge
    for i in bad:
        damage_object(store_dir, st, keys[i], 4096 * (i % 16), b"\x01")
    outs = [np.zeros(64 * KiB, np.uint8) for _ in keys]
    assert await st.get_many(keys, outs) == [i not in bad for i in range(256)]
    assert all(np.array_equal(outs[i], vals[i]) for i in range(256) if i not in bad)
    assert st.stats()["crc_errors"] == len(bad)
    await st.close()


async def test_a_cancelled_one_part_get_returns_only_once_its_read_ended(store_dir):
    hooks = EngineHooks()
    st = await PageStore.open(store_dir, small_config(ssd_capacity_bytes=96 * MiB, ssd_segment_size_bytes=8 * MiB),
                              engine_factory=hooks.engine_factory())  # fmt: skip
    keys = [f"o{i}" for i in range(32)]
    vals = [payload(k, 64 * KiB) for k in keys]  # 2 MiB: one part
    assert read_parts(np.full(len(keys), 64 * KiB, np.int64)) == ([0, len(keys)], 1)
    assert await st.put_many(keys, vals) == [True] * len(keys)
    release, started, in_flight = asyncio.Event(), [], [0]

    hooks.read = held_read(release, started, in_flight)
    outs = [np.zeros(64 * KiB, np.uint8) for _ in keys]
    task = asyncio.ensure_future(st.get_many(keys, outs))
    assert await until(lambda: started == [len(keys)] and in_flight[0] == 1, 30)
    task.cancel()
    for _ in range(20):
        await asyncio.sleep(0.005)
    assert not task.done()  # the read may still write every buffer
    assert st.stats()["pinned_slots"] == len(keys)
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert in_flight[0] == 0 and st.stats()["pinned_slots"] == 0
    hooks.read = None
    outs = [np.zeros(64 * KiB, np.uint8) for _ in keys]
    assert await st.get_many(keys, outs) == [True] * len(keys)
    assert all(np.array_equal(o, v) for o, v in zip(outs, vals))
    await st.close()



async def test_a_hit_confirmation_that_fails_while_the_read_is_in_flight_is_a_miss_and_the_read_ends(store_dir, monkeypatch,
                                                                                                  caplog):
    from umbp_nvme.buffers import AlignedBuffer
    from umbp_nvme.store import lookups

    st = await PageStore.open(store_dir, small_config(ssd_io_backend="io_uring"))
    mem = AlignedBuffer(16 * 64 * KiB)
    try:
        st.register_memory(mem.address, mem.nbytes)
        keys = [f"k{i}" for i in range(8)]
        srcs = [payload(k, 64 * KiB) for k in keys]
        assert await st.put_many(keys, srcs) == [True] * 8
        dst = [(mem.address + (8 + i) * 64 * KiB, 64 * KiB) for i in range(8)]  # one part, records in memory

        def broken(self):
            raise RuntimeError("comparison failed")

        monkeypatch.setattr(lookups.Hits, "answer", broken)
        assert await st.get_many(keys, dst) == [False] * 8  # nothing confirmed: misses, never an exception
        assert "confirming a get's hits failed" in caplog.text  # made while the one part was in flight
        assert st.state.read_engine.inflight == 0 and st.counters()["crc_errors"] == 0
        monkeypatch.undo()
        assert await st.get_many(keys, dst) == [True] * 8  # nothing was dropped
        for i in range(8):
            assert mem.array[(8 + i) * 64 * KiB : (9 + i) * 64 * KiB].tobytes() == srcs[i].tobytes()
    finally:
        await st.close()
        mem.close()
