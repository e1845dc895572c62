"""MultiDriveStore (store/drives.py): placement, reopen, old stores, removed drives, a failing drive.

Every check reads real bytes back and counts them; the failing drive is an EIO engine on one
root's files (tests/support/faults.py), so its pages must become misses, never wrong bytes.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import subprocess

import numpy as np
import pytest

from conftest import payload, small_config
from support.drive_pages import drive_roots as _roots, page_keys as _keys
from support.drive_stores import degrade_by_eio, filled_writer
from support.faults import FaultPlan, FaultRule, on_files_under as _on
from umbp_nvme.config import load_config
from umbp_nvme.store import PageStore, owed_deletes, placement
from umbp_nvme.store.drives import MultiDriveStore
from support.waits import until

OBJ = 16 << 10


async def _put(st, keys) -> list[bool]:
    return await st.put_many(keys, [payload(k, OBJ) for k in keys])


async def _get(st, keys) -> tuple[list[bool], int]:
    """(results, wrong): wrong counts hits whose bytes are not the key's payload."""
    outs = [np.zeros(OBJ, np.uint8) for _ in keys]
    res = await st.get_many(keys, outs)
    wrong = sum(1 for ok, k, o in zip(res, keys, outs) if ok and not np.array_equal(o, payload(k, OBJ)))
    return res, wrong

async def _filled(roots, pages: int) -> tuple[list[str], list[int]]:
    """Write ``pages`` pages (K and V) through a writer over ``roots`` and close it: (keys, drive of each)."""
    st = await PageStore.open(roots, small_config())
    keys = _keys(pages)
    assert await _put(st, keys) == [True] * len(keys)
    where = st.drive_of(keys)
    await st.close()
    return keys, where



def test_roots_parse_from_a_json_list_a_comma_string_and_a_list():
    assert load_config({"ssd_storage_dir": '["/a", "/b"]'}).storage_roots == ["/a", "/b"]
    assert load_config({}, {"UMBP_SSD_DIR": "/a, /b,/c"}).storage_roots == ["/a", "/b", "/c"]
    assert load_config({"ssd_storage_dir": ["/a", "/b"]}).storage_roots == ["/a", "/b"]
    assert load_config({"ssd_storage_dir": "/a"}).storage_roots == ["/a"]
    for bad in ("/a,/a", "/a,,/b", "[]", "[1]", '["/a"'):
        with pytest.raises(ValueError, match="ssd_storage_dir"):
            load_config({"ssd_storage_dir": bad})


def test_without_a_page_of_a_keys_page_is_its_text_before_the_first_underscore():
    assert placement.key_page("p7_0_k") == placement.key_page("p7_0_v") == placement.key_page("p7__k") == "p7"
    assert placement.key_page("whole") == "whole" and placement.key_page("_x_k") == "_x_k"


async def test_the_callers_page_of_decides_which_objects_share_a_drive(tmp_path):
    st = await PageStore.open(_roots(tmp_path, 2), small_config(), page_of=lambda k: k[-1])  # pages "k" and "v"
    keys = _keys(20)
    assert await _put(st, keys) == [True] * len(keys)
    where = st.drive_of(keys)
    assert len(set(where[0::2])) == 1 and len(set(where[1::2])) == 1 and where[0] != where[1]
    await st.close()


async def test_placement_spreads_pages_keeps_components_together_and_survives_reopen(tmp_path):
    roots = _roots(tmp_path, 3)
    st = await PageStore.open(roots, small_config())
    assert isinstance(st, MultiDriveStore)
    keys = _keys(120)
    assert await _put(st, keys) == [True] * len(keys)
    where = st.drive_of(keys)
    assert where == st.preferred_drive(keys)  # all healthy: every page on its preferred drive
    assert all(where[i] == where[i + 1] for i in range(0, len(keys), 2))  # K and V of a page together
    counts = [where.count(d) for d in range(3)]
    assert sum(counts) == 240 and max(counts) - min(counts) <= 2, counts  # a batch spreads evenly (whole pages)
    s = st.stats()
    assert [r["objects"] for r in s["drives"]] == counts and s["objects"] == 240
    assert [r["state"] for r in s["drives"]] == ["healthy"] * 3
    await st.close()
    st = await PageStore.open(roots, small_config())
    assert st.drive_of(keys) == where
    res, wrong = await _get(st, keys)
    assert res == [True] * 240 and wrong == 0
    more = _keys(30, "q")
    assert await _put(st, more) == [True] * 60
    assert st.drive_of(more) == st.preferred_drive(more)
    await st.close()


