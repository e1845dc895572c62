"""Issue 10, the data path's trust boundaries: batch isolation (defect 4), address arithmetic
(5), late completions (6), a full file system below capacity (11), calls after close (12).

Every test asserts bytes and counts; each fails on main at 5882ae7 / b66e0b0.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest

from conftest import KiB, MiB, mount_tmpfs, payload, small_config
from umbp_nvme.store import space as space_mod
from umbp_nvme.engine import uring as uring_mod
from support.faults import EngineHooks
from support.waits import until
from umbp_nvme.engine.posix import PosixEngine, read_full
from umbp_nvme.store import PageStore
from umbp_nvme.store.hooks import StoreHooks
from umbp_nvme.store.sync import SyncPageStore

OBJ = 16 * KiB
FAKE_DRIVES = "/work/shared/tools/fake-drives"


def pl(key, nbytes: int) -> np.ndarray:
    """conftest.payload for any key, lone surrogates and non-str keys included."""
    return payload(ascii(key), nbytes)


def cfg(**kw):
    return small_config(**kw)


class Arena:
    """One registered numpy range with guard bytes on both sides: any write outside shows."""

    GUARD = 0xEE

    def __init__(self, st, nbytes: int, guard: int = 64 * KiB):
        self.buf = np.full(guard + nbytes + guard, self.GUARD, np.uint8)
        self.guard, self.nbytes = guard, nbytes
        self.base = self.buf.ctypes.data + guard
        self.end = self.base + nbytes
        st.register_memory(self.base, nbytes)

    def inside(self) -> np.ndarray:
        return self.buf[self.guard : self.guard + self.nbytes]

    def guards_intact(self) -> bool:
        g = self.guard
        return bool((self.buf[:g] == self.GUARD).all() and (self.buf[g + self.nbytes :] == self.GUARD).all())

    def at(self, off: int, n: int) -> np.ndarray:
        return self.buf[self.guard + off : self.guard + off + n]


# --------------------------------------------------------------------------- 4. batch isolation


async def test_put_many_bad_keys_fail_alone(store_dir):
    st = await PageStore.open(store_dir, cfg())
    good = [f"g{i}" for i in range(4)]
    bad = ["", "\ud800", "\udcc3\udca9", 5, None, b"bytes", ("t",)]
    escaped = "k\udcff"  # byte 0xFF, escaped: a real key (keybytes), stored like any other
    keys = good[:2] + bad + [escaped] + good[2:]
    bufs = [pl(k, OBJ) for k in keys]
    r = await st.put_many(keys, bufs)
    assert r == [True, True] + [False] * len(bad) + [True, True, True]
    ok_keys = good + [escaped]
    outs = [np.zeros(OBJ, np.uint8) for _ in ok_keys]
    assert await st.get_many(ok_keys, outs) == [True] * 5
    assert all(bytes(o) == bytes(pl(k, OBJ)) for o, k in zip(outs, ok_keys))
    assert st.stats()["objects"] == 5
    await st.close()


async def test_a_bad_key_after_submit_cannot_lose_a_later_acknowledged_batch(store_dir):
    # Before: "\ud800" raised in _pack_pending after the write was submitted; the slots were freed
    # while the (here delayed) write still owned them, the next batch got the same slots, was
    # acknowledged, and the first batch's late write then overwrote it.
    hooks = EngineHooks()
    st = await PageStore.open(store_dir, cfg(), engine_factory=hooks.engine_factory())
    arena = Arena(st, 16 * OBJ)
    entered, release, landed = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def hold_first_write(real, *a):  # the first batch's write waits until the second is acknowledged
        if entered.is_set():
            return await real(*a)
        entered.set()
        await release.wait()
        try:
            return await real(*a)
        finally:
            landed.set()

    hooks.write = hold_first_write
    first = [f"a{i}" for i in range(4)] + ["\ud800"]
    for j in range(4):
        arena.at(j * OBJ, OBJ)[:] = pl(first[j], OBJ)
    second = [f"b{i}" for i in range(4)]
    for j in range(4):
        arena.at((8 + j) * OBJ, OBJ)[:] = pl(second[j], OBJ)
    t1 = asyncio.ensure_future(st.put_many(first, [(arena.base + j * OBJ, OBJ) for j in range(5)]))
    await asyncio.wait_for(entered.wait(), 30)  # the first batch is inside its write now
    try:
        r2 = await asyncio.wait_for(st.put_many(second, [(arena.base + (8 + j) * OBJ, OBJ) for j in range(4)]), 30)
    finally:
        release.set()
    r1 = await t1
    assert r1 == [True] * 4 + [False] and r2 == [True] * 4
    await asyncio.wait_for(landed.wait(), 30)  # the first batch's write has landed, late or not
    arena.inside()[:] = 0
    both = first[:4] + second
    assert await st.get_many(both, [(arena.base + j * OBJ, OBJ) for j in range(8)]) == [True] * 8
    for j, k in enumerate(both):
        assert bytes(arena.at(j * OBJ, OBJ)) == bytes(pl(k, OBJ)), k
    assert arena.guards_intact()
    await st.close()


async def test_bad_buffers_and_refused_ranges_fail_alone(store_dir):
    st = await PageStore.open(store_dir, cfg())
    arena = Arena(st, 8 * OBJ)
    for j in range(8):
        arena.at(j * OBJ, OBJ)[:] = pl(f"k{j}", OBJ)
    a = arena.base
    bufs = [
        (a, OBJ),  # good
        (a + OBJ, 0),
        (a + OBJ, -1),
        (True, OBJ),
        (a + OBJ, True),
        ("x", 4),
        (a + OBJ, 1.5),
        (arena.end, OBJ),  # just past the range
        (np.int64(a + 5 * OBJ), np.int64(OBJ)),  # numpy ints are ints: good
        (a + 6 * OBJ, OBJ, 7),
        (a + 7 * OBJ, OBJ),  # good
    ]
    keys = [f"k{j}" for j in range(len(bufs))]
    r = await st.put_many(keys, bufs)
    assert r == [True] + [False] * 7 + [True, False, True]
    assert st.stats()["bytes_used"] == 3 * OBJ  # the refused keys took no slot
    await st.close()


async def test_get_many_bad_buffers_fail_alone(store_dir):
    st = await PageStore.open(store_dir, cfg())
    arena = Arena(st, 4 * OBJ)
    keys = [f"k{j}" for j in range(6)]
    assert await st.put_many(keys, [pl(k, OBJ) for k in keys]) == [True] * 6
    ro = np.zeros(OBJ, np.uint8)
    ro.flags.writeable = False
    good = np.zeros(OBJ, np.uint8)
    bufs = [good, ro, (arena.base + OBJ, 2**63 - 1), "not a buffer", np.zeros(OBJ - 1, np.uint8), (arena.base, OBJ)]
    assert await st.get_many(keys, bufs) == [True, False, False, False, False, True]
    assert bytes(good) == bytes(pl("k0", OBJ)) and bytes(arena.at(0, OBJ)) == bytes(pl("k5", OBJ))
    assert not ro.any() and (arena.inside()[OBJ:] == Arena.GUARD).all() and arena.guards_intact()
    assert st.stats()["pinned_slots"] == 0
    await st.close()


async def test_bad_depths_fail_alone(store_dir):
    st = await PageStore.open(store_dir, cfg())
    keys = [f"d{i}" for i in range(4)]
    r = await st.put_many(keys, [pl(k, OBJ) for k in keys], depths=[0, None, 1 << 40, 3])
    assert r == [True, False, False, True]
    assert [e.depth for e in st.locate(["d0", "d3"])] == [0, 3]
    keys = [f"n{i}" for i in range(3)]  # a numpy array whose values do not fit int32: no wrap
    r = await st.put_many(keys, [pl(k, OBJ) for k in keys], depths=np.array([1, 1 << 40, 2], np.int64))
    assert r == [True, False, True]
    assert [e.depth for e in st.locate(["n0", "n2"])] == [1, 2]
    await st.close()


@pytest.mark.parametrize("readonly", [False, True])
async def test_get_exists_delete_with_bad_keys_answer_false_alone(store_dir, readonly):
    w = await PageStore.open(store_dir, cfg())
    good = ["g0", "g1", "g\udcff"]
    assert await w.put_many(good, [pl(k, OBJ) for k in good]) == [True] * 3
    st = w
    if readonly:
        await w.close()
        st = await PageStore.open(store_dir, cfg(), readonly=True)
    keys = ["g0", "", "\ud800", 5, ["unhashable"], None, "g\udcff", "x" * 4000, "g1"]
    want = [True, False, False, False, False, False, True, False, True]
    outs = [np.zeros(OBJ, np.uint8) for _ in keys]
    assert await st.get_many(keys, outs) == want
    assert bytes(outs[6]) == bytes(pl("g\udcff", OBJ)) and bytes(outs[8]) == bytes(pl("g1", OBJ))
    assert await st.exists_many(keys) == want
    assert await st.exists_prefix(keys) == 1
    assert await st.exists_prefix(["g0", "g1", "g\udcff", "\ud800"]) == 3
    if not readonly:
        assert await st.delete_many(keys) == want
        assert await st.exists_many(good) == [False] * 3
    await st.close()


class BlockingMemmove:
    """A ``StoreHooks.memmove`` (the store's bounce copies) that, once ``armed``, waits for
    ``release``; ``entered`` says when a copy started."""

    def __init__(self):
        self.armed, self.entered, self.release = False, threading.Event(), threading.Event()
        self.hooks = StoreHooks(memmove=self)

    def __call__(self, dst, src, n):
        if self.armed:
            self.entered.set()
            self.release.wait(10)
        return ctypes.memmove(dst, src, n)


async def test_cancelled_put_returns_only_after_its_staging_copy(store_dir):
    mm = BlockingMemmove()
    st = await PageStore.open(store_dir, cfg(o_direct=True), hooks=mm.hooks)
    assert await st.put_many(["w"], [pl("w", OBJ)]) == [True]  # opens a segment file
    if not st.stats()["o_direct"]:
        pytest.skip("the store's file system takes no O_DIRECT: nothing is staged")
    mm.armed = True
    entered, release = mm.entered, mm.release
    n = OBJ + 100  # not a whole block: staged through a bounce buffer
    task = asyncio.ensure_future(st.put_many(["s"], [pl("s", n)]))
    assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, 5)
    task.cancel()
    await asyncio.sleep(0.1)
    assert not task.done()  # the copy thread still writes the bounce buffer
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert st.stats()["bytes_used"] == OBJ and st.keys() == ["w"]  # nothing published, the slot is free
    mm.armed = False
    assert await st.put_many(["t"], [pl("t", n)]) == [True]
    out = np.zeros(n, np.uint8)
    assert await st.get_many(["t"], [out]) == [True] and bytes(out) == bytes(pl("t", n))
    await st.close()


async def test_cancelled_get_returns_only_after_its_copy_into_the_caller(store_dir):
    mm = BlockingMemmove()
    st = await PageStore.open(store_dir, cfg(o_direct=True), hooks=mm.hooks)
    assert await st.put_many(["g"], [pl("g", OBJ)]) == [True]
    if not st.stats()["o_direct"]:
        pytest.skip("the store's file system takes no O_DIRECT: nothing is bounced")
    mm.armed = True
    entered, release = mm.entered, mm.release
    raw = np.zeros(OBJ + 1, np.uint8)
    out = raw[1:]  # misaligned: read through a bounce buffer, then copied in by a worker thread
    task = asyncio.ensure_future(st.get_many(["g"], [out]))
    assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, 5)
    task.cancel()
    await asyncio.sleep(0.1)
    assert not task.done()  # the copy into the caller's memory is still running
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert bytes(out) == bytes(pl("g", OBJ))  # it finished before get_many ended, not after
    assert st.stats()["pinned_slots"] == 0
    await st.close()


# --------------------------------------------------------------------------- 5. range arithmetic


async def test_range_check_cannot_be_bypassed_by_overflow(store_dir):
    st = await PageStore.open(store_dir, cfg())
    arena = Arena(st, 4 * OBJ)
    assert await st.put_many(["x"], [pl("x", OBJ)]) == [True]
    near_end = arena.end - 4096  # a read of OBJ bytes here would run 12 KiB past the range
    lengths = [2**63 - 1, 2**63, 2**64 - 1, 2**64 + OBJ, 2**32, 2**32 + OBJ, -1, -(2**63), 0, True]
    for nb in lengths + [np.int64(2**63 - 1), np.uint64(2**64 - 1)]:
        assert await st.get_many(["x"], [(near_end, nb)]) == [False], nb
    # the vectorised path for a batch of pairs: one good pair and one huge length
    r = await st.get_many(["x", "x"], [(arena.base, OBJ), (near_end, 2**63 - 1)])
    assert r == [True, False]
    for addr in (2**63, 2**64 - 4096, -arena.base, near_end - 2**64):
        assert await st.get_many(["x"], [(addr, OBJ)]) == [False]
    assert bytes(arena.at(0, OBJ)) == bytes(pl("x", OBJ))
    assert (arena.inside()[OBJ:] == Arena.GUARD).all() and arena.guards_intact()
    for nb in lengths:
        assert await st.put_many([f"p{nb}"], [(near_end, nb)]) == [False]
    await st.close()


async def test_register_memory_refuses_ranges_that_wrap(store_dir):
    st = await PageStore.open(store_dir, cfg())
    for a, n in [(1 << 40, 2**63), (2**63 - 4096, 8192), (-4096, 8192), (4096, 0), (4096, -1)]:
        with pytest.raises(ValueError):
            st.register_memory(a, n)
    for a, n in [(True, 4096), (4096, 1.5), ("4096", 4096), (4096, None)]:
        with pytest.raises(TypeError):
            st.register_memory(a, n)
    mem = np.zeros(4096, np.uint8)  # (a range must be mapped readable and writable: store/mapped.py)
    st.register_memory(np.uint64(mem.ctypes.data), np.int64(4096))  # numpy ints are ints
    assert st.registered_memory() == [(mem.ctypes.data, 4096)]
    await st.close()


# --------------------------------------------------------------------------- 6. late completions


class FifoReads:
    """An engine_factory whose engines, once ``stall()`` is called, read every object from an empty
    FIFO: the read hangs in the kernel until the test writes the bytes. The store is opened with
    o_direct=False, so there is no bounce buffer: the read lands straight in the caller's memory.

    ``blocking_posix=True``: the engines are posix ones whose worker reads the FIFO with a plain
    blocking readv (preadv refuses a FIFO with ESPIPE), a kernel call no one can cancel, as a read
    from a hung drive; ``entered`` says when it started."""

    def __init__(self, tmp_path, *, blocking_posix: bool = False):
        path = str(tmp_path / "fifo")
        os.mkfifo(path)
        self.rfd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self.wfd = os.open(path, os.O_WRONLY)
        os.set_blocking(self.rfd, True)
        self.entered = threading.Event()
        self.hooks = EngineHooks(self._posix_engine if blocking_posix else None)

    def _read_op(self, fd, offset, addr, nbytes):
        if fd != self.rfd:
            return read_full(fd, offset, addr, nbytes)
        self.entered.set()
        return os.readv(fd, [(ctypes.c_char * nbytes).from_address(addr)])

    async def _posix_engine(self, backend, queue_depth):
        return PosixEngine(queue_depth, read_op=self._read_op)

    def engine_factory(self):
        return self.hooks.engine_factory()

    def stall(self) -> None:
        async def read(real, fds, offsets, addrs, lengths):
            # the pipe as a bare fd: a page-cache file to the engine, as a FIFO is
            return await real(np.full_like(fds.fds, self.rfd), offsets, addrs, lengths)

        self.hooks.read = read

    def close(self) -> None:
        os.close(self.wfd)
        os.close(self.rfd)


async def test_a_stalled_read_never_lands_in_the_caller_after_get_returned(store_dir, tmp_path, monkeypatch):
    # Before: io_uring drained a cancelled batch for at most DRAIN_TIMEOUT_S, then get_many
    # returned False; the read landed in the caller's buffer afterwards.
    monkeypatch.setattr(uring_mod, "DRAIN_TIMEOUT_S", 0.3, raising=False)
    fifo = FifoReads(tmp_path)
    st = await PageStore.open(store_dir, cfg(io_timeout_s=0.3, ssd_io_backend="io_uring", o_direct=False),
                              engine_factory=fifo.engine_factory())  # fmt: skip
    assert await st.put_many(["x"], [pl("x", OBJ)]) == [True]
    fifo.stall()
    wfd = fifo.wfd
    out = np.zeros(OBJ, np.uint8)
    try:
        t0 = time.monotonic()
        task = asyncio.ensure_future(st.get_many(["x"], [out]))
        await asyncio.wait({task}, timeout=5)
        if not task.done():  # a kernel that cannot cancel the pipe read: the get must still wait
            assert st.stats()["stalled_ops"] == 1 and st.stats()["late_completions"] == 0
            os.write(wfd, b"\xab" * OBJ)
            assert await asyncio.wait_for(task, 30) == [False]
            assert bytes(out) == b"\xab" * OBJ  # landed before get_many returned
        else:  # io_uring cancelled the read (IORING_OP_ASYNC_CANCEL)
            assert task.result() == [False] and time.monotonic() - t0 >= 0.3
            os.write(wfd, b"\xab" * OBJ)  # the late bytes: nobody may read them into `out` now
            await asyncio.sleep(0.3)
            assert not out.any()
        s = st.stats()
        assert s["stalled_ops"] == 1 and s["late_completions"] == 1 and s["timeouts"] == 1
        landed = bytes(out)
        await asyncio.sleep(0.1)
        assert bytes(out) == landed  # and nothing after the return
    finally:
        fifo.hooks.read = None
        fifo.close()
    await st.close()


async def test_an_uncancellable_stalled_read_holds_the_call_until_it_ends(store_dir, tmp_path):
    # posix threads in preadv cannot be cancelled: get_many waits for the read, however long
    fifo = FifoReads(tmp_path, blocking_posix=True)
    st = await PageStore.open(store_dir, cfg(io_timeout_s=0.5, ssd_io_backend="posix", o_direct=False),
                              engine_factory=fifo.engine_factory())  # fmt: skip
    assert await st.put_many(["x"], [pl("x", OBJ)]) == [True]
    fifo.stall()
    wfd, entered = fifo.wfd, fifo.entered
    out = np.zeros(OBJ, np.uint8)
    try:
        task = asyncio.ensure_future(st.get_many(["x"], [out]))
        assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, 5)  # the read runs
        # io_timeout_s passed (waited for, not slept: a loaded loop may run its timer late)
        assert await until(lambda: st.stats()["stalled_ops"] == 1, 30)
        assert not task.done()  # the read still runs: the call waits for it
        assert st.stats()["late_completions"] == 0
        os.write(wfd, b"\xab" * OBJ)
        assert await asyncio.wait_for(task, 30) == [False]
        landed = bytes(out)
        assert landed == b"\xab" * OBJ  # it landed before get_many returned
        assert st.stats()["late_completions"] == 1
    finally:
        fifo.hooks.read = None
        fifo.close()
    await st.close()


def test_sync_get_never_returns_while_the_store_waits_for_the_kernel(store_dir, tmp_path):
    fifo = FifoReads(tmp_path, blocking_posix=True)
    s = SyncPageStore(store_dir, cfg(io_timeout_s=0.3, ssd_io_backend="posix", o_direct=False),
                      engine_factory=fifo.engine_factory(), call_slack_s=0.1)  # the call's limit: 4 x 0.3 + 0.1 s
    assert s.put_many(["x"], [pl("x", OBJ)]) == [True]
    fifo.stall()
    wfd, entered = fifo.wfd, fifo.entered
    out = np.zeros(OBJ, np.uint8)
    done = threading.Event()
    result = []

    def call():
        result.append(s.get_many(["x"], [out]))
        done.set()

    th = threading.Thread(target=call)
    try:
        th.start()
        assert entered.wait(30)  # the read runs
        assert not done.wait(2.5)  # the sync limit (1.3 s) passed long ago: still waiting
        os.write(wfd, b"\xab" * OBJ)
        assert done.wait(30) and result == [[False]]
        assert bytes(out) == b"\xab" * OBJ  # landed before the call returned, never after
    finally:
        if not done.is_set():
            os.write(wfd, b"\0" * OBJ)
        th.join(5)
        fifo.hooks.read = None
        fifo.close()
    s.close()


_FD_ROOT = "/tmp/fake-drives-trust"  # a root of our own: other tests' drives are left alone


def _fake_drives(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, FAKE_DRIVES_ROOT=_FD_ROOT)
    return subprocess.run([FAKE_DRIVES, *args], capture_output=True, text=True, timeout=120, env=env)


def _cgroup_procs() -> str | None:
    """The fake-drives cgroup's procs file: its caps apply only to processes inside it."""
    for p in ("/sys/fs/cgroup/blkio/fake_drives/cgroup.procs", "/sys/fs/cgroup/fake_drives/cgroup.procs"):
        if os.path.exists(p):
            return p
    return None


async def test_a_real_device_stall_holds_the_get_until_the_drive_resumes(monkeypatch):
    monkeypatch.setattr(uring_mod, "DRAIN_TIMEOUT_S", 0.3, raising=False)  # before: the drain gave up
    if os.geteuid() != 0 or not os.path.exists(FAKE_DRIVES) or shutil.which("losetup") is None:
        pytest.skip("needs root, losetup and the fake-drives tool")
    r = _fake_drives("up", "1", "--size", "256M")
    if r.returncode != 0:
        _fake_drives("down")
        pytest.skip(f"fake-drives up failed: {r.stderr.strip()}")
    procs = _cgroup_procs()
    lines = [ln.split(":", 2) for ln in open("/proc/self/cgroup").read().split()]
    v1 = procs is not None and "/blkio/" in procs
    home = next((p for _, c, p in lines if (c == "blkio" if v1 else c == "")), "/")
    home_procs = ("/sys/fs/cgroup/blkio" if v1 else "/sys/fs/cgroup") + home.rstrip("/") + "/cgroup.procs"
    st = None
    try:
        if procs is None or not os.path.exists(home_procs):
            pytest.skip("no blkio/io cgroup for fake-drives here")
        with open(procs, "w") as f:
            f.write(str(os.getpid()))  # into the capped cgroup: the stall applies to our reads
        path = os.path.join(_FD_ROOT, "d0", "store")
        st = await PageStore.open(path, cfg(io_timeout_s=0.3, o_direct=True, ssd_io_backend="io_uring"))
        keys = [f"r{i}" for i in range(8)]
        assert await st.put_many(keys, [pl(k, 64 * KiB) for k in keys]) == [True] * 8
        assert st.stats()["o_direct"]
        outs = [np.zeros(64 * KiB, np.uint8) for _ in keys]
        resumed = False
        assert _fake_drives("stall", "0").returncode == 0
        try:
            task = asyncio.ensure_future(st.get_many(keys, outs))
            assert await until(lambda: st.stats()["stalled_ops"] >= 1, 30)  # io_timeout_s passed
            hung = not task.done()
            assert _fake_drives("resume", "0").returncode == 0
            resumed = True
            res = await asyncio.wait_for(task, 60)
        finally:
            if not resumed:
                _fake_drives("resume", "0")
        s = st.stats()
        assert hung and s["stalled_ops"] >= 1  # the get did not return while the drive held its reads
        assert s["late_completions"] == s["stalled_ops"] and res == [False] * 8
        before = [bytes(o) for o in outs]
        await asyncio.sleep(0.2)
        assert [bytes(o) for o in outs] == before  # nothing lands after the return
        again = [np.zeros(64 * KiB, np.uint8) for _ in keys]
        assert await st.get_many(keys, again) == [True] * 8
        assert all(bytes(o) == bytes(pl(k, 64 * KiB)) for o, k in zip(again, keys))
    finally:
        if st is not None:
            await st.close()
        with open(home_procs, "w") as f:
            f.write(str(os.getpid()))
        _fake_drives("down")


# --------------------------------------------------------------------------- 11. ENOSPC


class _Clock:
    """store/space.py's clock, moved forward by hand: the retry interval passes without a sleep."""

    def __init__(self):
        self.ahead_s = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead_s


async def test_a_full_file_system_below_capacity_keeps_caching_within_the_segments_it_has(tmp_path, monkeypatch):
    # Before: every batch failed whole from the fill on. Now the segments the store has become its
    # effective capacity; it evicts within them, keeps caching, and grows back once there is room.
    clock = _Clock()
    monkeypatch.setattr(space_mod, "time", clock)
    mnt = str(tmp_path / "small")
    why = mount_tmpfs(mnt, "8m")
    if why:
        pytest.skip(why)
    try:
        path = os.path.join(mnt, "store")
        c = cfg(ssd_capacity_bytes=64 * MiB, ssd_segment_size_bytes=1 * MiB, o_direct=True)
        st = await PageStore.open(path, c)
        stored = []
        for b in range(20):  # 20 MiB into an 8 MiB file system
            ks = [f"p{b}-{j}" for j in range(8)]
            r = await st.put_many(ks, [pl(k, 128 * KiB) for k in ks])
            stored.append(sum(r))
        s = st.stats()
        assert s["capacity_bytes"] == 64 * MiB and MiB <= s["effective_capacity_bytes"] < 8 * MiB, s
        assert stored[-10:] == [8] * 10, stored  # every batch after the fill is stored whole
        last = [f"p19-{j}" for j in range(8)]
        assert await st.exists_many(last) == [True] * 8
        present = st.keys()
        assert set(last) <= set(present) and len(present) < 160
        outs = [np.zeros(128 * KiB, np.uint8) for _ in present]
        assert await st.get_many(present, outs) == [True] * len(present)
        assert all(bytes(o) == bytes(pl(k, 128 * KiB)) for o, k in zip(outs, present))
        # room again: once the retry interval has passed the store grows back to its capacity
        subprocess.run(["mount", "-o", "remount,size=96m", mnt], check=True, capture_output=True)
        clock.ahead_s += space_mod.GROW_RETRY_S
        ks = [f"q{j}" for j in range(32)]
        assert await st.put_many(ks, [pl(k, 128 * KiB) for k in ks]) == [True] * 32
        assert st.stats()["effective_capacity_bytes"] == 64 * MiB
        await st.close()
        st = await PageStore.open(path, c)  # what it kept survives a reopen; growing evicted nothing
        assert await st.exists_many(present + ks) == [True] * (len(present) + 32)
        await st.close()
    finally:
        subprocess.run(["umount", "-l", mnt], capture_output=True)


# --------------------------------------------------------------------------- 12. after close


def _tree(path: str) -> dict:
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            p = os.path.join(d, f)
            st = os.lstat(p)
            out[p] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.parametrize("readonly", [False, True])
async def test_every_call_after_close_answers_false_and_logs_once(store_dir, readonly, caplog):
    w = await PageStore.open(store_dir, cfg())
    keys = ["a", "b"]
    assert await w.put_many(keys, [pl(k, OBJ) for k in keys]) == [True, True]
    st = w
    if readonly:
        await w.close()
        st = await PageStore.open(store_dir, cfg(), readonly=True)
    await st.close()
    before = _tree(store_dir)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="umbp_nvme"):
        for _ in range(50):
            if not readonly:
                assert await st.put_many(["c"], [pl("c", OBJ)]) == [False]
                assert await st.delete_many(keys) == [False, False]
            assert await st.get_many(keys, [np.zeros(OBJ, np.uint8) for _ in keys]) == [False, False]
            assert await st.exists_many(keys) == [False, False]
            assert st.exists_many_nowait(keys) == [False, False]
            assert await st.exists_prefix(keys) == 0
            assert await st.flush() is False
    assert _tree(store_dir) == before
    lines = [r for r in caplog.records if "close" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]


