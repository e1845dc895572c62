"""Opening a store must never destroy what it holds by accident.

Capacity recorded in the manifest (no silent drop on a smaller writer; deliberate shrink),
transient segment-open failures (never drop index records), a damaged index (moved aside, start
empty), LRU refresh on re-put, the public manifest/lock helpers, and slots of timed-out I/O.
"""

from __future__ import annotations

import asyncio
import errno
import glob
import json
import logging
import os

import lmdb
import numpy as np
import pytest

from conftest import KiB, MiB, payload, small_config
from umbp_nvme.store import segments as segments_mod
from support.faults import FaultPlan, FaultRule
from umbp_nvme.errors import CapacityShrinkError, IndexDamagedError, NotAStoreError, StoreError
from umbp_nvme.store.index import INDEX_FILE
from umbp_nvme.store.layout import record_slots
from umbp_nvme.store.segments import segment_name
from umbp_nvme.store import LOCK_FILE, MANIFEST_FILE, PageStore, lock_holder, read_manifest
from umbp_nvme.store.sync import SyncPageStore

OBJ = 64 * KiB
PER = record_slots(MiB, OBJ)  # 64 KiB slots per 1 MiB segment: 15, the tail holds their records (issue 14)


def cfg(cap_mib: int, **kw):
    return small_config(ssd_capacity_bytes=cap_mib * MiB, ssd_segment_size_bytes=1 * MiB, **kw)


async def put(st, keys, n=OBJ):
    return await st.put_many(keys, [payload(k, n) for k in keys])


async def check(st, keys, n=OBJ) -> list[bool]:
    outs = [np.zeros(n, np.uint8) for _ in keys]
    ok = await st.get_many(keys, outs)
    assert all(bytes(o) == bytes(payload(k, n)) for k, g, o in zip(keys, ok, outs) if g)
    return ok


def seg_files(path):
    return sorted(n for n in os.listdir(path) if n.startswith("seg-"))


async def filled(path, cap_mib=8, n=100, prefix="k"):
    """A store of cap_mib with n objects of 64 KiB (PER per 1 MiB segment); returns the keys."""
    st = await PageStore.open(path, cfg(cap_mib))
    keys = [f"{prefix}{i}" for i in range(n)]
    for lo in range(0, n, 16):
        assert all(await put(st, keys[lo : lo + 16]))
    await st.close()
    return keys


# --------------------------------------------------------------------------- 1. capacity


async def test_manifest_records_capacity_and_segment_size(store_dir):
    await filled(store_dir, 8, 4)
    m = read_manifest(store_dir)
    assert m["ssd_capacity_bytes"] == 8 * MiB and m["layout"]["segment_bytes"] == 1 * MiB


async def test_smaller_writer_is_refused_and_keeps_every_object(store_dir):
    keys = await filled(store_dir, 8, 100)  # 7 segments in use
    files = seg_files(store_dir)
    with pytest.raises(CapacityShrinkError) as e:
        await PageStore.open(store_dir, cfg(2))
    msg = str(e.value)
    assert str(8 * MiB) in msg and str(2 * MiB) in msg and "shrink=True" in msg and "capacity_from_manifest" in msg
    assert seg_files(store_dir) == files
    st = await PageStore.open(store_dir, cfg(8))
    assert all(await check(st, keys))
    await st.close()


async def test_capacity_from_manifest_adopts_the_recorded_capacity(store_dir):
    keys = await filled(store_dir, 8, 100)
    st = await PageStore.open(store_dir, cfg(2), capacity_from_manifest=True)  # e.g. the CLI's 32 GiB default
    assert st.stats()["capacity_bytes"] == 8 * MiB and st.stats()["objects"] == 100
    assert all(await check(st, keys))
    await st.close()
    assert read_manifest(store_dir)["ssd_capacity_bytes"] == 8 * MiB


async def test_larger_writer_grows_and_records_it(store_dir):
    await filled(store_dir, 4, 10)
    st = await PageStore.open(store_dir, cfg(16))
    assert st.stats()["usable_bytes"] == 16 * MiB
    await st.close()
    assert read_manifest(store_dir)["ssd_capacity_bytes"] == 16 * MiB
    with pytest.raises(CapacityShrinkError):
        await PageStore.open(store_dir, cfg(4))