async def test_a_single_directory_store_opened_with_two_roots_serves_every_old_page(tmp_path):
    old, new = _roots(tmp_path, 2)
    cfg = small_config()
    st = await PageStore.open(old, cfg)
    keys = _keys(60)
    assert await _put(st, keys) == [True] * 120
    await st.close()
    # the second drive brings its own share: the old drive keeps its capacity
    two = small_config(ssd_capacity_bytes=2 * cfg.ssd_capacity_bytes)
    st = await PageStore.open([old, new], two)
    res, wrong = await _get(st, keys)
    assert res == [True] * 120 and wrong == 0
    assert st.exists_many_nowait(keys) == [True] * 120 and st.exists_prefix_nowait(keys) == 120
    assert set(st.drive_of(keys)) == {0}
    assert await _put(st, keys) == [True] * 120  # a re-put dedups on the drive that has it
    assert st.stats()["drives"][1]["objects"] == 0
    fresh = _keys(60, "n")
    assert await _put(st, fresh) == [True] * 120
    assert 0 < st.stats()["drives"][1]["objects"] < 120  # new pages spread over both
    await st.close()


async def test_removing_a_root_drops_exactly_its_pages_and_says_how_many(tmp_path, caplog):
    roots = _roots(tmp_path, 3)
    keys, where = await _filled(roots, 90)
    lost = where.count(2)
    assert lost > 0
    caplog.set_level(logging.WARNING, "umbp_nvme.store")
    st = await PageStore.open(roots[:2], small_config())
    assert st.removed_drives == [{"root": os.path.abspath(roots[2]), "objects": lost}]
    assert st.stats()["removed_drives"] == st.removed_drives
    assert sum(f"its {lost} objects" in r.getMessage() for r in caplog.records) == 1
    res, wrong = await _get(st, keys)
    assert wrong == 0
    assert res == [d != 2 for d in where]  # exactly the removed drive's pages are gone
    await st.close()




async def test_an_eio_drive_is_degraded_at_once_its_pages_miss_and_it_rejoins(tmp_path, caplog):
    roots = _roots(tmp_path, 2)
    plan = FaultPlan()
    st = await PageStore.open(roots, small_config(), engine_factory=plan.engine_factory(),
                                    probe_interval_s=0.1)  # fmt: skip
    keys = _keys(60)
    assert await _put(st, keys) == [True] * 120
    where = st.drive_of(keys)
    bad = [k for k, d in zip(keys, where) if d == 1]
    good = [k for k, d in zip(keys, where) if d == 0]
    assert bad and good
    caplog.set_level(logging.WARNING, "umbp_nvme.store")
    plan.set_rules([FaultRule("eio", ops=("read",), predicate=_on(roots[1]))])
    res, wrong = await _get(st, keys)
    assert wrong == 0 and res == [d == 0 for d in where]
    row = st.stats()["drives"][1]
    assert row["state"] == "degraded" and "io_errors_read" in row["reason"] and row["errors"] > 0
    seen = plan.ops_seen
    res, wrong = await _get(st, bad)  # later batches skip the drive: no I/O reaches it
    assert res == [False] * len(bad) and wrong == 0 and plan.ops_seen == seen
    assert st.exists_many_nowait(bad) == [False] * len(bad)
    assert st.exists_many_nowait(good) == [True] * len(good)
    fresh = _keys(40, "f")
    assert await _put(st, fresh) == [True] * 80
    assert set(st.drive_of(fresh)) == {0}  # new writes go to the healthy drive
    await st.delete_many(bad[:2])  # owed by the degraded drive: applied before it serves again
    k_new = bad[2]  # a new version written while its old copy sits on the degraded drive
    assert await st.put_many([k_new], [payload(k_new + "v2", OBJ)]) == [True]
    degraded = [r for r in caplog.records if "degraded" in r.getMessage()]
    assert len(degraded) == 1 and roots[1] in degraded[0].getMessage()
    plan.clear()
    assert await until(lambda: st.stats()["drives"][1]["state"] == "healthy", 30)
    rest = bad[:2] + bad[3:]
    res, wrong = await _get(st, rest)
    assert wrong == 0 and res == [False, False] + [True] * (len(rest) - 2)  # surviving pages served again
    out = np.zeros(OBJ, np.uint8)  # the new version, never the copy the drive held before
    assert await st.get_many([k_new], [out]) == [True] and np.array_equal(out, payload(k_new + "v2", OBJ))
    res, wrong = await _get(st, fresh)
    assert res == [True] * 80 and wrong == 0
    await st.close()


