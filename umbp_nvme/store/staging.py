"""Bounce staging: page-aligned host memory for I/O that O_DIRECT cannot do from the caller's memory.

O_DIRECT needs the memory address and the length aligned to the file's DIO alignment. An op that
is not (an odd-sized object, a buffer at an odd address) goes through one slot of a bounce
buffer instead: writes copy the object in (zero-padded to whole blocks) before the I/O, reads
copy it out after. ``plan`` decides this once per batch, for reads and writes alike.

Also here: ``settle`` / ``wait_out``, the two waits that keep memory alive until the thread or
engine batch using it has ended, even when the caller is cancelled meanwhile.

State: its own (the bounce pool); a store's is state.bounce.
"""

from __future__ import annotations

import asyncio
import ctypes

import numpy as np

from ..buffers import AlignedBuffer
from .segments import size_classes

BOUNCE_IDLE_BYTES_MAX = 256 << 20  # idle bounce memory kept for reuse; more is freed
BOUNCE_BYTES_MIN = 1 << 20  # a bounce buffer is at least this large (small batches reuse it)


class BouncePool:
    """Page-aligned staging memory for callers whose memory O_DIRECT cannot use as is.
    ``memmove``: the copy its plans use (a store's ``StoreHooks.memmove``; default ctypes.memmove)."""

    def __init__(self, memmove=None):
        self.memmove = memmove or ctypes.memmove
        self._idle: list[AlignedBuffer] = []
        self._idle_bytes = 0

    def get(self, nbytes: int) -> AlignedBuffer:
        for i, b in enumerate(self._idle):
            if nbytes <= b.nbytes <= 4 * nbytes:
                self._idle_bytes -= b.nbytes
                return self._idle.pop(i)
        return AlignedBuffer(max(nbytes, BOUNCE_BYTES_MIN))

    def put(self, buf: AlignedBuffer) -> None:
        if self._idle_bytes + buf.nbytes <= BOUNCE_IDLE_BYTES_MAX:
            self._idle.append(buf)
            self._idle_bytes += buf.nbytes
        else:
            buf.close()

    def close(self) -> None:
        for b in self._idle:
            b.close()
        self._idle.clear()
        self._idle_bytes = 0


class StagePlan:
    """Per op of a batch: the address and length the engine uses, and which ops are bounced.

    ``io_addr`` / ``io_len`` are the caller's arrays themselves when nothing is bounced (no copy
    on the common path). The bounce buffer belongs to the plan until ``release``.
    """

    __slots__ = ("addrs", "lens", "io_addr", "io_len", "mask", "bounce", "memmove")

    def __init__(self, addrs, lens, io_addr, io_len, mask, bounce, memmove=ctypes.memmove):
        self.addrs, self.lens, self.io_addr, self.io_len, self.mask, self.bounce = addrs, lens, io_addr, io_len, mask, bounce
        self.memmove = memmove

    @property
    def bounced(self) -> bool:
        return self.bounce is not None

    def copy_in(self) -> None:
        """Writes, on a worker thread: each bounced object into its slot, zero-padded to whole blocks."""
        if self.bounce is None:
            return
        bj = np.flatnonzero(self.mask)
        for dst, s, nb, bl in zip(
            self.io_addr[bj].tolist(), self.addrs[bj].tolist(), self.lens[bj].tolist(), self.io_len[bj].tolist()
        ):
            self.memmove(dst, s, nb)
            if bl > nb:
                ctypes.memset(dst + nb, 0, bl - nb)

    def copy_out(self, sel: np.ndarray, ok: np.ndarray) -> None:
        """Reads, on a worker thread: each bounced object among ops ``sel`` (``ok``: read whole) into the caller's memory."""
        if self.bounce is None:
            return
        dst, io_addr, lens, memmove = self.addrs, self.io_addr, self.lens, self.memmove
        for j in sel[self.mask[sel] & ok].tolist():
            memmove(int(dst[j]), int(io_addr[j]), int(lens[j]))

    def release(self, pool: BouncePool) -> None:
        if self.bounce is not None:
            pool.put(self.bounce)
            self.bounce = None


def unbounced(addrs: np.ndarray, lens: np.ndarray) -> StagePlan:
    """The plan of a batch known to need no bounce (memory.resolve_reads / resolve_sources checked
    its alignment)."""
    return StagePlan(addrs, lens, addrs, lens, None, None)


def plan(pool: BouncePool, direct: np.ndarray, align: np.ndarray, addrs: np.ndarray, lens: np.ndarray,
         skip: np.ndarray | None = None) -> StagePlan:  # fmt: skip
    """The staging of one batch: ops on O_DIRECT files whose address or length is not a multiple
    of the file's alignment are bounced (``skip``: ops never bounced, e.g. CUDA memory)."""
    mask = direct & (((addrs % align.astype(np.uint64)) != 0) | (lens % align != 0))
    if skip is not None:
        mask &= ~skip
    if not mask.any():
        return StagePlan(addrs, lens, addrs, lens, mask, None)
    io_addr, io_len = addrs.copy(), lens.copy()
    bj = np.flatnonzero(mask)
    blen = -(-lens[bj] // align[bj]) * align[bj]
    starts = np.concatenate([[0], np.cumsum(blen)[:-1]])
    bounce = pool.get(int(blen.sum()))
    io_addr[bj] = np.uint64(bounce.address) + starts.astype(np.uint64)
    io_len[bj] = blen
    return StagePlan(addrs, lens, io_addr, io_len, mask, bounce, pool.memmove)


def device_layout(pool: BouncePool, lens: np.ndarray):
    """(block lengths, offsets in the bounce, bounce buffer) for staging CUDA memory through the host."""
    blen = size_classes(lens)
    starts = np.concatenate([[0], np.cumsum(blen)[:-1]]).astype(np.int64)
    return blen, starts, pool.get(int(blen.sum()))


async def settle(fut) -> None:
    """Wait until ``fut`` has ended, whatever it ended with. A cancellation of our caller
    meanwhile is re-raised only after that: the engine batch or worker thread behind ``fut`` may
    use memory (caller buffers, slots, bounce buffers) that must not be reused before it ends."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.wait((fut,))
        except asyncio.CancelledError:
            cancelled = True
    if not fut.cancelled():
        fut.exception()  # retrieved: the batch already counts as failed
    if cancelled:
        raise asyncio.CancelledError


async def wait_out(fut):
    """``fut``'s result (the common path: one shield); if our caller cancels us, the
    CancelledError comes only once ``fut`` has ended (see settle)."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        if not fut.done():
            await settle(fut)
        raise
