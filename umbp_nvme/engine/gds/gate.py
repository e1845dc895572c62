"""Probe, open and the store's gate (GdsGate): the GDS route for CUDA buffers, decided once."""

from __future__ import annotations

import asyncio
import os
import tempfile

import numpy as np

from ..base import EngineUnavailable
from ._common import DEFAULT_QUEUE_DEPTH, GDS_UNAVAILABLE, PROBE_BYTES, log, pkg
from .availability import gds_unavailable_error
from .engine import KvikioEngine
from .kvikio_settings import configure_kvikio, describe_kvikio
from .staging import StagingBuffer

# --------------------------------------------------------------------------------------------
# Probe, open, gate


async def probe_gds(engine: KvikioEngine, *, fd: int | None = None, offset: int = 0,
                    probe_dir: str | None = None, nbytes: int = PROBE_BYTES) -> tuple[bool, str]:
    """Read one page through the engine into device memory and compare with a host read.

    With ``fd`` (a data file of the store, at least ``offset + nbytes`` long) that page is read;
    otherwise a temporary file with random bytes is written in ``probe_dir`` (the store directory:
    the probe must run on the file system the store uses) and read back.
    """
    tmp_path = None
    own_fd = None
    try:
        if fd is None or os.fstat(fd).st_size < offset + nbytes:
            own_fd, tmp_path = tempfile.mkstemp(prefix=".umbp-gds-probe-", dir=probe_dir)
            os.pwrite(own_fd, os.urandom(nbytes), 0)
            os.fdatasync(own_fd)
            fd, offset = own_fd, 0
        expect = os.pread(fd, nbytes, offset)
        owner, dev = pkg()._device_ops.alloc(nbytes)
        res = await engine.read_many(fd, [offset], [dev], [nbytes])
        if int(res[0]) != nbytes:
            from ..base import errno_name

            return False, f"probe read of {nbytes} bytes returned {errno_name(int(res[0]))}"
        back = np.zeros(nbytes, dtype=np.uint8)
        pkg()._device_ops.copy_d2h([(dev, int(back.ctypes.data), nbytes)])
        del owner
        if back.tobytes() != expect:
            return False, "probe read into device memory differs from a host read of the same page"
        return True, "one-page probe read matched"
    except Exception as e:
        return False, f"probe failed: {type(e).__name__}: {e}"
    finally:
        if own_fd is not None:
            engine.forget_fd(own_fd)
            os.close(own_fd)
        if tmp_path is not None:
            try:
                os.unlink(tmp_path)
            except OSError:
                pass

async def open_gds_engine(queue_depth: int = DEFAULT_QUEUE_DEPTH, *, probe_dir: str | None = None,
                          probe_fd: int | None = None, compat_mode: str | None = None,
                          num_threads: int | None = None, gds_threshold: int | None = None) -> KvikioEngine:
    """A probed KvikioEngine, or EngineUnavailable('CUDA buffer given but GPUDirect Storage ...')."""
    ok, reason = pkg().gds_available()
    if not ok:
        raise gds_unavailable_error(reason)
    kv = pkg()._import_kvikio()
    configure_kvikio(kv, queue_depth, compat_mode=compat_mode, num_threads=num_threads,
                     gds_threshold=gds_threshold)
    engine = KvikioEngine(queue_depth, kvikio=kv)
    ok, why = await probe_gds(engine, fd=probe_fd, probe_dir=probe_dir)
    if not ok:
        engine.close()
        raise gds_unavailable_error(f"one-page probe read failed ({why})")
    path = engine.path()
    if path == "gds":
        log.info("GPUDirect Storage engine ready (cuFile served the probe): %s", engine.describe())
    else:
        log.warning("kvikio engine ready, but the probe was served by %s, not cuFile: CUDA buffers move by "
                    "kvikio's POSIX read + copy (%s)", path, describe_kvikio(kv))
    return engine


class GdsGate:
    """The store's switch for CUDA buffers: decided on first use, then fixed, logged once.

    ``await gate.route()`` -> ``"gds"`` (use ``gate.engine``) or ``"staging"`` (use ``staged_read``
    / ``staged_write`` with the host engine and ``gate.staging``), or raises EngineUnavailable with
    the GDS_UNAVAILABLE message (the store turns that into a per-key False).

    ``gate.staging`` is allocated on first access in staging mode, not when the route is decided:
    the store stages through its own aligned bounce buffers and never touches it, so no pinned
    memory is held for nothing.
    """

    def __init__(self, *, queue_depth: int = DEFAULT_QUEUE_DEPTH, probe_dir: str | None = None,
                 staging: bool = False, staging_bytes: int = 64 << 20, opener=None):
        self.queue_depth = queue_depth
        self.probe_dir = probe_dir
        self.staging_allowed = staging
        self.staging_bytes = staging_bytes
        self._opener = opener or pkg().open_gds_engine
        self.engine: KvikioEngine | None = None
        self._staging: StagingBuffer | None = None
        self.mode: str | None = None  # None until decided; then "gds" | "staging" | "off"
        self.reason: str = ""
        self._lock: asyncio.Lock | None = None

    @property
    def staging(self) -> StagingBuffer | None:
        """The pinned staging buffer for staged_read/staged_write in "staging" mode, else None."""
        if self._staging is None and self.mode == "staging":
            self._staging = pkg().StagingBuffer(self.staging_bytes)
        return self._staging

    async def route(self) -> str:
        if self.mode is None:
            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:
                if self.mode is None:
                    await self._decide()
        if self.mode == "off":
            raise gds_unavailable_error(self.reason)
        return self.mode

    async def _decide(self) -> None:
        try:
            self.engine = await self._opener(self.queue_depth, probe_dir=self.probe_dir)
            self.mode = "gds"
            return
        except EngineUnavailable as e:
            gds_reason = getattr(e, "reason", None) or str(e.strerror or e)
        if self.staging_allowed:
            ok, why = pkg()._device_ops.available()
            if ok:
                self.mode = "staging"
                log.warning("GPUDirect Storage unavailable (%s); CUDA buffers are staged through "
                            "pinned host memory (gds_staging=True)", gds_reason)
                return
            gds_reason = f"{gds_reason}; staging impossible too: {why}"
        self.mode = "off"
        self.reason = gds_reason
        log.warning("%s", GDS_UNAVAILABLE.format(reason=self.reason))

    def describe(self) -> dict:
        """The route and, in "gds" mode, the engine's settings and measured path (for store stats)."""
        d = {"mode": self.mode, "reason": self.reason or None}
        if self.engine is not None:
            d.update(self.engine.describe())
        return d

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self._staging is not None:
            self._staging.close()
            self._staging = None