async def test_deliberate_shrink_evicts_durably_and_records_it(store_dir, caplog):
    keys = await filled(store_dir, 8, 100)  # segments 0..6
    caplog.set_level(logging.WARNING, logger="umbp_nvme.store")
    st = await PageStore.open(store_dir, cfg(3), shrink=True)
    s = st.stats()
    assert s["usable_bytes"] == 3 * MiB and s["objects"] == 3 * PER  # the objects of segments 0..2 stay
    ok = await check(st, keys)
    assert ok == [i < 3 * PER for i in range(100)]
    await st.close()
    assert seg_files(store_dir) == [segment_name(i) for i in range(3)]
    assert read_manifest(store_dir)["ssd_capacity_bytes"] == 3 * MiB
    assert any("shrinking" in r.getMessage() and f"evicting {100 - 3 * PER} objects" in r.getMessage()
               for r in caplog.records)
    # evictions are durable: a reopen with the old capacity finds nothing of them
    st = await PageStore.open(store_dir, cfg(8))
    assert st.stats()["objects"] == 3 * PER and not any((await st.exists_many(keys))[3 * PER :])
    await st.close()


def test_sglang_facade_treats_a_lower_configured_capacity_as_a_shrink(store_dir):
    asyncio.run(filled(store_dir, 8, 100))
    st = SyncPageStore(store_dir, cfg(4))
    try:
        assert st.stats()["usable_bytes"] == 4 * MiB and st.stats()["objects"] == 4 * PER
    finally:
        st.close()
    with pytest.raises(CapacityShrinkError):
        SyncPageStore(store_dir, cfg(2), shrink=False)


async def test_store_without_recorded_capacity_is_protected_by_its_files(store_dir):
    keys = await filled(store_dir, 8, 100)
    m = read_manifest(store_dir)
    del m["ssd_capacity_bytes"]  # made before the manifest recorded it
    del m["crc32c"]  # (or its checksum)
    with open(os.path.join(store_dir, MANIFEST_FILE), "w") as f:
        json.dump(m, f)
    with pytest.raises(CapacityShrinkError):
        await PageStore.open(store_dir, cfg(2))
    on_disk = len(seg_files(store_dir)) * MiB  # 7 in use, and maybe one created ahead of need
    assert on_disk >= 7 * MiB
    st = await PageStore.open(store_dir, cfg(2), capacity_from_manifest=True)
    assert st.stats()["usable_bytes"] == on_disk and all(await check(st, keys))
    await st.close()
    assert read_manifest(store_dir)["ssd_capacity_bytes"] == on_disk


# --------------------------------------------------------------------------- 2. transient segment errors


async def test_transient_segment_open_failure_refuses_and_keeps_the_index(store_dir, monkeypatch):
    keys = await filled(store_dir, 8, 40)  # segments 0..2
    real = segments_mod.open_data_file

    for err in (errno.EMFILE, errno.EACCES, errno.EIO):

        def failing(path, *a, _err=err, **kw):
            if path.endswith(segment_name(1)):
                raise OSError(_err, f"cannot open data file {path}: {os.strerror(_err)}")
            return real(path, *a, **kw)

        monkeypatch.setattr(segments_mod, "open_data_file", failing)
        with pytest.raises(StoreError, match=segment_name(1)):
            await PageStore.open(store_dir, cfg(8))
    monkeypatch.setattr(segments_mod, "open_data_file", real)
    st = await PageStore.open(store_dir, cfg(8))
    assert st.stats()["objects"] == 40 and all(await check(st, keys))
    await st.close()


@pytest.mark.parametrize("chunk", [1 << 20, 4])
async def test_gone_or_short_segments_drop_only_what_they_lost(store_dir, chunk, monkeypatch):
    keys = await filled(store_dir, 8, 3 * PER)  # segments 0, 1, 2 full (PER objects each)
    os.unlink(os.path.join(store_dir, segment_name(0)))
    os.truncate(os.path.join(store_dir, segment_name(1)), 5 * OBJ)  # objects PER..PER+4 intact
    monkeypatch.setattr(segments_mod, "REBUILD_CHUNK", chunk)  # 4: the open checks records a few at a time (key order)
    st = await PageStore.open(store_dir, cfg(8))
    ok = await check(st, keys)
    assert ok == [PER <= i < PER + 5 or i >= 2 * PER for i in range(3 * PER)]
    assert st.stats()["objects"] == PER + 5
    assert all(await put(st, [f"new{i}" for i in range(64)]))  # the space is reused
    await st.close()


