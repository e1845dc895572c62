"""PosixEngine: os.preadv / os.pwritev in a bounded pool of threads.

The fallback when io_uring is unavailable (seccomp, old kernels) and the honest baseline for it.
A batch is cut into at most ``workers`` contiguous slices; each worker loops over its slice, one
blocking syscall per op with the GIL released, so at most ``workers`` ops are in flight. Reads and
writes (and syncs) have separate pools of workers, so a read never waits in a queue behind a
write; each pool's threads carry their own ioprio (``ioprio_set`` per thread, see priority.py). One
``call_soon_threadsafe`` per batch (not per op) wakes the loop: per-op Python work stays on the
worker threads and the event loop sees one completion per batch.

Memory safety: an op that is running writes into caller memory until its syscall returns, and a
syscall cannot be interrupted. So a batch whose await is cancelled, or whose engine is closed,
skips its queued slices at once but resolves only after its running ops return (at most one op
per worker); only then may the caller reuse the memory. Bad addresses are safe: the kernel
reports EFAULT for them, which becomes ``-EFAULT`` for that op.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import queue
import threading

import numpy as np

from .arbiter import Arbiter, timed_read, write_sliced
from .base import RESULT_DTYPE, Capabilities, EngineClosed, IoBatch
from .priority import IoPriorities, get_thread_ioprio, set_thread_ioprio

log = logging.getLogger(__name__)

DEFAULT_WORKERS = 64  # ops in flight; a virtio/NVMe disk on 4 KiB pages needs ~100+ to saturate
MAX_WORKERS = 1024

_c_char = ctypes.c_char
_STOP = object()


def read_full(fd: int, offset: int, addr: int, nbytes: int) -> int:
    """Bytes read (short only at EOF) or -errno. Retries short reads for the remainder."""
    done = 0
    while done < nbytes:
        try:
            k = os.preadv(fd, [(_c_char * (nbytes - done)).from_address(addr + done)], offset + done)
        except OSError as e:
            # After a short O_DIRECT read the remainder starts unaligned and fails with EINVAL:
            # that read stopped at EOF, which is a short result, not an error.
            if done and _at_eof(fd, offset + done):
                return done
            return -(e.errno or errno.EIO)
        if k == 0:
            return done  # EOF
        done += k
    return done


def _write_full(fd: int, offset: int, addr: int, nbytes: int) -> int:
    """Bytes written or -errno. Retries short writes for the remainder."""
    done = 0
    while done < nbytes:
        try:
            k = os.pwritev(fd, [(_c_char * (nbytes - done)).from_address(addr + done)], offset + done)
        except OSError as e:
            return -(e.errno or errno.EIO)
        if k == 0:
            return done  # the device took nothing: report short rather than spin
        done += k
    return done


def _at_eof(fd: int, offset: int) -> bool:
    try:
        return os.fstat(fd).st_size <= offset
    except OSError:
        return False


class _Batch:
    """One submitted batch: its slices, counters and the futures waiting on it."""

    __slots__ = ("loop", "fut", "xfer", "ops", "results", "nslices", "started", "finished", "abandoned", "closed",
                 "done", "drained")

    def __init__(self, loop, xfer, batch: IoBatch):
        self.loop = loop
        self.fut = loop.create_future()
        self.xfer = xfer
        # Plain lists once per batch: workers then index them without touching numpy.
        self.ops = (batch.fds.tolist(), batch.offsets.tolist(), batch.addrs.tolist(), batch.lengths.tolist())
        self.results = [0] * len(batch)
        self.nslices = 0
        # list.append is atomic under the GIL: workers mark a slice started without the lock;
        # slices running = len(started) - finished.
        self.started: list = []
        self.finished = 0  # under the engine lock
        self.abandoned = False  # slices not yet started are skipped (cancelled await or closed engine)
        self.closed = False  # the engine closed under this batch: fail with EngineClosed
        self.done = False
        self.drained = None  # future set once no op of this batch runs any more (cancel path)


class _SyncJob:
    __slots__ = ("loop", "fut", "fd", "datasync", "nslices", "started", "finished", "abandoned", "closed", "done",
                 "drained")

    def __init__(self, loop, fd: int, datasync: bool):
        self.loop = loop
        self.fut = loop.create_future()
        self.fd = fd
        self.datasync = datasync
        self.nslices = 1
        self.started: list = []
        self.finished = 0
        self.abandoned = False
        self.closed = False
        self.done = False
        self.drained = None


class _Pool:
    """The worker threads of one direction (reads, or writes and syncs) and their job queue."""

    __slots__ = ("name", "jobs", "threads", "tids", "ioprio")

    def __init__(self, name: str):
        self.name = name
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.tids: list[int] = []  # native thread ids, for ioprio_set after they started
        self.ioprio = 0

    def apply_ioprio(self, value: int) -> None:
        self.ioprio = value
        for tid in list(self.tids):
            err = set_thread_ioprio(value, tid)
            if err:
                log.debug("posix engine: ioprio_set(%s) on %s worker %d failed: %s", value, self.name, tid,
                          os.strerror(err))  # fmt: skip


def _set_result(fut, value):
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut, exc):
    if not fut.done():
        fut.set_exception(exc)


class PosixEngine:
    """IoEngine over preadv/pwritev in at most ``workers`` threads (started on demand)."""

    def __init__(self, queue_depth: int = 256, *, workers: int | None = None, read_op=None):
        """``read_op``: ``(fd, offset, addr, nbytes) -> bytes read or -errno``, run on a worker
        thread for each op of a read batch; default ``read_full`` (tests give one that blocks in
        a kernel call no one can cancel, as a read from a hung drive does)."""
        if queue_depth <= 0:
            raise ValueError(f"queue_depth must be > 0, got {queue_depth}")
        if workers is None:
            workers = min(queue_depth, DEFAULT_WORKERS)
        if not 0 < workers <= MAX_WORKERS:
            raise ValueError(f"workers must be in [1, {MAX_WORKERS}], got {workers}")
        self._max_workers = workers
        self._read_op = read_op or read_full
        self._reads, self._writes = _Pool("read"), _Pool("write")
        self._arbiter: Arbiter | None = None
        self._lock = threading.Lock()
        self._pending: set = set()
        self._closed = False
        self._told_no_fixed = False
        self.capabilities = Capabilities(
            name="posix", native_async=False, fixed_buffers=False, thread_safe=True, queue_depth=workers
        )

    # -- public API ---------------------------------------------------------------------------

    async def read_many(self, files, offsets, addrs, lengths) -> np.ndarray:
        batch = IoBatch.of(files, offsets, addrs, lengths)
        return await timed_read(self._arbiter, self._submit(self._read_op, batch, self._reads))

    async def write_many(self, files, offsets, addrs, lengths) -> np.ndarray:
        return await write_sliced(self._write_piece, self._arbiter, files, offsets, addrs, lengths)

    async def _write_piece(self, files, offsets, addrs, lengths) -> np.ndarray:
        return await self._submit(_write_full, IoBatch.of(files, offsets, addrs, lengths), self._writes)

    def set_io_policy(self, priorities: IoPriorities, arbiter: Arbiter | None) -> None:
        """ioprio of the read and write workers (now and when started); the arbiter for writes."""
        with self._lock:
            self._reads.apply_ioprio(priorities.read)
            self._writes.apply_ioprio(priorities.write)
        self._arbiter = arbiter

    async def sync(self, fd: int, *, datasync: bool = True) -> None:
        loop = asyncio.get_running_loop()
        job = _SyncJob(loop, int(fd), datasync)
        with self._lock:
            self._check_open()
            self._pending.add(job)
            self._spawn_locked(self._writes)
        self._writes.jobs.put((job, 0, 0))
        await self._wait(job)

    def register_buffers(self, ranges: list[tuple[int, int]]) -> bool:
        if not self._told_no_fixed:
            self._told_no_fixed = True
            log.info("posix engine has no fixed buffers; %d registered range(s) are used as plain memory", len(ranges))
        return False

    def close(self) -> None:
        """Fail pending awaits with EngineClosed (each once its running ops returned). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending)
            for job in pending:
                job.abandoned = True
                job.closed = True
                if job.finished == len(job.started):
                    self._finish_locked(job)
            pools = [(p, len(p.threads)) for p in (self._reads, self._writes)]
        for p, nthreads in pools:
            for _ in range(nthreads):
                p.jobs.put(_STOP)
        if pending:
            log.debug("posix engine closed with %d batch(es) pending", len(pending))

    def worker_ioprio(self) -> dict[str, list[int]]:
        """{"read": [...], "write": [...]}: each started worker's ioprio as the kernel reports it."""
        with self._lock:
            pools = {p.name: list(p.tids) for p in (self._reads, self._writes)}
        return {name: [get_thread_ioprio(t) for t in tids] for name, tids in pools.items()}

    @property
    def closed(self) -> bool:
        return self._closed

    # -- internals ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("posix engine is closed")

    async def _submit(self, xfer, batch: IoBatch, pool: _Pool) -> np.ndarray:
        n = len(batch)
        if n == 0:
            self._check_open()
            return np.zeros(0, dtype=RESULT_DTYPE)
        job = _Batch(asyncio.get_running_loop(), xfer, batch)
        nslices = min(n, self._max_workers)
        # Contiguous slices of near-equal op counts: bounds = 0, ..., n.
        bounds = [n * k // nslices for k in range(nslices + 1)]
        with self._lock:
            self._check_open()
            job.nslices = nslices
            self._pending.add(job)
            self._spawn_locked(pool)
        put = pool.jobs.put
        for k in range(nslices):
            put((job, bounds[k], bounds[k + 1]))
        return await self._wait(job)

    async def _wait(self, job):
        try:
            return await job.fut
        except asyncio.CancelledError:
            # The caller may free its memory as soon as we return: first wait for running ops.
            with self._lock:
                job.abandoned = True
                if job.done or job.finished == len(job.started):
                    self._finish_locked(job)
                    raise
                job.drained = job.loop.create_future()
                drained = job.drained
            while not drained.done():
                try:
                    await asyncio.shield(drained)
                except asyncio.CancelledError:
                    continue  # cancelled again: a running preadv may still write the caller's memory
            raise

    def _spawn_locked(self, pool: _Pool) -> None:
        # All of a pool's workers at its first use: tracking idle threads would cost a lock per
        # slice, and an idle thread costs only its (unbacked) stack.
        while len(pool.threads) < self._max_workers:
            name = f"umbp-posix-{pool.name}-{len(pool.threads)}"
            t = threading.Thread(target=self._worker, args=(pool,), name=name, daemon=True)
            pool.threads.append(t)
            t.start()  # returns once the thread runs: native_id is known
            pool.tids.append(t.native_id)
            if pool.ioprio:
                set_thread_ioprio(pool.ioprio, t.native_id)

    def _finish_locked(self, job) -> None:
        """Resolve a job whose ops are all done or abandoned. Caller holds self._lock."""
        if job.done:
            if job.drained is not None and job.finished == len(job.started):
                self._post(job.loop, _set_result, job.drained, None)
            return
        job.done = True
        self._pending.discard(job)
        if job.closed:
            self._post(job.loop, _set_exception, job.fut, EngineClosed("posix engine closed with I/O pending"))
        elif not job.abandoned:
            if isinstance(job, _Batch):
                self._post(job.loop, _set_result, job.fut, np.array(job.results, dtype=RESULT_DTYPE))
        if job.drained is not None:
            self._post(job.loop, _set_result, job.drained, None)

    @staticmethod
    def _post(loop, fn, *args) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop is closed: nobody is waiting any more

    def _worker(self, pool: _Pool) -> None:
        get = pool.jobs.get
        lock = self._lock
        while True:
            item = get()
            if item is _STOP:
                return
            job, start, end = item
            job.started.append(None)  # before reading abandoned: close() and cancel rely on the order
            if not job.abandoned:
                if isinstance(job, _SyncJob):
                    self._run_sync(job)
                else:
                    self._run_slice(job, start, end)
            with lock:  # the one lock acquisition per slice
                job.finished += 1
                if job.finished == job.nslices or (job.abandoned and job.finished == len(job.started)):
                    self._finish_locked(job)
            if self._closed:
                return

    def _run_slice(self, job: _Batch, start: int, end: int) -> None:
        xfer = job.xfer
        res = job.results
        fds, offs, addrs, lens = job.ops
        for i in range(start, end):
            if job.abandoned:
                return
            n = lens[i]
            if n == 0:
                r = 0
            elif addrs[i] == 0:
                r = -errno.EFAULT  # ctypes would wrap NULL without complaint
            else:
                r = xfer(fds[i], offs[i], addrs[i], n)
            res[i] = r

    def _run_sync(self, job: _SyncJob) -> None:
        try:
            (os.fdatasync if job.datasync else os.fsync)(job.fd)
        except OSError as e:
            self._post(job.loop, _set_exception, job.fut, e)
        else:
            self._post(job.loop, _set_result, job.fut, None)
