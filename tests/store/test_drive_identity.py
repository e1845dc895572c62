"""Drive identity and history (issue 34, item 2): a drive is current only when its OWN record shows
it took part in every writing session the drives' records know of; another drive's record can add
sessions it missed, never vouch for it. Runs on disjoint subsets of the drives, a restored older
copy of a drive's directory, a drive from another store and a copy of a drive beside itself are
recognised before they serve.

Every version of a key has its own bytes (tests/support/versions.py), so a stale page reads back
as the old version, not as a plain hit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil


from conftest import small_config
from support.drive_pages import drive_roots as _roots, page_keys as _keys, park_drive as _park, unpark_drive as _unpark
from support.versions import put_versions, read_versions
from umbp_nvme.store import PageStore

OBJ = 16 << 10
SHARE = 5 << 20  # each drive's capacity, whatever the number of roots


def _cfg(roots):
    return small_config(ssd_capacity_bytes=SHARE * len(roots))


async def _put(st, keys, version: int) -> list[bool]:
    return await put_versions(st, keys, version, OBJ)


async def _versions(st, keys) -> list[int | None]:
    return await read_versions(st, keys, OBJ)


async def _run(roots, fn=None, **kw):
    """One writer session over ``roots``: ``await fn(store)`` then a clean close; fn's answer."""
    st = await PageStore.open(roots, _cfg(roots), **kw)
    try:
        return await fn(st) if fn else None
    finally:
        await st.close()


async def _put_v1(roots, keys) -> dict:
    """A session over ``roots`` puts version 1 of ``keys``: the drive each landed on."""

    async def run1(st):
        assert await _put(st, keys, 1) == [True] * len(keys)
        return dict(zip(keys, st.drive_of(keys)))

    return await _run(roots, run1)


async def _old_copy_put_back(tmp_path, root, meanwhile) -> None:
    """``root``'s drive copied, ``await meanwhile()``, then the copy put back in its place (an old disk returned)."""
    snapshot = str(tmp_path / "snapshot")
    shutil.copytree(os.path.dirname(root), snapshot, symlinks=True)
    await meanwhile()
    shutil.rmtree(os.path.dirname(root))
    shutil.copytree(snapshot, os.path.dirname(root), symlinks=True)


def _record(root: str) -> dict:
    with open(os.path.join(root, "DRIVES.json")) as f:
        return json.load(f)


# ------------------------------------------------------------------ runs on disjoint subsets


async def test_runs_on_disjoint_drive_subsets_never_serve_a_page_a_run_replaced(tmp_path):
    # run 1 on A,B,C puts v1; run 2 on A,C re-puts B's keys as v2; run 3 on B,D writes; run 4 on A,B,C.
    # main: A and C were "behind" run 3 and cleared, B "current" (its own record named run 3): its v1 served
    A, B, C, D = _roots(tmp_path, 4)
    keys = _keys(30)

    where = await _put_v1([A, B, C], keys)
    on_b = [k for k in keys if where[k] == 1]
    assert on_b

    async def run2(st):
        assert await _put(st, on_b, 2) == [True] * len(on_b)
        assert await _versions(st, on_b) == [2] * len(on_b)

    await _run([A, C], run2)
    fresh = _keys(10, "f")

    async def run3(st):
        assert await _put(st, fresh, 3) == [True] * len(fresh)

    await _run([B, D], run3)

    async def run4(st):
        return await _versions(st, keys), st.stats()["drives"]

    got, rows = await _run([A, B, C], run4)
    served = dict(zip(keys, got))
    assert [k for k in on_b if served[k] == 1] == []  # no stale v1 of a key run 2 replaced
    assert set(got) <= {None, 1, 2}
    assert -1 not in got
    # every drive missed a session that wrote (B run 2, A and C run 3): all three were cleared
    assert [r["objects"] for r in rows] == [0, 0, 0]


# ------------------------------------------------------------------ an older copy of a drive


