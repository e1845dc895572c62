"""UringEngine: batched reads/writes over io_uring with completions on the asyncio loop."""

from __future__ import annotations

import asyncio
import errno
import os
import textwrap
import time

import numpy as np
import pytest

from conftest import open_direct, run_without_memlock

from umbp_nvme.buffers import AlignedBuffer
from umbp_nvme.engine.base import EngineClosed, EngineUnavailable, IoEngine
from umbp_nvme.engine.files import open_data_file

import umbp_nvme._uring  # noqa: E402,F401 - required: a missing extension fails here (python setup.py build_ext --inplace)

from umbp_nvme.engine.uring import UringEngine, open_uring_engine  # noqa: E402

PAGE = 4096


@pytest.fixture
async def engine():
    e = await open_uring_engine(64)
    yield e
    e.close()


def _u64(x):
    return np.asarray(x, dtype=np.uint64)


async def test_open_gives_an_io_engine_with_capabilities(engine):
    assert isinstance(engine, IoEngine)
    caps = engine.capabilities
    assert caps.name == "io_uring" and caps.native_async and not caps.thread_safe
    assert caps.queue_depth == 64 and caps.fixed_buffers is False


async def test_forced_unavailable_raises_engine_unavailable(monkeypatch):
    monkeypatch.setenv("UMBP_NVME_FORCE_NO_URING", "1")
    with pytest.raises(EngineUnavailable, match="UMBP_NVME_FORCE_NO_URING"):
        await open_uring_engine()


@pytest.mark.parametrize("size", [1, 511, 4096, 4097, 65_537, (1 << 20) + 3])
async def test_buffered_round_trip_random_bytes(engine, tmp_path, size):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    n = 5
    rng = np.random.default_rng(size)
    src = rng.integers(0, 256, n * size, dtype=np.uint8)
    dst = np.zeros_like(src)
    offs = (np.arange(n, dtype=np.int64) * (size + 13))[::-1].copy() + 7  # odd, unordered offsets
    mem = np.arange(n, dtype=np.uint64) * np.uint64(size)
    res = await engine.write_many(fd, offs, src.ctypes.data + mem, np.full(n, size))
    assert res.tolist() == [size] * n
    res = await engine.read_many(fd, offs, dst.ctypes.data + mem, np.full(n, size))
    assert res.dtype == np.int64 and res.tolist() == [size] * n
    assert np.array_equal(src, dst)
    os.close(fd)


@pytest.mark.parametrize("size", [PAGE, 3 * PAGE, 1 << 20])
async def test_odirect_round_trip_random_bytes(engine, tmp_path, size):
    fd = open_direct(tmp_path / "f")
    n = 9
    with AlignedBuffer(n * size) as src, AlignedBuffer(n * size) as dst:
        src.array[:] = np.random.default_rng(size).integers(0, 256, n * size, dtype=np.uint8)
        perm = np.random.default_rng(1).permutation(n)
        offs = perm.astype(np.int64) * size
        mem = _u64(np.arange(n) * size)
        assert (await engine.write_many(fd, offs, src.address + mem, np.full(n, size))).tolist() == [size] * n
        await engine.sync(fd)
        assert (await engine.read_many(fd, offs, dst.address + mem, np.full(n, size))).tolist() == [size] * n
        assert np.array_equal(src.array, dst.array)
    os.close(fd)


async def test_batch_larger_than_the_ring_is_queued_and_completes(tmp_path):
    e = await open_uring_engine(8)
    fd = open_direct(tmp_path / "f")
    n = 1000
    with AlignedBuffer(n * PAGE) as src, AlignedBuffer(n * PAGE) as dst:
        src.array[:] = np.random.default_rng(3).integers(0, 256, n * PAGE, dtype=np.uint8)
        offs = np.arange(n, dtype=np.int64) * PAGE
        assert (await e.write_many(fd, offs, src.address + _u64(offs), np.full(n, PAGE)) == PAGE).all()
        assert (await e.read_many(fd, offs, dst.address + _u64(offs), np.full(n, PAGE)) == PAGE).all()
        assert np.array_equal(src.array, dst.array)
        assert e.inflight == 0
    e.close()
    os.close(fd)


