"""KvikioEngine: the IoEngine protocol over kvikio CuFile futures, for CUDA device addresses."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..base import RESULT_DTYPE, Capabilities, EngineClosed, IoBatch
from ._common import READ, WRITE, DEFAULT_QUEUE_DEPTH, MAX_BATCH_WORKERS, MAX_SHORT_RETRIES, log, pkg
from .cuda import DeviceSpan
from .kvikio_io import (
    PATH_CUFILE,
    PATH_POSIX,
    close_quietly,
    CuFileEntry,
    errno_of,
    is_kvikio_eof,
    path_of,
    PathMeter,
)
from .kvikio_settings import kvikio_compat_preferred, kvikio_settings


class KvikioEngine:
    """IoEngine over kvikio CuFile futures; addresses are CUDA device pointers.

    A batch runs in one worker thread (never one thread hop per op): it submits ``pread``/``pwrite``
    futures to kvikio's thread pool, at most ``queue_depth`` in flight across all batches, and
    collects them in order. Results follow the protocol: bytes per op (short only at EOF), or
    ``-errno``; one failed op never fails the batch.
    """

    def __init__(self, queue_depth: int = DEFAULT_QUEUE_DEPTH, *, kvikio=None,
                 max_batches: int = MAX_BATCH_WORKERS):
        if queue_depth <= 0:
            raise ValueError(f"queue_depth must be > 0, got {queue_depth}")
        if max_batches <= 0:
            raise ValueError(f"max_batches must be > 0, got {max_batches}")
        self._kv = kvikio if kvikio is not None else pkg()._import_kvikio()
        self.capabilities = Capabilities(
            name="kvikio", native_async=False, fixed_buffers=False, thread_safe=True,
            queue_depth=queue_depth, device_memory=True,
        )
        self._slots = threading.BoundedSemaphore(queue_depth)
        self._lock = threading.Lock()
        self._files: dict[int, CuFileEntry] = {}
        self._retired: list[CuFileEntry] = []  # dropped while a batch held them
        self._pending: set = set()  # (loop, asyncio.Future)
        self._registered: dict[int, DeviceSpan] = {}  # allocation base -> the span registered
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=max_batches, thread_name_prefix="umbp-gds")
        # which path served the bytes: kvikio's per-backend counters, read around each batch
        self._meter = PathMeter(self._kv, self._lock)

    # ---- protocol

    async def read_many(self, files, offsets, addrs, lengths) -> np.ndarray:
        return await self._submit(READ, IoBatch.of(files, offsets, addrs, lengths))

    async def write_many(self, files, offsets, addrs, lengths) -> np.ndarray:
        return await self._submit(WRITE, IoBatch.of(files, offsets, addrs, lengths))

    async def sync(self, fd: int, *, datasync: bool = True) -> None:
        # cuFile writes go through kvikio's own descriptors of the same inode: fdatasync on ours
        # flushes that inode's data all the same.
        fn = os.fdatasync if datasync else os.fsync
        await self._run_in_worker(fn, int(fd))

    def register_buffers(self, ranges: list[tuple[int, int]]) -> bool:
        """cuFileBufRegister the allocations holding these device ranges; False when unsupported.

        kvikio's ``memory_register(buf)`` takes no size: it registers the whole CUDA allocation
        that holds the pointer. Ranges in one allocation (two slices of one torch segment) are
        registered once, keyed by the allocation's base; registering one twice is a cuFile error.
        A no-op (False) in compat mode, where kvikio ignores registrations.
        """
        reg = self._kv_fn("memory_register")
        if self._closed or reg is None or kvikio_compat_preferred(self._kv) is not False:
            return False
        done: dict[int, DeviceSpan] = {}
        try:
            for addr, nbytes in ranges:
                addr = int(addr)
                find_base = getattr(pkg()._device_ops, "allocation_base", None)
                base = find_base(addr) if find_base is not None else None
                key = addr if base is None else base
                if key in self._registered or key in done:
                    continue
                span = DeviceSpan(addr, int(nbytes))
                try:
                    reg(span)
                except Exception as e:
                    if "already registered" in str(e):  # another range of an allocation we hold
                        continue
                    raise
                done[key] = span
        except Exception as e:
            log.warning("cuFile buffer registration failed (%s); GDS continues unregistered", e)
            self._deregister(done.values())
            return False
        self._registered.update(done)
        return True

    def registered_allocations(self) -> list[int]:
        """Bases (or addresses, where the base is unknown) of the allocations registered."""
        return sorted(self._registered)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = list(self._pending), set()
            idle = [e for e in self._files.values() if self._retire(e)]
            self._files.clear()
        for loop, fut in pending:
            _fail_future(loop, fut, EngineClosed("KvikioEngine closed with I/O pending"))
        for e in idle:
            close_quietly(e.cufile)
        self._deregister(self._registered.values())
        self._registered = {}
        self._meter.stop()
        # Running batches stop submitting (they check _closed) and drain what kvikio already has:
        # those ops write into caller memory, so they must finish before the threads exit.
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- extras

    def forget_fd(self, fd: int) -> None:
        """Drop the CuFile cached for fd; call before the store closes that file descriptor."""
        with self._lock:
            e = self._files.pop(int(fd), None)
            if e is None or not self._retire(e):
                return
        close_quietly(e.cufile)

    def cached_fds(self) -> list[int]:
        with self._lock:
            return sorted(self._files)

    def file_paths(self) -> dict[int, str]:
        """fd -> the path that served its bytes: cufile | posix | mixed | unverified."""
        with self._lock:
            return {fd: e.path for fd, e in sorted(self._files.items())}

    def stats(self) -> dict:
        """Bytes served per op kind and path, and each cached file's path.

        ``served[op]["cufile"|"posix"]`` are kvikio's own per-backend counts for batches that ran
        alone; bytes of batches that overlapped another are ``unattributed`` (kvikio's counters are
        process-wide), and without kvikio.SummaryMonitor (kvikio < 26.x) all bytes are.
        """
        served = self._meter.served()
        return {"served": served, "files": self.file_paths(), "measured": self._meter.measured,
                "path": self.path()}

    def path(self) -> str:
        """"gds" only when cuFile served every byte measured; "posix", "mixed", or "unmeasured"."""
        c, p = self._meter.totals()
        got = path_of(c, p)
        if got is None:
            return PATH_POSIX if kvikio_compat_preferred(self._kv) else "unmeasured"
        return "gds" if got == PATH_CUFILE else got

    def describe(self) -> dict:
        return {"engine": "kvikio", "kvikio_version": getattr(self._kv, "__version__", None),
                **kvikio_settings(self._kv), "queue_depth": self.capabilities.queue_depth,
                "path": self.path(), "served": self.stats()["served"], "files": self.file_paths(),
                # kept for callers of the old keys
                "compat_mode_preferred": kvikio_compat_preferred(self._kv)}

    # ---- internals

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("KvikioEngine is closed")

    def _kv_fn(self, name: str):
        """kvikio.<name>, or kvikio.buffer.<name> where older releases keep it; None if neither."""
        return getattr(self._kv, name, None) or getattr(getattr(self._kv, "buffer", None), name, None)

    def _deregister(self, spans) -> None:
        dereg = self._kv_fn("memory_deregister")
        if dereg is None:
            return
        for span in list(spans):
            try:
                dereg(span)
            except Exception:
                pass

    async def _submit(self, op: int, batch: IoBatch) -> np.ndarray:
        self._check_open()
        if len(batch) == 0:
            return np.zeros(0, dtype=RESULT_DTYPE)
        return await self._run_in_worker(self._run_batch, op, batch)

    async def _run_in_worker(self, fn, *args):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            self._check_open()
            self._pending.add((loop, fut))
            try:
                cf = self._executor.submit(fn, *args)
            except RuntimeError:  # shut down between the check and the submit
                self._pending.discard((loop, fut))
                raise EngineClosed("KvikioEngine is closed") from None

        def done(cf_):
            with self._lock:
                self._pending.discard((loop, fut))
            exc = cf_.exception() if not cf_.cancelled() else EngineClosed("KvikioEngine closed")
            if exc is not None:
                _fail_future(loop, fut, exc)
            else:
                _resolve_future(loop, fut, cf_.result())

        cf.add_done_callback(done)
        return await fut

    def _acquire_file(self, fd: int, want_write: bool):
        """(entry, file size) or -errno. Runs in a worker thread."""
        try:
            st = os.fstat(fd)
            accmode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
        except OSError as e:
            return -(e.errno or errno.EBADF)
        if want_write and accmode == os.O_RDONLY:
            return -errno.EBADF  # what pwrite(2) says for a read-only descriptor
        key = (st.st_dev, st.st_ino)
        writable = accmode != os.O_RDONLY
        stale = None
        with self._lock:
            e = self._files.get(fd)
            if e is not None and (e.key != key or (want_write and not e.writable)):
                stale = self._files.pop(fd)  # fd number reused for another file, or reopened rw
                stale = stale if self._retire(stale) else None
                e = None
            if e is not None:
                e.refs += 1
                return e, st.st_size
        if stale is not None:
            close_quietly(stale.cufile)
        compat = kvikio_compat_preferred(self._kv) is True
        try:
            cufile = self._kv.CuFile(f"/proc/self/fd/{fd}", "r+" if writable else "r")
        except Exception as exc:
            return -errno_of(exc)
        try:  # the magic link must have reached the same inode (guards a racing close/reuse)
            kfd = cufile.fileno()
            kst = os.fstat(kfd) if isinstance(kfd, int) and kfd >= 0 else None
        except Exception:
            kst = None
        if kst is not None and (kst.st_dev, kst.st_ino) != key:
            close_quietly(cufile)
            return -errno.ESTALE
        with self._lock:
            if self._closed:
                close_quietly(cufile)
                return -errno.ECANCELED
            e = self._files.get(fd)
            if e is None or e.key != key:  # another batch may have raced us to it
                if e is not None and self._retire(e):
                    close_quietly(e.cufile)
                e = CuFileEntry(cufile, key, writable)
                if compat:  # kvikio runs every file POSIX: certain without measuring
                    e.path, e.why = PATH_POSIX, "kvikio compat decision (ON, or AUTO without usable cuFile)"
                self._files[fd] = e
            else:
                close_quietly(cufile)
            e.refs += 1
            return e, st.st_size

    def _retire(self, e: CuFileEntry) -> bool:
        """Under self._lock: mark e dead; True when idle (the caller closes it), else the last
        batch holding it closes it in _release."""
        e.dead = True
        if e.refs:
            self._retired.append(e)
        return not e.refs

    def _release(self, entries) -> None:
        to_close = []
        with self._lock:
            for e in entries:
                e.refs -= 1
                if e.refs == 0 and e.dead:
                    to_close.append(e)
                    if e in self._retired:
                        self._retired.remove(e)
        for e in to_close:
            close_quietly(e.cufile)

    def _run_batch(self, op: int, batch: IoBatch) -> np.ndarray:
        token = self._meter.start()
        res = None
        files: dict = {}
        try:
            res, files = self._run_ops(op, batch)
            return res
        finally:
            self._meter.end(token, op, res, files)

    def _run_ops(self, op: int, batch: IoBatch):
        n = len(batch)
        res = np.zeros(n, dtype=RESULT_DTYPE)
        fds, offs, addrs, lens = batch.fds, batch.offsets, batch.addrs, batch.lengths
        files: dict[int, tuple] = {}
        for fd in np.unique(fds).tolist():
            files[fd] = self._acquire_file(int(fd), op == WRITE)
        window: deque = deque()  # (index, future, size, cufile, op, addr, offset)
        try:
            for i in range(n):
                if self._closed:
                    res[i:] = -errno.ECANCELED
                    break
                length = int(lens[i])
                f = files[int(fds[i])]
                if isinstance(f, int):
                    res[i] = f
                    continue
                entry, fsize = f
                off = int(offs[i])
                size = length
                if op == READ:
                    # kvikio's POSIX path raises at EOF, cuFile returns short: clip to the size we
                    # saw so both give the protocol's short count.
                    size = max(0, min(length, fsize - off))
                if size == 0:
                    res[i] = 0
                    continue
                self._take_slot(window, res, files)
                try:
                    fut = self._start(entry.cufile, op, int(addrs[i]), size, off)
                except Exception as exc:
                    self._slots.release()
                    res[i] = -errno_of(exc)
                    continue
                window.append((i, fut, size, entry.cufile, op, int(addrs[i]), off))
        finally:
            while window:
                self._finish_one(window, res, files)
            self._release([f[0] for f in files.values() if not isinstance(f, int)])
        return res, files

    def _take_slot(self, window, res, files) -> None:
        # Slots are shared by all batches; while waiting, finish our own oldest op so two batches
        # holding slots can never wait on each other.
        while not self._slots.acquire(blocking=False):
            if window:
                self._finish_one(window, res, files)
            elif self._slots.acquire(timeout=0.05):
                return

    def _start(self, cufile, op: int, addr: int, size: int, off: int):
        span = DeviceSpan(addr, size, readonly=(op == WRITE))
        return (cufile.pread if op == READ else cufile.pwrite)(span, size, off)

    def _finish_one(self, window, res, files) -> None:
        i, fut, size, cufile, op, addr, off = window.popleft()
        try:
            got = int(fut.get())
        except Exception as exc:
            # the file shrank under a read (we clipped to the size seen): a short count, as cuFile gives
            got = 0 if is_kvikio_eof(exc) else -errno_of(exc)
        finally:
            self._slots.release()
        # Reads were clipped to the file size, so a short count here is not EOF: retry the
        # remainder a bounded number of times, synchronously (rare: signals, split transfers).
        for _ in range(MAX_SHORT_RETRIES):
            if not 0 < got < size or self._closed:
                break
            try:
                more = int(self._start(cufile, op, addr + got, size - got, off + got).get())
            except Exception:
                break  # keep the bytes that did transfer: a short count, not an error
            if more <= 0:
                break
            got += more
        res[i] = got


def _resolve_future(loop, fut, value) -> None:
    _call_in_loop(loop, lambda: fut.done() or fut.set_result(value))


def _fail_future(loop, fut, exc) -> None:
    _call_in_loop(loop, lambda: fut.done() or fut.set_exception(exc))


def _call_in_loop(loop, fn) -> None:
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        fn()
        return
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:
        pass  # that loop is closed; nobody awaits the future any more
