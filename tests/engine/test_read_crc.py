"""read_many_crc: the io_uring engine's reads with each object's CRC32C computed as its read completes
(native reap_batches), and the ops whose CRC it leaves to the caller (-1)."""

from __future__ import annotations

import os

import numpy as np

from conftest import open_direct

from umbp_nvme import _uring
from umbp_nvme._uring import crc32c
from umbp_nvme.buffers import AlignedBuffer
from umbp_nvme.engine.uring import open_uring_engine

PAGE = 4096


def _crc(a: np.ndarray) -> int:
    return crc32c(a.tobytes())


async def test_each_completed_reads_crc_is_its_bytes_crc_of_the_asked_length(tmp_path):
    eng = await open_uring_engine(32)
    fd = open_direct(tmp_path / "f")
    n, size = 40, 3 * PAGE  # more ops than the ring holds: queued ops get their CRCs too
    try:
        with AlignedBuffer(n * size) as src, AlignedBuffer(n * size) as dst:
            src.array[:] = np.random.default_rng(7).integers(0, 256, n * size, dtype=np.uint8)
            offs = np.random.default_rng(1).permutation(n).astype(np.int64) * size
            mem = np.arange(n, dtype=np.uint64) * np.uint64(size)
            assert (await eng.write_many(fd, offs, src.address + mem, np.full(n, size))).tolist() == [size] * n
            await eng.sync(fd)
            # per op: the whole op, a prefix, nothing (0), more than was read (refused: -1)
            want = np.array([size, size - 5, 0, size + 1] * (n // 4), np.int64)
            res, got = await eng.read_many_crc(fd, offs, dst.address + mem, np.full(n, size, np.int64), want)
            assert res.tolist() == [size] * n
            assert np.array_equal(src.array, dst.array)
            for i in range(n):
                obj = dst.array[i * size:(i + 1) * size]
                expect = _crc(obj[:want[i]]) if 0 < want[i] <= size else -1
                assert int(got[i]) == expect, i
    finally:
        os.close(fd)
        eng.close()


async def test_ops_that_do_not_finish_in_one_piece_are_left_to_the_caller(tmp_path):
    """A read short at EOF and a failed op carry -1: their CRC is not the object's."""
    eng = await open_uring_engine(8)
    path = tmp_path / "g"
    data = np.random.default_rng(3).integers(0, 256, 3 * PAGE + 100, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        dst = np.zeros(4 * PAGE, np.uint8)
        base = np.uint64(dst.ctypes.data)
        addrs = base + np.array([0, PAGE, 2 * PAGE], np.uint64)
        offs = np.array([0, PAGE, 3 * PAGE], np.int64)  # the last one meets EOF after 100 bytes
        lens = np.full(3, PAGE, np.int64)
        res, got = await eng.read_many_crc(fd, offs, addrs, lens, lens.copy())
        assert res.tolist() == [PAGE, PAGE, 100]
        assert got.tolist() == [_crc(data[:PAGE]), _crc(data[PAGE:2 * PAGE]), -1]
        res, got = await eng.read_many_crc([fd, 987654], offs[:2], addrs[:2], lens[:2], lens[:2].copy())
        assert res[1] < 0 and got[1] == -1 and got[0] == _crc(data[:PAGE])
    finally:
        os.close(fd)
        eng.close()


class _B:
    """A batch as reap_batches sees it, with the optional ``addrs`` and ``crc`` (crc_lens, crc_out)."""

    def __init__(self, lens, addrs, crc, done=None):
        self.lens = np.asarray(lens, np.int64)
        self.done = np.zeros(len(lens), np.int64) if done is None else np.asarray(done, np.int64)
        self.addrs = addrs
        self.crc = crc


def test_reap_computes_crcs_from_the_ops_start_and_ignores_unusable_arrays(tmp_path):
    """The CRC covers crc_lens[i] bytes from addrs[i], the op's start, also when the completion
    finishes a remainder (done was 1000 in); a batch whose crc/addrs arrays are unusable (wrong
    dtype, wrong length, not a pair, no addrs) completes its ops all the same and gets no CRC."""
    path = tmp_path / "f"
    data = np.random.default_rng(5).integers(0, 256, 4 * PAGE, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    ring = _uring.Ring(32)
    try:
        buf = np.zeros(4 * PAGE, np.uint8)
        ba = np.uint64(buf.ctypes.data)
        buf[:1000] = data[:1000]  # op 0 is 1000 bytes in already: only its remainder is read now
        good = _B([PAGE, PAGE], ba + np.array([0, PAGE], np.uint64),
                  (np.array([PAGE, 10], np.int64), np.full(2, -1, np.int64)), done=[1000, 0])
        bad = {  # slot -> batch whose CRC arrays C must refuse
            2: _B([PAGE], ba + np.array([2 * PAGE], np.uint64), (np.array([PAGE], np.int32), np.full(1, -1, np.int64))),
            3: _B([PAGE], ba + np.array([2 * PAGE], np.uint64), (np.array([PAGE, 1], np.int64), np.full(1, -1, np.int64))),
            4: _B([PAGE], ba + np.array([2 * PAGE], np.uint64), [np.array([PAGE], np.int64), np.full(1, -1, np.int64)]),
            5: _B([PAGE], np.array([2 * PAGE], np.float64), (np.array([PAGE], np.int64), np.full(1, -1, np.int64))),
            6: _B([PAGE], ba + np.array([2 * PAGE], np.uint64), (np.array([PAGE], np.int64), np.full(1, 7, np.uint32))),
        }
        assert ring.submit(_uring.OP_READ, fd, np.array([1000, PAGE], np.int64),
                           ba + np.array([1000, PAGE], np.uint64), np.array([PAGE - 1000, PAGE], np.int64), None, None,
                           ud_base=1 << 32) == 2  # fmt: skip
        for slot in bad:
            assert ring.submit(_uring.OP_READ, fd, np.array([2 * PAGE], np.int64), ba + np.array([2 * PAGE], np.uint64),
                               np.array([PAGE], np.int64), None, None, ud_base=slot << 32) == 1  # fmt: skip
        batches = {1: good, **bad}
        reaped = 0
        for _ in range(60):  # a lost completion fails the test instead of hanging it
            if reaped == 2 + len(bad):
                break
            ring.wait(1, timeout_s=10.0)
            n, _, odd = ring.reap_batches(batches)
            assert odd is None
            reaped += n
        assert reaped == 2 + len(bad), "completions did not arrive"
        assert good.done.tolist() == [PAGE, PAGE]
        assert good.crc[1].tolist() == [crc32c(data[:PAGE].tobytes()), crc32c(data[PAGE:PAGE + 10].tobytes())]
        for b in bad.values():
            assert b.done.tolist() == [PAGE]
            assert np.asarray(b.crc[1]).tolist() in ([-1], [7])  # untouched
    finally:
        ring.close()
        os.close(fd)


async def test_addresses_as_a_list_still_get_their_crcs(tmp_path):
    """The engine turns a list of addresses into the uint64 array the reap reads them from."""
    eng = await open_uring_engine(8)
    path = tmp_path / "h"
    data = np.random.default_rng(9).integers(0, 256, 2 * PAGE, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        dst = np.zeros(2 * PAGE, np.uint8)
        addrs = [dst.ctypes.data, dst.ctypes.data + PAGE]
        res, got = await eng.read_many_crc(fd, [0, PAGE], addrs, [PAGE, PAGE], [PAGE, PAGE])
        assert res.tolist() == [PAGE, PAGE]
        assert got.tolist() == [crc32c(data[:PAGE].tobytes()), crc32c(data[PAGE:].tobytes())]
        assert np.array_equal(dst, data)
    finally:
        os.close(fd)
        eng.close()


def test_more_checksums_in_one_reap_than_it_gathers_at_a_time(tmp_path):
    """300 completions reaped by one call: the checksums are computed in several GIL-free rounds
    (128 at a time), every one of them right."""
    n, size = 300, 512
    path = tmp_path / "many"
    data = np.random.default_rng(11).integers(0, 256, n * size, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    ring = _uring.Ring(512)
    try:
        dst = np.zeros(n * size, np.uint8)
        addrs = np.uint64(dst.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(size)
        lens = np.full(n, size, np.int64)
        b = _B(lens, addrs, (lens - np.arange(n) % 7, np.full(n, -1, np.int64)))
        offs = np.arange(n, dtype=np.int64) * size
        assert ring.submit(_uring.OP_READ, fd, offs, addrs, lens, None, None, ud_base=2 << 32) == n
        assert any(ring.wait(n, timeout_s=10.0) >= n for _ in range(60)), "completions did not arrive"
        got, _, odd = ring.reap_batches({2: b})
        assert got == n and odd is None and b.done.tolist() == [size] * n
        want = [crc32c(data[i * size:i * size + size - i % 7].tobytes()) for i in range(n)]
        assert b.crc[1].tolist() == want
    finally:
        ring.close()
        os.close(fd)
