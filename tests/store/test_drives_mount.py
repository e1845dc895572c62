"""An unmounted drive is never written (store/mounts.py): ``ssd_require_mount`` and the guard.

No real mounts: ``os.path.ismount`` is replaced by a set of "mounted" directories (plus /), so
a drive is mounted or unmounted by adding or removing its directory. Every check counts real
files in the drive's directory, objects per drive, and bytes read back.
"""

from __future__ import annotations

import asyncio
import logging
import os

import numpy as np
import pytest

from conftest import payload, small_config
from support.drive_pages import page_keys as _keys
from umbp_nvme.config import load_config
from umbp_nvme.errors import DriveNotMountedError
from umbp_nvme.store import PageStore
from umbp_nvme.store.mounts import drive_dirs, mount_above, unmounted_reason
from support.waits import until

OBJ = 16 << 10


async def _put(st, keys) -> list[bool]:
    return await st.put_many(keys, [payload(k, OBJ) for k in keys])


async def _get(st, keys) -> tuple[list[bool], int]:
    outs = [np.zeros(OBJ, np.uint8) for _ in keys]
    res = await st.get_many(keys, outs)
    return res, sum(1 for ok, k, o in zip(res, keys, outs) if ok and not np.array_equal(o, payload(k, OBJ)))


@pytest.fixture
def mounted(monkeypatch):
    """The directories os.path.ismount reports as mount points (and /); add or remove to (un)mount."""
    points: set[str] = set()
    monkeypatch.setattr(os.path, "ismount", lambda p: os.path.abspath(p) in points or os.path.abspath(p) == os.sep)
    return points


def _drives(tmp_path, n: int) -> tuple[list[str], list[str]]:
    """(drive directories, roots): root i is <tmp>/nvme<i>/hicache; every drive directory exists, empty."""
    drives = [str(tmp_path / f"nvme{i}") for i in range(n)]
    for d in drives:
        os.makedirs(d)
    return drives, [os.path.join(d, "hicache") for d in drives]


def _files(d: str) -> list[str]:
    """Every file under ``d`` (relative paths)."""
    return sorted(os.path.relpath(os.path.join(a, f), d) for a, _dirs, fs in os.walk(d) for f in fs)


def test_the_rule_itself(tmp_path, mounted):
    drives, roots = _drives(tmp_path, 3)
    assert drive_dirs(roots) == drives
    assert drive_dirs(["/x/y", "/z/x/y"]) == ["/x", "/z/x"]  # never down to /
    assert drive_dirs(["/a/p", "/b/q"]) == ["/a/p", "/b/q"]
    assert [unmounted_reason(i, roots, False) for i in range(3)] == [None] * 3  # plain directories
    assert unmounted_reason(0, roots[:1], True) is not None  # the knob: nothing mounted above it but /
    mounted.update(drives[:2])
    assert mount_above(os.path.join(roots[0], "tp0")) == drives[0]
    assert [unmounted_reason(i, roots, False) is None for i in range(3)] == [True, True, False]
    assert "nvme2 is not a mount point while" in unmounted_reason(2, roots, False)
    os.makedirs(roots[2])
    open(os.path.join(roots[2], "MANIFEST.json"), "w").close()
    assert unmounted_reason(2, roots, False) is None  # it holds a store: the guard leaves it be
    assert "ssd_require_mount" in unmounted_reason(2, roots, True)  # the knob does not


async def test_an_unmounted_drive_is_held_out_and_joins_once_mounted(tmp_path, mounted, caplog):
    """The guard (knob off): drive 1's directory is an empty mount point while drive 0 is mounted."""
    drives, roots = _drives(tmp_path, 2)
    mounted.add(drives[0])
    caplog.set_level(logging.WARNING, "umbp_nvme.store")
    st = await PageStore.open(roots, small_config(), probe_interval_s=0.05)
    row = st.stats()["drives"][1]
    assert row["state"] == "degraded" and "looks unmounted" in row["reason"]
    warned = [r.getMessage() for r in caplog.records if "degraded" in r.getMessage()]
    assert len(warned) == 1 and drives[1] in warned[0] and "nothing is created there" in warned[0]
    keys = _keys(40)
    assert await _put(st, keys) == [True] * 80
    assert st.drive_of(keys) == [0] * 80
    res, wrong = await _get(st, keys)
    assert res == [True] * 80 and wrong == 0
    await asyncio.sleep(0.3)  # several probes: still nothing there
    assert os.listdir(drives[1]) == [] and st.stats()["drives"][1]["objects"] == 0

    mounted.add(drives[1])  # the drive is mounted: the probe opens it, creating its store
    assert await until(lambda: st.stats()["drives"][1]["state"] == "healthy", 30)
    assert os.path.isfile(os.path.join(roots[1], "MANIFEST.json"))
    assert st.stats()["drives"][1]["capacity_bytes"] == 8 << 20  # its share of 16 MiB, sized once mounted
    fresh = _keys(40, "late")
    assert await _put(st, fresh) == [True] * 80
    on = st.drive_of(fresh)
    assert on.count(1) > 0 and on.count(0) > 0  # placement spreads over both again
    res, wrong = await _get(st, keys + fresh)
    assert res == [True] * 160 and wrong == 0
    assert sum(r["objects"] for r in st.stats()["drives"]) == 160
    assert len([r for r in caplog.records if "degraded" in r.getMessage()]) == 1
    await st.close()


