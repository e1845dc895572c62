"""No acknowledged write without a recorded session (issue 34, item 3): a drive of a multi-drive
store whose DRIVES.json cannot be written and fsynced (no inodes or space for a new small file, a
quota, EIO) while its preallocated segments still work takes no writes: puts go to the drives that
recorded the session (False when none did), deletes of its pages are owed in the log of a drive
that did (False when none did), and the log (once), stats(), the metrics and `umbp-nvme doctor` say
why. The probe records it later, so a passing failure heals.

Failures come through the ``StoreHooks.drive_record`` seam, and for real from tmpfs mounts with a
few inodes (root only: skipped with the reason otherwise).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import subprocess

import pytest

from conftest import mount_tmpfs, small_config
from support.drive_pages import page_keys as _keys
from support.versions import put_versions, read_versions
from support.waits import until
from umbp_nvme import metrics
from umbp_nvme.doctor.report import report
from umbp_nvme.store import PageStore
from umbp_nvme.store.drive_set import recorded_health
from umbp_nvme.store.hooks import StoreHooks

OBJ = 16 << 10
SHARE = 5 << 20


def _cfg(roots):
    return small_config(ssd_capacity_bytes=SHARE * len(roots))


async def _put(st, keys, version: int) -> list[bool]:
    return await put_versions(st, keys, version, OBJ)


async def _versions(st, keys) -> list[int | None]:
    return await read_versions(st, keys, OBJ)


class FailingRecords:
    """A drive_record hook: records under the roots in ``failing`` raise ENOSPC (as a full inode table does)."""

    def __init__(self, failing):
        self.failing = set(failing)
        self.calls = 0

    def __call__(self, real, path, rec):
        self.calls += 1
        if any(path.startswith(r + os.sep) for r in self.failing):
            raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
        real(path, rec)


async def _filled(roots, keys) -> dict[str, int]:
    st = await PageStore.open(roots, _cfg(roots))
    assert await _put(st, keys, 1) == [True] * len(keys)
    where = dict(zip(keys, st.drive_of(keys)))
    await st.close()
    return where


def _unrecorded_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "session record" in r.getMessage()]


async def test_a_session_no_drive_could_record_takes_no_writes_says_why_and_heals(tmp_path, caplog):
    roots = [str(tmp_path / f"d{i}" / "store") for i in range(2)]
    keys = _keys(10)
    await _filled(roots, keys)
    hook = FailingRecords(roots)
    with caplog.at_level(logging.WARNING, logger="umbp_nvme.store"):
        st = await PageStore.open(roots, _cfg(roots), hooks=StoreHooks(drive_record=hook), probe_interval_s=0.05)
        try:
            fresh = _keys(5, "f")
            for _ in range(3):  # several calls: still one WARNING per drive
                assert await _put(st, fresh, 2) == [False] * len(fresh)
                assert await st.delete_many(keys[:4]) == [False] * 4  # the owe is recorded nowhere
            assert st.exists_many_nowait(fresh) == [False] * len(fresh)
            assert await _versions(st, keys[4:]) == [1] * (len(keys) - 4)  # reads are still served
            s = st.stats()
            assert s["drives_session_unrecorded"] == 2
            assert [r["session_unrecorded"] for r in s["drives"]] == [1, 1]
            assert all("DRIVES.json" in r["reason"] and "ENOSPC" in r["reason"] for r in s["drives"])
            samples = {(n, lab.get("drive")): v for n, _, lab, v in metrics.samples_from_stats(s)}
            assert samples[("umbp_nvme_drives_session_unrecorded", None)] == 2
            assert samples[("umbp_nvme_drive_session_unrecorded", "0")] == 1
            assert samples[("umbp_nvme_drive_session_unrecorded", "1")] == 1
            said = _unrecorded_warnings(caplog)
            assert len(said) == 2 and {r for r in roots if any(r in m for m in said)} == set(roots)
            hook.failing.clear()  # the file system has room again: the probe records the session
            assert await until(lambda: st.stats()["drives_session_unrecorded"] == 0, 20)
            assert await _put(st, fresh, 2) == [True] * len(fresh)
            # the deletes that answered False were kept in memory (their keys hidden) and applied on the way back
            assert st.exists_many_nowait(keys[:4]) == [False] * 4
            assert await st.delete_many(keys[4:6]) == [True] * 2
            assert len(_unrecorded_warnings(caplog)) == 2
        finally:
            await st.close()
    st = await PageStore.open(roots, _cfg(roots))
    assert await _versions(st, fresh) == [2] * len(fresh)
    assert await _versions(st, keys) == [None] * 6 + [1] * (len(keys) - 6)
    await st.close()


async def test_a_drive_that_could_not_record_the_session_serves_reads_takes_no_writes_and_owes_its_deletes(tmp_path):
    roots = [str(tmp_path / f"d{i}" / "store") for i in range(2)]
    keys = _keys(20)
    where = await _filled(roots, keys)
    on_1 = [k for k in keys if where[k] == 1]
    hook = FailingRecords([roots[1]])
    st = await PageStore.open(roots, _cfg(roots), hooks=StoreHooks(drive_record=hook), probe_interval_s=0.05)
    try:
        assert st.stats()["drives"][1]["state"] == "degraded"
        fresh = _keys(10, "f")
        assert await _put(st, fresh, 2) == [True] * len(fresh)
        assert set(st.drive_of(fresh)) == {0}  # nothing lands on the drive that did not record the session
        objects_1 = st.stats()["drives"][1]["objects"]
        assert await st.delete_many(on_1[:2]) == [True, True]  # owed: recorded in drive 0's log
        assert st.exists_many_nowait(on_1[:2]) == [False, False]  # hidden at once
        assert st.stats()["drives"][1]["objects"] == objects_1  # not deleted there: it takes no writes
        assert await _versions(st, on_1[2:]) == [1] * (len(on_1) - 2)
        # a running writer's state reaches `umbp-nvme doctor` through drive 0's DRIVES.json
        assert await until(lambda: (recorded_health(roots[1]) or {}).get("kind") == "unrecorded", 10)
        r = await asyncio.to_thread(report, roots[1], _cfg(roots), probe=False)
        said = [f for f in r["findings"] if f["item"] == "session"]
        assert r["status"] == "fail" and said and said[0]["level"] == "fail"
        assert "could not record its session" in said[0]["message"] and "ENOSPC" in said[0]["message"]
        ok = await asyncio.to_thread(report, roots[0], _cfg(roots), probe=False)
        assert [f["level"] for f in ok["findings"] if f["item"] == "session"] == ["ok"]
        hook.failing.clear()
        assert await until(lambda: st.stats()["drives"][1]["state"] == "healthy", 20)
        assert st.stats()["drives"][1]["objects"] == objects_1 - 2  # the owed deletes were applied first
        assert await _versions(st, on_1[:2]) == [None, None]
    finally:
        await st.close()
    st = await PageStore.open(roots, _cfg(roots))
    assert await _versions(st, on_1) == [None, None] + [1] * (len(on_1) - 2)
    assert await _versions(st, fresh) == [2] * len(fresh)
    await st.close()


# ------------------------------------------------------------------ a real file system without inodes


def _fill_inodes(d: str) -> list[str]:
    made = []
    while True:
        p = os.path.join(d, f"fill{len(made)}")
        try:
            open(p, "w").close()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
            return made
        made.append(p)


@pytest.fixture
def three_mounts(tmp_path):
    """Three tmpfs drives: A and C with 64 inodes, B with plenty. The roots under them."""
    mnts = [str(tmp_path / m) for m in "abc"]
    done = []
    try:
        for m, opts in zip(mnts, ("64m,nr_inodes=64", "64m", "64m,nr_inodes=64")):
            why = mount_tmpfs(m, opts)
            if why:
                pytest.skip(why)
            done.append(m)
        yield [os.path.join(m, "store") for m in mnts]
    finally:
        for m in done:
            subprocess.run(["umount", "-l", m], capture_output=True)


async def test_with_no_inodes_for_its_record_a_session_acknowledges_no_write_a_drive_absent_from_it_could_miss(
    three_mounts,
):
    # main: DRIVES.json failed with ENOSPC on A and C, the writer logged it and acknowledged the re-puts
    # and deletes of B's keys; B (absent) was not behind at the next open and served them again
    A, B, C = three_mounts
    keys = _keys(30)
    where = await _filled([A, B, C], keys)
    on_b = [k for k in keys if where[k] == 1]
    fills = [_fill_inodes(os.path.dirname(r)) for r in (A, C)]
    st = await PageStore.open([A, C], _cfg([A, C]), probe_interval_s=0.05)
    try:
        put = await _put(st, on_b, 2)
        deleted = await st.delete_many(on_b)
        assert put == [False] * len(on_b) and deleted == [False] * len(on_b)
        s = st.stats()
        assert s["drives_session_unrecorded"] == 2
        assert all("No space left on device" in r["reason"] for r in s["drives"])
        for f in fills:  # a few inodes come free: the probe records the session, writes are taken again
            os.unlink(f.pop())
        assert await until(lambda: st.stats()["drives_session_unrecorded"] == 0, 20)
        late = _keys(4, "late")
        assert await _put(st, late, 2) == [True] * len(late)
    finally:
        await st.close()
    got = dict(zip(on_b, await _run_versions([A, B, C], on_b)))
    assert [k for k, ok in zip(on_b, deleted) if ok and got[k] is not None] == []  # an acknowledged delete holds
    assert [k for k, ok in zip(on_b, put) if ok and got[k] == 1] == []  # an acknowledged re-put is never stale
    assert set(got.values()) <= {1, None}


async def _run_versions(roots, keys):
    st = await PageStore.open(roots, _cfg(roots))
    try:
        return await _versions(st, keys)
    finally:
        await st.close()