async def test_a_write_error_sends_later_puts_to_the_other_drive(tmp_path):
    roots = _roots(tmp_path, 2)
    plan = FaultPlan()
    st = await PageStore.open(roots, small_config(), engine_factory=plan.engine_factory(),
                                    probe_interval_s=60)  # fmt: skip
    plan.set_rules([FaultRule("errno", ops=("write",), errno=errno.EIO, predicate=_on(roots[1]))])
    keys = _keys(40)
    first = await _put(st, keys)
    pref = st.preferred_drive(keys)
    assert first == [d == 0 for d in pref]  # the failed drive's share failed, cleanly
    assert st.stats()["drives"][1]["state"] == "degraded"
    again = await _put(st, keys)
    assert again == [True] * 80 and set(st.drive_of(keys)) == {0}
    res, wrong = await _get(st, keys)
    assert res == [True] * 80 and wrong == 0
    await st.close()


async def test_a_root_that_cannot_open_is_a_degraded_drive_and_the_rest_open(tmp_path):
    roots = _roots(tmp_path, 2)
    keys, where = await _filled(roots, 30)
    os.chmod(os.path.dirname(roots[1]), 0o000)  # root ignores modes; an unreadable index is what fails
    try:
        with open(os.path.join(roots[1], "index.lmdb"), "r+b") as f:
            f.write(b"\xff" * 64)  # damaged: the read-only opener refuses it
        st = await PageStore.open(roots, small_config(), readonly=True)
        row = st.stats()["drives"][1]
        assert row["state"] == "degraded" and "open failed" in row["reason"]
        res, wrong = await _get(st, keys)
        assert wrong == 0 and res == [d == 0 for d in where]
        await st.close()
    finally:
        os.chmod(os.path.dirname(roots[1]), 0o755)


def _plant(root: str, parked: str, what: str) -> None:
    """What is at a drive's root once its directory has moved to ``parked``."""
    if what == "file":
        with open(root, "wb") as f:
            f.write(b"not a directory")
    elif what == "store_dir":  # a MANIFEST.json at the root, but not the files this writer holds open
        os.mkdir(root, 0o700)  # (another drive mounted there, a copy)
        for name in ("MANIFEST.json", "LOCK"):
            shutil.copy(os.path.join(parked, name), os.path.join(root, name))


@pytest.mark.parametrize("what,reason", [("nothing", "is gone"), ("file", "is gone"), ("store_dir", "was replaced")])
async def test_a_drive_whose_directory_is_gone_or_replaced_is_degraded_and_rejoins_when_it_is_back(
    tmp_path, caplog, what, reason
):
    # nothing: as an unmount would. file: the old probe took ENOTDIR (stat of FILE/MANIFEST.json) for a
    # passing error. store_dir: the old probe saw a manifest. Both kept the drive healthy, taking new
    # pages into the files of a directory no longer at its root (lost at the next open).
    roots = _roots(tmp_path, 2)
    st = await PageStore.open(roots, small_config(), probe_interval_s=0.05)
    keys = _keys(30)
    assert await _put(st, keys) == [True] * 60
    where = st.drive_of(keys)
    caplog.set_level(logging.WARNING, "umbp_nvme.store")
    parked = roots[1] + ".away"
    os.rename(roots[1], parked)
    _plant(roots[1], parked, what)
    try:
        assert await until(lambda: st.stats()["drives"][1]["state"] == "degraded", 30)
        assert reason in st.stats()["drives"][1]["reason"]
        await asyncio.sleep(0.3)  # later probes keep finding it so: no re-admission through the old files
        assert st.stats()["drives"][1]["state"] == "degraded"
        res, wrong = await _get(st, keys)
        assert wrong == 0 and res == [d == 0 for d in where]
        fresh = _keys(10, "g")
        assert await _put(st, fresh) == [True] * 20 and set(st.drive_of(fresh)) == {0}
    finally:
        if os.path.isdir(roots[1]):
            shutil.rmtree(roots[1])
        elif os.path.lexists(roots[1]):
            os.unlink(roots[1])
        os.rename(parked, roots[1])
    assert await until(lambda: st.stats()["drives"][1]["state"] == "healthy", 30)
    res, wrong = await _get(st, keys)
    assert res == [True] * 60 and wrong == 0
    assert sum("degraded" in r.getMessage() for r in caplog.records) == 1
    await st.close()


