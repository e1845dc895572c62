"""Issue 25, scenarios 1 and 2: no rebuild serves a replaced or deleted page, no record write
zeroes acknowledged data.

Each version of a key has its own bytes (``ver``), so a rebuild that serves an older or an
unacknowledged version shows as wrong bytes, not as a hit. A put is killed (SIGKILL in a child)
after its data and record reached the disk and before its index commit; then the next session
re-puts, deletes or clears, and every rebuild route must keep what was acknowledged.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, payload, small_config
from support import version_crash
from support.faults import FaultPlan, FaultRule
from umbp_nvme.store import PageStore
from umbp_nvme.store.index import INDEX_FILE
from umbp_nvme.store.rebuild import rebuild_records

OBJ = 4096  # 240 slots per 1 MiB segment: 240 objects fill segment 0
SEG = 1 << 20
ROUTES = list(version_crash.ROUTES)


def cfg(**kw):
    return small_config(ssd_durability_mode="strict", **kw)


def ver(key: str, v: int, n: int = OBJ) -> np.ndarray:
    return payload(f"{key}@v{v}", n)


CHILD = r"""
import asyncio, os, signal, sys
sys.path[:0] = [{root!r}, {tests!r}]
import numpy as np
from conftest import payload, small_config
from support import version_crash
from support.faults import FaultPlan, FaultRule
from umbp_nvme.store import PageStore

async def main():
    plan = FaultPlan()
    st = await PageStore.open({path!r}, small_config(ssd_durability_mode="strict"), engine_factory=plan.engine_factory())
    keys = {keys!r}
    assert all(await st.put_many(keys, [payload(k + "@v1", {obj}) for k in keys]))
    {then}
