"""Index records in the segments (issue 14): the LMDB index is a cache the segments can rebuild."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, payload, small_config
from umbp_nvme.store import PageStore
from umbp_nvme.store import layout
from umbp_nvme.store.index import INDEX_FILE
from umbp_nvme.store.records import MAGIC, area_blocks, PER_BLOCK, R_CONFIRMED, RECORD_DTYPE, block_offset, seal
from umbp_nvme.store.segments import segment_name

OBJ = 5000  # 8 KiB slots, objects not a whole number of blocks


def cfg(mode="strict", **kw):
    return small_config(ssd_durability_mode=mode, **kw)


async def fill(path, mode, n=300, deletes=20):
    st = await PageStore.open(path, cfg(mode))
    keys = [f"page-{i:04d}_0_k" for i in range(n)]
    assert all(await st.put_many(keys, [payload(k, OBJ) for k in keys]))
    gone = keys[:deletes]
    assert all(await st.delete_many(gone))
    await st.close()
    return keys[deletes:], gone


async def served(path, keys, mode="strict"):
    st = await PageStore.open(path, cfg(mode))
    outs = [np.zeros(OBJ, np.uint8) for _ in keys]
    ok = await st.get_many(keys, outs)
    wrong = [k for k, g, o in zip(keys, ok, outs) if g and not np.array_equal(o, payload(k, OBJ))]
    n = st.stats()["objects"]
    await st.close()
    return sum(ok), wrong, n


@pytest.mark.parametrize("mode", ["strict", "relaxed"])
async def test_index_deleted_reopen_serves_every_page(store_dir, mode):
    live, gone = await fill(store_dir, mode)
    os.unlink(os.path.join(store_dir, INDEX_FILE))
    hits, wrong, n = await served(store_dir, live + gone, mode)
    assert (hits, wrong, n) == (len(live), [], len(live))  # deleted keys stay deleted (tombstones)


@pytest.mark.parametrize("damage", ["garbage", "truncate", "empty"])
async def test_index_damaged_reopen_serves_every_page(store_dir, damage):
    live, gone = await fill(store_dir, "strict")
    p = os.path.join(store_dir, INDEX_FILE)
    size = os.path.getsize(p)
    if damage == "garbage":
        with open(p, "r+b") as f:
            f.write(os.urandom(size))
    elif damage == "truncate":
        os.truncate(p, size // 2)
    else:
        os.truncate(p, 0)
    hits, wrong, n = await served(store_dir, live + gone)
    assert (hits, wrong, n) == (len(live), [], len(live))
    assert any(f.startswith(INDEX_FILE + ".corrupt-") for f in os.listdir(store_dir))


async def test_rebuilt_index_keeps_serving_and_puts_after(store_dir):
    live, _ = await fill(store_dir, "strict")
    os.unlink(os.path.join(store_dir, INDEX_FILE))
    st = await PageStore.open(store_dir, cfg())
    new = [f"new-{i}" for i in range(40)]
    assert all(await st.put_many(new, [payload(k, OBJ) for k in new]))  # no slot handed out twice
    await st.close()
    hits, wrong, n = await served(store_dir, live + new)
    assert (hits, wrong, n) == (len(live) + len(new), [], len(live) + len(new))


def _area_record(path, seg, idx):
    """(file offset, record) of slot ``idx``'s record in segment ``seg``."""
    sb = layout.read_manifest(path)["layout"]["segment_bytes"]
    off = block_offset(sb, idx // PER_BLOCK) + (idx % PER_BLOCK) * RECORD_DTYPE.itemsize
    with open(os.path.join(path, segment_name(seg)), "rb") as f:
        f.seek(off)
        rec = np.frombuffer(f.read(RECORD_DTYPE.itemsize), RECORD_DTYPE).copy()
    return off, rec


def _write_record(path, seg, off, rec):
    with open(os.path.join(path, segment_name(seg)), "r+b") as f:
        f.seek(off)
        f.write(rec.tobytes())


async def test_a_record_whose_slot_holds_a_later_object_is_never_served(store_dir):
    """A's record comes back (a lost tombstone) over the slot B now holds: A is never served."""
    st = await PageStore.open(store_dir, cfg())
    assert all(await st.put_many(["A"], [payload("A", OBJ)]))
    (ext,) = st.locate(["A"])
    await st.close()
    seg, idx = ext.segment, ext.offset // 8192
    off, rec_a = _area_record(store_dir, seg, idx)
    assert rec_a["magic"][0] == MAGIC and rec_a["flags"][0] & R_CONFIRMED
    st = await PageStore.open(store_dir, cfg())
    assert all(await st.delete_many(["A"]))
    assert all(await st.put_many(["B"], [payload("B", OBJ)]))
    assert st.locate(["B"])[0][:2] == (seg, ext.offset)  # B reuses A's slot
    await st.close()
    for confirmed in (False, True):
        stale = rec_a.copy()
        if not confirmed:
            stale["flags"] &= ~np.uint16(R_CONFIRMED)
        seal(stale)
        _write_record(store_dir, seg, off, stale)  # as if B's record and A's tombstone never landed
        os.unlink(os.path.join(store_dir, INDEX_FILE))
        st = await PageStore.open(store_dir, cfg())
        # unconfirmed: the rebuild checks A's data CRC and leaves it out; confirmed: it is trusted,
        # and the get's CRC check refuses it (and drops the entry)
        assert ("A" in st.keys()) is confirmed
        out = np.zeros(OBJ, np.uint8)
        assert await st.get_many(["A"], [out]) == [False], confirmed
        assert "A" not in st.keys()
        await st.close()


async def test_newest_generation_wins_for_one_key_in_two_slots(store_dir):
    """K's older record in another slot (a lost tombstone) never shadows its newer one."""
    st = await PageStore.open(store_dir, cfg())
    assert all(await st.put_many(["K", "pad"], [payload("K", OBJ), payload("pad", OBJ)]))
    (old,) = st.locate(["K"])
    await st.close()
    off_old, rec_old = _area_record(store_dir, old.segment, old.offset // 8192)
    st = await PageStore.open(store_dir, cfg())
    assert all(await st.delete_many(["K"]))
    assert all(await st.put_many(["filler"], [payload("filler", OBJ)]))  # takes K's old slot
    new_bytes = payload("K", OBJ)
    assert all(await st.put_many(["K"], [new_bytes]))
    (new,) = st.locate(["K"])
    assert new.offset != old.offset
    await st.close()
    # put K's old record back at an unused slot of the same segment, pointing at K's old slot
    idx_free = 200
    off_free, _ = _area_record(store_dir, old.segment, idx_free)
    stale = rec_old.copy()
    stale["offset"] = idx_free * 8192
    seal(stale)
    _write_record(store_dir, old.segment, off_free, stale)
    os.unlink(os.path.join(store_dir, INDEX_FILE))
    st = await PageStore.open(store_dir, cfg())
    assert st.locate(["K"])[0].offset == new.offset
    out = np.zeros(OBJ, np.uint8)
    assert await st.get_many(["K"], [out]) == [True] and np.array_equal(out, new_bytes)
    await st.close()


async def test_store_without_records_is_migrated_once(store_dir):
    """A store written before the records: the writer takes its index as the truth and writes
    the records once; the manifest then says so and a lost index is rebuilt."""
    live, _ = await fill(store_dir, "strict")
    m = layout.read_manifest(store_dir)
    del m["layout"]["record_bytes"]
    layout.write_manifest(os.path.join(store_dir, layout.MANIFEST_FILE), m)
    sb = m["layout"]["segment_bytes"]
    area = area_blocks(sb, 8192) * 4096
    for name in layout.segment_files(store_dir).values():  # no records on disk
        with open(os.path.join(store_dir, name), "r+b") as f:
            f.seek(sb - area)
            f.write(bytes(area))
    hits, wrong, n = await served(store_dir, live)
    assert (hits, wrong, n) == (len(live), [], len(live))
    assert layout.has_records(layout.read_manifest(store_dir))
    os.unlink(os.path.join(store_dir, INDEX_FILE))
    hits, wrong, n = await served(store_dir, live)
    assert (hits, wrong, n) == (len(live), [], len(live))


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "umbp_nvme.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip


async def test_verify_rebuild_index_exit_codes(store_dir):
    live, _ = await fill(store_dir, "strict")
    os.unlink(os.path.join(store_dir, INDEX_FILE))
    p = _cli("verify", "--store", store_dir, "--rebuild-index", "--json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert s["records"] == len(live) and s["bad_records"] == 0
    hits, wrong, n = await served(store_dir, live)
    assert (hits, wrong, n) == (len(live), [], len(live))
    # a damaged record: left out, exit 1
    st = await PageStore.open(store_dir, cfg())
    (ext,) = st.locate([live[0]])
    await st.close()
    off, rec = _area_record(store_dir, ext.segment, ext.offset // 8192)
    rec["depth"] ^= 1  # its own CRC no longer matches
    _write_record(store_dir, ext.segment, off, rec)
    p = _cli("verify", "--store", store_dir, "--rebuild-index", "--json")
    assert p.returncode == 1, p.stderr
    assert json.loads(p.stdout)["records"] == len(live) - 1
    # a writer holds the store: refused, exit 2, the index untouched
    st = await PageStore.open(store_dir, cfg())
    try:
        p = _cli("verify", "--store", store_dir, "--rebuild-index")
        assert p.returncode == 2 and "to itself" in p.stderr, (p.returncode, p.stderr)
    finally:
        await st.close()
    # not a store: exit 2
    p = _cli("verify", "--store", os.path.dirname(store_dir), "--rebuild-index")
    assert p.returncode == 2


async def test_a_strict_batch_is_confirmed_on_disk_by_the_next_write_never_over_a_reused_slot(store_dir):
    """Confirmation is placed after the put returns, with the next use of the areas: batch A's
    records reach disk unconfirmed, B's block write carries A's flag; a pending confirmation
    never lands on a slot cleared and reused meanwhile."""
    st = await PageStore.open(store_dir, cfg())
    a = [f"a{i}" for i in range(3)]
    assert all(await st.put_many(a, [payload(k, OBJ) for k in a]))
    exts = st.locate(a)
    assert len({e.segment for e in exts}) == 1
    seg, idx = exts[0].segment, [e.offset // 8192 for e in exts]
    flags = [int(_area_record(store_dir, seg, i)[1]["flags"][0]) for i in idx]
    assert all(f & 1 and not f & R_CONFIRMED for f in flags)  # valid, not yet confirmed on disk
    assert all(await st.delete_many(a[:1]))  # its tombstone is written while A's flags still wait
    b = ["b0"]
    assert all(await st.put_many(b, [payload(k, OBJ) for k in b]))
    assert st.locate(b)[0][:2] == (seg, exts[0].offset)  # B reuses the deleted one's slot
    recs = [_area_record(store_dir, seg, i)[1] for i in idx]
    # that slot holds B's record (A's pending flag did not land on it), itself unconfirmed so far
    assert bytes(recs[0]["key"][0][:2]) == b"b0" and not recs[0]["flags"][0] & R_CONFIRMED
    assert all(r["flags"][0] & R_CONFIRMED and r["magic"][0] == MAGIC for r in recs[1:])
    await st.close()
    hits, wrong, n = await served(store_dir, a + b)
    assert (hits, wrong, n) == (3, [], 3)