async def test_registered_buffers_reads_land_in_caller_numpy_and_torch_memory(engine, tmp_path):
    torch = pytest.importorskip("torch")
    path = tmp_path / "f"
    data = os.urandom(64 * PAGE)
    path.write_bytes(data)
    fd = open_direct(path, os.O_RDONLY)
    with AlignedBuffer(32 * PAGE) as a, AlignedBuffer(32 * PAGE) as b:
        tensor = torch.from_numpy(b.array)  # mmap-backed, page-aligned tensor
        assert engine.register_buffers([(a.address, a.nbytes), (int(tensor.data_ptr()), tensor.numel())]) is True
        assert engine.capabilities.fixed_buffers is True
        offs = np.arange(64, dtype=np.int64)[::-1].copy() * PAGE
        mem = np.concatenate([a.address + _u64(np.arange(32) * PAGE), tensor.data_ptr() + _u64(np.arange(32) * PAGE)])
        res = await engine.read_many(fd, offs, mem, np.full(64, PAGE))
        assert (res == PAGE).all()
        expect = np.frombuffer(data, dtype=np.uint8).reshape(64, PAGE)[::-1]
        assert np.array_equal(a.array.reshape(32, PAGE), expect[:32])
        assert np.array_equal(tensor.numpy().reshape(32, PAGE), expect[32:])
        del tensor
    os.close(fd)


async def test_batch_mixing_registered_and_plain_memory(engine, tmp_path):
    path = tmp_path / "f"
    data = os.urandom(8 * PAGE)
    path.write_bytes(data)
    fd = open_direct(path, os.O_RDONLY)
    with AlignedBuffer(8 * PAGE) as buf:
        assert engine.register_buffers([(buf.address, 4 * PAGE)])
        # op 1 straddles the registered range's end and op 2 lies past it: both go as plain reads
        offs = np.array([6 * PAGE, 0, 4 * PAGE])
        mem = buf.address + _u64([0, 3 * PAGE, 5 * PAGE])
        lens = np.array([2 * PAGE, 2 * PAGE, 3 * PAGE])
        assert engine.fixed_index(mem, lens).tolist() == [0, -1, -1]
        res = await engine.read_many(fd, offs, mem, lens)
        assert res.tolist() == lens.tolist()
        assert buf.array[: 2 * PAGE].tobytes() == data[6 * PAGE :]
        assert buf.array[3 * PAGE : 5 * PAGE].tobytes() == data[: 2 * PAGE]
        assert buf.array[5 * PAGE :].tobytes() == data[4 * PAGE : 7 * PAGE]
    os.close(fd)


def test_ranges_are_merged_and_split_into_1gib_pieces():
    from umbp_nvme.engine.uring_buffers import split_ranges

    gib = 1 << 30
    base = 1 << 40
    pieces = split_ranges([(base + 3 * gib, 10), (base, 2 * gib + 5), (base + gib, PAGE)])
    assert pieces == [(base, gib), (base + gib, gib), (base + 2 * gib, 5), (base + 3 * gib, 10)]


async def test_register_buffers_accumulates_ranges(engine):
    with AlignedBuffer(2 * PAGE) as a, AlignedBuffer(2 * PAGE) as b:
        assert engine.register_buffers([(a.address, a.nbytes)]) is True
        assert engine.register_buffers([(b.address, b.nbytes)]) is True
        assert engine.ring.nbufs == 2
        assert engine.fixed_index(_u64([a.address, b.address + PAGE]), np.array([PAGE, PAGE])).tolist() in ([0, 1], [1, 0])


