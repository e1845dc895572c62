"""PosixEngine: round trips, per-op errno, short transfers, sync, cancel and close in flight."""

from __future__ import annotations

import asyncio
import errno
import os
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from umbp_nvme.buffers import AlignedBuffer
from umbp_nvme.engine import EngineClosed, IoEngine, open_data_file
from umbp_nvme.engine import posix as posix_mod
from umbp_nvme.engine.posix import PosixEngine

from support.waits import until

MiB = 1 << 20


@pytest.fixture
async def engine():
    eng = PosixEngine(64, workers=8)
    yield eng
    eng.close()


def _pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


async def test_is_an_io_engine(engine):
    assert isinstance(engine, IoEngine)
    assert engine.capabilities.name == "posix"
    assert engine.capabilities.queue_depth == 8


@pytest.mark.parametrize("size", [4096, 8192, 65536, 1 * MiB, 4 * MiB])
async def test_direct_round_trip_at_aligned_sizes_and_offsets(engine, tmp_path, size):
    f = open_data_file(tmp_path / "d", create=True, size=16 * MiB)
    assert f.direct
    n = 3
    offsets = np.array([0, size + 3 * 4096, 16 * MiB - size], dtype=np.int64)  # disjoint extents
    with AlignedBuffer(n * size) as src, AlignedBuffer(n * size) as dst:
        src.array[:] = _pattern(n * size, size)
        addrs = [src.address + i * size for i in range(n)]
        assert (await engine.write_many(f.fd, offsets, addrs, [size] * n)).tolist() == [size] * n
        res = await engine.read_many(f.fd, offsets, [dst.address + i * size for i in range(n)], [size] * n)
        assert res.tolist() == [size] * n
        assert np.array_equal(src.array, dst.array)
    f.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 70000)), min_size=1, max_size=12))
def test_buffered_round_trip_at_any_size_and_offset(tmp_path, ops):
    async def run():
        eng = PosixEngine(32, workers=4)
        f = open_data_file(tmp_path / "b", create=True, direct=False)
        try:
            for off, n in ops:
                src = _pattern(n, off)
                res = await eng.write_many(f.fd, [off], [src.ctypes.data], [n])
                assert res.tolist() == [n]
                dst = np.zeros(n, dtype=np.uint8)
                res = await eng.read_many(f.fd, [off], [dst.ctypes.data], [n])
                assert res.tolist() == [n]
                assert np.array_equal(src, dst)
        finally:
            eng.close()
            f.close()

    asyncio.run(run())


async def test_large_batch_spread_over_workers(engine, tmp_path):
    f = open_data_file(tmp_path / "d", create=True, size=8 * MiB)
    n = 1000
    offs = np.random.default_rng(0).permutation(2048)[:n].astype(np.int64) * 4096
    with AlignedBuffer(n * 4096) as src, AlignedBuffer(n * 4096) as dst:
        src.array[:] = _pattern(n * 4096, 7)
        addrs = src.address + np.arange(n, dtype=np.uint64) * 4096
        assert (await engine.write_many(f.fd, offs, addrs, np.full(n, 4096))).tolist() == [4096] * n
        daddrs = dst.address + np.arange(n, dtype=np.uint64) * 4096
        assert (await engine.read_many(f.fd, offs, daddrs, np.full(n, 4096))).tolist() == [4096] * n
        assert np.array_equal(src.array, dst.array)
    f.close()


async def test_concurrent_batches_from_many_tasks(engine, tmp_path):
    f = open_data_file(tmp_path / "d", create=True, direct=False)
    bufs = [_pattern(5000, i) for i in range(20)]
    res = await asyncio.gather(
        *(engine.write_many(f.fd, [i * 5000], [b.ctypes.data], [5000]) for i, b in enumerate(bufs))
    )
    assert [r.tolist() for r in res] == [[5000]] * 20
    out = np.zeros(100000, dtype=np.uint8)
    assert (await engine.read_many(f.fd, [0], [out.ctypes.data], [100000])).tolist() == [100000]
    assert np.array_equal(out, np.concatenate(bufs))
    f.close()


