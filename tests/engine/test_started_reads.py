"""Reads the io_uring engine submits before the call returns (engine/uring_started.py: the get
path's one engine batch): in flight when start_read_crc returns, the bytes and their CRCs at
finish_read, and the memory rules of read_many: a deadline cancels the ops and the wait goes on
until the kernel let go; a cancelled await returns only then. Through a store: a get whose
started read hangs times out, counted, and returns only once the read has ended."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os

import numpy as np
import pytest

from conftest import small_config

import umbp_nvme._uring  # noqa: F401 - required: a missing extension fails here
from umbp_nvme._uring import crc32c
from umbp_nvme.buffers import AlignedBuffer
from umbp_nvme.engine import open_engine
from umbp_nvme.engine.arbiter import Arbiter
from umbp_nvme.engine.priority import IoPriorities
from umbp_nvme.engine.uring import open_uring_engine
from umbp_nvme.store import PageStore


def _addr(a: np.ndarray, off: int = 0) -> np.ndarray:
    return np.array([a.ctypes.data + off], np.uint64)


async def _ended(fut, w: int, nbytes: int = 64) -> bool:
    """Whether ``fut`` ended within 30 s; if not, the pipe is written so the read completes and the
    test fails on its assertion instead of hanging."""
    await asyncio.wait({fut}, timeout=30)
    if fut.done():
        return True
    os.write(w, b"x" * nbytes)
    await asyncio.wait({fut})
    return False


async def test_a_started_read_is_submitted_when_start_returns_and_gives_bytes_and_crcs(tmp_path):
    e = await open_uring_engine(16)
    data = os.urandom(3 * 4096)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    buf = np.zeros(3 * 4096, np.uint8)
    arb = Arbiter()
    e.set_io_policy(IoPriorities(), arb)
    try:
        offs = np.arange(3, dtype=np.int64) * 4096
        b = e.start_read_crc(fd, offs, buf.ctypes.data + offs.astype(np.uint64), np.full(3, 4096), np.array([4096, 100, 0]))
        assert b is not None and e.inflight == 3 and arb.reads_about()  # submitted: no await yet
        res, crcs = await e.finish_read(b)
        assert res.tolist() == [4096] * 3 and buf.tobytes() == data
        assert crcs.tolist() == [crc32c(data[:4096]), crc32c(data[4096:4196]), -1]  # 0: no CRC asked
        assert e.inflight == 0
        with pytest.raises(ValueError, match="crc_lens"):
            e.start_read_crc(fd, offs, buf.ctypes.data + offs.astype(np.uint64), np.full(3, 4096), np.zeros(2))
        assert e.inflight == 0  # refused before anything was submitted
        assert e.start_read_crc(fd, [0], [buf.ctypes.data], [4096], [4096]) is None  # lists: the general path's
    finally:
        e.close()
        os.close(fd)


async def test_a_started_read_abandoned_at_its_deadline_ends_once_the_kernel_let_go():
    e = await open_uring_engine(8)
    r, w = os.pipe()  # nothing is ever written: the read hangs until cancelled
    buf = np.zeros(64, np.uint8)
    try:
        b = e.start_read_crc(r, np.zeros(1, np.int64), _addr(buf), np.full(1, 64), np.full(1, 64))
        assert b is not None and e.inflight == 1
        done = asyncio.ensure_future(e.finish_read(b))
        await asyncio.sleep(0.05)
        assert not done.done()
        e.abandon(b)
        assert await _ended(done, w)  # the kernel let go of the cancelled read
        res, crcs = done.result()
        assert res.tolist() == [-errno.ECANCELED] and crcs.tolist() == [-1] and e.inflight == 0
        e.abandon(b)  # ended: nothing more to do
    finally:
        e.close()
        os.close(r), os.close(w)


async def test_a_cancelled_finish_read_returns_only_after_its_ops_ended():
    e = await open_uring_engine(8)
    arb = Arbiter()
    e.set_io_policy(IoPriorities(), arb)
    r, w = os.pipe()
    buf = np.zeros(64, np.uint8)
    try:
        b = e.start_read_crc(r, np.zeros(1, np.int64), _addr(buf), np.full(1, 64), np.full(1, 64))
        task = asyncio.ensure_future(e.finish_read(b))
        await asyncio.sleep(0)
        task.cancel()
        assert await _ended(task, w)
        assert task.cancelled()
        assert e.inflight == 0 and b.left == 0  # the kernel let go before the await returned
        assert arb.stats["reads"] == 1 and arb.reads_in_flight == 0  # told the read ended
    finally:
        e.close()
        os.close(r), os.close(w)


class PipeReads:
    """The real engine, reading a pipe nobody writes (a drive that hangs) for its started reads (the
    get path's data batch) with ``data``, for its other reads (a get's record blocks after an open)
    with ``records``."""

    def __init__(self, inner, fd: int, *, data: bool = True, records: bool = False):
        self.inner, self.fd, self.data, self.records = inner, fd, data, records

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def start_read_crc(self, files, offsets, addrs, lengths, crc_lens):
        if not self.data:
            return self.inner.start_read_crc(files, offsets, addrs, lengths, crc_lens)
        return self.inner.start_read_crc(self.fd, np.zeros(len(lengths), np.int64), addrs, lengths, crc_lens)

    async def read_many(self, files, offsets, addrs, lengths):
        if not self.records:
            return await self.inner.read_many(files, offsets, addrs, lengths)
        return await self.inner.read_many(self.fd, np.zeros(len(lengths), np.int64), addrs, lengths)


class HangingStore:
    """``async with HangingStore(store_dir, timeout_s) as h``: a store whose started reads hang on a
    pipe (``h.w`` writes it), one 8 KiB object "k" stored from registered memory (``h.mem[:8192]``),
    ``h.get()`` a task getting it into the registered memory after it (a started read)."""

    def __init__(self, store_dir, timeout_s: float):
        self.store_dir, self.timeout_s = store_dir, timeout_s
        self.engines: list = []

    async def __aenter__(self):
        self.r, self.w = os.pipe()

        async def factory(backend, qd):
            e = PipeReads(await open_engine(backend, qd), self.r)
            self.engines.append(e)
            return e

        self.st = await PageStore.open(self.store_dir, small_config(ssd_io_backend="io_uring", io_timeout_s=self.timeout_s),
                                       engine_factory=factory)  # fmt: skip
        self.mem = AlignedBuffer(2 * 8192)  # registered, aligned: the get's read is started (nothing bounced)
        self.st.register_memory(self.mem.address, self.mem.nbytes)
        self.mem.array[:8192] = np.frombuffer(os.urandom(8192), np.uint8)
        assert await self.st.put_many(["k"], [(self.mem.address, 8192)]) == [True]
        return self

    def get(self) -> asyncio.Future:
        return asyncio.ensure_future(self.st.get_many(["k"], [(self.mem.address + 8192, 8192)]))

    def idle(self) -> bool:
        return all(e.inflight == 0 for e in self.engines)

    async def __aexit__(self, *exc):
        await self.st.close()
        self.mem.close()
        os.close(self.r), os.close(self.w)


async def test_a_get_whose_started_read_hangs_times_out_and_returns_after_it_ended(store_dir):
    async with HangingStore(store_dir, 0.2) as h:
        get = h.get()
        assert await _ended(get, h.w, 8192)
        assert get.result() == [False]  # the read outlived io_timeout_s: a miss
        c = h.st.counters()
        assert c["timeouts"] == 1 and c["hits"] == 0
        assert h.idle()  # the get returned once its read had ended
        assert h.st.stats()["late_completions"] == 1


async def test_a_get_cancelled_while_its_started_read_hangs_ends_after_the_read_and_unpins(store_dir):
    async with HangingStore(store_dir, 30.0) as h:
        get = h.get()
        for _ in range(100):  # until the read is in flight (submitted from the get's own step)
            await asyncio.sleep(0.01)
            if not h.idle():
                break
        assert not h.idle()
        get.cancel()
        assert await _ended(get, h.w, 8192)  # the cancel asked the kernel to let go, and it did
        assert get.cancelled() and h.idle()
        assert not h.st.writer.rows.pins.any()  # the row's pin went with the read: eviction may take it
        out = np.zeros(8192, np.uint8)  # not registered: bounced, read through the engine's task path (the file)
        assert await h.st.get_many(["k"], [out]) == [True] and out.tobytes() == h.mem.array[:8192].tobytes()


@contextlib.asynccontextmanager
async def reopened(store_dir, timeout_s: float = 0.2, **hang):
    """HangingStore's store, reopened with ``io_timeout_s=timeout_s`` on engines whose reads hang as
    ``hang`` says (PipeReads): (the store, 8 KiB of registered memory, the pipe's write end, the engines)."""
    r, w = os.pipe()
    engines: list = []

    async def factory(backend, qd):
        engines.append(PipeReads(await open_engine(backend, qd), r, **hang))
        return engines[-1]

    st = await PageStore.open(store_dir, small_config(ssd_io_backend="io_uring", io_timeout_s=timeout_s),
                              engine_factory=factory)  # fmt: skip
    mem = AlignedBuffer(8192)
    try:
        st.register_memory(mem.address, mem.nbytes)
        yield st, mem, w, engines
    finally:
        await st.close()
        mem.close()
        os.close(r), os.close(w)


async def test_a_get_after_an_open_whose_data_and_record_reads_hang_ends_both_and_leaves_no_task(store_dir):
    # after an open the records are on disk: the get's record blocks are a batch of their own, started
    # while its data is in flight; a timed-out data read must end that batch too before the get returns
    async with HangingStore(store_dir, 0.2):
        pass  # "k" stored, the store closed
    async with reopened(store_dir, records=True) as (st, mem, w, engines):
        get = asyncio.ensure_future(st.get_many(["k"], [(mem.address, 8192)]))
        assert await _ended(get, w, 3 * 8192)
        assert get.result() == [False] and st.counters()["timeouts"] >= 1  # the data's; the records' may time out too
        assert all(e.inflight == 0 for e in engines)  # the record batch ended with the data's
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()
                and "_confirmed" in repr(t.get_coro())]  # fmt: skip
        assert left == []


async def test_a_get_whose_record_read_hangs_answers_at_the_timeout_from_the_index(store_dir):
    # the data is read; the record blocks that confirm its key hang: the get must not wait for them
    # past io_timeout_s, and then the index confirms the key (the same bytes, nothing taken for damage)
    async with HangingStore(store_dir, 0.2) as h:
        want = h.mem.array[:8192].tobytes()
    # the data's real read must end inside io_timeout_s, on a loaded CI machine too: 1 s, not 0.2
    async with reopened(store_dir, 1.0, data=False, records=True) as (st, mem, w, engines):
        get = asyncio.ensure_future(st.get_many(["k"], [(mem.address, 8192)]))
        assert await _ended(get, w, 4096)  # a get that waited for the records would need the pipe written
        assert get.result() == [True] and mem.array.tobytes() == want
        c = st.counters()
        assert c["timeouts"] == 1 and c["crc_errors"] == 0 and st.stats()["objects"] == 1
        assert all(e.inflight == 0 for e in engines)
