"""kvikio errors -> errno, and which path (cuFile or POSIX) served a file's bytes."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

import numpy as np

from ._common import WRITE, log

# --------------------------------------------------------------------------------------------
# The engine


# kvikio raises RuntimeError whatever went wrong (its C++ exceptions, std::system_error included,
# reach Python as RuntimeError(what())): no errno attribute, only text. The text of a failed system
# call ends with strerror(errno) -- not always the errno of the call that failed (a pwrite on a
# read-only descriptor has been seen to read "Operation not permitted"), so the engine checks what
# it can itself before calling kvikio (descriptor open, access mode) and maps the rest from text.
_ERRNO_BY_TEXT = sorted(
    ((os.strerror(code), code) for code in (
        errno.ENOSPC, errno.EBADF, errno.EINVAL, errno.EFAULT, errno.ENOMEM, errno.EROFS, errno.ENOENT,
        errno.EACCES, errno.EPERM, errno.EIO, errno.EDQUOT, errno.EFBIG, errno.EAGAIN, errno.EINTR,
        errno.ENODEV, errno.ENXIO, errno.EOPNOTSUPP, errno.ETIMEDOUT, errno.ESTALE, errno.EISDIR)),
    key=lambda t: -len(t[0]))
KVIKIO_EOF_TEXT = "POSIX error on pread: EOF"  # kvikio's POSIX path at EOF (cuFile returns short)


def errno_of(exc: BaseException) -> int:
    """An errno for an exception out of kvikio: strerror text in its message, else EIO."""
    if isinstance(exc, OSError) and exc.errno:  # our own calls (fstat, open); kvikio never raises it
        return int(exc.errno)
    msg = str(exc)
    for text, code in _ERRNO_BY_TEXT:
        if msg.endswith(text) or f"{text}" in msg.rsplit(": ", 1)[-1]:
            return code
    for text, code in _ERRNO_BY_TEXT:
        if text in msg:
            return code
    return errno.EIO


def is_kvikio_eof(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and KVIKIO_EOF_TEXT in str(exc)


# Which path served a file's bytes. kvikio decides per file (CompatModeManager: in AUTO a file
# whose O_DIRECT open or cuFile handle registration fails silently runs POSIX) and its Python API
# does not say which; its SummaryMonitor counts bytes per backend, so the engine measures.
PATH_CUFILE = "cufile"  # cuFile (GPUDirect Storage) moved every byte measured
PATH_POSIX = "posix"  # kvikio's POSIX read/write + copy (compat mode) moved them
PATH_MIXED = "mixed"
PATH_UNVERIFIED = "unverified"  # kvikio would try cuFile; no batch on the file measured yet


@dataclass(slots=True, eq=False)
class CuFileEntry:
    cufile: object
    key: tuple
    writable: bool
    refs: int = 0
    dead: bool = False
    path: str = PATH_UNVERIFIED
    why: str = ""


def _backend_bytes(summary) -> dict[str, int]:
    """{backend name: bytes transferred} from a kvikio Summary (by_backend), {} if absent."""
    by = getattr(summary, "by_backend", None) or {}
    out = {}
    for name, totals in by.items():
        n = totals.get("bytes_transferred", 0) if isinstance(totals, dict) else getattr(totals, "bytes_transferred", 0)
        out[str(name).upper()] = int(n or 0)
    return out


def path_of(cufile_bytes: int, posix_bytes: int) -> str | None:
    if cufile_bytes and not posix_bytes:
        return PATH_CUFILE
    if posix_bytes and not cufile_bytes:
        return PATH_POSIX
    if cufile_bytes and posix_bytes:
        return PATH_MIXED
    return None


def close_quietly(cufile) -> None:
    try:
        cufile.close()
    except Exception as e:  # closing must not fail a batch or close(); note it
        log.debug("closing a kvikio CuFile failed: %s", e)


class PathMeter:
    """Bytes a KvikioEngine served per op kind and path, from kvikio's per-backend counters.

    kvikio's counters (``SummaryMonitor``) are process-wide, so a batch's bytes are attributed to a
    path only when it ran alone. Uses the engine's lock: ``end`` also sets the path of the batch's
    file entries, which the engine reads under that lock.
    """

    def __init__(self, kv, lock):
        self._lock = lock
        self.monitor = None
        monitor_cls = getattr(kv, "SummaryMonitor", None)
        if monitor_cls is not None:
            try:
                self.monitor = monitor_cls()
            except Exception as e:
                log.info("kvikio.SummaryMonitor unavailable (%s); which I/O path ran is not measured", e)
        self._active = 0  # batches running
        self._started = 0  # batches ever started (to tell whether one ran alone)
        self._served = {op: {"cufile": 0, "posix": 0, "unattributed": 0} for op in ("read", "write")}

    @property
    def measured(self) -> bool:
        return self.monitor is not None

    def served(self) -> dict:
        with self._lock:
            return {op: dict(v) for op, v in self._served.items()}

    def totals(self) -> tuple[int, int]:
        """(cufile, posix) bytes measured over all op kinds."""
        with self._lock:
            c = sum(v["cufile"] for v in self._served.values())
            p = sum(v["posix"] for v in self._served.values())
        return c, p

    def stop(self) -> None:
        if self.monitor is not None:
            try:
                self.monitor.stop()
            except Exception:
                pass

    def start(self):
        """Before a batch: (ran alone so far, its sequence number, kvikio's counters or None)."""
        with self._lock:
            alone = self._active == 0
            self._active += 1
            self._started += 1
            seq = self._started
        before = None
        if self.monitor is not None:
            try:
                before = _backend_bytes(self.monitor.get())
            except Exception:
                before = None
        return alone, seq, before

    def end(self, token, op: int, res, files) -> None:
        """After a batch: add its bytes to served and, when it ran alone, set its files' path."""
        alone, seq, before = token
        after = None
        if before is not None:
            try:
                after = _backend_bytes(self.monitor.get())
            except Exception:
                after = None
        entries = [f[0] for f in files.values() if not isinstance(f, int)]
        moved = int(np.maximum(res, 0).sum()) if res is not None else 0
        kind = "write" if op == WRITE else "read"
        with self._lock:
            alone = alone and self._started == seq
            self._active -= 1
            if after is None or not alone:
                self._served[kind]["unattributed"] += moved
                return
            c = after.get("GDS", 0) - before.get("GDS", 0)
            p = sum(after.get(k, 0) - before.get(k, 0) for k in after if k != "GDS")
            self._served[kind]["cufile"] += c
            self._served[kind]["posix"] += p
            path = path_of(c, p)
            if path is None:
                return
            if path == PATH_MIXED and len(entries) > 1:
                return  # a mix over several files: which file went which way is unknown
            for e in entries:
                e.path = path if e.path in (PATH_UNVERIFIED, path) else PATH_MIXED
                e.why = "measured (kvikio per-backend counters)"