async def test_bad_fd_is_ebadf_for_that_op_only(engine, tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"abcdefgh")
    fd = os.open(path, os.O_RDONLY)
    r, w = os.pipe()
    os.close(r), os.close(w)
    buf = np.zeros(16, dtype=np.uint8)
    res = await engine.read_many(np.array([fd, r, fd]), [0, 0, 4], _u64([buf.ctypes.data, buf.ctypes.data + 4, buf.ctypes.data + 8]), [4, 4, 4])
    assert res.tolist() == [4, -errno.EBADF, 4]
    assert buf[:4].tobytes() == b"abcd" and buf[8:12].tobytes() == b"efgh" and buf[4:8].tobytes() == b"\0" * 4
    os.close(fd)


async def test_write_to_readonly_fd_fails_per_op_and_the_rest_succeeds(engine, tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"\0" * 3 * PAGE)
    ro = os.open(path, os.O_RDONLY)
    rw = os.open(path, os.O_RDWR)
    src = np.frombuffer(os.urandom(3 * PAGE), dtype=np.uint8).copy()
    fds = np.array([rw, ro, rw], dtype=np.int32)
    offs = np.arange(3) * PAGE
    res = await engine.write_many(fds, offs, src.ctypes.data + _u64(offs), np.full(3, PAGE))
    assert res.tolist() == [PAGE, -errno.EBADF, PAGE]
    got = path.read_bytes()
    assert got[:PAGE] == src[:PAGE].tobytes() and got[2 * PAGE :] == src[2 * PAGE :].tobytes()
    assert got[PAGE : 2 * PAGE] == b"\0" * PAGE
    os.close(ro), os.close(rw)


def _direct_data_file(path):
    f = open_data_file(path, create=True)
    if not f.direct:
        f.close()
        pytest.skip(f"O_DIRECT unsupported on {path} (tmpfs?)")
    return f


async def test_misaligned_odirect_buffer_raises_value_error(engine, tmp_path):
    f = _direct_data_file(tmp_path / "f")  # handed as the DataFile: its alignment comes with it
    with AlignedBuffer(2 * PAGE) as buf:
        buf.array[:] = 0x77
        with pytest.raises(ValueError, match=r"op 0: fd \d+ is O_DIRECT"):
            await engine.read_many(f, [0], [buf.address + 8], [PAGE])
        assert engine.inflight == 0 and (buf.array == 0x77).all()
        # the engine stays usable
        assert (await engine.write_many(f, [0], [buf.address], [PAGE])).tolist() == [PAGE]
        # a bare O_DIRECT fd carries no facts: the kernel refuses the op alone
        raw = open_direct(tmp_path / "f", os.O_RDWR)
        assert (await engine.read_many(raw, [0], [buf.address + 8], [PAGE])).tolist() == [-errno.EINVAL]
        assert (buf.array == 0x77).all()
        os.close(raw)
    f.close()


async def test_misaligned_op_in_a_queued_batch_refuses_the_whole_batch(tmp_path):
    e = await open_uring_engine(4)
    f = _direct_data_file(tmp_path / "f")
    with AlignedBuffer(20 * PAGE) as buf:
        mem = buf.address + _u64(np.arange(20) * PAGE)
        mem[17] += 1
        with pytest.raises(ValueError, match="op 17"):
            await e.write_many(f, np.arange(20) * PAGE, mem, np.full(20, PAGE))
        assert e.inflight == 0 and os.fstat(f.fd).st_size == 0
    e.close()
    f.close()


async def test_short_read_at_eof_buffered(engine, tmp_path):
    path = tmp_path / "f"
    data = os.urandom(10_000)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    buf = np.zeros(3 * 8192, dtype=np.uint8)
    res = await engine.read_many(fd, [0, 8192, 20_000], buf.ctypes.data + _u64([0, 8192, 16384]), [8192, 8192, 100])
    assert res.tolist() == [8192, 10_000 - 8192, 0]
    assert buf[: 10_000].tobytes() == data[:8192] + bytes(buf[8192 : 8192 + 1808])
    assert buf[8192 : 8192 + 1808].tobytes() == data[8192:]
    os.close(fd)


