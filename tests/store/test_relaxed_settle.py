"""A relaxed writer settles each segment its puts fill (store/flushing.py): the segment's data
synced, then the records of the puts published in it confirmed while their blocks are in memory,
so they do not leave memory unconfirmed and the flush at close reads almost nothing back."""

from __future__ import annotations

import os

from conftest import MiB, payload, small_config
from support.paged import served
from support.waits import until
from umbp_nvme.store import PageStore
from umbp_nvme.store.index import INDEX_FILE

OBJ = 4096  # 1 MiB segments: ~240 slots, 15 record blocks each


def conf(cache_blocks: int = 8):
    return small_config(ssd_durability_mode="relaxed", ssd_record_cache_bytes=cache_blocks * 4096,
                        ssd_capacity_bytes=16 * MiB, ssd_segment_size_bytes=1 * MiB)  # fmt: skip


async def fill(st, keys, version: int) -> dict:
    want = {}
    for lo in range(0, len(keys), 16):
        ks = keys[lo : lo + 16]
        assert await st.put_many(ks, [payload(f"{k}@{version}", OBJ) for k in ks]) == [True] * len(ks)
        want.update((k, payload(f"{k}@{version}", OBJ)) for k in ks)
    return want


async def test_full_segments_are_confirmed_while_in_memory_and_the_flush_reads_almost_nothing(store_dir):
    st = await PageStore.open(store_dir, conf(cache_blocks=24))  # a segment's 15 blocks fit, the 125 do not
    keys = [f"page-{i:05d}_0_k" for i in range(2000)]  # ~8 segments filled
    want = await fill(st, keys, 0)
    assert await until(lambda: not st.writer.settles, 30)
    before = st.stats()["record_blocks_read_back"]
    assert await st.flush()
    # only the blocks of the segment still filling (and its neighbours' last blocks) come back,
    # not the ~125 blocks the 2000 records span
    assert st.stats()["record_blocks_read_back"] - before <= 2 * 16
    assert st.stats()["record_blocks_read_on_loop"] == 0
    assert await served(st, want, OBJ) == (len(keys), [])
    await st.close()
    os.unlink(os.path.join(store_dir, INDEX_FILE))  # the records alone, as the settles and flush left them
    st = await PageStore.open(store_dir, conf())
    assert await served(st, want, OBJ) == (len(keys), [])
    await st.close()


async def test_a_slot_reused_before_its_segment_settles_keeps_its_new_record(store_dir):
    """Deletes free slots of a full segment and new puts take them before the settle runs: the
    settle confirms only the generation it noted, never the new record with the old one's image."""
    st = await PageStore.open(store_dir, conf(cache_blocks=0))
    keys = [f"page-{i:05d}_0_k" for i in range(1200)]
    want = await fill(st, keys, 0)
    gone = keys[100:300:3]
    assert await st.delete_many(gone) == [True] * len(gone)
    want.update((k, None) for k in gone)
    again = [f"again-{i:04d}" for i in range(len(gone))]  # into the freed slots
    want.update(await fill(st, again, 1))
    assert await until(lambda: not st.writer.settles, 30)
    live = sum(v is not None for v in want.values())
    assert await served(st, want, OBJ) == (live, [])
    await st.close()
    os.unlink(os.path.join(store_dir, INDEX_FILE))
    st = await PageStore.open(store_dir, conf())
    assert await served(st, want, OBJ) == (live, [])
    assert st.stats()["objects"] == live
    await st.close()
