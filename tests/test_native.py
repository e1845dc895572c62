"""umbp_nvme._uring: the C boundary (argument checks, raw ring round trips) and CRC32C."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from umbp_nvme.buffers import AlignedBuffer

_uring = pytest.importorskip("umbp_nvme._uring", reason="extension not built: python setup.py build_ext --inplace")

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


def _submit(ring, op, fds, offs, addrs, lens, ud=None, bidx=None, flags=None):
    f, o, a, ln, b, u = _arrays(fds, offs, addrs, lens, ud, bidx)
    fl = None if flags is None else np.asarray(flags, dtype=np.uint8)
    return ring.submit(op, f, o, a, ln, b, u, fl)


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


def _open_direct(path, flags):
    try:
        return os.open(path, flags | os.O_DIRECT, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            pytest.skip(f"O_DIRECT unsupported on {path} (tmpfs?)")
        raise


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
    fd = _open_direct(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    with AlignedBuffer(3 * PAGE) as buf:
        buf.array[:] = 0xAB
        addrs = [buf.address, buf.address + PAGE + 100]
        with pytest.raises(ValueError, match=r"op 1: fd \d+ is O_DIRECT.*aligned"):
            _submit(ring, _uring.OP_READ, fd, [0, PAGE], addrs, [PAGE, PAGE])
        with pytest.raises(ValueError, match=r"op 0: .*O_DIRECT.*offset 100"):
            _submit(ring, _uring.OP_READ, fd, [100], [buf.address], [PAGE])
        with pytest.raises(ValueError, match=r"op 0: .*O_DIRECT.*length 1000"):
            _submit(ring, _uring.OP_READ, fd, [0], [buf.address], [1000])
        assert ring.inflight == 0 and ring.sq_pending == 0
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
    fd = _open_direct(path, os.O_RDONLY)
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


def test_register_files_and_fixed_file_ops(ring, tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"hello world")
    fd = os.open(path, os.O_RDONLY)
    ring.register_files([-1, fd])
    assert ring.nfiles == 2
    buf = np.zeros(11, dtype=np.uint8)
    _submit(ring, _uring.OP_READ, 1, [0], [buf.ctypes.data], [11], flags=[_uring.F_FIXED_FILE])
    assert _reap_all(ring, 1) == {0: 11}
    assert buf.tobytes() == b"hello world"
    with pytest.raises(ValueError, match="F_FIXED_FILE index 0 is not a registered file"):
        _submit(ring, _uring.OP_READ, 0, [0], [buf.ctypes.data], [11], flags=[_uring.F_FIXED_FILE])
    ring.unregister_files()
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
        import ctypes, errno, resource, sys
        from umbp_nvme import _uring
        from umbp_nvme.buffers import AlignedBuffer
        libc = ctypes.CDLL(None, use_errno=True)
        class Hdr(ctypes.Structure): _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
        class Data(ctypes.Structure): _fields_ = [("eff", ctypes.c_uint32), ("perm", ctypes.c_uint32), ("inh", ctypes.c_uint32)]
        hdr, data = Hdr(0x20080522, 0), (Data * 2)()
        if libc.capget(ctypes.byref(hdr), data) == 0:
            for d in data:  # CAP_IPC_LOCK = 14
                d.eff &= ~(1 << 14); d.perm &= ~(1 << 14); d.inh &= ~(1 << 14)
            libc.capset(ctypes.byref(hdr), data)
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, 1 << 20))
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
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"ERRNO {errno.ENOMEM}", out.stdout + out.stderr