async def test_short_read_at_eof_odirect(engine, tmp_path):
    path = tmp_path / "f"
    data = os.urandom(3 * PAGE + 100)
    path.write_bytes(data)
    fd = open_direct(path, os.O_RDONLY)
    with AlignedBuffer(2 * PAGE) as buf:
        res = await engine.read_many(fd, [2 * PAGE], [buf.address], [2 * PAGE])
        assert res.tolist() == [PAGE + 100]
        assert buf.array[: PAGE + 100].tobytes() == data[2 * PAGE :]
    os.close(fd)


async def test_zero_length_ops_complete_with_zero(engine, tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"xyz")
    fd = os.open(path, os.O_RDONLY)
    buf = np.zeros(8, dtype=np.uint8)
    res = await engine.read_many(fd, [0, 0, 1], _u64([buf.ctypes.data] * 3), [0, 3, 0])
    assert res.tolist() == [0, 3, 0] and buf[:3].tobytes() == b"xyz"
    assert (await engine.read_many(fd, [0], [buf.ctypes.data], [0])).tolist() == [0]
    assert (await engine.read_many(fd, [], [], [])).tolist() == []
    os.close(fd)


async def test_thousand_concurrent_batches_lose_no_completion(tmp_path):
    e = await open_uring_engine(16)
    fd = open_direct(tmp_path / "f")
    nb, per = 1000, 3
    with AlignedBuffer(nb * per * PAGE) as src, AlignedBuffer(nb * per * PAGE) as dst:
        src.array[:] = np.random.default_rng(5).integers(0, 256, src.nbytes, dtype=np.uint8)

        async def one(i, read):
            offs = (i * per + np.arange(per)) * PAGE
            base = dst.address if read else src.address
            op = e.read_many if read else e.write_many
            res = await op(fd, offs, base + _u64(offs), np.full(per, PAGE))
            return res.tolist()

        results = await asyncio.gather(*(one(i, False) for i in range(nb)))
        assert results == [[PAGE] * per] * nb
        results = await asyncio.gather(*(one(i, True) for i in range(nb)))
        assert results == [[PAGE] * per] * nb
        assert np.array_equal(src.array, dst.array)
        assert e.inflight == 0
    e.close()
    os.close(fd)


async def test_sync_and_sync_error(engine, tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, b"data")
    await engine.sync(fd)
    await engine.sync(fd, datasync=False)
    r, w = os.pipe()
    os.close(r), os.close(w)
    with pytest.raises(OSError) as ei:
        await engine.sync(r)
    assert ei.value.errno == errno.EBADF
    os.close(fd)


async def test_close_with_ops_in_flight_fails_pending_awaits(tmp_path):
    e = await open_uring_engine(8)
    path = tmp_path / "big"
    with open(path, "wb") as f:
        f.truncate(256 << 20)
    fd = os.open(path, os.O_RDONLY)
    buf = np.zeros(8 << 20, dtype=np.uint8)
    n = 64  # 8 in flight on io-wq workers (>= 64 KiB buffered ops go async), 56 queued
    offs = np.arange(n, dtype=np.int64) * (4 << 20)
    task = asyncio.ensure_future(e.read_many(fd, offs, _u64(np.full(n, buf.ctypes.data)), np.full(n, 4 << 20)))
    await asyncio.sleep(0)
    assert e.inflight > 0
    t0 = time.monotonic()
    e.close()
    assert time.monotonic() - t0 < 60  # a hang guard: close must not wait for the queued reads
    with pytest.raises(EngineClosed, match="closed"):
        await task
    assert not e.ring.leaked
    e.close()  # idempotent
    with pytest.raises(EngineClosed):
        await e.read_many(fd, [0], [buf.ctypes.data], [10])
    os.close(fd)


