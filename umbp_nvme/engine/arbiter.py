"""Reads first: write bytes in flight are bounded, and a write slice waits while reads run.

A backup batch (48 x 4 MiB = 192 MiB) handed to the device at once sits in front of every read
that arrives after it: the device and the block layer serve whichever came first. So a store's
read and write engines share one ``Arbiter`` (one event loop, no locks):

* a write batch goes to the device in slices of about ``slice_bytes``; at most ``WINDOW_SLICES``
  slices are in flight (the next one is queued while the current one runs, so the device never
  idles between slices), across every write batch of the store;
* while a read batch is in flight, the next write slice is held as long as another write slice
  is still at the device, or until it has waited ``HOLD_MAX_S``: reads compete with at most one
  slice, and a stream of back-to-back reads still lets the backup move one slice at a time.

A read therefore waits behind at most the write slices already at the device.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import numpy as np

from ..config import WRITE_SLICE_BYTES_MAX as SLICE_BYTES_MAX
from ..config import WRITE_SLICE_BYTES_MIN as SLICE_BYTES_MIN
from ..config import StoreConfig
from .base import RESULT_DTYPE, IoBatch

DEFAULT_SLICE_BYTES = StoreConfig.ssd_write_slice_bytes
WINDOW_SLICES = 2  # slices in flight: one at the device, the next queued behind it
HOLD_MAX_S = 0.010  # longest a ready write slice waits for reads to finish


def check_slice_bytes(v) -> int:
    """``ssd_write_slice_bytes``: 0 turns slicing off; otherwise SLICE_BYTES_MIN..SLICE_BYTES_MAX."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"ssd_write_slice_bytes must be an int (bytes), got {v!r}")
    if v != 0 and not SLICE_BYTES_MIN <= v <= SLICE_BYTES_MAX:
        raise ValueError(
            f"ssd_write_slice_bytes must be 0 (off) or in [{SLICE_BYTES_MIN}, {SLICE_BYTES_MAX}], got {v}"
        )
    return v


class Arbiter:
    """Write window and read gate shared by one store's engines (used from their event loop only)."""

    def __init__(self, slice_bytes: int = DEFAULT_SLICE_BYTES, *, hold_reads: bool = True,
                 hold_max_s: float = HOLD_MAX_S):  # fmt: skip
        self.slice_bytes = check_slice_bytes(slice_bytes)
        self.hold_reads = hold_reads
        self.hold_max_s = float(hold_max_s)
        self._limit = self.slice_bytes * WINDOW_SLICES
        self._wbytes = 0  # write bytes submitted, not complete
        self._waiting: deque = deque()  # (nbytes, future, since) of write slices, FIFO
        self._reads = 0  # read batches in flight
        self._timer = None
        self.stats = {"write_slices": 0, "write_slices_held": 0, "reads": 0}

    @property
    def enabled(self) -> bool:
        return self.slice_bytes > 0

    # -- reads ------------------------------------------------------------------------------

    def read_started(self) -> None:
        self._reads += 1
        self.stats["reads"] += 1

    def read_done(self) -> None:
        self._reads -= 1
        if self._reads == 0:
            self._wake()

    # -- writes -----------------------------------------------------------------------------

    def _may_go(self, nbytes: int, since: float, now: float) -> bool:
        if self._wbytes and self._wbytes + nbytes > self._limit:
            return False
        return not (self.hold_reads and self._reads and self._wbytes and now - since < self.hold_max_s)

    async def acquire(self, nbytes: int) -> None:
        now = time.monotonic()
        if not self._waiting and self._may_go(nbytes, now, now):
            self._wbytes += nbytes
            self.stats["write_slices"] += 1
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append((nbytes, fut, now))
        self.stats["write_slices_held"] += 1
        self._arm_timer()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(nbytes)  # granted and cancelled in the same step: hand it back
            else:
                self._drop(fut)
            raise

    def release(self, nbytes: int) -> None:
        self._wbytes -= nbytes
        self._wake()

    def _drop(self, fut) -> None:
        for item in self._waiting:
            if item[1] is fut:
                self._waiting.remove(item)
                break
        self._wake()

    def _wake(self) -> None:
        now = time.monotonic()
        while self._waiting:
            nbytes, fut, since = self._waiting[0]
            if fut.done():
                self._waiting.popleft()
                continue
            if not self._may_go(nbytes, since, now):
                break
            self._waiting.popleft()
            self._wbytes += nbytes
            self.stats["write_slices"] += 1
            fut.set_result(None)
        self._arm_timer()

    def _arm_timer(self) -> None:
        """A held slice goes after hold_max_s even if reads keep coming."""
        if self._timer is not None or not self._waiting or not (self.hold_reads and self._reads):
            return
        since = self._waiting[0][2]
        delay = max(0.0, since + self.hold_max_s - time.monotonic())
        self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._wake()


async def timed_read(arbiter: Arbiter | None, read):
    """Await ``read`` (a read batch's awaitable) with the arbiter told a read is in flight."""
    if arbiter is None:
        return await read
    arbiter.read_started()
    try:
        return await read
    finally:
        arbiter.read_done()


def slice_bounds(lengths: np.ndarray, slice_bytes: int) -> list[tuple[int, int]]:
    """Consecutive op ranges of about ``slice_bytes`` each (an op is never split; >= 1 op each)."""
    n = len(lengths)
    ends = np.cumsum(lengths)
    bounds, s = [], 0
    while s < n:
        base = int(ends[s - 1]) if s else 0
        e = int(np.searchsorted(ends, base + slice_bytes, side="right"))
        e = max(e, s + 1)
        bounds.append((s, min(e, n)))
        s = e
    return bounds


async def write_sliced(run, arbiter: Arbiter | None, fds, offsets, addrs, lengths) -> np.ndarray:
    """``run(fds, offs, addrs, lens)`` for the batch, in slices through the arbiter's window.

    Results are the same per-op array one ``run`` of the whole batch returns. A cancelled await
    returns only once every slice already submitted has ended (each ``run`` drains its own).
    """
    if arbiter is None or not arbiter.enabled:
        return await run(fds, offsets, addrs, lengths)
    try:
        lens = np.asarray(lengths, dtype=np.int64)
        total = int(lens.sum())
    except (TypeError, ValueError):
        return await run(fds, offsets, addrs, lengths)  # run() reports what is wrong
    if total <= arbiter.slice_bytes:
        await arbiter.acquire(total)
        try:
            return await run(fds, offsets, addrs, lengths)
        finally:
            arbiter.release(total)
    b = IoBatch.of(fds, offsets, addrs, lengths)
    out = np.zeros(len(b), dtype=RESULT_DTYPE)
    tasks: list[asyncio.Task] = []

    async def one(s: int, e: int) -> None:
        nbytes = int(b.lengths[s:e].sum())
        await arbiter.acquire(nbytes)
        try:
            out[s:e] = await run(b.fds[s:e], b.offsets[s:e], b.addrs[s:e], b.lengths[s:e])
        finally:
            arbiter.release(nbytes)

    try:
        for s, e in slice_bounds(b.lengths, arbiter.slice_bytes):
            tasks.append(asyncio.ensure_future(one(s, e)))  # FIFO in the arbiter keeps their order
        await asyncio.gather(*tasks)
    except BaseException as exc:
        if not isinstance(exc, asyncio.CancelledError):  # a cancel already reached every slice via gather
            for t in tasks:
                t.cancel()
        while not all(t.done() for t in tasks):  # the kernel may still read the caller's memory
            try:
                await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
            except asyncio.CancelledError:
                continue
        raise
    return out