async def test_failed_op_reports_errno_and_the_rest_of_the_batch_goes_on(engine, tmp_path):
    f = open_data_file(tmp_path / "d", create=True, size=1 * MiB)
    with AlignedBuffer(4 * 4096) as buf:
        buf.array[:] = 9
        a = buf.address
        fds = np.array([f.fd, 987654, f.fd, f.fd, f.fd], dtype=np.int32)
        offs = [0, 0, 100, 8192, 12288]  # op 2: unaligned offset under O_DIRECT
        addrs = [a, a + 4096, a + 8192, 0, a + 12288]  # op 3: NULL address
        res = await engine.write_many(fds, offs, addrs, [4096] * 5)
        assert res.tolist() == [4096, -errno.EBADF, -errno.EINVAL, -errno.EFAULT, 4096]
    f.close()


async def test_bad_address_is_efault_not_a_crash(engine, tmp_path):
    f = open_data_file(tmp_path / "d", create=True, size=1 * MiB, direct=False)
    res = await engine.read_many(f.fd, [0], [4096], [4096])  # unmapped page
    assert res.tolist() == [-errno.EFAULT]
    f.close()


async def test_write_to_readonly_file_is_ebadf(engine, tmp_path):
    open_data_file(tmp_path / "d", create=True, size=1 * MiB).close()
    f = open_data_file(tmp_path / "d", readonly=True)
    with AlignedBuffer(4096) as buf:
        assert (await engine.write_many(f.fd, [0], [buf.address], [4096])).tolist() == [-errno.EBADF]
    f.close()


@pytest.mark.parametrize("direct", [True, False])
async def test_read_past_eof_is_short(engine, tmp_path, direct):
    path = tmp_path / "d"
    with open(path, "wb") as w:
        w.write(b"x" * 5000)
    f = open_data_file(path, direct=direct)
    with AlignedBuffer(3 * 8192) as buf:
        a = buf.address
        res = await engine.read_many(f.fd, [0, 4096, 8192], [a, a + 8192, a + 16384], [8192] * 3)
        assert res.tolist() == [5000, 904, 0]
        assert bytes(buf.array[:5000]) == b"x" * 5000
    f.close()