async def test_cancelled_await_waits_for_its_running_ops_and_engine_goes_on(tmp_path):
    e = await open_uring_engine(4)
    path = tmp_path / "big"
    data = os.urandom(1 << 20)
    path.write_bytes(data * 16)
    fd = os.open(path, os.O_RDONLY)
    buf = np.zeros(16 << 20, dtype=np.uint8)
    n = 16
    offs = np.arange(n, dtype=np.int64) << 20
    task = asyncio.ensure_future(e.read_many(fd, offs, buf.ctypes.data + _u64(offs), np.full(n, 1 << 20)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert e.inflight == 0  # the cancelled await returned only after the kernel let go
    res = await e.read_many(fd, [0], [buf.ctypes.data], [1 << 20])
    assert res.tolist() == [1 << 20] and buf[: 1 << 20].tobytes() == data
    e.close()
    os.close(fd)


async def test_register_buffers_returns_false_without_memlock(tmp_path):
    code = textwrap.dedent(
        """
        import asyncio
        from umbp_nvme.engine.uring import open_uring_engine
        from umbp_nvme.buffers import AlignedBuffer
        import numpy as np
        async def main():
            e = await open_uring_engine(8)
            buf = AlignedBuffer(16 << 20)
            ok = e.register_buffers([(buf.address, buf.nbytes)])
            ok2 = e.register_buffers([(buf.address, buf.nbytes)])
            with open("PATH", "wb") as f:
                f.write(b"q" * 4096)
            import os
            fd = os.open("PATH", os.O_RDONLY)
            res = await e.read_many(fd, [0], [buf.address], [4096])
            print(ok, ok2, e.capabilities.fixed_buffers, res.tolist(), bytes(buf.array[:4]))
            e.close()
        asyncio.run(main())
        """
    ).replace("PATH", str(tmp_path / "f"))
    out = run_without_memlock(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False False False [4096] b'qqqq'", out.stdout + out.stderr
    assert out.stderr.count("cannot register buffers") == 1  # logged once


async def test_engine_is_usable_through_the_selector():
    from umbp_nvme.engine import open_engine

    e = await open_engine("io_uring", queue_depth=32)
    try:
        assert isinstance(e, UringEngine)
    finally:
        e.close()


def test_may_continue_uses_the_facts_the_batch_came_with_not_a_syscall(tmp_path, monkeypatch):
    """The short-transfer retry decides from the batch's FileFacts: no fcntl on the completion path."""
    import fcntl

    from umbp_nvme.engine.files import PAGE_CACHE
    from umbp_nvme.engine.uring_batch import Batch

    def no_syscall(*a, **k):
        raise AssertionError("fcntl called on the completion path")

    monkeypatch.setattr(fcntl, "fcntl", no_syscall)
    f = _direct_data_file(tmp_path / "d")
    try:
        fds = np.array([f.fd], dtype=np.int32)
        offs = np.array([2 * f.align], dtype=np.int64)
        addrs = _u64([1 << 20])  # never dereferenced: only the decision is tested
        lens = np.array([4 * f.align], dtype=np.int64)
        b = Batch(0, 0, fds, f.facts, offs, addrs, lens, None, None, 1)
        assert b.may_continue(0, f.align)  # remainder aligned in file and memory: resubmit
        assert not b.may_continue(0, f.align + 512 if f.align > 512 else 100)  # O_DIRECT would refuse it
        # the same fd handed without facts (a page-cache file as far as the engine knows): any remainder
        assert Batch(0, 0, fds, PAGE_CACHE, offs, addrs, lens, None, None, 1).may_continue(0, 100)
    finally:
        f.close()


async def test_short_read_at_eof_of_a_data_file(engine, tmp_path):
    """An O_DIRECT data file read past EOF: the bytes that exist, no resubmit of an unaligned tail."""
    f = _direct_data_file(tmp_path / "f")
    data = os.urandom(3 * PAGE + 100)
    with open(tmp_path / "f", "r+b") as w:
        w.write(data)
    with AlignedBuffer(2 * PAGE) as buf:
        res = await engine.read_many(f, [2 * PAGE], [buf.address], [2 * PAGE])
        assert res.tolist() == [PAGE + 100]
        assert buf.array[: PAGE + 100].tobytes() == data[2 * PAGE :]
    f.close()