async def test_a_full_drive_stops_taking_writes_but_keeps_serving_its_pages(tmp_path):
    from conftest import mount_tmpfs

    small, big = str(tmp_path / "small"), str(tmp_path / "big")
    why = mount_tmpfs(small, "3m")
    if why:
        pytest.skip(why)
    # the other drive is mounted too: a plain directory beside a mounted drive, holding no store,
    # is what an unmounted drive looks like, and the guard holds it out (store/mounts.py)
    why = mount_tmpfs(big, "64m")
    if why:
        subprocess.run(["umount", "-l", small], capture_output=True)
        pytest.skip(why)
    try:
        roots = [os.path.join(small, "store"), os.path.join(big, "store")]
        cfg = small_config(ssd_capacity_bytes=32 << 20, ssd_segment_size_bytes=1 << 20)
        st = await PageStore.open(roots, cfg, probe_interval_s=60)
        kept = []
        for b in range(12):
            ks = _keys(16, f"b{b}-")
            res = await _put(st, ks)
            kept += [k for k, ok in zip(ks, res) if ok]
        row = st.stats()["drives"][0]
        assert row["state"] == "degraded" and "full" in row["reason"]
        assert st.stats()["drives"][1]["state"] == "healthy"
        later = _keys(16, "late")
        assert await _put(st, later) == [True] * 32 and set(st.drive_of(later)) == {1}
        present = [k for k in kept if st.exists_many_nowait([k])[0]]
        on_full = [k for k, d in zip(present, st.drive_of(present)) if d == 0]
        assert on_full  # the full drive's pages are still found and read
        res, wrong = await _get(st, present)
        assert res == [True] * len(present) and wrong == 0
        # A new version of a page the full drive holds goes elsewhere; the old copy must not be served.
        k_new, k_del = on_full[0], on_full[-1]
        assert k_new != k_del
        assert await st.put_many([k_new], [payload(k_new + "v2", OBJ)]) == [True]
        out = np.zeros(OBJ, np.uint8)
        assert await st.get_many([k_new], [out]) == [True] and np.array_equal(out, payload(k_new + "v2", OBJ))
        assert st.drive_of([k_new]) == [1]
        assert await st.delete_many([k_del]) == [True]
        assert st.exists_many_nowait([k_del]) == [False] and (await _get(st, [k_del]))[0] == [False]
        await st.close()
    finally:
        for mnt in (small, big):
            subprocess.run(["umount", "-l", mnt], capture_output=True)


async def test_a_hung_drive_holds_only_the_batch_that_touched_it(tmp_path):
    """A read that ignores cancellation on one drive (a hung device, without root): the batch
    that touched it returns only after the read ends; later batches skip the drive at once."""
    from support.faults import EngineHooks

    roots = _roots(tmp_path, 2)
    hooks = EngineHooks()
    st = await PageStore.open(roots, small_config(io_timeout_s=0.3), engine_factory=hooks.engine_factory(),
                                    probe_interval_s=0.05)  # fmt: skip
    keys = _keys(40)
    assert await _put(st, keys) == [True] * 80
    where = st.drive_of(keys)
    on1 = _on(roots[1])
    release, held = asyncio.Event(), []

    async def read(real, fds, *rest):
        fd = int(np.asarray(fds.fds).reshape(-1)[0])  # the store hands engines.files.Files
        if on1("read", fd, 0, 0):
            held.append(fd)
            while not release.is_set():  # the device does not let go before it is released
                try:
                    await asyncio.shield(release.wait())
                except asyncio.CancelledError:
                    continue
        return await real(fds, *rest)

    hooks.read = read
    first = asyncio.ensure_future(_get(st, keys))
    assert await until(lambda: st.stats()["drives"][1]["state"] == "degraded", 30)
    assert "no completion within io_timeout_s" in st.stats()["drives"][1]["reason"]
    await asyncio.sleep(0.2)
    assert not first.done()  # still owned by the "kernel": the batch has not returned
    n_held = len(held)
    # later batches do not wait for it (held until release below, it would hold them past this guard)
    res, wrong = await asyncio.wait_for(_get(st, keys), 30)
    assert wrong == 0 and res == [d == 0 for d in where] and len(held) == n_held
    release.set()
    res, wrong = await asyncio.wait_for(first, 30)
    assert wrong == 0 and all(res[i] for i, d in enumerate(where) if d == 0)
    hooks.read = None
    assert await until(lambda: st.stats()["drives"][1]["state"] == "healthy", 30)
    res, wrong = await _get(st, keys)
    assert res == [True] * 80 and wrong == 0
    await st.close()


