"""Drive membership with memory (issue 25, scenario 3): a drive that missed a writer session never
serves a page that session replaced, deleted or cleared, and a key on two drives is served from
its newest copy.

Every version of a key has its own bytes (``_put(..., "v2")``), and reads report which version
came back (``_versions``), so a stale page shows as the old version, not as a plain hit.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import numpy as np

from conftest import ROOT, payload, small_config
from support.drive_pages import drive_roots as _roots, page_keys as _keys, park_drive as _park, unpark_drive as _unpark
from support.faults import FaultPlan, FaultRule, on_files_under
from support.waits import until
from umbp_nvme.store import PageStore

OBJ = 16 << 10
VERSIONS = ("v1", "v2")
SHARE = 5 << 20  # each drive's capacity, whatever the number of roots (a larger share would not shrink back)


def _cfg(roots):
    return small_config(ssd_capacity_bytes=SHARE * len(roots))


def _bytes(key: str, version: str) -> np.ndarray:
    return payload(f"{key}/{version}", OBJ)


async def _put(st, keys, version: str) -> list[bool]:
    return await st.put_many(keys, [_bytes(k, version) for k in keys])


async def _versions(st, keys) -> list[str | None]:
    """The version each key reads back as: "v1" / "v2", None for a miss, "wrong" for other bytes."""
    outs = [np.zeros(OBJ, np.uint8) for _ in keys]
    res = await st.get_many(keys, outs)
    found = []
    for ok, k, o in zip(res, keys, outs):
        found.append(None if not ok else next((v for v in VERSIONS if np.array_equal(o, _bytes(k, v))), "wrong"))
    return found


async def _run_one(roots, keys_v1) -> dict[str, int]:
    """Run 1: a writer over ``roots`` puts ``keys_v1`` as v1; the drive of each key."""
    st = await PageStore.open(roots, _cfg(roots))
    assert await _put(st, keys_v1, "v1") == [True] * len(keys_v1)
    where = dict(zip(keys_v1, st.drive_of(keys_v1)))
    await st.close()
    return where


def _drive_set(root: str) -> dict:
    with open(os.path.join(root, "DRIVES.json")) as f:
        return json.load(f)


# ------------------------------------------------------------------ scenario 3: a drive removed from the roots


async def test_a_key_re_put_while_its_drive_was_removed_is_served_new_once_the_drive_is_back(tmp_path):
    roots = _roots(tmp_path, 3)
    keys = _keys(30)
    where = await _run_one(roots, keys)
    on_a = [k for k in keys if where[k] == 0][:6]
    st = await PageStore.open(roots[1:], _cfg(roots[1:]))  # run 2: drive A removed from the roots
    assert await _put(st, on_a, "v2") == [True] * 6
    assert await _versions(st, on_a) == ["v2"] * 6
    await st.close()
    st = await PageStore.open(roots, _cfg(roots))  # run 3: A is back
    assert await _versions(st, on_a) == ["v2"] * 6  # main served v1 (A first in root order)
    others = [k for k in keys if where[k] != 0]
    assert await _versions(st, others) == ["v1"] * len(others)  # the drives that stayed keep theirs
    await st.close()


async def test_a_key_deleted_while_its_drive_was_removed_stays_deleted_once_the_drive_is_back(tmp_path):
    roots = _roots(tmp_path, 3)
    keys = _keys(30)
    where = await _run_one(roots, keys)
    on_a = [k for k in keys if where[k] == 0]
    reput, gone = on_a[:4], on_a[4:8]
    st = await PageStore.open(roots[1:], _cfg(roots[1:]))  # run 2 without A
    assert await _put(st, reput, "v2") == [True] * 4
    assert await st.delete_many(reput) == [True] * 4  # re-put, then deleted: acknowledged
    await st.delete_many(gone)  # only A had them: nothing to delete in this run's view
    await st.close()
    st = await PageStore.open(roots, _cfg(roots))
    assert await _versions(st, reput + gone) == [None] * 8  # main served the v1 left on A
    assert st.exists_many_nowait(reput + gone) == [False] * 8
    await st.close()


async def test_a_clear_while_a_drive_was_removed_clears_it_once_it_is_back(tmp_path):
    roots = _roots(tmp_path, 3)
    keys = _keys(30)
    await _run_one(roots, keys)
    fresh = _keys(10, "f")
    st = await PageStore.open(roots[1:], _cfg(roots[1:]))
    await st.clear()
    assert await _put(st, fresh, "v2") == [True] * 20
    await st.close()
    st = await PageStore.open(roots, _cfg(roots))
    assert await _versions(st, keys) == [None] * len(keys)  # main served every page of A again
    assert await _versions(st, fresh) == ["v2"] * 20
    assert st.stats()["drives"][0]["objects"] == 0
    await st.close()


async def test_drives_recorded_before_sessions_still_name_the_removed_drive(tmp_path):
    # a store whose runs 1 and 2 were written before DRIVES.json kept sessions: only the roots remain
    roots = _roots(tmp_path, 3)
    keys = _keys(30)
    where = await _run_one(roots, keys)
    on_a = [k for k in keys if where[k] == 0][:4]
    st = await PageStore.open(roots[1:], _cfg(roots[1:]))
    assert await _put(st, on_a, "v2") == [True] * 4
    await st.close()
    for r in roots:
        path = os.path.join(r, "DRIVES.json")
        with open(path) as f:
            rec = json.load(f)
        with open(path, "w") as f:
            drop = ("session", "members", "wrote", "store_id", "drive_id", "seen")  # what identities added, too
            json.dump({k: v for k, v in rec.items() if k not in drop}, f)
    st = await PageStore.open(roots, _cfg(roots))
    assert await _versions(st, on_a) == ["v2"] * 4
    assert st.stats()["drives"][0]["objects"] == 0  # cleared, not only outranked by the newer copies
    await st.close()


async def test_a_drive_back_without_the_drive_that_holds_the_new_copy_does_not_serve_the_old_one(tmp_path):
    # run 2 re-puts k on B; run 3 has A but not B: the new copy is out of reach, the old must not come back
    roots = _roots(tmp_path, 3)
    keys = _keys(40)
    where = await _run_one(roots, keys)
    on_a = [k for k in keys if where[k] == 0]
    st = await PageStore.open(roots[1:], _cfg(roots[1:]))
    assert await _put(st, on_a, "v2") == [True] * len(on_a)
    on_b = [k for k, d in zip(on_a, st.drive_of(on_a)) if d == 0]  # drive 0 of this run is B
    assert on_b
    await st.close()
    st = await PageStore.open([roots[0], roots[2]], _cfg(roots[1:]))
    assert set(await _versions(st, on_b)) == {None}  # main: v1 from A
    await st.close()


async def _a_away_while_four_of_its_keys_are_reput(tmp_path):
    """Run 1 on A,B,C puts v1 of 30 pages; run 2 on B,C re-puts 4 of A's as v2. (roots, A's keys)."""
    roots = _roots(tmp_path, 3)
    keys = _keys(30)
    where = await _run_one(roots, keys)
    on_a = [k for k in keys if where[k] == 0]
    st = await PageStore.open(roots[1:], _cfg(roots[1:]))
    assert await _put(st, on_a[:4], "v2") == [True] * 4
    await st.close()
    return roots, on_a


async def test_a_drive_whose_clear_fails_stays_out_until_a_probe_has_cleared_it(tmp_path):
    roots, on_a = await _a_away_while_four_of_its_keys_are_reput(tmp_path)
    plan = FaultPlan()
    plan.set_rules([FaultRule("eio", ops=("write",), predicate=on_files_under(roots[0]))])  # its clear fails
    st = await PageStore.open(roots, _cfg(roots), engine_factory=plan.engine_factory(), probe_interval_s=0.05)
    assert st.stats()["drives"][0]["state"] == "degraded"
    want = ["v2"] * 4 + [None] * (len(on_a) - 4)
    assert await _versions(st, on_a) == want
    await asyncio.sleep(0.2)
    assert st.stats()["drives"][0]["state"] == "degraded"  # not re-admitted while it cannot clear
    plan.clear()
    assert await until(lambda: st.stats()["drives"][0]["state"] == "healthy", 10)
    assert await _versions(st, on_a) == want
    assert st.stats()["drives"][0]["objects"] == 0
    await st.close()
    sessions = {_drive_set(r).get("session") for r in roots}
    assert len(sessions) == 1  # recorded on A once cleared: the next open keeps what it holds now


# ------------------------------------------------------------------ a drive that could not open


async def _evicted_re_put(st, keys) -> None:
    """Re-put ``keys`` as v2 on the drives that are open, then push them out with fresh pages."""
    assert await _put(st, keys, "v2") == [True] * len(keys)
    fill = _keys(400, "x")  # 12.5 MiB of fresh pages: more than one drive holds
    for i in range(0, len(fill), 100):
        await _put(st, fill[i : i + 100], "v1")
    assert st.exists_many_nowait(keys) == [False] * len(keys)  # evicted: no trace of the re-put is left


async def test_a_re_put_evicted_while_a_drive_could_not_open_does_not_bring_the_old_bytes_back(tmp_path):
    roots = _roots(tmp_path, 2)
    keys = _keys(20)
    where = await _run_one(roots, keys)
    on_1 = [k for k in keys if where[k] == 1][:4]
    parked = str(tmp_path / "parked")
    _park(roots[1], parked)
    st = await PageStore.open(roots, _cfg(roots), probe_interval_s=60)
    assert st.stats()["drives"][1]["state"] == "degraded"
    await _evicted_re_put(st, on_1)
    await st.close()
    _unpark(roots[1], parked)
    st = await PageStore.open(roots, _cfg(roots), probe_interval_s=60)
    assert "v1" not in await _versions(st, on_1)  # main: v1 (its stale-copy check finds no other copy)
    await st.close()


async def test_a_drive_that_joins_after_writes_does_not_serve_a_page_they_replaced(tmp_path):
    roots = _roots(tmp_path, 2)
    keys = _keys(20)
    where = await _run_one(roots, keys)
    on_1 = [k for k in keys if where[k] == 1][:4]
    parked = str(tmp_path / "parked")
    _park(roots[1], parked)
    st = await PageStore.open(roots, _cfg(roots), probe_interval_s=0.05)
    await _evicted_re_put(st, on_1)
    _unpark(roots[1], parked)  # the probe opens it in this run
    assert await until(lambda: st.stats()["drives"][1]["state"] == "healthy", 10)
    assert "v1" not in await _versions(st, on_1)
    await st.close()


async def test_a_drive_that_missed_only_a_session_without_writes_keeps_its_pages(tmp_path):
    roots = _roots(tmp_path, 2)
    keys = _keys(20)
    where = await _run_one(roots, keys)
    parked = str(tmp_path / "parked")
    _park(roots[1], parked)
    st = await PageStore.open(roots, _cfg(roots), probe_interval_s=60)
    on_0 = [k for k in keys if where[k] == 0]
    assert await _versions(st, on_0) == ["v1"] * len(on_0)  # reads only
    await st.close()
    _unpark(roots[1], parked)
    st = await PageStore.open(roots, _cfg(roots), probe_interval_s=60)
    assert await _versions(st, keys) == ["v1"] * len(keys)
    assert st.stats()["drives"][1]["objects"] == list(where.values()).count(1)
    await st.close()


# ------------------------------------------------------------------ readers, and a key on two drives


async def test_a_reader_does_not_serve_a_drive_that_missed_a_session_until_a_writer_cleared_it(tmp_path):
    roots, on_a = await _a_away_while_four_of_its_keys_are_reput(tmp_path)
    rd = await PageStore.open(roots, _cfg(roots), readonly=True, probe_interval_s=0.05)
    assert rd.stats()["drives"][0]["state"] == "degraded"
    assert await _versions(rd, on_a) == ["v2"] * 4 + [None] * (len(on_a) - 4)  # main: v1 for all of them
    await asyncio.sleep(0.2)
    assert rd.stats()["drives"][0]["state"] == "degraded"  # the probe does not re-admit it on its own
    await _writer_in_a_child(roots)  # it clears A, records that, and puts fresh pages
    assert await until(lambda: rd.stats()["drives"][0]["state"] == "healthy", 10)
    assert await _versions(rd, on_a) == ["v2"] * 4 + [None] * (len(on_a) - 4)
    assert await _versions(rd, _keys(10, "f")) == ["v1"] * 20
    await rd.close()


async def _writer_in_a_child(roots) -> None:
    """A writer over ``roots`` in another process (LMDB: one process cannot be reader and writer of
    one index) that puts the pages f0000..f0009 as v1."""
    code = textwrap.dedent("""
        import asyncio, sys
        from test_drive_membership import PageStore, _cfg, _keys, _put
        async def main(roots):
            st = await PageStore.open(roots, _cfg(roots))
            assert await _put(st, _keys(10, "f"), "v1") == [True] * 20
            await st.close()
        asyncio.run(main(sys.argv[1:]))
    """)
    path = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.path.dirname(__file__)])
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, *roots, cwd=ROOT,
                                                env=dict(os.environ, PYTHONPATH=path), stderr=subprocess.PIPE)  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()[-2000:]


async def test_a_key_on_two_drives_is_served_from_its_newest_copy_never_the_first_in_root_order(tmp_path):
    # two copies as a racing put leaves them: the same key written on each drive, v2 after v1;
    # one key has its newer copy on the first drive, the other on the second
    roots = _roots(tmp_path, 2)
    st = await PageStore.open(roots, _cfg(roots))
    a, b = "keyA_0_k", "keyB_0_k"
    for key, older, newer in ((a, 0, 1), (b, 1, 0)):
        assert await _put(st.stores[older], [key], "v1") == [True]
        assert await _put(st.stores[newer], [key], "v2") == [True]
    assert await _versions(st, [a, b]) == ["v2", "v2"]  # main: a read v1 (drive 0 first)
    assert st.drive_of([a, b]) == [1, 0]
    assert await _put(st, [a], "v1") == [True]  # a put of a held key keeps the served copy
    assert await _versions(st, [a]) == ["v2"]
    await st.close()
    for readonly in (False, True):  # the generations on disk still order them
        st = await PageStore.open(roots, _cfg(roots), readonly=readonly)
        assert await _versions(st, [a, b]) == ["v2", "v2"]
        await st.close()
