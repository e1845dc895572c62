"""umbp_nvme._uring: the C boundary (argument checks, raw ring round trips) and CRC32C."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import open_direct, run_without_memlock

from umbp_nvme.buffers import AlignedBuffer

from umbp_nvme import _uring  # required: a missing extension fails here (build it: python setup.py build_ext --inplace)

PAGE = 4096


# ---------------------------------------------------------------- CRC32C


def _crc32c_reference(data: bytes, crc: int = 0) -> int:
    table = _crc32c_reference.table
    crc ^= 0xFFFFFFFF
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _make_table():
    t = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        t.append(c)
    return t


_crc32c_reference.table = _make_table()


@pytest.mark.parametrize("force_table", [False, True])
def test_crc32c_published_vectors(force_table):
    assert _uring.crc32c(b"123456789", force_table=force_table) == 0xE3069283
    assert _uring.crc32c(bytes(32), force_table=force_table) == 0x8A9136AA
    assert _uring.crc32c(b"\xff" * 32, force_table=force_table) == 0x62A8AB43
    assert _uring.crc32c(bytes(range(32)), force_table=force_table) == 0x46DD794E
    assert _uring.crc32c(b"", force_table=force_table) == 0


@pytest.mark.parametrize("force_table", [False, True])
def test_crc32c_matches_reference_on_random_data_and_unaligned_starts(force_table):
    rng = np.random.default_rng(7)
    # sizes cross the 8-byte, 3x256-byte and 3x8192-byte stream boundaries of the SSE4.2 path
    sizes = [1, 7, 8, 9, 63, 255, 767, 768, 769, 4096, 24575, 24576, 24577, 50001]
    blob = rng.integers(0, 256, 50001 + 16, dtype=np.uint8).tobytes()
    mv = memoryview(blob)
    for size in sizes:
        for start in (0, 1, 3, 7):
            chunk = mv[start : start + size]
            assert _uring.crc32c(chunk, force_table=force_table) == _crc32c_reference(bytes(chunk)), (size, start)


def test_crc32c_hardware_and_table_paths_agree():
    data = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    assert _uring.crc32c(data) == _uring.crc32c(data, force_table=True)


def test_crc32c_chains_through_seed():
    data = os.urandom(100_003)
    whole = _uring.crc32c(data)
    assert _uring.crc32c(data[40_000:], seed=_uring.crc32c(data[:40_000])) == whole
    assert _uring.crc32c(data[1:], seed=_uring.crc32c(data[:1])) == whole


def test_crc32c_of_address_pair_and_many():
    arr = np.frombuffer(os.urandom(3 * 10_000), dtype=np.uint8).copy()
    addr = arr.ctypes.data
    assert _uring.crc32c((addr, 10_000)) == _crc32c_reference(arr[:10_000].tobytes())
    addrs = np.array([addr, addr + 10_000 + 3, addr + 29_990], dtype=np.uint64)
    lens = np.array([10_000, 5, 10], dtype=np.int64)
    out = np.zeros(3, dtype=np.uint32)
    assert _uring.crc32c_many(addrs, lens, out) == 3
    expect = [_crc32c_reference(arr[int(a - addr) : int(a - addr) + int(n)].tobytes()) for a, n in zip(addrs, lens)]
    assert out.tolist() == expect


def test_crc32c_each_is_each_items_crc():
    keys = [b"", b"a", b"key/0", bytes(range(256)) * 3]
    out = np.full(len(keys), 7, dtype=np.uint32)
    assert _uring.crc32c_each(keys, out) == len(keys)
    assert out.tolist() == [_crc32c_reference(k) for k in keys]
    assert _uring.crc32c_each((), np.zeros(0, np.uint32)) == 0


def test_crc32c_each_refuses_bad_input_before_writing():
    out = np.full(2, 7, dtype=np.uint32)
    with pytest.raises(TypeError, match="item 1 must be bytes, got str"):
        _uring.crc32c_each([b"a", "b"], out)
    with pytest.raises(TypeError, match="item 0 must be bytes, got bytearray"):
        _uring.crc32c_each([bytearray(b"a"), b"b"], out)
    assert out.tolist() == [7, 7]  # nothing written
    with pytest.raises(TypeError, match="list or tuple of bytes"):
        _uring.crc32c_each(iter([b"a", b"b"]), out)
    with pytest.raises(ValueError, match="one entry per item"):
        _uring.crc32c_each([b"a"], out)  # out too long
    with pytest.raises(ValueError, match="one entry per item"):
        _uring.crc32c_each([b"a", b"b", b"c"], out)  # out too short
    with pytest.raises(TypeError, match="format I"):
        _uring.crc32c_each([b"a", b"b"], np.zeros(2, np.int64))  # wrong dtype
    with pytest.raises(TypeError, match="writable"):
        _uring.crc32c_each([b"a", b"b"], np.frombuffer(bytes(8), np.uint32))  # read-only memory


def test_crc32c_refuses_bad_input():
    with pytest.raises(ValueError, match="not a valid range"):
        _uring.crc32c((0, 10))
    with pytest.raises(ValueError, match="seed"):
        _uring.crc32c(b"x", seed=1 << 32)
    with pytest.raises(TypeError):
        _uring.crc32c("text")


def test_probe_reports_ring_and_ops():
    p = _uring.probe()
    assert p["ring"] is True, p
    assert p["ops"]["read"] and p["ops"]["write"] and p["ops"]["read_fixed"]
    assert p["sse42"] == _uring.CRC32C_HW
    assert isinstance(p["kernel"], str) and p["kernel"]


# ---------------------------------------------------------------- Ring


def _arrays(fds, offs, addrs, lens, ud=None, bidx=None):
    n = len(offs)
    return (
        np.broadcast_to(np.asarray(fds, dtype=np.int32), (n,)).copy(),
        np.asarray(offs, dtype=np.int64),
        np.asarray(addrs, dtype=np.uint64),
        np.asarray(lens, dtype=np.int64),
        None if bidx is None else np.asarray(bidx, dtype=np.int16),
        np.asarray(range(n) if ud is None else ud, dtype=np.uint64),
    )


def _submit(ring, op, fds, offs, addrs, lens, ud=None, bidx=None, flags=None, **kw):
    f, o, a, ln, b, u = _arrays(fds, offs, addrs, lens, ud, bidx)
    fl = None if flags is None else np.asarray(flags, dtype=np.uint8)
    return ring.submit(op, f, o, a, ln, b, u, fl, **kw)


def _reap_all(ring, count, timeout_s=10.0):
    out_ud = np.zeros(ring.cq_entries, dtype=np.uint64)
    out_res = np.zeros(ring.cq_entries, dtype=np.int32)
    got = {}
    while len(got) < count:
        ring.wait(1, timeout_s=timeout_s)
        n = ring.reap(out_ud, out_res)
        assert n > 0, "completion did not arrive"
        got.update(zip(out_ud[:n].tolist(), out_res[:n].tolist()))
    return got


@pytest.fixture
def ring():
    r = _uring.Ring(32)
    yield r
    r.close()


def test_ring_geometry_and_eventfd(ring):
    import fcntl

    assert ring.entries == 32 and ring.cq_entries == 64
    assert ring.eventfd >= 0 and fcntl.fcntl(ring.eventfd, fcntl.F_GETFL) & os.O_NONBLOCK
    assert ring.inflight == 0 and ring.sq_pending == 0


def test_ring_refuses_bad_entries():
    with pytest.raises(ValueError, match="entries"):
        _uring.Ring(0)
    with pytest.raises(ValueError, match="entries"):
        _uring.Ring(_uring.MAX_ENTRIES + 1)


def test_write_then_read_round_trip_buffered(ring, tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    src = np.frombuffer(os.urandom(5 * 1000), dtype=np.uint8).copy()
    dst = np.zeros_like(src)
    offs = [0, 1000, 2000, 3000, 4000]
    q = _submit(ring, _uring.OP_WRITE, fd, offs, [src.ctypes.data + o for o in offs], [1000] * 5)
    assert q == 5
    assert set(_reap_all(ring, 5).values()) == {1000}
    q = _submit(ring, _uring.OP_READ, fd, offs[::-1], [dst.ctypes.data + o for o in offs[::-1]], [1000] * 5, ud=[7] * 5)
    assert _reap_all(ring, 1) == {7: 1000}
    assert bytes(dst) == bytes(src)
    os.close(fd)


def test_eventfd_signals_completion(ring, tmp_path):
    import select

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    buf = np.ones(64, dtype=np.uint8)
    _submit(ring, _uring.OP_WRITE, fd, [0], [buf.ctypes.data], [64])
    r, _, _ = select.select([ring.eventfd], [], [], 5)
    assert r == [ring.eventfd]
    assert _reap_all(ring, 1) == {0: 64}
    os.close(fd)


def test_bad_fd_completes_with_ebadf(ring):
    buf = np.zeros(PAGE, dtype=np.uint8)
    r, w = os.pipe()
    os.close(r), os.close(w)  # a closed descriptor number
    _submit(ring, _uring.OP_READ, r, [0], [buf.ctypes.data], [PAGE])
    assert _reap_all(ring, 1) == {0: -errno.EBADF}


def test_write_to_readonly_fd_fails_only_that_op(ring, tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"\0" * 8192)
    ro = os.open(path, os.O_RDONLY)
    rw = os.open(path, os.O_RDWR)
    src = np.frombuffer(os.urandom(8192), dtype=np.uint8).copy()
    f = np.array([rw, ro, rw], dtype=np.int32)
    o = np.array([0, 4096, 4096], dtype=np.int64)
    a = np.array([src.ctypes.data, src.ctypes.data, src.ctypes.data + 4096], dtype=np.uint64)
    ln = np.full(3, 4096, dtype=np.int64)
    assert ring.submit(_uring.OP_WRITE, f, o, a, ln, None, np.arange(3, dtype=np.uint64)) == 3
    assert _reap_all(ring, 3) == {0: 4096, 1: -errno.EBADF, 2: 4096}
    assert path.read_bytes() == src.tobytes()
    os.close(ro), os.close(rw)


def test_short_read_at_eof_is_reported(ring, tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1000))
    fd = os.open(path, os.O_RDONLY)
    buf = np.zeros(4096, dtype=np.uint8)
    _submit(ring, _uring.OP_READ, fd, [600, 5000], [buf.ctypes.data, buf.ctypes.data + 2048], [2048, 100])
    assert _reap_all(ring, 2) == {0: 400, 1: 0}
    assert buf[:400].tobytes() == path.read_bytes()[600:]
    os.close(fd)


def test_misaligned_odirect_buffer_is_refused_before_submission(ring, tmp_path):
    """The caller states the files' O_DIRECT alignment (engine/files.py knows it); the ring
    refuses a misaligned op before writing any SQE. Without it the kernel fails that op alone."""
    (tmp_path / "f").write_bytes(b"x" * 3 * PAGE)
    fd = open_direct(tmp_path / "f", os.O_RDWR)
    al = dict(mem_align=512, off_align=PAGE)
    with AlignedBuffer(3 * PAGE) as buf:
        buf.array[:] = 0xAB
        addrs = [buf.address, buf.address + PAGE + 100]
        with pytest.raises(ValueError, match=r"op 1: fd \d+ is O_DIRECT.*aligned to 512 bytes"):
            _submit(ring, _uring.OP_READ, fd, [0, PAGE], addrs, [PAGE, PAGE], **al)
        with pytest.raises(ValueError, match=r"op 0: .*O_DIRECT.*offset and length to 4096 bytes.*offset 100"):
            _submit(ring, _uring.OP_READ, fd, [100], [buf.address], [PAGE], **al)
        with pytest.raises(ValueError, match=r"op 0: .*O_DIRECT.*length 1000"):
            _submit(ring, _uring.OP_READ, fd, [0], [buf.address], [1000], **al)
        assert ring.inflight == 0 and ring.sq_pending == 0
        assert (buf.array == 0xAB).all()
        # no alignment given: the ring does not ask the kernel; the kernel refuses the op alone
        assert _submit(ring, _uring.OP_READ, fd, [100], [buf.address], [PAGE]) == 1
        assert _reap_all(ring, 1) == {0: -errno.EINVAL}
        assert (buf.array == 0xAB).all()
    os.close(fd)


def test_argument_checks_name_the_op_and_value(ring):
    buf = np.zeros(PAGE, dtype=np.uint8)
    a = buf.ctypes.data
    with pytest.raises(ValueError, match=r"op 1: length must be in \(0, 1073741824\], got 0"):
        _submit(ring, _uring.OP_READ, 0, [0, 0], [a, a], [10, 0])
    with pytest.raises(ValueError, match=r"got 1073741825"):
        _submit(ring, _uring.OP_READ, 0, [0], [a], [(1 << 30) + 1])
    with pytest.raises(ValueError, match=r"op 0: fd must be >= 0, got -1"):
        _submit(ring, _uring.OP_READ, -1, [0], [a], [10])
    with pytest.raises(ValueError, match=r"offset must be >= 0, got -5"):
        _submit(ring, _uring.OP_READ, 0, [-5], [a], [10])
    with pytest.raises(ValueError, match=r"address 0x0"):
        _submit(ring, _uring.OP_READ, 0, [0], [0], [10])
    with pytest.raises(ValueError, match=r"fixed buffer index 0 is not registered"):
        _submit(ring, _uring.OP_READ, 0, [0], [a], [10], bidx=[0])
    with pytest.raises(ValueError, match=r"flags 0x80"):
        _submit(ring, _uring.OP_READ, 0, [0], [a], [10], flags=[0x80])
    with pytest.raises(ValueError, match="lengths has 1 entries but fds has 2"):
        ring.submit(_uring.OP_READ, np.zeros(2, np.int32), np.zeros(2, np.int64), np.full(2, a, np.uint64),
                    np.ones(1, np.int64), None, np.zeros(2, np.uint64))  # fmt: skip
    with pytest.raises(TypeError, match="offsets must have format"):
        ring.submit(_uring.OP_READ, np.zeros(1, np.int32), np.zeros(1, np.int32), np.full(1, a, np.uint64),
                    np.ones(1, np.int64), None, np.zeros(1, np.uint64))  # fmt: skip
    with pytest.raises(ValueError, match="opcode"):
        _submit(ring, 9, 0, [0], [a], [10])
    assert ring.inflight == 0


def test_fixed_buffer_reads_land_in_place(ring, tmp_path):
    path = tmp_path / "f"
    data = os.urandom(4 * PAGE)
    path.write_bytes(data)
    fd = open_direct(path, os.O_RDONLY)
    with AlignedBuffer(4 * PAGE) as buf:
        ring.register_buffers([(buf.address, buf.nbytes)])
        assert ring.nbufs == 1
        offs = [3 * PAGE, 0, PAGE, 2 * PAGE]
        _submit(ring, _uring.OP_READ, fd, offs, [buf.address + o for o in offs], [PAGE] * 4, bidx=[0] * 4)
        assert set(_reap_all(ring, 4).values()) == {PAGE}
        assert buf.array.tobytes() == data
        ring.unregister_buffers()
        assert ring.nbufs == 0
    os.close(fd)


def test_fixed_buffer_op_outside_its_range_is_refused_and_memory_untouched(ring, tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(4 * PAGE))
    fd = os.open(path, os.O_RDONLY)
    with AlignedBuffer(4 * PAGE) as buf:
        buf.array[:] = 0x5A
        ring.register_buffers([(buf.address, 2 * PAGE)])
        with pytest.raises(ValueError, match=r"op 1: .* lies outside registered buffer 0"):
            _submit(ring, _uring.OP_READ, fd, [0, PAGE], [buf.address, buf.address + PAGE], [PAGE, 2 * PAGE], bidx=[0, 0])
        with pytest.raises(ValueError, match=r"outside registered buffer 0"):
            _submit(ring, _uring.OP_READ, fd, [0], [buf.address - PAGE], [PAGE], bidx=[0])
        assert ring.inflight == 0 and ring.sq_pending == 0
        assert (buf.array == 0x5A).all()
    os.close(fd)


def test_linked_op_is_cancelled_when_its_predecessor_fails(ring, tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    buf = np.ones(100, dtype=np.uint8)
    r, w = os.pipe()
    os.close(r), os.close(w)
    q = _submit(ring, _uring.OP_WRITE, [r, fd], [0, 0], [buf.ctypes.data] * 2, [100, 100], flags=[_uring.F_LINK, 0])
    assert q == 2
    assert _reap_all(ring, 2) == {0: -errno.EBADF, 1: -errno.ECANCELED}
    assert os.fstat(fd).st_size == 0
    os.close(fd)


def test_fsync_and_fdatasync_ops(ring, tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, b"x" * 10)
    f = np.array([fd, fd], dtype=np.int32)
    ring.submit(_uring.OP_FSYNC, f[:1], None, None, None, None, np.array([1], np.uint64))
    ring.submit(_uring.OP_FDATASYNC, f[1:], None, None, None, None, np.array([2], np.uint64))
    assert _reap_all(ring, 2) == {1: 0, 2: 0}
    os.close(fd)


def test_submit_queues_no_more_than_the_ring_holds(tmp_path):
    ring = _uring.Ring(4)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    buf = np.zeros(16, dtype=np.uint8)
    n = 10
    q = _submit(ring, _uring.OP_WRITE, fd, range(n), [buf.ctypes.data] * n, [1] * n)
    assert q == 4 and ring.inflight == 4
    assert len(_reap_all(ring, 4)) == 4 and ring.inflight == 0
    assert ring.close() is True
    os.close(fd)


def test_fixed_files_are_not_offered(ring, tmp_path):
    """register_files/F_FIXED_FILE were dropped (nothing used them, issue 11): the flag bit is refused."""
    assert not hasattr(ring, "register_files") and not hasattr(_uring, "F_FIXED_FILE")
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    buf = np.zeros(11, dtype=np.uint8)
    with pytest.raises(ValueError, match=r"op 0: flags 0x1 has bits outside F_DRAIN\|F_LINK"):
        _submit(ring, _uring.OP_READ, fd, [0], [buf.ctypes.data], [11], flags=[1])
    assert ring.inflight == 0
    os.close(fd)


def test_close_is_idempotent_and_refuses_later_use():
    r = _uring.Ring(8)
    assert r.close() is True
    assert r.close() is True
    assert r.closed
    with pytest.raises(ValueError, match="closed"):
        r.reap(np.zeros(1, np.uint64), np.zeros(1, np.int32))


def test_close_with_ops_in_flight_waits_for_them(tmp_path):
    path = tmp_path / "big"
    with open(path, "wb") as f:
        f.truncate(64 << 20)
    fd = os.open(path, os.O_RDONLY)
    r = _uring.Ring(16)
    buf = np.zeros(16 << 20, dtype=np.uint8)
    n = 16
    offs = [i * (4 << 20) for i in range(n)]
    # F_ASYNC puts them on io-wq workers, so they are really in flight at close()
    _submit(r, _uring.OP_READ, fd, offs, [buf.ctypes.data + (i % 4) * (4 << 20) for i in range(n)], [4 << 20] * n,
            flags=[_uring.F_ASYNC] * n)  # fmt: skip
    assert r.inflight == n
    assert r.close(timeout_s=5.0) is True
    assert r.inflight == 0 and not r.leaked
    os.close(fd)


def test_register_buffers_beyond_memlock_fails_with_enomem(tmp_path):
    """Without CAP_IPC_LOCK the pinned bytes count against RLIMIT_MEMLOCK (8 MiB for users)."""
    code = textwrap.dedent(
        """
        from umbp_nvme import _uring
        from umbp_nvme.buffers import AlignedBuffer
        r = _uring.Ring(8)
        buf = AlignedBuffer(16 << 20)
        try:
            r.register_buffers([(buf.address, buf.nbytes)])
        except OSError as e:
            print("ERRNO", e.errno)
        else:
            print("REGISTERED")
        """
    )
    out = run_without_memlock(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"ERRNO {errno.ENOMEM}", out.stdout + out.stderr


# ---------------------------------------------------------------- submit/check/reap_batches: scalar fd,
# ud_base, auto_fixed, reap_batches


def _wait_ready(ring, n, timeout_s=30.0):
    """Block until at least n CQEs are ready (they are not reaped)."""
    import time

    deadline = time.monotonic() + timeout_s
    while ring.wait(n, timeout_s=1.0) < n:
        assert time.monotonic() < deadline, f"{n} completions did not arrive"


def _u64(v):
    return np.asarray(v, dtype=np.uint64)


def _i64(v):
    return np.asarray(v, dtype=np.int64)


def test_scalar_fd_and_one_entry_fd_array_apply_to_every_op(ring, tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    src = np.frombuffer(os.urandom(6 * 700), dtype=np.uint8).copy()
    offs = _i64([i * 700 for i in range(6)])
    lens = _i64([700] * 6)
    assert type(fd) is int
    q = ring.submit(_uring.OP_WRITE, fd, offs, _u64(src.ctypes.data + offs), lens, None, _u64(range(6)))
    assert q == 6
    assert _reap_all(ring, 6) == {i: 700 for i in range(6)}
    assert os.pread(fd, 4200, 0) == src.tobytes()
    # a one-entry int32 array broadcasts the same way (reverse order, so each op's offset matters)
    dst = np.zeros_like(src)
    one = np.array([fd], dtype=np.int32)
    q = ring.submit(_uring.OP_READ, one, offs[::-1].copy(), _u64(dst.ctypes.data + offs[::-1]), lens, None,
                    _u64(range(10, 16)))  # fmt: skip
    assert q == 6
    assert _reap_all(ring, 6) == {i: 700 for i in range(10, 16)}
    assert dst.tobytes() == src.tobytes()
    # fsync/fdatasync take the scalar too (one op)
    assert ring.submit(_uring.OP_FDATASYNC, fd, None, None, None, None, _u64([99])) == 1
    assert _reap_all(ring, 1) == {99: 0}
    # a scalar that is a closed descriptor fails every op with EBADF (the kernel's verdict, per op)
    r, w = os.pipe()
    os.close(r), os.close(w)
    q = ring.submit(_uring.OP_READ, r, offs[:3].copy(), _u64(dst.ctypes.data + offs[:3]), lens[:3].copy(), None,
                    _u64([1, 2, 3]))  # fmt: skip
    assert q == 3 and _reap_all(ring, 3) == {1: -errno.EBADF, 2: -errno.EBADF, 3: -errno.EBADF}
    # a fd array of neither 1 nor n entries is refused, nothing queued
    with pytest.raises(ValueError, match="has 6 entries but fds has 2"):
        ring.submit(_uring.OP_READ, np.array([fd, fd], np.int32), offs, _u64(dst.ctypes.data + offs), lens, None, None)
    with pytest.raises(ValueError, match=r"op 0: fd must be >= 0, got -3"):
        ring.submit(_uring.OP_READ, -3, offs, _u64(dst.ctypes.data + offs), lens, None, None)
    with pytest.raises(ValueError, match="out of range"):
        ring.submit(_uring.OP_READ, 1 << 40, offs, _u64(dst.ctypes.data + offs), lens, None, None)
    assert ring.inflight == 0 and ring.sq_pending == 0
    os.close(fd)


def test_ud_base_numbers_ops_in_order(ring, tmp_path):
    path = tmp_path / "f"
    data = os.urandom(64)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    buf = np.zeros(64, dtype=np.uint8)
    base = (5 << 32) + 10
    # op i reads i + 1 bytes: its result names it
    lens = _i64(range(1, 7))
    q = ring.submit(_uring.OP_READ, fd, np.zeros(6, np.int64), _u64([buf.ctypes.data] * 6), lens, None, None,
                    ud_base=base)  # fmt: skip
    assert q == 6
    assert _reap_all(ring, 6) == {base + i: i + 1 for i in range(6)}
    # ud_base is the default of 0 when omitted, and an explicit user_data array wins over it
    q = ring.submit(_uring.OP_READ, fd, np.zeros(2, np.int64), _u64([buf.ctypes.data] * 2), _i64([3, 4]), None, None)
    assert _reap_all(ring, 2) == {0: 3, 1: 4}
    q = ring.submit(_uring.OP_READ, fd, np.zeros(2, np.int64), _u64([buf.ctypes.data] * 2), _i64([3, 4]), None,
                    _u64([700, 800]), ud_base=base)  # fmt: skip
    assert _reap_all(ring, 2) == {700: 3, 800: 4}
    assert buf[:6].tobytes() == data[:6]
    os.close(fd)


def test_user_data_reserved_value_and_ud_base_overflow_are_refused(ring, tmp_path):
    """UINT64_MAX tags the ring's own cancel op: reap drops such a CQE, so an op carrying it
    would stay in flight forever (and close() would leak the ring). ud_base + i may not reach it."""
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, b"z" * 64)
    buf = np.zeros(64, dtype=np.uint8)
    a3 = _u64([buf.ctypes.data] * 3)
    z3, l3 = np.zeros(3, np.int64), _i64([8, 8, 8])
    top = (1 << 64) - 1
    with pytest.raises(ValueError, match=r"op 2: user_data 0xffffffffffffffff"):
        ring.submit(_uring.OP_READ, fd, z3, a3, l3, None, None, ud_base=top - 2)
    with pytest.raises(ValueError, match=r"op 1: user_data 0xffffffffffffffff"):
        ring.submit(_uring.OP_READ, fd, z3, a3, l3, None, _u64([0, top, 1]))
    with pytest.raises((ValueError, OverflowError)):
        ring.submit(_uring.OP_READ, fd, z3, a3, l3, None, None, ud_base=-1)
    with pytest.raises((ValueError, OverflowError)):
        ring.submit(_uring.OP_READ, fd, z3, a3, l3, None, None, ud_base=1 << 64)
    assert ring.inflight == 0 and ring.sq_pending == 0
    # the largest base that fits is accepted and numbered exactly
    assert ring.submit(_uring.OP_READ, fd, z3, a3, l3, None, None, ud_base=top - 3) == 3
    assert _reap_all(ring, 3) == {top - 3: 8, top - 2: 8, top - 1: 8}
    assert ring.inflight == 0
    os.close(fd)


def _anon_pages(npages):
    """Private anonymous memory: MADV_DONTNEED later swaps fresh zero pages in under the address."""
    import mmap

    m = mmap.mmap(-1, npages * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return m, np.frombuffer(m, dtype=np.uint8)


@pytest.mark.parametrize("order", ["sorted", "unsorted"])
def test_auto_fixed_uses_the_registered_pages_only_for_ops_inside_a_range(ring, tmp_path, order):
    """Proof by page divergence: after MADV_DONTNEED the address shows fresh zero pages while the
    ring keeps the pages pinned at registration. A fixed write sends the old bytes; a plain write
    sends zeros. So the file shows which ops C ran against a registered buffer."""
    import mmap

    m, mem = _anon_pages(9)
    pattern = np.frombuffer(os.urandom(9 * PAGE), dtype=np.uint8)
    mem[:] = pattern
    base = mem.ctypes.data
    P = PAGE
    ranges = [(base + P, 2 * P), (base + 4 * P, 2 * P), (base + 7 * P, 2 * P)]
    ring.register_buffers(ranges if order == "sorted" else ranges[::-1])
    assert ring.nbufs == 3
    m.madvise(mmap.MADV_DONTNEED)
    assert not mem.any()  # the address now maps zero pages; the pinned ones keep the pattern
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    # (memory offset, length, expected fixed): inside buffer 1, straddling the end of buffer 0,
    # the whole of buffer 2 (last), the start of buffer 0 (first), buffer 1 and past it, exactly
    # buffer 1, an unregistered gap, below every range, straddling the start of buffer 0
    ops = [(4 * P + 100, 1000, True), (3 * P - 500, 1000, False), (7 * P, 2 * P, True), (P, P, True),
           (5 * P, 3 * P, False), (4 * P, 2 * P, True), (6 * P, 10, False), (0, 500, False),
           (P - 8, 100, False)]  # fmt: skip
    mo = _i64([o for o, _, _ in ops])
    lens = _i64([n for _, n, _ in ops])
    foffs = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    q = ring.submit(_uring.OP_WRITE, fd, foffs, _u64(base + mo), lens, None, None, auto_fixed=True)
    assert q == len(ops)
    assert _reap_all(ring, len(ops)) == {i: n for i, (_, n, _) in enumerate(ops)}
    got = os.pread(fd, int(lens.sum()), 0)
    for i, (o, n, fixed) in enumerate(ops):
        part = got[foffs[i] : foffs[i] + n]
        assert part == (pattern[o : o + n].tobytes() if fixed else bytes(n)), (i, o, n, fixed)
    # control: without auto_fixed (or with an explicit buf_index of -1) the same in-range op is plain
    end = int(lens.sum())
    q = ring.submit(_uring.OP_WRITE, fd, _i64([end, end + 1000]), _u64([base + 4 * P + 100] * 2),
                    _i64([1000, 1000]), np.array([-1], np.int16).repeat(2), _u64([0, 1]), auto_fixed=True)  # fmt: skip
    ring.submit(_uring.OP_WRITE, fd, _i64([end + 2000]), _u64([base + 4 * P + 100]), _i64([1000]), None, _u64([2]))
    assert _reap_all(ring, 3) == {0: 1000, 1: 1000, 2: 1000}
    assert os.pread(fd, 3000, end) == bytes(3000)
    # once unregistered, auto_fixed finds nothing and every op is plain
    ring.unregister_buffers()
    ring.submit(_uring.OP_WRITE, fd, _i64([end]), _u64([base + 4 * P + 100]), _i64([1000]), None, None,
                auto_fixed=True)  # fmt: skip
    assert _reap_all(ring, 1) == {0: 1000}
    assert os.pread(fd, 1000, end) == bytes(1000)
    os.close(fd)
    del mem
    m.close()


def test_auto_fixed_read_lands_in_the_registered_buffer(ring, tmp_path):
    import mmap

    path = tmp_path / "f"
    data = os.urandom(2 * PAGE)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    m, mem = _anon_pages(4)
    base = mem.ctypes.data
    ring.register_buffers([(base, 2 * PAGE)])
    # before any divergence, a fixed read is visible at the address
    ring.submit(_uring.OP_READ, fd, _i64([0]), _u64([base]), _i64([PAGE]), None, None, auto_fixed=True)
    assert _reap_all(ring, 1) == {0: PAGE}
    assert mem[:PAGE].tobytes() == data[:PAGE]
    m.madvise(mmap.MADV_DONTNEED)
    # in range -> read into the pinned pages (invisible at the address); straddling -> plain read
    q = ring.submit(_uring.OP_READ, fd, _i64([0, 0]), _u64([base, base + PAGE + 96]), _i64([2 * PAGE, PAGE]), None,
                    None, ud_base=40, auto_fixed=True)  # fmt: skip
    assert q == 2 and _reap_all(ring, 2) == {40: 2 * PAGE, 41: PAGE}
    assert not mem[: PAGE + 96].any()
    assert mem[PAGE + 96 : 2 * PAGE + 96].tobytes() == data[:PAGE]
    # the pinned pages really hold the read: a fixed write of them reproduces the file
    out = os.open(tmp_path / "g", os.O_RDWR | os.O_CREAT, 0o644)
    ring.submit(_uring.OP_WRITE, out, _i64([0]), _u64([base]), _i64([2 * PAGE]), None, None, auto_fixed=True)
    assert _reap_all(ring, 1) == {0: 2 * PAGE}
    assert os.pread(out, 2 * PAGE, 0) == data
    ring.unregister_buffers()
    os.close(fd), os.close(out)
    del mem
    m.close()


def test_check_with_scalar_fd_refuses_misaligned_odirect_op_by_index(ring, tmp_path):
    fd = open_direct(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    with AlignedBuffer(4 * PAGE) as buf:
        a = buf.address
        offs = _i64([0, PAGE, 2 * PAGE])
        lens = _i64([PAGE] * 3)
        al = dict(mem_align=PAGE, off_align=PAGE)
        assert ring.check(_uring.OP_READ, fd, offs, _u64([a, a + PAGE, a + 2 * PAGE]), lens, **al) is None
        with pytest.raises(ValueError, match=rf"op 2: fd {fd} is O_DIRECT.*address 0x{a + 2 * PAGE + 100:x}"):
            ring.check(_uring.OP_READ, fd, offs, _u64([a, a + PAGE, a + 2 * PAGE + 100]), lens, **al)
        with pytest.raises(ValueError, match=rf"op 1: fd {fd} is O_DIRECT.*offset {PAGE + 100}"):
            ring.check(_uring.OP_WRITE, fd, _i64([0, PAGE + 100, 2 * PAGE]), _u64([a, a + PAGE, a + 2 * PAGE]), lens, **al)
        # the one-entry array form is the same check
        with pytest.raises(ValueError, match=r"op 0: .*O_DIRECT.*length 1000"):
            ring.check(_uring.OP_READ, np.array([fd], np.int32), _i64([0, 0]), _u64([a, a]), _i64([1000, PAGE]), **al)
        # without an alignment the check has nothing to hold the op to
        assert ring.check(_uring.OP_READ, fd, _i64([100]), _u64([a + 1]), _i64([1000])) is None
        with pytest.raises(ValueError, match=r"op 0: fd must be >= 0, got -1"):
            ring.check(_uring.OP_READ, -1, offs, _u64([a, a + PAGE, a + 2 * PAGE]), lens)
        with pytest.raises(ValueError, match="differ in length"):
            ring.check(_uring.OP_READ, fd, offs[:2].copy(), _u64([a, a + PAGE, a + 2 * PAGE]), lens)
        # check() writes nothing: the ring is untouched and so is the memory
        buf.array[:] = 0xC3
        assert ring.inflight == 0 and ring.sq_pending == 0
        assert (buf.array == 0xC3).all()
    os.close(fd)


class _RB:
    """A batch as reap_batches sees it: int64 ``done`` (writable) and ``lens``."""

    __slots__ = ("name", "done", "lens", "__weakref__")

    def __init__(self, name, lens, done=None, dtype=np.int64):
        self.name = name
        self.lens = _i64(lens)
        self.done = np.zeros(len(lens), dtype=dtype) if done is None else np.asarray(done, dtype=dtype)

    def __repr__(self):
        return f"_RB({self.name})"


def test_reap_batches_finishes_full_ops_in_c_and_reports_the_odd_ones_exactly(ring, tmp_path):
    path = tmp_path / "f"
    data = os.urandom(10_000)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    r, w = os.pipe()
    os.close(r), os.close(w)  # a closed descriptor number
    buf = np.zeros(8 * PAGE, dtype=np.uint8)
    ba = buf.ctypes.data
    # batch A (slot 3): two full reads, a short read at EOF, an EBADF op, the remainder of an op
    # already 1000 bytes in (finishes: res == lens - done), and a read past EOF (0)
    A = _RB("A", [PAGE] * 6, done=[0, 0, 0, 0, 1000, 0])
    fds = np.array([fd, fd, fd, r, fd, fd], dtype=np.int32)
    offs = _i64([0, PAGE, 2 * PAGE, 0, 1000, 20_000])
    addrs = _u64([ba, ba + PAGE, ba + 2 * PAGE, ba + 3 * PAGE, ba + 4 * PAGE + 1000, ba + 5 * PAGE])
    lens = _i64([PAGE, PAGE, PAGE, PAGE, PAGE - 1000, PAGE])
    assert ring.submit(_uring.OP_READ, fds, offs, addrs, lens, None, None, ud_base=3 << 32) == 6
    # batch B (slot 7): two full ops numbered by ud_base, and one whose index is past its arrays
    B = _RB("B", [100, 100])
    scratch = ba + 6 * PAGE
    assert ring.submit(_uring.OP_READ, fd, _i64([0, 100]), _u64([scratch, scratch + 100]), _i64([100, 100]), None,
                       None, ud_base=7 << 32) == 2  # fmt: skip
    # batch C (slot 11): float64 ``done`` is not a usable array, so its full op is odd, untouched
    C = _RB("C", [100], dtype=np.float64)
    # slot 9 is not in the dict (its batch is gone): its CQE is consumed and dropped
    more = ring.submit(_uring.OP_READ, fd, _i64([0, 0, 0]), _u64([scratch + 200] * 3), _i64([100] * 3), None,
                       _u64([(7 << 32) + 5, (11 << 32) + 0, (9 << 32) + 0]))  # fmt: skip
    assert more == 3
    _wait_ready(ring, 11)
    n, touched, odd = ring.reap_batches({3: A, 7: B, 11: C})
    assert n == 11
    assert {b.name: k for b, k in touched} == {"A": 3, "B": 2, "C": 0}
    assert len(touched) == 3
    assert sorted((b.name, i, res) for b, i, res in odd) == sorted([
        ("A", 2, 10_000 - 2 * PAGE), ("A", 3, -errno.EBADF), ("A", 5, 0), ("B", 5, 100), ("C", 0, 100)
    ])  # fmt: skip
    assert A.done.tolist() == [PAGE, PAGE, 0, 0, PAGE, 0]  # odd ops are left to the caller's policy
    assert B.done.tolist() == [100, 100]
    assert C.done.tolist() == [0.0]
    assert ring.inflight == 0
    assert buf[: 2 * PAGE].tobytes() == data[: 2 * PAGE]
    assert buf[2 * PAGE : 2 * PAGE + 1808].tobytes() == data[2 * PAGE :]
    assert buf[4 * PAGE + 1000 : 5 * PAGE].tobytes() == data[1000:PAGE]
    # nothing left: the next call reports nothing and touches nothing
    assert ring.reap_batches({3: A, 7: B, 11: C}) == (0, [], None)
    with pytest.raises(TypeError, match="dict"):
        ring.reap_batches([(3, A)])
    os.close(fd)


def test_reap_batches_takes_at_most_64_batches_per_call(tmp_path):
    ring = _uring.Ring(128)
    path = tmp_path / "f"
    path.write_bytes(b"q" * 10)
    fd = os.open(path, os.O_RDONLY)
    buf = np.zeros(10, dtype=np.uint8)
    nb = 70
    batches = {s: _RB(s, [10]) for s in range(nb)}
    ud = _u64([s << 32 for s in range(nb)])
    assert ring.submit(_uring.OP_READ, fd, np.zeros(nb, np.int64), _u64([buf.ctypes.data] * nb), _i64([10] * nb),
                       None, ud) == nb  # fmt: skip
    _wait_ready(ring, nb)
    n1, t1, odd1 = ring.reap_batches(batches)
    assert n1 == 64 and len(t1) == 64 and odd1 is None and ring.inflight == nb - 64
    n2, t2, odd2 = ring.reap_batches(batches)
    assert n2 == nb - 64 and len(t2) == nb - 64 and odd2 is None and ring.inflight == 0
    assert {b.name for b, k in t1 + t2} == set(range(nb)) and all(k == 1 for _, k in t1 + t2)
    assert all(b.done[0] == 10 for b in batches.values())
    assert ring.close() is True
    os.close(fd)


def test_reap_batches_keeps_a_batch_alive_that_leaves_the_dict_mid_call(tmp_path):
    """reap_batches runs Python code (attribute lookups) while it holds a batch taken from the
    dict; that code may drop the dict's reference. The returned tuples must hold a live object."""
    path = tmp_path / "f"
    path.write_bytes(b"k" * 64)
    code = textwrap.dedent(
        f"""
        import os, weakref, numpy as np
        from umbp_nvme import _uring
        batches = {{}}
        class B:
            __slots__ = ("_done", "lens", "__weakref__")
            @property
            def done(self):
                batches.pop(3, None)  # the last strong reference goes while C is using it
                return self._done
        b = B(); b._done = np.zeros(1, np.int64); b.lens = np.array([64], np.int64)
        batches[3] = b
        wr = weakref.ref(b)
        del b
        r = _uring.Ring(8)
        fd = os.open({str(path)!r}, os.O_RDONLY)
        buf = np.zeros(64, np.uint8)
        r.submit(_uring.OP_READ, fd, np.zeros(1, np.int64), np.array([buf.ctypes.data], np.uint64),
                 np.array([64], np.int64), None, np.array([3 << 32], np.uint64))
        r.wait(1, timeout_s=5)
        n, touched, odd = r.reap_batches(batches)
        alive = wr() is not None
        print(n, alive, alive and touched[0][0] is wr(), touched[0][1], odd, alive and int(wr()._done[0]))
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "True", "True", "1", "None", "64"], out.stdout + out.stderr