async def test_a_drive_with_its_store_mounted_late_serves_its_pages_again(tmp_path, mounted):
    drives, roots = _drives(tmp_path, 2)
    mounted.update(drives)
    st = await PageStore.open(roots, small_config())
    keys = _keys(60)
    assert await _put(st, keys) == [True] * 120
    where = st.drive_of(keys)
    assert where.count(1) > 10
    await st.close()
    # drive 1 unmounted: its store is elsewhere, the mount point is an empty directory again
    parked = str(tmp_path / "parked")
    os.rename(drives[1], parked)
    os.makedirs(drives[1])
    mounted.discard(drives[1])
    st = await PageStore.open(roots, small_config(), probe_interval_s=0.05)
    assert "looks unmounted" in st.stats()["drives"][1]["reason"]
    res, wrong = await _get(st, keys)
    assert wrong == 0 and res == [d == 0 for d in where]  # its pages miss, the others are served
    assert st.exists_many_nowait(keys) == [d == 0 for d in where]
    assert os.listdir(drives[1]) == []
    os.rmdir(drives[1])  # mounted again, with its store
    os.rename(parked, drives[1])
    mounted.add(drives[1])
    assert await until(lambda: st.stats()["drives"][1]["state"] == "healthy", 30)
    res, wrong = await _get(st, keys)
    assert res == [True] * 120 and wrong == 0
    assert st.drive_of(keys) == where
    await st.close()


async def test_require_mount_holds_out_every_root_not_on_a_mounted_drive(tmp_path, mounted):
    drives, roots = _drives(tmp_path, 3)
    cfg = small_config(ssd_require_mount=True)
    with pytest.raises(DriveNotMountedError, match="ssd_require_mount"):
        await PageStore.open(roots, cfg)  # no drive mounted: nothing to open
    assert [os.listdir(d) for d in drives] == [[], [], []]
    # a store on drive 2 that is not a mount point (made there before): the knob still refuses it
    st = await PageStore.open(roots[2], small_config(ssd_capacity_bytes=5 << 20))  # its share of 16 MiB
    await st.close()
    before = _files(drives[2])
    mounted.update(drives[:2])
    st = await PageStore.open(roots, cfg, probe_interval_s=0.05)
    assert [r["state"] for r in st.stats()["drives"]] == ["healthy", "healthy", "degraded"]
    assert "ssd_require_mount" in st.stats()["drives"][2]["reason"]
    keys = _keys(30)
    assert await _put(st, keys) == [True] * 60 and 2 not in st.drive_of(keys)
    await asyncio.sleep(0.2)
    assert _files(drives[2]) == before  # not even its DRIVES.json was written
    mounted.add(drives[2])
    assert await until(lambda: st.stats()["drives"][2]["state"] == "healthy", 30)
    res, wrong = await _get(st, keys)
    assert res == [True] * 60 and wrong == 0
    await st.close()


async def test_require_mount_on_a_single_root(tmp_path, mounted):
    drive = str(tmp_path / "nvme0")
    root = os.path.join(drive, "hicache", "tp0")
    cfg = small_config(ssd_require_mount=True)
    with pytest.raises(DriveNotMountedError, match="not on a mounted drive"):
        await PageStore.open(root, cfg)
    assert not os.path.exists(drive)  # nothing created
    mounted.add(drive)
    os.makedirs(drive)
    st = await PageStore.open(root, cfg)  # a root below the mount point passes
    keys = _keys(4)
    assert await _put(st, keys) == [True] * 8
    assert (await _get(st, keys)) == ([True] * 8, 0)
    await st.close()


async def test_plain_directories_and_a_single_root_are_never_held_out(tmp_path, mounted):
    _drives_, roots = _drives(tmp_path, 3)  # nothing mounted below /: tests, tmp
    st = await PageStore.open(roots, small_config(), probe_interval_s=0.05)
    assert [r["state"] for r in st.stats()["drives"]] == ["healthy"] * 3
    keys = _keys(30)
    assert await _put(st, keys) == [True] * 60 and set(st.drive_of(keys)) == {0, 1, 2}
    await st.close()
    single = str(tmp_path / "single" / "store")
    st = await PageStore.open(single, small_config())
    assert await _put(st, keys[:2]) == [True, True]
    await st.close()
    assert os.path.isfile(os.path.join(single, "MANIFEST.json"))


def test_the_knob_parses_from_extra_config_and_the_environment():
    assert load_config({}, env={}).ssd_require_mount is False
    assert load_config({"ssd_require_mount": "yes"}, env={}).ssd_require_mount is True
    assert load_config({}, env={"UMBP_SSD_REQUIRE_MOUNT": "1"}).ssd_require_mount is True
    assert load_config({"ssd_require_mount": "off"}, env={"UMBP_SSD_REQUIRE_MOUNT": "1"}).ssd_require_mount is False
    with pytest.raises(ValueError, match="ssd_require_mount.*'maybe'"):
        load_config({"ssd_require_mount": "maybe"}, env={})