asyncio.run(main())
"""

KILLED_PUT = """assert await st.put_many(["K"], [payload("K@v1", {obj})]) == [True]
    assert all(await st.delete_many(["K"]))
    for _ in range(50):  # hits tick the clock after the last commit
        assert await st.get_many(keys[:1], [np.zeros({obj}, np.uint8)]) == [True]
    plan.set_rules([FaultRule("kill", ops=("sync",), when="after")])
    xk = [f"x-{{i}}" for i in range(16)] + ["K"]
    await st.put_many(xk, [payload(k + "@v9", {obj}) for k in xk])"""


def run_child(path: str, keys: list[str], then: str) -> None:
    code = CHILD.format(root=ROOT, tests=os.path.join(ROOT, "tests"), path=path, keys=keys, obj=OBJ,
                        then=then.format(obj=OBJ))  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, (p.returncode, p.stderr[-2000:])


def killed_put(path: str) -> None:
    """Segment 0 full (240 others), K=v1 put in segment 1 and deleted, 50 hits, then a put of
    16 others and K=v9 killed once its data and records are synced, before its commit: K's record
    lands in slot 16 of segment 1, which holds no object, in another record block than slot 0's
    (the next session's first put, whose block write would have wiped it)."""
    run_child(path, [f"fill-{i:03d}" for i in range(240)], KILLED_PUT)


def records_of(path: str, key: str) -> list[int]:
    """Generations of the sound records of ``key`` in the segments."""
    keys, recs, _, _ = rebuild_records(path, SEG, 16)
    return [int(g) for k, g in zip(keys, recs["generation"].tolist()) if k == key]


def rebuild_by(route: str, path: str) -> None:
    version_crash.rebuild_by(route, path, 16 * SEG)


async def get(path: str, keys: list[str]) -> list:
    """Each key's bytes as served after reopening, or None on a miss."""
    st = await PageStore.open(path, cfg())
    try:
        outs = [np.zeros(OBJ, np.uint8) for _ in keys]
        ok = await st.get_many(keys, outs)
        return [o if g else None for o, g in zip(outs, ok)]
    finally:
        await st.close()


@pytest.mark.parametrize("route", ROUTES)
async def test_a_killed_put_never_beats_an_acknowledged_reput(store_dir, route):
    killed_put(store_dir)
    st = await PageStore.open(store_dir, cfg())  # same boot: the index is trusted
    assert await st.put_many(["K"], [ver("K", 2)]) == [True]
    await st.close()
    rebuild_by(route, store_dir)
    (got,) = await get(store_dir, ["K"])
    assert got is not None and np.array_equal(got, ver("K", 2)), "served a version other than the acknowledged v2"


@pytest.mark.parametrize("how", ["delete", "clear"])
@pytest.mark.parametrize("route", ROUTES)
async def test_a_killed_put_never_brings_back_a_deleted_key(store_dir, route, how):
    killed_put(store_dir)
    st = await PageStore.open(store_dir, cfg())
    assert await st.put_many(["K"], [ver("K", 2)]) == [True]
    if how == "delete":
        assert all(await st.delete_many(["K"]))
    else:
        await st.clear()
    await st.close()
    rebuild_by(route, store_dir)
    assert await get(store_dir, ["K"]) == [None]


async def test_the_killed_puts_record_is_cleared_at_the_next_open(store_dir):
    """The unclean same-boot open rewrites every area, those of segments without objects too."""
    killed_put(store_dir)
    assert len(records_of(store_dir, "K")) == 1  # the killed v9's (v1's was cleared by its delete)
    st = await PageStore.open(store_dir, cfg())
    await st.close()
    assert records_of(store_dir, "K") == []


async def test_generations_never_run_backwards_after_a_kill(store_dir):
    """Gets ticked the clock past the last commit before the kill: the next session's puts still
    get generations above every record the killed one left."""
    killed_put(store_dir)
    killed = max(records_of(store_dir, "K"))
    st = await PageStore.open(store_dir, cfg())
    assert all(await st.put_many(["N"], [ver("N", 1)]))
    await st.close()
    assert min(records_of(store_dir, "N")) > killed


LOST_RACE = """a = ["K"] + [f"a-{{i}}" for i in range(16)]
    b = ["K"] + [f"b-{{i}}" for i in range(16)]
    ra, rb = await asyncio.gather(st.put_many(a, [payload(k + "@v2", {obj}) for k in a]),
                                  st.put_many(b, [payload(k + "@v3", {obj}) for k in b]))
    assert all(ra) and all(rb), (ra, rb)
    assert all(await st.delete_many(["K"]))
    os.kill(os.getpid(), signal.SIGKILL)"""


@pytest.mark.parametrize("route", ROUTES)
async def test_the_loser_of_a_put_race_never_comes_back_after_a_delete(store_dir, route):
    """Two puts of K race; the loser's record (its data landed, so its CRC matches) is given back in
    memory; the acknowledged delete must clear it on disk too, before a crash. 223 pads leave 17
    slots in segment 0: the two batches of 17 write K into different segments."""
    run_child(store_dir, [f"pad-{i:03d}" for i in range(223)], LOST_RACE)
    rebuild_by(route, store_dir)
    assert await get(store_dir, ["K"]) == [None]


async def test_records_of_an_unpublished_batch_never_zero_a_larger_class(store_dir):
    """240 x 4 KiB whose data write fails (their records landed, given back in memory), then the
    emptied segment goes to 8 KiB objects: every acknowledged one reads back whole. The record
    write of the 8 KiB batch is held back so that it lands after the data, as on a busy device."""
    plan = FaultPlan()
    st = await PageStore.open(store_dir, cfg(ssd_capacity_bytes=SEG), engine_factory=plan.engine_factory())
    try:
        area = SEG - 15 * 4096
        plan.set_rules([FaultRule("eio", ops=("write",), predicate=lambda op, fd, off, n: off < area)])
        small = [f"s-{i:03d}" for i in range(240)]
        assert not any(await st.put_many(small, [ver(k, 1) for k in small]))
        plan.set_rules([FaultRule("delay", ops=("write",), delay_s=0.3, limit=1,
                                  predicate=lambda op, fd, off, n: off + n == SEG)])  # fmt: skip
        big = [f"b-{i:03d}" for i in range(124)]
        assert all(await st.put_many(big, [ver(k, 1, 8192) for k in big]))
        outs = [np.zeros(8192, np.uint8) for _ in big]
        ok = await st.get_many(big, outs)
        bad = [k for k, g, o in zip(big, ok, outs) if not g or not np.array_equal(o, ver(k, 1, 8192))]
        assert bad == []
    finally:
        await st.close()


async def test_a_tie_of_newest_generations_drops_the_key(store_dir):
    """Two sound records of one key with the same generation: neither can be trusted."""
    st = await PageStore.open(store_dir, cfg())
    assert all(await st.put_many(["T", "U"], [ver("T", 1), ver("U", 1)]))
    (t,) = st.locate(["T"])
    await st.close()
    from umbp_nvme.keybytes import encode_key
    from umbp_nvme.store.index import key_crcs
    from umbp_nvme.store.records import KEY_INLINE, PER_BLOCK, RECORD_DTYPE, block_offset, seal

    def at(idx):
        return block_offset(SEG, idx // PER_BLOCK) + (idx % PER_BLOCK) * RECORD_DTYPE.itemsize

    from umbp_nvme.store.segments import segment_name

    p = os.path.join(store_dir, segment_name(t.segment))
    with open(p, "r+b") as f:
        f.seek(at(t.offset // OBJ))
        rt = np.frombuffer(f.read(RECORD_DTYPE.itemsize), RECORD_DTYPE).copy()
        other = 1 - t.offset // OBJ  # U's slot: relabel its record as T's, same generation
        f.seek(at(other))
        ru = np.frombuffer(f.read(RECORD_DTYPE.itemsize), RECORD_DTYPE).copy()
        assert ru["generation"][0] == rt["generation"][0]  # one batch
        k = encode_key("T")
        ru["key"][0] = np.frombuffer(k.ljust(KEY_INLINE, b"\0"), np.uint8)
        ru["key_len"], ru["key_crc"] = len(k), key_crcs([k])[0]
        seal(ru)
        f.seek(at(other))
        f.write(ru.tobytes())
    os.unlink(os.path.join(store_dir, INDEX_FILE))
    got_t, got_u = await get(store_dir, ["T", "U"])
    assert got_t is None and got_u is None