def test_sync_store_after_close_answers_false_and_logs_once(store_dir, caplog):
    s = SyncPageStore(store_dir, cfg())
    assert s.put_many(["a"], [pl("a", OBJ)]) == [True]
    s.close()
    before = _tree(store_dir)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="umbp_nvme"):
        t0 = time.monotonic()
        for _ in range(50):
            assert s.put_many(["c"], [pl("c", OBJ)]) == [False]
            assert s.get_many(["a"], [np.zeros(OBJ, np.uint8)]) == [False]
            assert s.delete_many(["a"]) == [False]
            assert s.exists_many(["a"]) == [False]
            assert s.exists_prefix(["a"]) == 0
            assert s.flush() is False
            assert s.register_memory(1 << 40, 4096) is False
        assert s.stats()["objects"] == 1 and s.stats()["puts"] == 1  # the last counters; the calls counted nothing
        assert time.monotonic() - t0 < 30  # a hang guard: no call waits on the stopped loop
    assert _tree(store_dir) == before
    lines = [r for r in caplog.records if "close" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]


def test_sglang_backend_after_close_answers_false_without_opening_anything(root, caplog):
    from support import sglang_env as E

    E.require_sglang()
    pool = E.mha_pool()
    backend = E.load_backend(E.storage_config(root), pool.host)
    hashes = E.page_hashes(4)
    idx = pool.alloc_pages(4)
    assert backend.batch_set_v1(hashes, idx) == [True] * 4
    backend.close()
    before = _tree(root)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="umbp_nvme"):
        for _ in range(50):
            assert backend.batch_set_v1(hashes, idx) == [False] * 4
            assert backend.batch_get_v1(hashes, idx) == [False] * 4
            assert backend.batch_exists(hashes) == 0
            assert backend.exists(hashes[0]) is False
    assert _tree(root) == before
    lines = [r for r in caplog.records if "close" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