def test_rendezvous_order_is_stable_and_spreads_first_choices():
    from umbp_nvme.store.placement import drive_id, drive_order

    salts = [drive_id(f"/mnt/nvme{i}/hicache") for i in range(4)]
    assert salts == [drive_id(f"/mnt/nvme{i}/hicache") for i in range(4)]  # no per-process seed
    firsts = [drive_order(f"{i:064x}", salts)[0] for i in range(4000)]
    assert all(800 <= firsts.count(d) <= 1200 for d in range(4)), [firsts.count(d) for d in range(4)]
    assert sorted(drive_order("abc", salts)) == [0, 1, 2, 3]


async def test_the_rest_of_a_page_joins_the_drive_that_holds_part_of_it(tmp_path):
    roots = _roots(tmp_path, 3)
    st = await PageStore.open(roots, small_config())
    ks = [f"pg{i:03d}_0_k" for i in range(30)]
    assert await _put(st, ks) == [True] * 30  # only K of each page first
    vs = [k[:-1] + "v" for k in ks]
    assert await _put(st, vs + ks) == [True] * 60  # then V (and K again) in one batch
    assert st.drive_of(vs) == st.drive_of(ks)
    assert sum(r["objects"] for r in st.stats()["drives"]) == 60  # the re-put of K stored nothing twice
    await st.close()


async def test_a_drive_missing_at_open_joins_once_its_store_is_back(tmp_path):
    roots = _roots(tmp_path, 2)
    keys, where = await _filled(roots, 30)
    parked = str(tmp_path / "parked")
    os.rename(os.path.dirname(roots[1]), parked)  # drive 1 not mounted: its directory is not there
    st = await PageStore.open(roots, small_config(), readonly=True, probe_interval_s=0.05)
    row = st.stats()["drives"][1]
    assert row["state"] == "degraded" and "open failed" in row["reason"]
    res, wrong = await _get(st, keys)
    assert wrong == 0 and res == [d == 0 for d in where]
    await asyncio.sleep(0.3)
    assert not os.path.exists(roots[1])  # nothing is created where the drive should be
    os.rename(parked, os.path.dirname(roots[1]))  # mounted again
    assert await until(lambda: st.stats()["drives"][1]["state"] == "healthy", 30)
    res, wrong = await _get(st, keys)
    assert res == [True] * 60 and wrong == 0
    await st.close()


async def _degraded_by_eio(tmp_path, n: int = 2):
    """A writer over ``n`` drives whose drive 1 answers EIO to reads (degraded by one get), with
    pages on every drive; the probe never re-admits it in this process."""
    roots, plan, st, keys = await filled_writer(tmp_path, 60, n=n)
    where = st.drive_of(keys)
    await degrade_by_eio(plan, st, roots[1], keys)
    res, wrong = await _get(st, keys)
    assert wrong == 0 and st.stats()["drives"][1]["state"] == "degraded"
    return roots, st, keys, where