async def test_long_keys_and_dropped_records_survive_opens_from_hashed_keys(store_dir, caplog):
    """A writer's open maps its keys from their hashes (walked_keys.py) and reads key bytes from the
    walked map only where it needs them: keys longer than a record holds (kept in memory), the
    records it drops (deleted from the index) and, after an unclean close, every key (each record
    area is rewritten). Each object reads back its own bytes after each of those opens."""
    from umbp_nvme.store.index import Index
    from umbp_nvme.store.rebuild import boot_id

    keys = [("L" * 250 + f"/{i}") if i % 3 == 0 else f"s{i}" for i in range(3 * PER)]
    st = await PageStore.open(store_dir, cfg(8))
    for lo in range(0, len(keys), 16):
        assert all(await put(st, keys[lo : lo + 16]))
    await st.close()
    os.unlink(os.path.join(store_dir, segment_name(0)))  # objects 0..PER-1
    want = [i >= PER for i in range(3 * PER)]
    caplog.set_level(logging.WARNING, logger="umbp_nvme.store")
    st = await PageStore.open(store_dir, cfg(8))
    assert await check(st, keys) == want and st.stats()["objects"] == 2 * PER
    await st.close()
    assert "dropping %d index records" % PER in caplog.text
    caplog.clear()
    st = await PageStore.open(store_dir, cfg(8))  # the drops reached the index: nothing is dropped again
    assert await check(st, keys) == want and st.stats()["objects"] == 2 * PER
    await st.close()
    assert "dropping" not in caplog.text
    ix = Index(os.path.join(store_dir, INDEX_FILE), readonly=False, map_size=1 << 30, durable=False)
    ix.set_writer_state(b"open:" + boot_id())  # as a writer killed on this boot leaves it
    ix.close()
    st = await PageStore.open(store_dir, cfg(8))
    assert await check(st, keys) == want and st.stats()["objects"] == 2 * PER
    await st.close()
    assert "after a rebuild or unclean close" in caplog.text  # every area was written, from every key


# --------------------------------------------------------------------------- 3. damaged index


def _damage_index(path):
    with open(os.path.join(path, INDEX_FILE), "r+b") as f:
        for off in (0, 4096):
            f.seek(off)
            f.write(b"\xa5" * 512)


async def test_damaged_index_is_moved_aside_and_the_writer_rebuilds_it(store_dir, caplog):
    keys = await filled(store_dir, 4, 60)  # nearly full (the watermark evicted the oldest)
    st = await PageStore.open(store_dir, cfg(4))
    stored = [k for k, e in zip(keys, await st.exists_many(keys)) if e]
    await st.close()
    _damage_index(store_dir)
    with pytest.raises(IndexDamagedError, match=os.path.join(store_dir, INDEX_FILE)):
        await PageStore.open(store_dir, cfg(4), readonly=True)
    caplog.set_level(logging.WARNING, logger="umbp_nvme.store")
    st = await PageStore.open(store_dir, cfg(4))
    # issue 14: rebuilt from the records in the segments, every stored object is back, byte-exact
    assert st.stats()["objects"] == len(stored) > 40 and all(await check(st, stored))
    aside = glob.glob(os.path.join(store_dir, INDEX_FILE + ".corrupt-*"))
    assert len(aside) == 1
    assert any("damaged" in r.getMessage() and aside[0] in r.getMessage() for r in caplog.records)
    # and it keeps caching: new objects evict old ones as usual
    new = [f"n{i}" for i in range(32)]
    for lo in range(0, len(new), 16):
        assert all(await put(st, new[lo : lo + 16]))
    assert all(await check(st, new))
    await st.close()
    ro = await PageStore.open(store_dir, cfg(4), readonly=True)
    assert all(await check(ro, new))
    await ro.close()


async def test_other_lmdb_errors_become_store_errors_naming_the_path(store_dir, monkeypatch):
    await filled(store_dir, 4, 2)
    import umbp_nvme.store.index as index_mod

    def boom(*a, **kw):
        raise lmdb.ReadersFullError("mdb_env_open: MDB_READERS_FULL")

    monkeypatch.setattr(index_mod.lmdb, "open", boom)
    for ro in (False, True):
        with pytest.raises(StoreError) as e:
            await PageStore.open(store_dir, cfg(4), readonly=ro)
        assert not isinstance(e.value, IndexDamagedError)
        assert os.path.join(store_dir, INDEX_FILE) in str(e.value) and "followers" in str(e.value)
    assert not glob.glob(os.path.join(store_dir, INDEX_FILE + ".corrupt-*"))