async def test_a_restored_older_copy_of_a_drive_serves_nothing_deleted_or_replaced_since(tmp_path):
    # main: B's old record (run 1) was vouched for by A's record naming B in run 2: deleted keys came back
    A, B, C = _roots(tmp_path, 3)
    keys = _keys(30)

    where = await _put_v1([A, B, C], keys)
    on_b = [k for k in keys if where[k] == 1]
    gone, reput = on_b[: len(on_b) // 2], on_b[len(on_b) // 2 :]

    async def run2(st):
        assert await st.delete_many(gone + reput) == [True] * len(on_b)
        assert await _put(st, reput, 2) == [True] * len(reput)

    await _old_copy_put_back(tmp_path, B, lambda: _run([A, B, C], run2))

    async def run3(st):
        return await _versions(st, gone), await _versions(st, reput), st.stats()["drives"][1]

    got_gone, got_reput, row = await _run([A, B, C], run3)
    assert got_gone == [None] * len(gone)  # acknowledged deletes stay deleted
    assert 1 not in got_reput and -1 not in got_reput
    assert row["objects"] == 0  # the copy was cleared (its record is older than what A and C say it took part in)
    others = [k for k in keys if where[k] != 1]
    assert await _run([A, B, C], lambda st: _versions(st, others)) == [1] * len(others)  # A and C keep theirs


async def test_a_reader_holds_out_a_restored_older_copy_until_a_writer_cleared_it(tmp_path):
    A, B = _roots(tmp_path, 2)
    keys = _keys(20)

    where = await _put_v1([A, B], keys)
    on_b = [k for k in keys if where[k] == 1]
    await _old_copy_put_back(tmp_path, B, lambda: _run([A, B], lambda st: st.delete_many(on_b)))
    rd = await PageStore.open([A, B], _cfg([A, B]), readonly=True, probe_interval_s=60)
    try:
        assert await _versions(rd, on_b) == [None] * len(on_b)
        row = rd.stats()["drives"][1]
        assert row["state"] == "degraded" and "older copy" in row["reason"]
    finally:
        await rd.close()


# ------------------------------------------------------------------ a drive from another store


async def test_a_drive_from_another_store_is_refused_and_left_untouched(tmp_path, caplog):
    # main: the other store's newer session made A "behind": A was cleared and E's v2 bytes served
    A, B = _roots(tmp_path, 2)
    E, F = [str(tmp_path / f"other{i}" / "store") for i in range(2)]
    keys = _keys(20)

    where = await _put_v1([A, B], keys)

    async def other(st):
        assert await _put(st, keys, 2) == [True] * len(keys)  # the same key names, another store's bytes
        return st.stats()["drives"][0]["objects"]

    e_objects = await _run([E, F], other)
    with caplog.at_level(logging.WARNING, logger="umbp_nvme.store"):

        async def mixed(st):
            return await _versions(st, keys), st.stats()["drives"]

        got, rows = await _run([A, E], mixed)
    on_a = [k for k in keys if where[k] == 0]
    assert 2 not in got and -1 not in got  # nothing of the other store is served
    assert [v for k, v in zip(keys, got) if k in on_a] == [1] * len(on_a)  # A is not cleared for it
    assert rows[1]["state"] == "degraded" and "another store" in rows[1]["reason"]
    assert any(E in r.getMessage() and "another store" in r.getMessage() for r in caplog.records)
    async def objects(st):
        return st.stats()["drives"][0]["objects"]

    assert await _run([E, F], objects) == e_objects  # untouched
    assert await _run([E, F], lambda st: _versions(st, keys)) == [2] * len(keys)


# ------------------------------------------------------------------ a copy of a drive beside it


async def test_a_copy_of_a_drive_opened_beside_it_is_cleared_and_gets_an_identity_of_its_own(tmp_path):
    A, B, B2 = _roots(tmp_path, 3)
    keys = _keys(20)

    async def run1(st):
        assert await _put(st, keys, 1) == [True] * len(keys)

    await _run([A, B], run1)
    shutil.copytree(os.path.dirname(B), os.path.dirname(B2), symlinks=True)

    async def run2(st):
        got = await _versions(st, keys)
        assert await st.delete_many(keys[:4]) == [True] * 4
        return got, [r["objects"] for r in st.stats()["drives"]]

    got, objects = await _run([A, B, B2], run2)
    assert got == [1] * len(keys)
    assert objects[2] == 0  # the copy, not the drive it was copied from
    ids = [_record(r)["drive_id"] for r in (A, B, B2)]
    assert len(set(ids)) == 3
    assert {_record(r)["store_id"] for r in (A, B, B2)} == {_record(A)["store_id"]}
    assert await _run([A, B, B2], lambda st: _versions(st, keys)) == [None] * 4 + [1] * (len(keys) - 4)


# ------------------------------------------------------------------ drives written before identities


async def test_drives_recorded_before_identities_keep_their_pages_and_are_stamped(tmp_path):
    A, B = _roots(tmp_path, 2)
    keys = _keys(20)
    await _run([A, B], lambda st: _put(st, keys, 1))
    for r in (A, B):  # what DRIVES.json held before this change
        rec = _record(r)
        old = {k: rec[k] for k in ("roots", "objects", "session", "members", "wrote", "health") if k in rec}
        with open(os.path.join(r, "DRIVES.json"), "w") as f:
            json.dump(old, f)
    assert await _run([A, B], lambda st: _versions(st, keys)) == [1] * len(keys)
    recs = [_record(r) for r in (A, B)]
    assert recs[0]["store_id"] == recs[1]["store_id"] and recs[0]["drive_id"] != recs[1]["drive_id"]
    assert await _run([A, B], lambda st: _versions(st, keys)) == [1] * len(keys)


async def test_a_drive_whose_record_is_lost_is_not_vouched_for_by_the_others(tmp_path):
    # main: B's record gone, A's record naming B in the newest session counted as B's: kept and served
    A, B = _roots(tmp_path, 2)
    keys = _keys(20)

    where = await _put_v1([A, B], keys)
    on_b = [k for k in keys if where[k] == 1]
    await _old_copy_put_back(tmp_path, B, lambda: _run([A, B], lambda st: st.delete_many(on_b)))
    os.unlink(os.path.join(B, "DRIVES.json"))  # an old copy whose record is lost as well
    assert await _run([A, B], lambda st: _versions(st, on_b)) == [None] * len(on_b)


# ------------------------------------------------------------------ drives the probe opens later


async def test_an_older_copy_that_comes_back_while_the_writer_runs_is_cleared_before_it_serves(tmp_path):
    from support.waits import until

    A, B = _roots(tmp_path, 2)
    keys = _keys(20)

    where = await _put_v1([A, B], keys)
    on_b = [k for k in keys if where[k] == 1]
    snapshot = str(tmp_path / "snapshot")
    shutil.copytree(os.path.dirname(B), snapshot, symlinks=True)
    await _run([A, B], lambda st: st.delete_many(on_b))  # run 2: B's pages deleted, acknowledged
    shutil.rmtree(os.path.dirname(B))
    open(os.path.dirname(B), "w").close()  # run 3 opens without B; the old copy is put back while it runs
    st = await PageStore.open([A, B], _cfg([A, B]), probe_interval_s=0.05)
    try:
        assert st.stats()["drives"][1]["state"] == "degraded"
        _unpark(B, snapshot)
        assert await until(lambda: st.stats()["drives"][1]["state"] == "healthy", 20)
        assert await _versions(st, on_b) == [None] * len(on_b)
        assert st.stats()["drives"][1]["objects"] == 0
    finally:
        await st.close()


async def test_another_stores_drive_that_appears_while_the_writer_runs_is_never_opened(tmp_path):
    from support.waits import until

    A, B = _roots(tmp_path, 2)
    E, F = [str(tmp_path / f"other{i}" / "store") for i in range(2)]
    keys = _keys(20)
    await _run([A, B], lambda st: _put(st, keys, 1))
    await _run([E, F], lambda st: _put(st, keys, 2))
    parked = str(tmp_path / "parked")
    _park(B, parked)
    st = await PageStore.open([A, B], _cfg([A, B]), probe_interval_s=0.05)
    try:
        os.unlink(os.path.dirname(B))
        shutil.copytree(os.path.dirname(E), os.path.dirname(B), symlinks=True)  # another store's drive there
        assert await until(lambda: "another store" in (st.stats()["drives"][1]["reason"] or ""), 30)  # probed
        await asyncio.sleep(0.3)  # more probes: none lets it join
        got = await _versions(st, keys)
        assert 2 not in got and -1 not in got  # main: the other store's drive joined and its bytes were served
        assert st.stats()["drives"][1]["state"] == "degraded" and "another store" in st.stats()["drives"][1]["reason"]
    finally:
        await st.close()
    assert _record(B)["store_id"] == _record(E)["store_id"]  # never written by this store


def _strip_identities(roots) -> None:
    for r in roots:  # what DRIVES.json held before identities
        rec = _record(r)
        old = {k: rec[k] for k in ("roots", "objects", "session", "members", "wrote", "health") if k in rec}
        with open(os.path.join(r, "DRIVES.json"), "w") as f:
            json.dump(old, f)


async def test_a_drive_left_unstamped_by_the_first_stamping_session_keeps_its_pages_unless_that_session_wrote(tmp_path):
    from umbp_nvme.store.hooks import StoreHooks

    A, B = _roots(tmp_path, 2)
    keys = _keys(20)

    where = await _put_v1([A, B], keys)
    on_b = [k for k in keys if where[k] == 1]
    _strip_identities([A, B])

    def no_record_on_b(real, path, rec):
        if path.startswith(B + os.sep):
            raise OSError(5, "Input/output error (injected)", path)
        real(path, rec)

    hooks = StoreHooks(drive_record=no_record_on_b)
    await _run([A, B], lambda st: _versions(st, keys), hooks=hooks)  # reads only: A stamped, B keeps its old record
    assert "store_id" in _record(A) and "store_id" not in _record(B)
    assert await _run([A, B], lambda st: _versions(st, on_b)) == [1] * len(on_b)  # B missed nothing: kept
    _strip_identities([A, B])
    fresh = _keys(4, "f")
    await _run([A, B], lambda st: _put(st, fresh, 2), hooks=hooks)  # this time the stamping session wrote
    assert "store_id" in _record(A) and "store_id" not in _record(B)
    assert await _run([A, B], lambda st: _versions(st, on_b)) == [None] * len(on_b)  # B missed it: cleared