async def test_deletes_and_re_puts_owed_by_a_degraded_drive_survive_a_restart(tmp_path):
    roots, st, keys, where = await _degraded_by_eio(tmp_path)
    bad = [k for k, d in zip(keys, where) if d == 1]
    deleted, reput, kept = bad[:6], bad[6:12], bad[12:]
    assert len(kept) > 4
    await st.delete_many(deleted)
    assert await st.put_many(reput, [payload(k + "v2", OBJ) for k in reput]) == [True] * 6
    assert set(st.drive_of(reput)) == {0}
    await st.close()  # the drive still owes them: only the log on drive 0 remembers

    st = await PageStore.open(roots, small_config(), probe_interval_s=60)  # drive 1 healthy again
    assert [r["state"] for r in st.stats()["drives"]] == ["healthy", "healthy"]
    res, wrong = await _get(st, deleted + kept)
    assert wrong == 0 and res == [False] * 6 + [True] * len(kept)
    assert st.drive_of(reput) == [0] * 6  # the old copies left drive 1 before it served
    outs = [np.zeros(OBJ, np.uint8) for _ in reput]
    assert await st.get_many(reput, outs) == [True] * 6
    assert all(np.array_equal(o, payload(k + "v2", OBJ)) for k, o in zip(reput, outs))
    good = [k for k, d in zip(keys, where) if d == 0]
    res, wrong = await _get(st, good)
    assert res == [True] * len(good) and wrong == 0
    await st.close()
    left = owed_deletes.load(roots)  # compacted at the open: nothing owed any more
    assert not left.owes(roots[0]) and not left.owes(roots[1])


async def test_a_reader_hides_what_a_drive_owes_until_the_writer_applies_it(tmp_path):
    roots, st, keys, where = await _degraded_by_eio(tmp_path)
    bad = [k for k, d in zip(keys, where) if d == 1]
    await st.delete_many(bad[:4])
    assert await st.put_many(bad[4:8], [payload(k + "v2", OBJ) for k in bad[4:8]]) == [True] * 4
    await st.close()
    rd = await PageStore.open(roots, small_config(), readonly=True, probe_interval_s=60)
    res, wrong = await _get(rd, bad[:4] + bad[8:])
    assert wrong == 0 and res == [False] * 4 + [True] * (len(bad) - 8)
    outs = [np.zeros(OBJ, np.uint8) for _ in range(4)]
    assert await rd.get_many(bad[4:8], outs) == [True] * 4
    assert all(np.array_equal(o, payload(k + "v2", OBJ)) for k, o in zip(bad[4:8], outs))
    await rd.close()


async def test_deletes_and_re_puts_made_while_a_drive_was_not_open_survive_a_restart(tmp_path):
    roots = _roots(tmp_path, 2)
    st = await PageStore.open(roots, small_config())
    keys = _keys(40)
    assert await _put(st, keys) == [True] * 80
    bad = [k for k, d in zip(keys, st.drive_of(keys)) if d == 1]
    await st.close()
    parked = str(tmp_path / "parked")
    os.rename(os.path.dirname(roots[1]), parked)  # drive 1 cannot open for a whole run
    open(os.path.dirname(roots[1]), "w").close()  # (a file where its directory should be)
    st = await PageStore.open(roots, small_config(), probe_interval_s=60)
    assert st.stats()["drives"][1]["state"] == "degraded"
    await st.delete_many(bad[:3])
    assert await st.put_many(bad[3:6], [payload(k + "v2", OBJ) for k in bad[3:6]]) == [True] * 3
    await st.close()
    os.unlink(os.path.dirname(roots[1]))
    os.rename(parked, os.path.dirname(roots[1]))
    st = await PageStore.open(roots, small_config(), probe_interval_s=60)
    res, wrong = await _get(st, bad[:3] + bad[6:])
    # drive 1 missed a session that wrote, so it came back cleared (drive_sessions.py): its other pages miss too
    assert wrong == 0 and res == [False] * (len(bad) - 3)
    outs = [np.zeros(OBJ, np.uint8) for _ in range(3)]
    assert await st.get_many(bad[3:6], outs) == [True] * 3
    assert all(np.array_equal(o, payload(k + "v2", OBJ)) for k, o in zip(bad[3:6], outs))
    assert [r["objects"] for r in st.stats()["drives"]] == [80 - len(bad) + 3, 0]  # no stale second copy kept
    await st.close()


