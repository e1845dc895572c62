"""A record block that left memory comes back through the read engine, bounded by io_timeout_s,
never by a blocking read on the loop thread (store/record_areas.py ``fetch``): a drive that
stops answering must not stop the store. While its reads hang, an eviction leaves the rows it
cannot read alone, a delete of such a row answers False and drops nothing, a put whose old slot's
block cannot be read is refused; once the drive answers again all of it works, and a rebuild from
the records alone serves every live key's newest bytes and nothing deleted.

The hung drive is a FaultyEngine (tests/support/faults.py) whose reads never complete until
released; ``record_blocks_read_on_loop`` counts blocking read-backs, and must stay 0.
"""

from __future__ import annotations

import os

import numpy as np

from conftest import MiB, payload, small_config
from support.faults import FaultPlan, FaultRule
from support.paged import served as served_bytes
from umbp_nvme.store import PageStore
from umbp_nvme.store.index import INDEX_FILE

OBJ = 5000  # 8 KiB slots: 16 records to a 4 KiB record block


def conf(mode="strict", capacity=8 * MiB):
    return small_config(ssd_durability_mode=mode, ssd_record_cache_bytes=8 * 4096, io_timeout_s=0.5,
                        ssd_capacity_bytes=capacity, ssd_segment_size_bytes=1 * MiB)  # fmt: skip


def body(key: str, version: int) -> np.ndarray:
    return payload(f"{key}@v{version}", OBJ)  # every version its own bytes: an old one shows


async def served(st, want: dict) -> tuple[int, list]:
    return await served_bytes(st, want, OBJ)


async def test_a_hung_drive_never_blocks_the_loop_on_a_record_read_back(store_dir):
    plan = FaultPlan(seed=1)
    st = await PageStore.open(store_dir, conf(), engine_factory=plan.engine_factory())
    keys = [f"page-{i:05d}_0_k" for i in range(1500)]  # ~1.5x what fits: evictions
    want: dict = {}
    for lo in range(0, len(keys), 10):
        ks = keys[lo : lo + 10]
        ok = await st.put_many(ks, [body(k, 0) for k in ks])
        want.update((k, body(k, 0)) for k, o in zip(ks, ok) if o)
    s = st.stats()
    assert s["evictions"] > 0 and s["record_blocks_read_back"] > 0  # old blocks came back through the engine
    assert s["record_blocks_read_on_loop"] == 0
    present = dict(zip(want, await st.exists_many(list(want))))
    want = {k: v for k, v in want.items() if present[k]}
    left = [k for k in keys if k in want]
    old = left[len(left) // 2 :][:5]  # neither the newest nor next to the last evicted: their blocks left memory
    evicted = s["evictions"]

    plan.set_rules([FaultRule("stuck", ops=("read",))])  # the drive stops answering reads
    assert await st.delete_many(old[:1]) == [False]  # its record cannot be read: nothing dropped
    late = [f"late-{i}" for i in range(30)]
    ok = await st.put_many(late, [body(k, 1) for k in late])  # evicts or reuses slots of old blocks
    assert st.stats()["record_blocks_read_on_loop"] == 0
    assert await st.exists_many(old[:1]) == [True]  # the delete that answered False dropped nothing

    plan.clear()
    plan.release_stuck()
    want.update((k, body(k, 1)) for k, o in zip(late, ok) if o)
    assert await st.delete_many(old) == [True] * len(old)  # the drive answers: the same delete goes through
    want.update((k, None) for k in old)
    more = [f"more-{i}" for i in range(40)]
    assert await st.put_many(more, [body(k, 2) for k in more]) == [True] * 40
    want.update((k, body(k, 2)) for k in more)
    assert st.stats()["evictions"] > evicted
    present = dict(zip(want, await st.exists_many(list(want))))
    want = {k: v for k, v in want.items() if v is None or present[k]}  # evicted meanwhile: gone, like deleted
    want.update((k, None) for k in keys if k not in want)
    live = sum(v is not None for v in want.values())
    assert await served(st, want) == (live, [])
    assert st.stats()["record_blocks_read_on_loop"] == 0
    await st.close()
    os.unlink(os.path.join(store_dir, INDEX_FILE))  # the records alone must carry every live key
    st = await PageStore.open(store_dir, conf())
    assert await served(st, want) == (live, [])
    assert st.stats()["objects"] == live
    await st.close()


async def test_a_flush_on_a_hung_drive_answers_false_and_confirms_once_it_answers(store_dir):
    """A relaxed writer's blocks leave memory holding unconfirmed records; the flush that confirms
    them must read them back, and cannot while the drive hangs."""
    plan = FaultPlan(seed=1)
    cfg = conf("relaxed", 32 * MiB)
    st = await PageStore.open(store_dir, cfg, engine_factory=plan.engine_factory())
    keys = [f"page-{i:04d}_0_k" for i in range(600)]  # no eviction: every record unconfirmed until the flush
    for lo in range(0, len(keys), 10):
        ks = keys[lo : lo + 10]
        assert await st.put_many(ks, [body(k, 0) for k in ks]) == [True] * len(ks)
    plan.set_rules([FaultRule("stuck", ops=("read",))])
    assert await st.flush() is False
    assert st.stats()["record_blocks_read_on_loop"] == 0
    plan.clear()
    plan.release_stuck()
    assert await st.flush() is True
    s = st.stats()
    assert s["record_blocks_read_back"] > 0 and s["record_blocks_read_on_loop"] == 0
    await st.close()
    os.unlink(os.path.join(store_dir, INDEX_FILE))
    st = await PageStore.open(store_dir, cfg)
    assert await served(st, {k: body(k, 0) for k in keys}) == (len(keys), [])
    await st.close()
