"""Capacity is real: bytes on disk, watermarks, eviction order, durable eviction, ENOSPC, pins.

A full file system below the configured capacity: reliability/test_trust_datapath.py (defect 11)."""

from __future__ import annotations

import asyncio
import os

import numpy as np

from support.faults import EngineHooks
from conftest import KiB, MiB, payload, small_config
from umbp_nvme.store import PageStore
from umbp_nvme.store.layout import record_slots

PER_64K = record_slots(MiB, 64 * KiB)  # 64 KiB slots per 1 MiB segment: 15, the tail holds their records


def disk_bytes(path: str) -> int:
    return sum(os.stat(os.path.join(path, n)).st_blocks * 512 for n in os.listdir(path) if n.startswith("seg-"))


async def fill(st, prefix: str, count: int, nbytes: int, batch: int = 16, depths=None) -> list[str]:
    keys = [f"{prefix}{i}" for i in range(count)]
    for lo in range(0, count, batch):
        ks = keys[lo : lo + batch]
        d = None if depths is None else depths[lo : lo + batch]
        assert await st.put_many(ks, [payload(k, nbytes) for k in ks], depths=d) == [True] * len(ks)
    return keys


async def test_bytes_on_disk_stay_under_capacity_and_space_is_reused(store_dir):
    cap = 8 * MiB
    st = await PageStore.open(store_dir, small_config(ssd_capacity_bytes=cap, ssd_segment_size_bytes=1 * MiB))
    keys = await fill(st, "k", 3 * cap // (64 * KiB), 64 * KiB)  # three times the capacity
    s = st.stats()
    assert disk_bytes(store_dir) <= cap
    assert s["bytes_used"] <= st.config.ssd_high_watermark * cap and s["evictions"] > 0
    assert s["objects"] * 64 * KiB == s["bytes_used"]
    present = await st.exists_many(keys)
    assert present[-1] and not present[0]  # LRU: the oldest went first
    outs = [np.zeros(64 * KiB, np.uint8) for _ in keys]
    res = await st.get_many(keys, outs)
    assert res == present
    assert all(bytes(o) == bytes(payload(k, 64 * KiB)) for o, k, ok in zip(outs, keys, res) if ok)
    await st.close()
    # evictions are durable: nothing evicted comes back
    st = await PageStore.open(store_dir, small_config(ssd_capacity_bytes=cap, ssd_segment_size_bytes=1 * MiB))
    assert await st.exists_many(keys) == present
    await st.close()


async def test_eviction_runs_from_high_to_low_watermark(store_dir):
    cap = 4 * MiB
    cfg = small_config(ssd_capacity_bytes=cap, ssd_segment_size_bytes=1 * MiB, ssd_high_watermark=0.9, ssd_low_watermark=0.5)
    st = await PageStore.open(store_dir, cfg)
    await fill(st, "a", int(0.9 * cap) // (64 * KiB), 64 * KiB, batch=1)
    assert st.stats()["evictions"] == 0
    before = st.stats()["bytes_used"]
    await fill(st, "b", 1, 64 * KiB)
    s = st.stats()
    assert s["evictions"] > 0
    assert s["bytes_used"] <= 0.5 * cap + 64 * KiB < before
    await st.close()


async def test_lru_keeps_recently_read_objects(store_dir):
    cap = 4 * MiB
    st = await PageStore.open(store_dir, small_config(ssd_capacity_bytes=cap, ssd_segment_size_bytes=1 * MiB))
    old = await fill(st, "old", 40, 64 * KiB)
    assert await st.get_many(old[:5], [np.zeros(64 * KiB, np.uint8) for _ in range(5)]) == [True] * 5
    await fill(st, "new", 30, 64 * KiB)
    assert await st.exists_many(old[:5]) == [True] * 5
    assert not all(await st.exists_many(old[5:]))
    await st.close()


async def test_lru_evicts_the_deepest_pages_used_together_with_all_their_components(store_dir):
    # "prefix_aware" names the same policy (deepest-first across the store lost to LRU, issue 26)
    for policy in ("lru", "prefix_aware"):
        cap = 4 * MiB
        cfg = small_config(ssd_capacity_bytes=cap, ssd_segment_size_bytes=1 * MiB, eviction_policy=policy,
                           ssd_high_watermark=0.9, ssd_low_watermark=0.7)
        st = await PageStore.open(f"{store_dir}/{policy}", cfg)
        # one chain of 28 pages, two components (k, v) per page, 64 KiB each = 3.5 MiB
        pages = 28
        keys = [f"h{p}_{c}" for p in range(pages) for c in "kv"]
        depths = [p for p in range(pages) for _ in "kv"]
        for lo in range(0, len(keys), 8):
            ks = keys[lo : lo + 8]
            assert await st.put_many(ks, [payload(k, 64 * KiB) for k in ks], depths=depths[lo : lo + 8]) == [True] * 8
        # a prefix hit reads the whole chain: one use, so the deepest pages are the least needed
        assert await st.get_many(keys, [np.zeros(64 * KiB, np.uint8) for _ in keys]) == [True] * len(keys)
        await fill(st, "z", 4, 64 * KiB, depths=[0, 0, 1, 1])
        present = await st.exists_many(keys)
        n_present = sum(present)
        assert 0 < n_present < len(keys)
        assert present == [True] * n_present + [False] * (len(keys) - n_present)  # a clean prefix survives
        assert n_present % 2 == 0  # k and v of a page leave together
        await st.close()


async def test_size_class_without_room_reclaims_a_whole_segment(store_dir):
    cap = 4 * MiB
    st = await PageStore.open(store_dir, small_config(ssd_capacity_bytes=cap, ssd_segment_size_bytes=1 * MiB,
                                                      ssd_high_watermark=1.0, ssd_low_watermark=0.99))
    small = await fill(st, "s", 4 * PER_64K, 64 * KiB, batch=PER_64K)  # every segment now belongs to 64 KiB
    assert st.stats()["segments_free"] == 0
    assert await st.put_many(["big"], [payload("big", 512 * KiB)]) == [True]
    out = np.zeros(512 * KiB, np.uint8)
    assert await st.get_many(["big"], [out]) == [True] and bytes(out) == bytes(payload("big", 512 * KiB))
    s = st.stats()
    assert s["evictions"] == PER_64K  # exactly one segment's worth
    assert s["size_classes"] == {64 * KiB: len(small) - PER_64K, 512 * KiB: 1}
    await st.close()


async def test_pinned_slot_is_not_reused_while_a_read_is_in_flight(store_dir):
    cap = 2 * MiB
    hooks = EngineHooks()
    st = await PageStore.open(
        store_dir, small_config(ssd_capacity_bytes=cap, ssd_segment_size_bytes=1 * MiB), engine_factory=hooks.engine_factory()
    )
    await st.put_many(["victim"], [payload("victim", 64 * KiB)])
    slot = tuple(st.locate(["victim"])[0][:2])
    started, release = asyncio.Event(), asyncio.Event()

    async def held_read(real, *a):
        started.set()
        await release.wait()
        return await real(*a)

    hooks.read = held_read
    out = np.zeros(64 * KiB, np.uint8)
    reader = asyncio.ensure_future(st.get_many(["victim"], [out]))
    await started.wait()
    assert await st.delete_many(["victim"]) == [True]
    hooks.read = None
    # fill the store so every free slot is taken; the pinned one must stay out of use
    for i in range(40):
        await st.put_many([f"f{i}"], [payload(f"f{i}", 64 * KiB)])
        slots = {tuple(e[:2]) for e in st.locate([f"f{j}" for j in range(i + 1)]) if e is not None}
        assert slot not in slots
    assert st.stats()["pinned_slots"] == 1
    release.set()
    assert await reader == [True]
    assert bytes(out) == bytes(payload("victim", 64 * KiB))
    s = st.stats()  # the read ended: the victim's slot is free now (counted in no object, pinned by none)
    assert s["pinned_slots"] == 0 and s["bytes_used"] == s["objects"] * 64 * KiB
    await st.close()


async def test_put_that_cannot_get_space_fails_only_that_key(store_dir):
    cap = 1 * MiB
    hooks = EngineHooks()
    st = await PageStore.open(
        store_dir, small_config(ssd_capacity_bytes=cap, ssd_segment_size_bytes=1 * MiB), engine_factory=hooks.engine_factory()
    )
    # all slots pinned by an in-flight read: nothing can be evicted
    keys = await fill(st, "p", PER_64K, 64 * KiB)
    started, gate = asyncio.Event(), asyncio.Event()

    async def held_read(real, *a):
        started.set()
        await gate.wait()
        return await real(*a)

    hooks.read = held_read
    reader = asyncio.ensure_future(st.get_many(keys, [np.zeros(64 * KiB, np.uint8) for _ in keys]))
    await started.wait()
    r = await st.put_many(["x", "tiny"], [payload("x", 64 * KiB), payload("tiny", 64 * KiB)])
    assert r == [False, False]
    gate.set()
    assert await reader == [True] * PER_64K
    hooks.read = None
    assert await st.put_many(["x"], [payload("x", 64 * KiB)]) == [True]  # usable again
    await st.close()


async def test_put_that_cannot_fit_a_segment_evicts_nothing(store_dir, caplog):
    """Issue 34: an object between (segment - 4 KiB) and one segment has no slot in any segment
    (the tail keeps the slots' records). Before, the put evicted the whole store, then failed; now it
    is refused before anything is reserved, with one log line naming the largest object taken."""
    import logging

    st = await PageStore.open(store_dir, small_config(ssd_capacity_bytes=8 * MiB, ssd_segment_size_bytes=1 * MiB))
    try:
        assert st.max_object_bytes == MiB - 4 * KiB
        keys = await fill(st, "k", 4 * PER_64K, 64 * KiB)  # half the store, below the high watermark
        assert st.stats()["evictions"] == 0
        caplog.set_level(logging.WARNING, logger="umbp_nvme.store")
        for n in (MiB - 4 * KiB + 1, MiB - 100, MiB):  # in one call with a key that fits: only it fails
            caplog.clear()
            assert await st.put_many(["big", "fits"], [payload("big", n), payload("fits", 4 * KiB)]) == [False, True]
            assert await st.delete_many(["fits"]) == [True]
            lines = [r.getMessage() for r in caplog.records]
            assert len(lines) == 1 and f"1..{MiB - 4 * KiB} bytes" in lines[0] and "'big'" in lines[0], lines
        s = st.stats()
        assert (s["evictions"], s["objects"]) == (0, len(keys))
        outs = [np.zeros(64 * KiB, np.uint8) for _ in keys]
        assert await st.get_many(keys, outs) == [True] * len(keys)
        assert all(np.array_equal(o, payload(k, 64 * KiB)) for o, k in zip(outs, keys))
        # the largest object it takes is taken (evicting what its class needs, as any put)
        assert await st.put_many(["largest"], [payload("largest", MiB - 4 * KiB)]) == [True]
        out = np.zeros(MiB - 4 * KiB, np.uint8)
        assert await st.get_many(["largest"], [out]) == [True] and np.array_equal(out, payload("largest", MiB - 4 * KiB))
    finally:
        await st.close()