def test_the_backend_on_rank_subdirectories_leaves_an_unmounted_drive_alone(tmp_path, mounted):
    """SGLang's layout: each root gets this rank's subdirectory (<drive>/hicache/tp1); the guard
    still sees drive 1's directory as an unmounted mount point beside a mounted drive 0."""
    from support.backends import make_backend
    from support.host_pool import HostPool, page_key

    drives, roots = _drives(tmp_path, 2)
    mounted.add(drives[0])
    pool = HostPool(page_num=32)
    be = make_backend(roots, pool, tp_rank=1, tp_size=2, mode="relaxed", capacity=16 << 20)
    try:
        assert be.store_dirs == [os.path.join(r, "tp1") for r in roots]
        keys = [page_key(i, "mnt") for i in range(16)]
        for p, k in enumerate(keys):
            pool.fill(p, k)
        assert be.batch_set_v1(keys, pool.indices(0, 16)) == [True] * 16
        pool.clear_pages(16, 16, 0xEE)
        assert be.batch_get_v1(keys, pool.indices(16, 16)) == [True] * 16
        assert all(pool.holds(16 + p, k) for p, k in enumerate(keys))
        rows = be.store_stats()["store"]["drives"]
        assert [r["state"] for r in rows] == ["healthy", "degraded"] and rows[0]["objects"] == 32
        assert os.listdir(drives[1]) == []
    finally:
        be.close()
        pool.close()


def test_the_backend_on_one_unmounted_root_with_require_mount_refuses_clearly(tmp_path, mounted):
    from support.backends import make_backend
    from support.host_pool import HostPool

    pool = HostPool(page_num=8)
    try:
        with pytest.raises(DriveNotMountedError, match="mount the drive, or turn ssd_require_mount off"):
            make_backend(str(tmp_path / "nvme0" / "hicache"), pool, ssd_require_mount=True)
        assert os.listdir(tmp_path) == []  # not even the drive's directory
    finally:
        pool.close()


def test_an_mla_follower_serves_the_open_drives_while_one_is_held_out_as_unmounted(tmp_path, mounted):
    """The leader holds drive 1 out (unmounted: no store, no MANIFEST there); the follower opens
    the drives that have the leader's store instead of missing everything, and drive 1 once the
    leader has created its store there."""
    from support.backends import make_backend
    from support.host_pool import HostPool, page_key

    drives, roots = _drives(tmp_path, 2)
    mounted.add(drives[0])
    lpool, fpool = HostPool(page_num=64, mla=True), HostPool(page_num=64, mla=True)
    kw = dict(mla=True, tp_size=2, mode="relaxed", capacity=16 << 20)
    leader = make_backend(roots, lpool, tp_rank=0, **kw)
    follower = make_backend(roots, fpool, tp_rank=1, **kw)
    try:
        assert follower.is_mla_follower and leader.store_dirs == follower.store_dirs == roots
        keys = [page_key(i, "f") for i in range(16)]
        for p, k in enumerate(keys):
            lpool.fill(p, k)
        assert leader.batch_set_v1(keys, lpool.indices(0, 16)) == [True] * 16
        assert [r["state"] for r in leader.store_stats()["store"]["drives"]] == ["healthy", "degraded"]
        assert follower.batch_exists(keys) == 16
        fpool.clear_pages(0, 16, 0xEE)
        assert follower.batch_get_v1(keys, fpool.indices(0, 16)) == [True] * 16
        assert all(fpool.holds(p, k) for p, k in enumerate(keys))
        assert os.listdir(drives[1]) == []  # the follower created nothing there either
        mounted.add(drives[1])  # mounted: the leader's probe creates drive 1's store, the follower's opens it
        assert _wait(lambda: [r["state"] for r in follower.store_stats()["store"]["drives"]] == ["healthy"] * 2)
        more = [page_key(i, "g") for i in range(32)]
        for p, k in enumerate(more):
            lpool.fill(16 + p, k)
        assert _wait(lambda: [r["state"] for r in leader.store_stats()["store"]["drives"]] == ["healthy"] * 2)
        assert leader.batch_set_v1(more, lpool.indices(16, 32)) == [True] * 32
        assert leader.store_stats()["store"]["drives"][1]["objects"] > 0  # new pages went to drive 1 too
        fpool.clear_pages(16, 32, 0xEE)
        assert follower.batch_get_v1(more, fpool.indices(16, 32)) == [True] * 32
        assert all(fpool.holds(16 + p, k) for p, k in enumerate(more))
    finally:
        follower.close()
        leader.close()
        lpool.close()
        fpool.close()


def _wait(pred, timeout_s: float = 30.0) -> bool:
    import time

    end = time.monotonic() + timeout_s
    while time.monotonic() < end and not pred():
        time.sleep(0.05)
    return pred()
