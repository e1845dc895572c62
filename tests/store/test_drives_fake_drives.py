"""A really stalled drive (the fake-drives tool: loop devices with per-drive bandwidth caps, one
of them dropped to ~0): later batches complete without it, it is reported degraded, the batch
that touched it returns only once the kernel let go, and after resume it rejoins and serves its
pages again. Needs root, losetup and a blkio/io cgroup; skips with the reason otherwise."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time

import numpy as np
import pytest

from conftest import payload, small_config
from umbp_nvme.store import PageStore
from support.waits import until

FAKE_DRIVES = "/work/shared/tools/fake-drives"
_ROOT = "/tmp/fake-drives-multi"  # a root of our own: other drives are left alone
OBJ = 64 << 10


def _fd(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, FAKE_DRIVES_ROOT=_ROOT)
    return subprocess.run([FAKE_DRIVES, *args], capture_output=True, text=True, timeout=120, env=env)


def _cgroups() -> tuple[str, str] | None:
    """(the fake-drives cgroup's procs file, ours to return to), or None without one."""
    procs = next((p for p in ("/sys/fs/cgroup/blkio/fake_drives/cgroup.procs", "/sys/fs/cgroup/fake_drives/cgroup.procs")
                  if os.path.exists(p)), None)  # fmt: skip
    if procs is None:
        return None
    v1 = "/blkio/" in procs
    lines = [ln.split(":", 2) for ln in open("/proc/self/cgroup").read().split()]
    home = next((p for _, c, p in lines if (c == "blkio" if v1 else c == "")), "/")
    home_procs = ("/sys/fs/cgroup/blkio" if v1 else "/sys/fs/cgroup") + home.rstrip("/") + "/cgroup.procs"
    return (procs, home_procs) if os.path.exists(home_procs) else None


async def _get(st, keys):
    outs = [np.zeros(OBJ, np.uint8) for _ in keys]
    res = await st.get_many(keys, outs)
    wrong = sum(1 for ok, k, o in zip(res, keys, outs) if ok and not np.array_equal(o, payload(k, OBJ)))
    return res, wrong


@pytest.mark.timeout(180)
async def test_fake_drives_a_stalled_drive_is_skipped_then_rejoins_and_serves_its_pages():
    if os.geteuid() != 0 or not os.path.exists(FAKE_DRIVES) or shutil.which("losetup") is None:
        pytest.skip("needs root, losetup and the fake-drives tool")
    r = _fd("up", "3", "--size", "256M")
    if r.returncode != 0:
        _fd("down")
        pytest.skip(f"fake-drives up failed: {r.stderr.strip()}")
    cg = _cgroups()
    st = stuck = None
    resumed = True
    try:
        if cg is None:
            pytest.skip("no blkio/io cgroup for fake-drives here")
        with open(cg[0], "w") as f:
            f.write(str(os.getpid()))  # into the capped cgroup: the stall applies to our I/O
        roots = [os.path.join(_ROOT, f"d{i}", "store") for i in range(3)]
        cfg = small_config(io_timeout_s=0.5, o_direct=True, ssd_io_backend="io_uring")
        st = await PageStore.open(roots, cfg, probe_interval_s=0.2)
        keys = [f"s{i:03d}_0_{c}" for i in range(30) for c in "kv"]
        assert await st.put_many(keys, [payload(k, OBJ) for k in keys]) == [True] * 60
        assert st.stats()["o_direct"]
        where = st.drive_of(keys)
        on2 = [k for k, d in zip(keys, where) if d == 2]
        assert on2 and len(on2) < 60
        resumed = False
        assert _fd("stall", "2").returncode == 0
        stuck = asyncio.ensure_future(_get(st, keys))  # touches the stalled drive
        assert await until(lambda: st.stats()["drives"][2]["state"] == "degraded", 30)
        row = st.stats()["drives"][2]
        assert "io_timeout_s" in row["reason"]
        assert not stuck.done()  # the kernel still owns its reads: the batch has not returned
        t0 = time.monotonic()
        res, wrong = await _get(st, keys)  # a later batch skips the drive without waiting
        assert time.monotonic() - t0 < 30  # a hang guard (a speed bound failed on a loaded machine)
        assert wrong == 0 and res == [d != 2 for d in where]
        assert st.exists_many_nowait(on2) == [False] * len(on2)
        fresh = [f"n{i:03d}_0_{c}" for i in range(10) for c in "kv"]
        assert await st.put_many(fresh, [payload(k, OBJ) for k in fresh]) == [True] * 20
        assert 2 not in st.drive_of(fresh)
        assert _fd("resume", "2").returncode == 0
        resumed = True
        res, wrong = await asyncio.wait_for(stuck, 60)
        assert wrong == 0  # its drive-2 objects are misses, never late bytes
        assert await until(lambda: st.stats()["drives"][2]["state"] == "healthy", 10.0)
        res, wrong = await _get(st, keys + fresh)
        assert res == [True] * 80 and wrong == 0  # the drive's surviving pages are served again
    finally:
        if not resumed:
            _fd("resume", "2")
        if stuck is not None and not stuck.done():
            await asyncio.wait_for(stuck, 60)
        if st is not None:
            await st.close()
        if cg is not None:
            with open(cg[1], "w") as f:
                f.write(str(os.getpid()))
        _fd("down")
