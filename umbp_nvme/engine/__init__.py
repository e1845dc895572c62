"""I/O engines behind one protocol, and the one place that picks among them.

``await open_engine("auto" | "io_uring" | "posix", queue_depth)``:

* ``"auto"`` (and the config default ``"io_uring"``) try io_uring first. When ring setup fails
  (ENOSYS on old kernels, EPERM under seccomp or ``io_uring_disabled``, the extension not built, or
  ``UMBP_NVME_FORCE_NO_URING=1``) the store still works: it falls back to the posix thread pool
  with one warning per process that names the reason.
* ``"posix"`` forces the thread pool.

``apply_io_policy(engines, read_priority=, write_slice_bytes=)`` gives a store's engines one
``Arbiter`` (write slices, reads first) and the kernel I/O priorities (``priority.choose``).
"""

from __future__ import annotations

import errno
import inspect
import logging
import os
import threading

from .arbiter import Arbiter
from .base import Capabilities, EngineClosed, EngineUnavailable, IoBatch, IoEngine
from .files import PAGE_CACHE, DataFile, FileFacts, Files, open_data_file
from .posix import PosixEngine
from .priority import choose as choose_priorities

__all__ = [
    "Capabilities",
    "DataFile",
    "FileFacts",
    "Files",
    "PAGE_CACHE",
    "EngineClosed",
    "EngineUnavailable",
    "IoBatch",
    "IoEngine",
    "PosixEngine",
    "open_data_file",
    "open_engine",
    "apply_io_policy",
    "BACKENDS",
    "FORCE_NO_URING_ENV",
]

log = logging.getLogger(__name__)

BACKENDS = ("auto", "io_uring", "posix")
FORCE_NO_URING_ENV = "UMBP_NVME_FORCE_NO_URING"

_warned_lock = threading.Lock()
_warned = False  # the io_uring fallback is logged once per process, however many engines open


async def _open_uring(queue_depth: int):
    if os.environ.get(FORCE_NO_URING_ENV, "") not in ("", "0"):
        raise EngineUnavailable(errno.EPERM, f"io_uring disabled by {FORCE_NO_URING_ENV}=1")
    try:
        from .uring import open_uring_engine
    except ImportError as e:
        raise EngineUnavailable(errno.ENOSYS, f"io_uring engine not importable ({e})") from None
    engine = open_uring_engine(queue_depth)
    if inspect.isawaitable(engine):
        engine = await engine
    return engine


async def open_engine(backend: str = "auto", queue_depth: int = 256, *, workers: int | None = None) -> IoEngine:
    """Open an IoEngine inside the running loop; falls back to posix when io_uring cannot start."""
    global _warned
    if backend not in BACKENDS:
        raise ValueError(f"ssd_io_backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if queue_depth <= 0:
        raise ValueError(f"queue_depth must be > 0, got {queue_depth}")
    if backend != "posix":
        try:
            return await _open_uring(queue_depth)
        except (EngineUnavailable, OSError) as e:
            reason = f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror or e}" if e.errno else str(e)
            with _warned_lock:
                first, _warned = not _warned, True
            if first:
                if backend == "io_uring":
                    log.warning(
                        "ssd_io_backend='io_uring' requested but io_uring cannot start (%s); "
                        "falling back to the posix thread-pool engine",
                        reason,
                    )
                else:
                    log.warning("io_uring unavailable (%s); using the posix thread-pool engine", reason)
    return PosixEngine(queue_depth, workers=workers)


def apply_io_policy(engines, *, read_priority: str = "on", write_slice_bytes: int = 0) -> Arbiter | None:
    """One store's engines share one arbiter; engines without ``set_io_policy`` (test and fault
    wrappers, GDS) are left as they are. Returns the arbiter (None when slicing is off)."""
    prios = choose_priorities(read_priority)
    arbiter = None
    if write_slice_bytes:
        arbiter = Arbiter(write_slice_bytes, hold_reads=read_priority == "on")
    for e in engines:
        setter = getattr(e, "set_io_policy", None)
        if setter is not None:
            setter(prios, arbiter)
    return arbiter


def reset_fallback_warning() -> None:
    """For tests: make the next fallback log again."""
    global _warned
    with _warned_lock:
        _warned = False