async def test_a_clear_while_a_drive_is_degraded_is_applied_by_it_after_a_restart(tmp_path):
    roots, st, keys, where = await _degraded_by_eio(tmp_path, 3)
    await st.clear()
    fresh = _keys(10, "f")
    assert await _put(st, fresh) == [True] * 20
    assert 1 not in st.drive_of(fresh)
    await st.close()
    rd = await PageStore.open(roots, small_config(), readonly=True, probe_interval_s=60)
    res, wrong = await _get(rd, keys)  # a reader before the writer reopened: the cleared drive serves nothing
    assert res == [False] * len(keys) and wrong == 0
    await rd.close()
    st = await PageStore.open(roots, small_config(), probe_interval_s=60)
    res, wrong = await _get(st, keys + fresh)
    assert wrong == 0 and res == [False] * len(keys) + [True] * 20
    assert st.stats()["drives"][1]["objects"] == 0 and st.stats()["drives"][1]["state"] == "healthy"
    await st.close()


def test_the_owed_log_ignores_a_torn_line_and_a_settled_line_cancels_older_lines_in_any_drives_log(tmp_path):
    a, b, c = (str(tmp_path / n) for n in "abc")
    for r in (a, b, c):
        os.makedirs(r)
    owed_deletes.append(c, [{"drive": b, "keys": ["k1"]}])  # c's log: then c was out a while
    owed_deletes.append(a, [{"drive": b, "keys": ["k2"]}, {"drive": c, "out": True}])
    with open(os.path.join(a, owed_deletes.OWED_FILE), "a") as f:
        f.write('{"drive": "' + b + '", "keys": ["k3"')  # a crash mid-append
    st = owed_deletes.load([a, c])
    assert st.keys == {b: {"k1", "k2"}} and st.out == {c}
    owed_deletes.append(a, [{"drive": b, "settled": True}])
    st = owed_deletes.load([a, c])
    assert st.keys == {} and st.out == {c}
    owed_deletes.rewrite(a, st, [a, b, c])  # compaction keeps a settled line for b: c's old line stays cancelled
    assert owed_deletes.load([a, c]).keys == {} and owed_deletes.load([a, c]).out == {c}


_KILLED_CHILD = r"""
import asyncio, json, os, signal, sys
sys.path[:0] = [TESTS, os.path.join(TESTS, "store")]
import numpy as np
from conftest import payload, small_config
from support.faults import FaultPlan, FaultRule
from test_drives import OBJ, _keys, _on
from umbp_nvme.store import PageStore

async def main(roots):
    plan = FaultPlan()
    cfg = small_config(ssd_durability_mode="strict")
    st = await PageStore.open(roots, cfg, engine_factory=plan.engine_factory(), probe_interval_s=60)
    keys = _keys(40)
    assert await st.put_many(keys, [payload(k, OBJ) for k in keys]) == [True] * 80
    bad = [k for k, d in zip(keys, st.drive_of(keys)) if d == 1]
    plan.set_rules([FaultRule("eio", ops=("read",), predicate=_on(roots[1]))])
    await st.get_many(keys, [np.zeros(OBJ, np.uint8) for _ in keys])
    assert st.stats()["drives"][1]["state"] == "degraded"
    await st.delete_many(bad[:4])
    assert await st.put_many(bad[4:8], [payload(k + "v2", OBJ) for k in bad[4:8]]) == [True] * 4
    print(json.dumps(bad), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close: only what is on disk survives

asyncio.run(main(json.loads(sys.argv[1])))
"""


def test_owed_deletes_survive_a_sigkill_of_the_writer(tmp_path):
    import json
    import sys

    roots = _roots(tmp_path, 2)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = _KILLED_CHILD.replace("TESTS", repr(tests))
    p = subprocess.run([sys.executable, "-c", code, json.dumps(roots)], capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, p.stderr[-2000:]
    bad = json.loads(p.stdout)

    async def check():
        st = await PageStore.open(roots, small_config(ssd_durability_mode="strict"), probe_interval_s=60)
        res, wrong = await _get(st, bad[:4] + bad[8:])
        assert wrong == 0 and res == [False] * 4 + [True] * (len(bad) - 8)
        outs = [np.zeros(OBJ, np.uint8) for _ in range(4)]
        assert await st.get_many(bad[4:8], outs) == [True] * 4
        assert all(np.array_equal(o, payload(k + "v2", OBJ)) for k, o in zip(bad[4:8], outs))
        assert st.drive_of(bad[4:8]) == [0] * 4
        await st.close()

    asyncio.run(check())