async def test_short_transfers_are_completed(engine, tmp_path, monkeypatch):
    f = open_data_file(tmp_path / "d", create=True, direct=False)
    real_preadv, real_pwritev = os.preadv, os.pwritev
    calls = {"r": 0, "w": 0}

    def half(real, key):
        def fn(fd, bufs, off):
            calls[key] += 1
            mv = memoryview(bufs[0]).cast("B")
            return real(fd, [mv[: max(1, len(mv) // 2)]], off)  # never more than half

        return fn

    monkeypatch.setattr(posix_mod.os, "preadv", half(real_preadv, "r"))
    monkeypatch.setattr(posix_mod.os, "pwritev", half(real_pwritev, "w"))
    src = _pattern(10000, 3)
    assert (await engine.write_many(f.fd, [123], [src.ctypes.data], [10000])).tolist() == [10000]
    dst = np.zeros(10000, dtype=np.uint8)
    assert (await engine.read_many(f.fd, [123], [dst.ctypes.data], [10000])).tolist() == [10000]
    assert np.array_equal(src, dst)
    assert calls["r"] > 5 and calls["w"] > 5
    f.close()


async def test_empty_and_zero_length_ops(engine, tmp_path):
    f = open_data_file(tmp_path / "d", create=True, direct=False)
    assert len(await engine.read_many(f.fd, [], [], [])) == 0
    assert (await engine.write_many(f.fd, [0], [0], [0])).tolist() == [0]
    f.close()


async def test_sync_and_sync_error(engine, tmp_path):
    f = open_data_file(tmp_path / "d", create=True, size=1 * MiB)
    await engine.sync(f.fd)
    await engine.sync(f.fd, datasync=False)
    with pytest.raises(OSError) as e:
        await engine.sync(987654)
    assert e.value.errno == errno.EBADF
    f.close()


async def test_register_buffers_is_declined(engine):
    with AlignedBuffer(4096) as buf:
        assert engine.register_buffers([(buf.address, buf.nbytes)]) is False


def _held_preadv(monkeypatch, gate: threading.Event, counter: list):
    """Every preadv waits for ``gate`` (30 s at most, so a failed test cannot hang a worker), then reads."""
    real = os.preadv

    def fn(fd, bufs, off):
        counter[0] += 1
        gate.wait(30)
        return real(fd, bufs, off)

    monkeypatch.setattr(posix_mod.os, "preadv", fn)


async def test_close_with_ops_in_flight_fails_pending_awaits(tmp_path, monkeypatch):
    eng = PosixEngine(64, workers=4)
    f = open_data_file(tmp_path / "d", create=True, size=1 * MiB, direct=False)
    gate, count = threading.Event(), [0]
    _held_preadv(monkeypatch, gate, count)
    buf = np.zeros(200 * 4096, dtype=np.uint8)
    addrs = buf.ctypes.data + np.arange(200, dtype=np.uint64) * 4096
    tasks = [asyncio.ensure_future(eng.read_many(f.fd, np.arange(200) * 4096, addrs, np.full(200, 4096))) for _ in range(3)]
    sync_task = asyncio.ensure_future(eng.sync(f.fd))
    try:
        assert await until(lambda: count[0] == 4, 30)  # each of the 4 read workers holds one op
        # syncs run on the write workers: queued behind the held reads, this would never return
        assert await asyncio.wait_for(sync_task, 30) is None
        assert not any(t.done() for t in tasks)
        eng.close()
        eng.close()  # idempotent
        for _ in range(10):
            await asyncio.sleep(0)
        # each fails once its running ops returned: the first batch's 4 are held, the others had none
        assert [t.done() for t in tasks] == [False, True, True]
    finally:
        gate.set()
    for t in tasks:
        with pytest.raises(EngineClosed):
            await asyncio.wait_for(t, 30)  # a hang guard, not a speed bound
    ran = count[0]
    await asyncio.sleep(0.2)
    assert count[0] == ran == 4  # nothing started after close, nothing touches caller memory after the awaits
    with pytest.raises(EngineClosed):
        await eng.read_many(f.fd, [0], [buf.ctypes.data], [4096])
    f.close()


async def test_cancelled_await_returns_only_after_running_ops_stop(tmp_path, monkeypatch):
    eng = PosixEngine(64, workers=4)
    f = open_data_file(tmp_path / "d", create=True, size=1 * MiB, direct=False)
    gate, count = threading.Event(), [0]
    _held_preadv(monkeypatch, gate, count)
    buf = np.zeros(100 * 4096, dtype=np.uint8)
    addrs = buf.ctypes.data + np.arange(100, dtype=np.uint64) * 4096
    task = asyncio.ensure_future(eng.read_many(f.fd, np.arange(100) * 4096, addrs, np.full(100, 4096)))
    try:
        assert await until(lambda: count[0] == 4, 30)  # each of the 4 workers holds one op
        task.cancel()
        for _ in range(10):
            await asyncio.sleep(0)
        assert not task.done()  # a running preadv may still write the caller's memory: the await waits
    finally:
        gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    ran = count[0]
    await asyncio.sleep(0.2)
    assert count[0] == ran == 4  # the ops that were running, no more
    # The engine is still usable afterwards.
    monkeypatch.undo()
    assert (await eng.read_many(f.fd, [0], [buf.ctypes.data], [4096])).tolist() == [4096]
    eng.close()
    f.close()


def test_bad_arguments_are_refused_clearly():
    with pytest.raises(ValueError, match="workers"):
        PosixEngine(8, workers=0)
    with pytest.raises(ValueError, match="queue_depth"):
        PosixEngine(0)
