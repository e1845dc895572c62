"""Staging CUDA buffers through pinned host memory (gds_staging=True), and CRC of device ranges."""

from __future__ import annotations

import asyncio
import ctypes
import errno

import numpy as np

from ..base import ADDR_DTYPE, RESULT_DTYPE, IoBatch
from ._common import READ, WRITE, STAGING_ALIGN_BYTES, pkg

# --------------------------------------------------------------------------------------------
# Staging through pinned host memory (gds_staging=True), and CRC of device ranges


def round_up(n, unit: int = STAGING_ALIGN_BYTES):
    """n (an int or an int array) rounded up to a multiple of unit."""
    return -(-n // unit) * unit


class StagingBuffer:
    """Page-aligned host memory, pinned with cudaHostRegister when possible (O_DIRECT-ready).

    One staged call uses it at a time (an asyncio lock, created on first use).
    """

    def __init__(self, nbytes: int, *, pin: bool = True):
        from ...buffers import AlignedBuffer

        if nbytes <= 0:
            raise ValueError(f"staging nbytes must be > 0, got {nbytes}")
        self.nbytes = round_up(nbytes)
        self._buf = AlignedBuffer(self.nbytes)
        self.address = self._buf.address
        self.pinned = pkg()._device_ops.pin(self.address, self.nbytes) if pin else False
        self._lock: asyncio.Lock | None = None

    def lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def close(self) -> None:
        if self._buf is None:
            return
        if self.pinned:
            pkg()._device_ops.unpin(self.address)
            self.pinned = False
        self._buf.close()
        self._buf = None


def _plan_groups(io_lengths: np.ndarray, capacity: int, base: int):
    """Yield (indices, host addresses) groups that fit a staging buffer at base, in op order.

    io_lengths are multiples of STAGING_ALIGN_BYTES, so every op starts block-aligned.
    """
    idx: list[int] = []
    host: list[int] = []
    used = 0
    for k, ln in enumerate(io_lengths.tolist()):
        if used + ln > capacity and idx:
            yield idx, host
            idx, host, used = [], [], 0
        idx.append(k)
        host.append(base + used)
        used += ln
    if idx:
        yield idx, host


def _to_host(dev, host, lens, io_lens) -> None:
    """Device ranges -> host, then zero each host range from lens up to io_lens."""
    pkg()._device_ops.copy_d2h([(d, h, n) for d, h, n in zip(dev, host, lens) if n > 0])
    for h, n, p in zip(host, lens, io_lens):
        if p > n:
            ctypes.memset(h + n, 0, p - n)


def _crcs_into(out: np.ndarray, idx, host, lens) -> None:
    for k, h, n in zip(idx, host, lens):
        out[k] = pkg().host_crc32c(h, n)


async def _in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def _staged(op: int, host_engine, fds, offsets, dev_addrs, lengths, staging: StagingBuffer,
                  with_crc: bool):
    b = IoBatch.of(fds, offsets, dev_addrs, lengths)
    res = np.zeros(len(b), dtype=RESULT_DTYPE)
    crcs = np.zeros(len(b), dtype=np.uint32)
    io_lens = round_up(b.lengths)  # O_DIRECT files take whole blocks only
    too_big = io_lens > staging.nbytes
    res[too_big] = -errno.ENOBUFS
    ok = np.flatnonzero(~too_big)
    transfer = host_engine.write_many if op == WRITE else host_engine.read_many
    async with staging.lock():
        for idx, host in _plan_groups(io_lens[ok], staging.nbytes, staging.address):
            sel = ok[idx]
            dev, want = b.addrs[sel].tolist(), b.lengths[sel]
            if op == WRITE:
                await _in_thread(_to_host, dev, host, want.tolist(), io_lens[sel].tolist())
            r = await transfer(b.files(sel), b.offsets[sel], np.asarray(host, dtype=ADDR_DTYPE), io_lens[sel])
            res[sel] = r = np.minimum(r, want)  # the bytes past the object are not the caller's
            moved = want.tolist() if op == WRITE else np.maximum(r, 0).tolist()
            if with_crc:
                _crcs_into(crcs, sel, host, moved)
            if op == READ:
                pairs = [(h, d, n) for h, d, n in zip(host, dev, moved) if n > 0]
                await _in_thread(pkg()._device_ops.copy_h2d, pairs)
    return (res, crcs) if with_crc else res


async def staged_read(host_engine, fds, offsets, dev_addrs, lengths, staging: StagingBuffer, *,
                      with_crc: bool = False):
    """Read extents into device memory via host_engine (io_uring) and the pinned staging buffer.

    The host engine reads each op rounded up to STAGING_ALIGN_BYTES (O_DIRECT files refuse other
    lengths); only ``lengths`` bytes reach the device and the results are clipped to them.
    Returns the per-op results (the protocol's convention), and with ``with_crc`` also the CRC32C of
    the bytes read (computed on the host copy, before the device copy) as uint32.
    """
    return await _staged(READ, host_engine, fds, offsets, dev_addrs, lengths, staging, with_crc)


async def staged_write(host_engine, fds, offsets, dev_addrs, lengths, staging: StagingBuffer, *,
                       with_crc: bool = False):
    """Copy device ranges to the pinned staging buffer, then write them with host_engine.

    Each op is written rounded up to STAGING_ALIGN_BYTES, the padding zeroed (no stale staging
    bytes reach the disk): the extent at each offset must be reserved rounded up too, as the
    store's slots are (slot-sized, 4 KiB aligned). Results are clipped to ``lengths``. The device
    copy runs on torch's current stream after the caller's queued work on it; work on other streams
    must be synchronised by the caller first.
    """
    return await _staged(WRITE, host_engine, fds, offsets, dev_addrs, lengths, staging, with_crc)


async def device_crc32c_many(dev_addrs, lengths, staging: StagingBuffer | None = None) -> np.ndarray:
    """CRC32C of device ranges, computed on a pinned host copy (one device sync per group)."""
    addrs = np.ascontiguousarray(dev_addrs, dtype=ADDR_DTYPE)
    lens = np.ascontiguousarray(lengths, dtype=np.int64)
    if len(addrs) != len(lens):
        raise ValueError(f"dev_addrs ({len(addrs)}) and lengths ({len(lens)}) differ in length")
    crcs = np.zeros(len(lens), dtype=np.uint32)
    if len(lens) == 0:
        return crcs
    own = staging is None
    if own:
        staging = pkg().StagingBuffer(max(int(lens.max()), 1) * min(len(lens), 8))
    if int(lens.max()) > staging.nbytes:
        raise ValueError(f"a range of {int(lens.max())} bytes exceeds the staging buffer ({staging.nbytes} bytes)")

    def work():
        for idx, host in _plan_groups(round_up(lens), staging.nbytes, staging.address):
            n = lens[idx].tolist()
            _to_host(addrs[idx].tolist(), host, n, n)
            _crcs_into(crcs, idx, host, n)

    try:
        async with staging.lock():
            await _in_thread(work)
    finally:
        if own:
            staging.close()
    return crcs
