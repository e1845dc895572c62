"""The fast put path's publish: a batch whose keys were all absent skips its "published meanwhile"
lookup only while no key was mapped since (KeyMap.adds); racing batches of the same keys still
keep the first bytes published, and one row per key."""

from __future__ import annotations

import asyncio

import numpy as np

from conftest import KiB, MiB, payload, small_config
from umbp_nvme.buffers import AlignedBuffer
from umbp_nvme.store import PageStore
from umbp_nvme.store.hooks import StoreHooks


async def _store(path, hooks=None):
    return await PageStore.open(path, small_config(ssd_capacity_bytes=64 * MiB), hooks=hooks)


async def test_racing_fast_batches_of_the_same_keys_keep_the_first_published_bytes(store_dir):
    st = await _store(store_dir)
    n, size = 8, 16 * KiB
    buf = AlignedBuffer(3 * n * size)
    st.register_memory(buf.address, buf.nbytes)
    a, b = payload("a", n * size), payload("b", n * size)
    buf.array[: n * size], buf.array[n * size : 2 * n * size] = a, b
    keys = [f"race{i}" for i in range(n)]
    pairs_a = [(buf.address + i * size, size) for i in range(n)]
    pairs_b = [(buf.address + (n + i) * size, size) for i in range(n)]
    adds = st.writer.keys.adds
    ra, rb = await asyncio.gather(st.put_many(keys, pairs_a), st.put_many(keys, pairs_b))
    assert ra == rb == [True] * n
    assert st.stats()["objects"] == n and len(st.writer.keys) == n
    assert st.writer.keys.adds > adds
    out = [(buf.address + (2 * n + i) * size, size) for i in range(n)]
    assert await st.get_many(keys, out) == [True] * n
    got = bytes(buf.array[2 * n * size :])
    assert got in (bytes(a), bytes(b))  # one batch's bytes, whole: never a mix, never both rows
    # a single row per key: one delete makes every key miss
    assert await st.delete_many(keys) == [True] * n
    assert await st.get_many(keys, out) == [False] * n
    assert st.stats()["objects"] == 0
    await st.close()
    buf.close()


async def test_a_key_published_by_another_batch_while_this_one_writes_is_kept(store_dir):
    held = asyncio.Event()

    async def slow_commit(real, store, puts, deletes):  # the first batch's commit (under the commit lock) takes a while
        if puts and not held.is_set():
            held.set()
            await asyncio.sleep(0.05)
        return await real(puts, deletes)

    st = await _store(store_dir, StoreHooks(commit=slow_commit))
    size = 16 * KiB
    buf = AlignedBuffer(4 * size)
    st.register_memory(buf.address, buf.nbytes)
    buf.array[:size], buf.array[size : 2 * size] = payload("first", size), payload("second", size)
    t1 = asyncio.ensure_future(st.put_many(["k", "other"], [(buf.address, size), (buf.address + 3 * size, size)]))
    await held.wait()
    # found absent, written while the first batch commits; it publishes after it: its key is taken
    assert await st.put_many(["k"], [(buf.address + size, size)]) == [True]
    assert t1.done() and await t1 == [True, True]
    assert st.stats()["objects"] == 2
    assert await st.get_many(["k"], [(buf.address + 2 * size, size)]) == [True]
    assert bytes(buf.array[2 * size : 3 * size]) == bytes(payload("first", size))
    assert np.count_nonzero(st.writer.keys.rows(["k", "other"]) >= 0) == 2
    assert st.stats()["bytes_used"] == 2 * size  # the second batch's slot went back
    await st.close()
    buf.close()
