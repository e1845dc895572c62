"""UringEngine: batched reads/writes over one io_uring (umbp_nvme._uring), completions on the loop.

One batch = one ``ring.submit`` (one io_uring_enter) of numpy descriptor arrays; completions
are reaped in bulk when the ring's eventfd turns readable (``loop.add_reader``), so there is no
thread and no Python object per op. In flight stays <= the ring's SQ entries (the CQ is twice
that, so it can never overflow); the rest of a large batch waits in a Python queue and is
submitted as completions free slots.

``user_data`` = (batch slot << 32) | op index, so results scatter straight into the batch's
arrays: ``ring.reap_batches`` finishes every op that moved all its bytes in C (``done[i] =
lens[i]``) and hands back only the odd ones (short, errors) and per-batch counts, so a reap costs
a few Python operations per batch, none per op.

Hot path cost (per batch, not per op): when the caller's arrays already have the contract's
dtypes (fd int or int32[], int64, uint64, int64) they go to ``ring.submit`` as they are (no
conversion, no copy; the C side validates them, computes user_data from the slot and looks up
the registered buffer of each op); anything else, or a batch the C check refuses, takes the
general path through ``IoBatch.of`` (conversions, zero-length ops, exact error messages).

Memory safety: the kernel writes into caller memory until an op's CQE is posted. A batch's
await therefore returns only once none of its ops is in flight: a cancelled await stops the
batch's queued ops, asks the kernel to cancel the running ones and waits for them however long
it takes (a read from a pipe is cancelled; block I/O usually runs to its end or to the block
layer's timeout); ``close()`` cancels, waits (bounded)
and, if the kernel still holds ops after that, leaks the ring instead of unmapping it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import os
import threading
from collections import deque
from functools import partial

import numpy as np

from .base import (
    ADDR_DTYPE,
    RESULT_DTYPE,
    Capabilities,
    EngineClosed,
    EngineUnavailable,
    IoBatch,
)
from .arbiter import Arbiter, timed_read, write_sliced
from .priority import IoPriorities
from .files import PAGE_CACHE, FileFacts, Files, split_files
from .uring_batch import SLOT_SHIFT as _SLOT_SHIFT, Batch
from .uring_buffers import FixedBuffers
from .uring_started import StartedReads

log = logging.getLogger(__name__)

FORCE_NO_URING_ENV = "UMBP_NVME_FORCE_NO_URING"
DEFAULT_QUEUE_DEPTH = 256
# Page-cache copies of at least this many bytes go to io-wq workers (IOSQE_ASYNC) instead of
# running inline in io_uring_enter on the loop's core; O_DIRECT ops are never affected.
DEFAULT_ASYNC_MIN_BYTES = 64 << 10
MAX_RETRIES = 8  # EAGAIN/EINTR resubmissions per op
CLOSE_TIMEOUT_S = 5.0
_REAP_MAX_BATCHES = 64  # native reap_batches handles at most this many batches per call


def _load_native():
    try:
        from .. import _uring
    except ImportError as e:
        raise EngineUnavailable(
            errno.ENOSYS, f"umbp_nvme._uring is not built ({e}); run: python setup.py build_ext --inplace"
        ) from None
    return _uring


class UringEngine(StartedReads):
    """IoEngine over io_uring. Create with ``await UringEngine.open(queue_depth)``."""

    def __init__(self, ring, loop: asyncio.AbstractEventLoop, queue_depth: int, *, async_min_bytes: int):
        self._u = _load_native()
        self._ring = ring
        self._loop = loop
        self._thread = threading.get_ident()
        self._depth = min(int(queue_depth), ring.entries)
        self._async_min = int(async_min_bytes)
        self._batches: dict[int, Batch] = {}
        self._next_slot = 0
        self._queue: deque[Batch] = deque()  # batches with ops not yet submitted, in order
        self._retry: deque[tuple[Batch, int]] = deque()  # remainders of short ops, EAGAIN
        self._efd = ring.eventfd
        self._flush_handle = None
        self._closed = False
        self._fixed = FixedBuffers()  # registered ranges, for READ_FIXED/WRITE_FIXED
        self._fixed_on = False  # == self._fixed.on, read by every submit
        self._arbiter: Arbiter | None = None  # reads first: shared with the store's other engine
        self.capabilities = Capabilities(
            name="io_uring", native_async=True, fixed_buffers=False, thread_safe=False, queue_depth=self._depth
        )
        loop.add_reader(self._efd, self._on_ready)

    @classmethod
    async def open(cls, queue_depth: int = DEFAULT_QUEUE_DEPTH, *, async_min_bytes: int = DEFAULT_ASYNC_MIN_BYTES):
        if os.environ.get(FORCE_NO_URING_ENV, "") not in ("", "0"):
            raise EngineUnavailable(errno.EPERM, f"io_uring disabled by {FORCE_NO_URING_ENV}=1")
        u = _load_native()
        if not 1 <= int(queue_depth) <= u.MAX_ENTRIES:
            raise ValueError(f"queue_depth must be in [1, {u.MAX_ENTRIES}], got {queue_depth}")
        try:
            ring = u.Ring(int(queue_depth))
        except OSError as e:
            raise EngineUnavailable(e.errno or errno.ENOSYS, f"io_uring unavailable: {e.strerror or e}") from None
        return cls(ring, asyncio.get_running_loop(), queue_depth, async_min_bytes=async_min_bytes)

    # ------------------------------------------------------------------ IoEngine

    async def read_many(self, files, offsets, addrs, lengths) -> np.ndarray:
        return await timed_read(self._arbiter, self._run(self._u.OP_READ, files, offsets, addrs, lengths))

    async def read_many_crc(self, files, offsets, addrs, lengths, crc_lens) -> tuple[np.ndarray, np.ndarray]:
        """read_many, and per op the CRC32C of its first crc_lens[i] bytes (0 < crc_lens[i] <= lengths[i]),
        computed as it completes while the rest are in flight; -1 where not (not whole in one piece)."""
        crc = np.ascontiguousarray(crc_lens, dtype=np.int64)
        out = np.full(len(crc), -1, np.int64)
        res = await timed_read(self._arbiter, self._run(self._u.OP_READ, files, offsets, addrs, lengths, (crc, out)))
        return res, out

    async def write_many(self, files, offsets, addrs, lengths) -> np.ndarray:
        # through the arbiter's window in slices (reads first); whole when there is none
        return await write_sliced(partial(self._run, self._u.OP_WRITE), self._arbiter, files, offsets, addrs, lengths)

    def set_io_policy(self, priorities: IoPriorities, arbiter: Arbiter | None) -> None:
        """ioprio stamped on later read / write SQEs; the arbiter that slices writes and times reads."""
        self._ring.read_ioprio = priorities.read
        self._ring.write_ioprio = priorities.write
        self._arbiter = arbiter

    async def sync(self, fd: int, *, datasync: bool = True) -> None:
        self._check_open()
        op = self._u.OP_FDATASYNC if datasync else self._u.OP_FSYNC
        z = np.zeros(1, dtype=np.int64)
        b = self._new_batch(op, np.array([fd], dtype=np.int32), PAGE_CACHE, z, z.view(ADDR_DTYPE), z, None, 1)
        self._start(b, validate=False)
        res = int((await self._wait(b))[0])
        if res < 0:
            raise OSError(-res, f"{'fdatasync' if datasync else 'fsync'}(fd {fd}) failed: {os.strerror(-res)}")

    def register_buffers(self, ranges) -> bool:
        """Register (address, nbytes) ranges (added to earlier ones) for fixed-buffer ops, in pieces of
        <= 1 GiB (the kernel's limit). False, logged once, when the kernel refuses (ENOMEM under
        RLIMIT_MEMLOCK, file-backed memory): ops then use plain reads/writes into the same memory."""
        if self._closed:
            return False
        # queued SQEs name buffer indexes of the current table: flush them before it changes
        ok = self._fixed.register(self._ring, ranges, self._u.MAX_FIXED_BUFFERS, self._flush_pending)
        if self._fixed.on != self._fixed_on:
            self._fixed_on = self._fixed.on  # submit(auto_fixed=...): C finds each op's registered buffer
            self.capabilities = dataclasses.replace(self.capabilities, fixed_buffers=self._fixed_on)
        return ok

    def close(self) -> None:
        """Fail pending awaits with EngineClosed; bounded wait for ops the kernel holds. Idempotent."""
        if self._closed:
            return
        if threading.get_ident() != self._thread and self._loop.is_running():
            # The ring has one owner: hand the close to the loop's thread.
            self._loop.call_soon_threadsafe(self.close)
            return
        self._closed = True
        inflight = self._ring.inflight
        try:
            self._loop.remove_reader(self._efd)
        except Exception:  # the loop may already be closed
            pass
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        clean = self._ring.close(timeout_s=CLOSE_TIMEOUT_S)
        if not clean:
            log.error("io_uring engine closed with %d ops still owned by the kernel after %.0f s; the ring is leaked so "
                      "the kernel never writes into freed memory", self._ring.inflight, CLOSE_TIMEOUT_S)  # fmt: skip
        exc_msg = f"io_uring engine closed ({inflight} ops were in flight)"
        for b in list(self._batches.values()):
            if not b.fut.done():
                b.fut.set_exception(EngineClosed(exc_msg))
            if b.drained is not None and not b.drained.done():
                b.drained.set_result(None)
        self._batches.clear()
        self._queue.clear()
        self._retry.clear()

    # ------------------------------------------------------------------ batches

    def _check_open(self):
        if self._closed:
            raise EngineClosed("io_uring engine is closed")

    def _new_slot(self) -> int:
        slot = self._next_slot
        batches = self._batches
        while slot in batches:
            slot = (slot + 1) & 0x7FFFFFFF
        self._next_slot = (slot + 1) & 0x7FFFFFFF
        return slot

    def _new_batch(self, op, fds, facts, offs, addrs, lens, idx_map, n_total) -> Batch:
        return Batch(op, self._new_slot(), fds, facts, offs, addrs, lens, self._loop.create_future(), idx_map, n_total)

    async def _run(self, op, files, offsets, addrs, lengths, crc=None) -> np.ndarray:
        b = self._start_now(op, files, offsets, addrs, lengths, crc)
        if b is not None:
            return await self._wait(b)
        return await self._run_general(op, files, offsets, addrs, lengths, crc)

    def _start_now(self, op, files, offsets, addrs, lengths, crc=None) -> Batch | None:
        """The batch, submitted, when all of it fits in the ring now and its arrays have the right dtypes
        (C takes them as they are; it validates all before writing an SQE); None: the general path."""
        if self._closed:
            raise EngineClosed("io_uring engine is closed")
        fds, facts = split_files(files)
        ring = self._ring
        try:
            n = len(lengths)
        except TypeError:
            return None
        if not 0 < n <= self._depth - ring.inflight or self._queue or self._retry:
            return None
        slot = self._new_slot()
        try:
            q = self._submit(op, fds, facts, offsets, addrs, lengths, ud_base=slot << _SLOT_SHIFT)
        except (TypeError, ValueError):
            return None
        b = Batch(op, slot, fds, facts, offsets, addrs, lengths, self._loop.create_future(), None, n, n)
        if crc is not None and len(crc[0]) == n:
            b.crc = crc  # before any reap: completions are reaped on this thread, later
        self._batches[slot] = b
        b.next = q
        if q < n:  # SQ full of unconsumed SQEs: the rest waits for the pump
            self._queue.append(b)
        if ring.sq_pending:
            self._schedule_flush()
        return b

    def _submit(self, op, fds, facts: FileFacts, offsets, addrs, lengths, *, ud_base: int, enter: bool = True) -> int:
        """ring.submit with this engine's settings: user_data = ud_base + op index (slot << 32 | op),
        the O_DIRECT alignment the batch's files came with, F_ASYNC above async_min_bytes when
        they include page-cache files, registered buffers found per op when there are any."""
        return self._ring.submit(
            op, fds, offsets, addrs, lengths, async_min_bytes=self._async_min if facts.buffered else 0, enter=enter,
            ud_base=ud_base, auto_fixed=self._fixed_on, mem_align=facts.mem_align, off_align=facts.off_align,
        )  # fmt: skip

    async def _run_general(self, op, files: Files, offsets, addrs, lengths, crc=None) -> np.ndarray:
        self._check_open()
        batch = IoBatch.of(files, offsets, addrs, lengths)
        n = len(batch)
        if n == 0:
            return np.zeros(0, dtype=RESULT_DTYPE)
        f, o, a, ln = batch.fds, batch.offsets, batch.addrs, batch.lengths
        idx_map = None
        if ln.min() == 0:  # zero-length ops complete at once with 0 bytes
            idx_map = np.flatnonzero(ln)
            if len(idx_map) == 0:
                return np.zeros(n, dtype=RESULT_DTYPE)
            f, o, a, ln = f[idx_map], o[idx_map], a[idx_map], ln[idx_map]
        b = self._new_batch(op, f, batch.facts, o, a, ln, idx_map, n)
        if crc is not None and idx_map is None and len(crc[0]) == n:
            b.crc = crc
        self._start(b, validate=True)
        return await self._wait(b)

    def _start(self, b: Batch, *, validate: bool) -> None:
        free = self._depth - self._ring.inflight
        if self._queue or self._retry or b.n > free:
            if validate:  # the whole batch is refused up front, before any of it is queued
                self._ring.check(b.op, b.fds, b.offs, b.addrs, b.lens, self._fixed.index(b.addrs, b.lens),
                                 mem_align=b.facts.mem_align, off_align=b.facts.off_align)  # fmt: skip
            self._batches[b.slot] = b
            self._queue.append(b)
            self._pump()
            return
        # Common case: the batch fits; submit() validates it and queues all of it or nothing.
        self._batches[b.slot] = b
        try:
            q = self._submit(b.op, b.fds, b.facts, b.offs, b.addrs, b.lens, ud_base=b.slot << _SLOT_SHIFT)
        except BaseException:
            del self._batches[b.slot]
            raise
        b.next = q
        if q < b.n:  # cannot happen while in flight <= depth; kept correct anyway
            self._queue.append(b)
        if self._ring.sq_pending:
            self._schedule_flush()

    async def _wait(self, b: Batch) -> np.ndarray:
        try:
            return await b.fut
        except asyncio.CancelledError:
            await self._drain_after_cancel(b)
            raise

    async def _drain_after_cancel(self, b: Batch) -> None:
        """The caller gave up, but the kernel may still write its memory: ask the kernel to cancel
        the batch's running ops, then wait for every one of their completions, however long (the
        block layer's own command timeout bounds it). Returning earlier would let a late DMA land
        in memory the caller already reuses."""
        if b.left == 0 or self._closed:
            return
        b.abandoned = True
        self._drop_unsubmitted(b)
        if b.left == 0:
            self._finish(b)
            return
        b.drained = self._loop.create_future()
        b.cancel_running(self._ring)
        while not b.drained.done():
            try:
                await asyncio.shield(b.drained)
            except asyncio.CancelledError:
                continue  # cancelled again: still may not return while the kernel holds the memory

    def _drop_unsubmitted(self, b: Batch) -> None:
        if b.next < b.n:
            b.fail_from(b.next, errno.ECANCELED)
        if self._queue and b in self._queue:
            self._queue.remove(b)

    def _finish(self, b: Batch) -> None:
        self._batches.pop(b.slot, None)
        if not b.fut.done():
            b.fut.set_result(b.results())
        if b.drained is not None and not b.drained.done():
            b.drained.set_result(None)

    # ------------------------------------------------------------------ submission

    def fixed_index(self, addrs, lens):  # int16 registered-buffer index per op (-1 = plain op), or None
        return self._fixed.index(addrs, lens)

    def _pump(self) -> None:
        """Submit retries and queued ops while in-flight slots are free; one enter at the end."""
        if not self._queue and not self._retry:
            return
        ring = self._ring
        free = self._depth - ring.inflight
        if free <= 0 or self._closed:
            return
        while self._retry and free > 0:
            b, i = self._retry.popleft()
            self._resubmit(b, i)
            free -= 1
        chunks = []
        while self._queue and free > 0:
            b = self._queue[0]
            k = min(free, b.n - b.next)
            chunks.append((b, b.next, b.next + k))
            b.next += k
            free -= k
            if b.next >= b.n:
                self._queue.popleft()
        last = len(chunks) - 1
        for j, (b, s, e) in enumerate(chunks):
            try:
                q = self._submit(
                    b.op, b.fds_slice(s, e), b.facts, b.offs[s:e], b.addrs[s:e], b.lens[s:e],
                    ud_base=(b.slot << _SLOT_SHIFT) + s, enter=j == last,
                )  # fmt: skip
            except (ValueError, OSError) as exc:
                # Validated when queued against these same facts: only the enter itself fails here.
                self._fail_unsubmitted(b, s, exc)
                continue
            if q < e - s:  # the ring was full after all: put the rest back in front
                b.next = s + q
                if b not in self._queue:
                    self._queue.appendleft(b)
        if ring.sq_pending:
            self._schedule_flush()

    def _fail_unsubmitted(self, b: Batch, s: int, exc: BaseException) -> None:
        err = exc.errno if isinstance(exc, OSError) and exc.errno else errno.EINVAL
        log.warning("io_uring: submitting ops %d.. of a batch failed: %s", s, exc)
        b.fail_from(s, err)
        if self._queue and b in self._queue:
            self._queue.remove(b)
        if b.left == 0:
            self._finish(b)

    def _resubmit(self, b: Batch, i: int) -> None:
        """Submit the remainder of op i (after a short transfer, or again after EAGAIN)."""
        d = max(int(b.done[i]), 0)
        try:
            self._submit(b.op, b.fd(i), b.facts, *b.remainder(i, d), ud_base=(b.slot << _SLOT_SHIFT) + i)
        except (ValueError, OSError) as exc:
            b.final(i, d if d else -(getattr(exc, "errno", None) or errno.EINVAL))

    def _schedule_flush(self) -> None:
        if self._flush_handle is None and not self._closed:
            self._flush_handle = self._loop.call_later(0.0005, self._flush_retry)

    def _flush_retry(self) -> None:
        self._flush_handle = None
        if not self._closed and self._flush_pending():
            self._schedule_flush()

    def _flush_pending(self) -> int:
        try:
            return self._ring.flush() if self._ring.sq_pending else 0
        except OSError as e:
            log.warning("io_uring: flushing queued SQEs failed: %s", e)
            return self._ring.sq_pending

    # ------------------------------------------------------------------ completions

    def _on_ready(self) -> None:
        try:
            os.read(self._efd, 8)
        except BlockingIOError:
            pass
        if self._closed:
            return
        self._reap()
        self._pump()

    def _reap(self) -> None:
        """Complete every ready CQE: full transfers in C, the odd ones through _odd_completion."""
        reap, batches = self._ring.reap_batches, self._batches
        while True:
            n, touched, odd = reap(batches)
            if n == 0:
                return
            for b, k in touched:
                b.left -= k
            if odd is not None:
                for b, i, r in odd:
                    self._odd_completion(b, i, r)
            for b, _ in touched:
                if b.left == 0:
                    self._finish(b)
            if len(touched) < _REAP_MAX_BATCHES:
                return

    def _odd_completion(self, b: Batch, i: int, r: int) -> None:
        """Short transfer, EOF, or an error: resubmit, or record the final result."""
        done = int(b.done[i])
        if r < 0:
            if r in (-errno.EAGAIN, -errno.EINTR) and not b.abandoned and not self._closed:
                b.retries = b.retries or {}
                c = b.retries.get(i, 0)
                if c < MAX_RETRIES:
                    b.retries[i] = c + 1
                    self._retry.append((b, i))
                    return
            # EINVAL on a remainder: a file handed as page-cache (bare fd, mixed batch) was O_DIRECT (may_continue)
            b.final(i, done if r == -errno.EINVAL and done > 0 else r)
            return
        if b.op not in (self._u.OP_READ, self._u.OP_WRITE):
            b.final(i, r)
            return
        done += r
        b.done[i] = done
        remaining = int(b.lens[i]) - done
        if remaining <= 0:
            b.final(i, done)
        elif r == 0 or b.abandoned or self._closed or not b.may_continue(i, done):
            b.final(i, done)  # EOF (reads), or a remainder O_DIRECT cannot express
        else:
            self._retry.append((b, i))

    # ------------------------------------------------------------------ introspection

    @property
    def inflight(self) -> int:
        return 0 if self._closed else self._ring.inflight

    @property
    def ring(self):
        return self._ring


async def open_uring_engine(
    queue_depth: int = DEFAULT_QUEUE_DEPTH, *, async_min_bytes: int = DEFAULT_ASYNC_MIN_BYTES
) -> UringEngine:
    """Open a UringEngine in the running loop; EngineUnavailable when io_uring cannot start."""
    return await UringEngine.open(queue_depth, async_min_bytes=async_min_bytes)