# --------------------------------------------------------------------------- 4. re-put refreshes LRU


async def test_reput_refreshes_lru_age_and_keeps_the_first_bytes(store_dir):
    st = await PageStore.open(store_dir, cfg(4))  # high watermark 3.6 MiB: 57 objects of 64 KiB
    hot = "hot"
    assert await put(st, [hot]) == [True]
    keys = [f"k{i}" for i in range(200)]
    for lo in range(0, 200, 8):
        assert all(await put(st, keys[lo : lo + 8]))
        # SGLang re-sets its hot prefix (other bytes here: the first ones must stay)
        assert await st.put_many([hot], [np.full(OBJ, 7, np.uint8)]) == [True]
    assert st.stats()["evictions"] > 100
    assert await check(st, [hot]) == [True]
    await st.close()


# --------------------------------------------------------------------------- 5. public helpers


async def test_public_manifest_and_lock_helpers(store_dir, tmp_path):
    with pytest.raises(NotAStoreError, match="does not exist"):
        read_manifest(str(tmp_path / "nope"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(NotAStoreError, match=MANIFEST_FILE):
        read_manifest(str(tmp_path / "empty"))
    st = await PageStore.open(store_dir, cfg(4))
    assert os.path.exists(os.path.join(store_dir, LOCK_FILE))
    assert lock_holder(store_dir) == os.getpid()
    await st.close()
    assert lock_holder(store_dir) is None
    assert lock_holder(str(tmp_path / "empty")) is None
    import umbp_nvme.cli.maintenance as maint

    assert maint.read_manifest is read_manifest and maint.lock_holder is lock_holder  # no copies


# --------------------------------------------------------------------------- 6. timed-out I/O


async def test_timed_out_read_unpins_its_slot(store_dir):
    plan = FaultPlan(seed=1)
    st = await PageStore.open(store_dir, cfg(4, io_timeout_s=0.3), engine_factory=plan.engine_factory())
    assert await put(st, ["a"]) == [True]
    plan.set_rules([FaultRule("delay", ops=("read",), delay_s=3.0, limit=1)])
    assert await check(st, ["a"]) == [False]
    assert st.stats()["timeouts"] == 1 and st.stats()["pinned_slots"] == 0
    assert await st.delete_many(["a"]) == [True]
    assert st.stats()["bytes_used"] == 0  # the slot is free at once, not after a restart
    await st.close()


async def test_timed_out_write_frees_its_slots_when_the_engine_completes(store_dir):
    # put_many returns only once the engine let go of the batch (here the cancelled delay ends
    # it at once): nothing of it is in flight afterwards, so its slots are free at return
    plan = FaultPlan(seed=1)
    st = await PageStore.open(store_dir, cfg(1, io_timeout_s=0.3), engine_factory=plan.engine_factory())  # one segment
    plan.set_rules([FaultRule("delay", ops=("write",), delay_s=1.0, limit=1)])
    keys = [f"w{i}" for i in range(4)]
    assert await put(st, keys) == [False] * 4
    s = st.stats()
    assert s["timeouts"] == 1 and s["stalled_ops"] == 4 and s["late_completions"] == 4
    assert s["late_writes"] == 0 and s["bytes_used"] == 0 and not any(await st.exists_many(keys))
    # the whole capacity is usable again
    st.state.timeout_s = 30.0  # real writes now: 0.3 s was for the delayed one (a loaded machine failed it once)
    more = [f"m{i}" for i in range(14)]
    assert all(await put(st, more)) and all(await check(st, more))
    await st.close()


async def test_late_write_slots_are_released_at_close(store_dir):
    plan = FaultPlan(seed=1)
    st = await PageStore.open(store_dir, cfg(1, io_timeout_s=0.3), engine_factory=plan.engine_factory())
    plan.set_rules([FaultRule("stuck", ops=("write",), limit=1)])
    assert await put(st, ["s"]) == [False]
    assert st.stats()["late_writes"] == 0 and st.stats()["bytes_used"] == 0  # the stuck batch was never submitted
    await st.close()
    assert st.stats()["late_writes"] == 0 and st.stats()["bytes_used"] == 0
