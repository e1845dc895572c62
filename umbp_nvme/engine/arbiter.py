"""Reads first: write bytes in flight are bounded, and narrowed to two short slices while reads run.

A backup batch (48 x 4 MiB = 192 MiB) handed to the device at once sits in front of every read
that arrives after it: the device and the block layer serve whichever came first. So a store's
read and write engines share one ``Arbiter`` (one event loop, no locks):

* a write batch goes to the device in slices of about ``slice_bytes``; with no reads about, up to
  ``WINDOW_SLICES`` slices are in flight (the next one queued while the current one runs, so the
  device never idles between slices), across every write batch of the store;
* while a read batch is in flight, and for ``READ_QUIET_S`` after the last one ended, at most
  ``read_window_slices`` (2) write slices are in flight, each cut to ``read_slice_fraction`` of
  ``slice_bytes`` (floor ``READ_SLICE_FLOOR``): a prefetch that arrives competes with at most two
  short slices, and a stream of back-to-back reads still lets the backup move (never starved).

A batch is cut into slices lazily, each when the window grants it, so the cut follows whether
reads are about at that moment. Why 8 MiB slices, a quarter of that (2 MiB) beside reads, and two
of those: the sweeps in docs/benchmarks.md (a ~3.5 ms 1 MiB read waited behind a whole 8 MiB slice;
4 MiB slices all the time cost 4 MiB-object backups their share; what a backup moves beside reads
follows the write bytes in flight, not gaps between slices: two 1 MiB slices moved what one 2 MiB
slice did, two 2 MiB slices 1.1-1.3x that, with the 1 MiB read tail unchanged within noise;
three or four cost the reads their p50 / p99 targets).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable

import numpy as np

from ..config import WRITE_SLICE_BYTES_MAX as SLICE_BYTES_MAX
from ..config import WRITE_SLICE_BYTES_MIN as SLICE_BYTES_MIN
from ..config import StoreConfig
from .base import RESULT_DTYPE, IoBatch

DEFAULT_SLICE_BYTES = StoreConfig.ssd_write_slice_bytes
WINDOW_SLICES = 2  # slices in flight with no reads about: one at the device, the next queued
READ_QUIET_S = 0.100  # after a read ends, this long before the window widens again (spaced prefetches)
READ_SLICE_FRACTION = 0.25  # slice size while reads are about, as a fraction of slice_bytes
READ_SLICE_FLOOR = 2 << 20  # ... but never below this (or slice_bytes, if that is smaller)
READ_WINDOW_SLICES = 2  # cut write slices in flight while reads are about: one at the device, the next queued


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
                 quiet_s: float | None = None, window_slices: int | None = None,
                 read_slice_fraction: float | None = None, read_window_slices: int | None = None,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        # None: the module's value at construction (bench mixed's sweep flags set those)
        # clock: seconds for quiet_s; tests pass a virtual loop's time() so no step depends on wall time
        self.clock = clock
        self.slice_bytes = check_slice_bytes(slice_bytes)
        frac = READ_SLICE_FRACTION if read_slice_fraction is None else read_slice_fraction
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac <= 1:
            raise ValueError(f"read_slice_fraction must be in (0, 1], got {frac!r}")
        floor = min(self.slice_bytes, READ_SLICE_FLOOR)
        self.read_slice_bytes = max(floor, int(self.slice_bytes * frac))  # the cut while reads are about
        self.hold_reads = hold_reads  # False (ssd_read_priority=off): reads never narrow the window
        self.quiet_s = float(READ_QUIET_S if quiet_s is None else quiet_s)
        self.window_slices = WINDOW_SLICES if window_slices is None else int(window_slices)
        if self.window_slices < 1:
            raise ValueError(f"window_slices must be >= 1, got {window_slices!r}")
        self.read_window_slices = READ_WINDOW_SLICES if read_window_slices is None else int(read_window_slices)
        if self.read_window_slices < 1:
            raise ValueError(f"read_window_slices must be >= 1, got {read_window_slices!r}")
        self._limit = self.slice_bytes * self.window_slices
        self._wbytes = 0  # write bytes submitted, not complete
        self._wslices = 0  # write slices submitted, not complete
        self._waiting: deque = deque()  # futures of write slices waiting for a grant, FIFO
        self._reads = 0  # read batches in flight
        self._read_end = -1e9  # monotonic time the last read batch ended
        self.stats = {"write_slices": 0, "write_slices_held": 0, "write_slices_cut": 0, "write_whole": 0, "reads": 0}

    @property
    def enabled(self) -> bool:
        return self.slice_bytes > 0

    @property
    def granted(self) -> tuple[int, int]:
        """(write bytes, write slices) granted and not yet released: (0, 0) when the window is whole."""
        return self._wbytes, self._wslices

    @property
    def waiting(self) -> int:
        """Write slices waiting for a grant."""
        return len(self._waiting)

    # -- reads ------------------------------------------------------------------------------

    def read_started(self) -> None:
        self._reads += 1
        self.stats["reads"] += 1

    def read_done(self) -> None:
        self._reads -= 1
        if self._reads == 0:
            self._read_end = self.clock()

    # -- writes -----------------------------------------------------------------------------

    @property
    def reads_in_flight(self) -> int:
        return self._reads

    def reads_about(self) -> bool:
        """A read batch is in flight or one ended within quiet_s (and reads narrow the window)."""
        return self.hold_reads and bool(self._reads or self.clock() - self._read_end < self.quiet_s)

    def _may_go(self, reads_about: bool) -> bool:
        """A slice goes when nothing is in flight, else when one more full slice fits the window;
        while reads run or ran within quiet_s, only while fewer than read_window_slices (cut short)
        are in flight. A held one goes at a release."""
        if not self._wbytes:
            return True
        if reads_about:
            return self._wslices < self.read_window_slices
        return self._wbytes + self.slice_bytes <= self._limit

    def _grant(self, reads_about: bool) -> int:
        nbytes = self.read_slice_bytes if reads_about else self.slice_bytes
        self._wbytes += nbytes
        self._wslices += 1
        self.stats["write_slices"] += 1
        self.stats["write_slices_cut"] += nbytes < self.slice_bytes
        return nbytes

    async def acquire(self) -> int:
        """Wait for a turn in the window; returns the bytes granted (charged until settle/release):
        the caller cuts its next slice to about that many and settles the difference."""
        about = self.reads_about()
        if not self._waiting and self._may_go(about):
            return self._grant(about)
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        self.stats["write_slices_held"] += 1
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(fut.result())  # granted and cancelled in the same step: hand it back
            else:
                self._drop(fut)
            raise

    def take_whole(self, lengths: np.ndarray, total: int) -> int:
        """Slices charged when a batch of ``total`` bytes goes to the device as one run, or 0 (slice
        it): only when slicing it now would grant every slice at once (an empty window, no read
        about, nothing waiting, each slice fitting beside those before it), so the device holds
        the same bytes either way and one submission replaces one task per slice."""
        if self._wbytes or self._waiting or total > self._limit or self.reads_about():
            return 0
        bounds = slice_bounds(lengths, self.slice_bytes)
        if len(bounds) > 1:
            ends = np.cumsum(lengths)
            before = [int(ends[s - 1]) for s, _ in bounds[1:]]
            if max(before) + self.slice_bytes > self._limit:
                return 0
        k = len(bounds)
        self._wbytes += total
        self._wslices += k
        self.stats["write_slices"] += k
        self.stats["write_whole"] += 1  # batches that went as one run (put_path skips a loop pass)
        return k

    def release_whole(self, total: int, k: int) -> None:
        self._wbytes -= total
        self._wslices -= k
        self._wake()

    def settle(self, granted: int, used: int) -> None:
        """The slice cut from a grant holds ``used`` bytes (ops are never split): charge that instead."""
        self._wbytes += used - granted
        if used < granted:
            self._wake()

    def release(self, nbytes: int) -> None:
        self._wbytes -= nbytes
        self._wslices -= 1
        self._wake()

    def _drop(self, fut) -> None:
        if fut in self._waiting:
            self._waiting.remove(fut)
        self._wake()

    def _wake(self) -> None:
        about = self.reads_about()
        while self._waiting:
            fut = self._waiting[0]
            if fut.done():
                self._waiting.popleft()
                continue
            if not self._may_go(about):
                break
            self._waiting.popleft()
            fut.set_result(self._grant(about))


async def timed_read(arbiter: Arbiter | None, read):
    """Await ``read`` (a read batch's awaitable) with the arbiter told a read is in flight."""
    if arbiter is None:
        return await read
    arbiter.read_started()
    try:
        return await read
    finally:
        arbiter.read_done()


def slice_end(ends: np.ndarray, s: int, slice_bytes: int) -> int:
    """End of the op range from ``s`` of at most ``slice_bytes`` (``ends``: cumsum of lengths);
    an op is never split, so a range holds >= 1 op."""
    base = int(ends[s - 1]) if s else 0
    e = int(np.searchsorted(ends, base + slice_bytes, side="right"))
    return min(max(e, s + 1), len(ends))


def slice_bounds(lengths: np.ndarray, slice_bytes: int) -> list[tuple[int, int]]:
    """Consecutive op ranges of about ``slice_bytes`` each (an op is never split; >= 1 op each)."""
    ends = np.cumsum(lengths)
    bounds, s = [], 0
    while s < len(ends):
        e = slice_end(ends, s, slice_bytes)
        bounds.append((s, e))
        s = e
    return bounds


async def write_sliced(run, arbiter: Arbiter | None, files, offsets, addrs, lengths) -> np.ndarray:
    """``run(files, offs, addrs, lens)`` for the batch, in slices through the arbiter's window, each
    cut to the size the window grants when its turn comes (every slice keeps the files' facts).

    Results are the same per-op array one ``run`` of the whole batch returns. A cancelled await
    returns only once every slice already submitted has ended (each ``run`` drains its own).
    """
    if arbiter is None or not arbiter.enabled:
        return await run(files, offsets, addrs, lengths)
    try:
        lens = np.asarray(lengths, dtype=np.int64)
        total = int(lens.sum())
    except (TypeError, ValueError):
        return await run(files, offsets, addrs, lengths)  # run() reports what is wrong
    if total <= arbiter.read_slice_bytes:
        arbiter.settle(await arbiter.acquire(), total)
        try:
            return await run(files, offsets, addrs, lengths)
        finally:
            arbiter.release(total)
    k = arbiter.take_whole(lens, total)
    if k:
        try:
            return await run(files, offsets, addrs, lengths)
        finally:
            arbiter.release_whole(total, k)
    b = IoBatch.of(files, offsets, addrs, lengths)
    out = np.zeros(len(b), dtype=RESULT_DTYPE)
    ends = np.cumsum(b.lengths)
    tasks: list[asyncio.Task] = []
    held: dict[int, int] = {}  # slice start -> bytes granted and not yet released
    failed = False

    async def one(s: int, e: int, nbytes: int) -> None:
        nonlocal failed
        try:
            out[s:e] = await run(b.files(slice(s, e)), b.offsets[s:e], b.addrs[s:e], b.lengths[s:e])
        except BaseException:
            failed = True  # stop cutting slices; gather below raises it
            raise
        finally:
            if held.pop(s, None) is not None:
                arbiter.release(nbytes)

    try:
        s = 0
        while s < len(b) and not failed:
            granted = await arbiter.acquire()  # FIFO in the arbiter keeps batches in order
            e = slice_end(ends, s, granted)
            nbytes = int(ends[e - 1] - (ends[s - 1] if s else 0))
            arbiter.settle(granted, nbytes)
            held[s] = nbytes
            tasks.append(asyncio.ensure_future(one(s, e, nbytes)))
            s = e
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
        # A slice cancelled before its first step never runs its finally (seen on Python 3.12 and
        # 3.13 when a slice fails while the next is being granted): its grant is handed back here.
        for nbytes in held.values():
            arbiter.release(nbytes)
        held.clear()
        raise
    return out
