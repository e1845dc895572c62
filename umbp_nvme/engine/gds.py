"""GPUDirect Storage through kvikio, for CUDA buffers (optional: ``pip install umbp_nvme[gds]``).

SGLang's HiCache hands L3 only pinned host memory, so io_uring serves it. This engine is for callers
that load pages straight into GPU memory (a device loader, the warm-up tool restoring into a GPU,
other frameworks on the async API). Nothing here imports torch or kvikio at module import: both are
looked up on first use, so the module imports on any machine.

Pieces, in the order a caller meets them:

* ``cuda_buffer_address(buf)`` -> ``(device address, nbytes)`` for a CUDA buffer (torch CUDA tensor,
  ``__cuda_array_interface__`` object, explicit ``CudaPointer``), ``None`` for host memory. This is
  the routing test: not None -> this engine, None -> io_uring.
* ``gds_available()`` -> ``(ok, reason)``, cached: libcuda.so.1 loads, torch sees a GPU, kvikio
  imports. kvikio is no CPU fallback (every read fails without libcuda.so.1, even in compat mode).
* ``await open_gds_engine(queue_depth, probe_dir=...)`` -> ``KvikioEngine`` after a one-page probe
  read (device buffer compared byte for byte with a host read); raises ``EngineUnavailable`` with
  ``GDS_UNAVAILABLE`` otherwise. ``GdsGate`` wraps that for the store: opened on the first CUDA
  buffer, the failure cached and logged once.
* ``KvikioEngine``: the IoEngine protocol over ``kvikio.CuFile.pread/pwrite`` futures. It records
  which path served the bytes -- cuFile or kvikio's POSIX fallback, which kvikio picks per file
  and does not report -- from kvikio's per-backend counters (``SummaryMonitor``): ``stats()``,
  ``file_paths()``, ``path()`` ("gds" only when cuFile moved every byte measured), ``describe()``.
* ``configure_kvikio``: thread count, gds_threshold, compat mode, each read back after setting
  (``import kvikio`` alone does not import ``kvikio.defaults``; ``_import_kvikio`` does).
* ``StagingBuffer`` + ``staged_read/staged_write``: staging for callers outside the store (io_uring
  into pinned host memory, then a device copy; lengths padded to whole blocks for O_DIRECT), and
  ``device_crc32c_many`` (CRC32C of device ranges via a pinned host copy; see docs/gpu.md for why
  the CRC is computed on the host).

fd -> CuFile. kvikio opens files by path (it keeps two descriptors, one with O_DIRECT for cuFile),
never by fd. The engine opens ``/proc/self/fd/<fd>`` -- the magic link reaches the very inode the
store opened, even if the file was renamed or unlinked -- once per fd, with flags ``"r"`` or ``"r+"``
from the fd's access mode (never ``"w"``: kvikio's ``"w"`` truncates). Each batch fstat()s its fds
and compares (st_dev, st_ino) with the cached CuFile: a closed-and-reused fd number is detected and
the stale CuFile dropped. Call ``engine.forget_fd(fd)`` before closing a data file; ``close()``
drops all. A CuFile in use by a running batch is closed when that batch ends.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import logging
import os
import tempfile
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .base import (
    ADDR_DTYPE,
    RESULT_DTYPE,
    Capabilities,
    EngineClosed,
    EngineUnavailable,
    IoBatch,
)

log = logging.getLogger(__name__)

GDS_UNAVAILABLE = (
    "CUDA buffer given but GPUDirect Storage is unavailable: {reason}; "
    "install umbp_nvme[gds] on a CUDA machine or pass host memory"
)
PROBE_BYTES = 4096
DEFAULT_QUEUE_DEPTH = 64
MAX_BATCH_WORKERS = 4  # batches running at once; each keeps its ops in kvikio's thread pool
MAX_SHORT_RETRIES = 2  # a short transfer that is not at EOF is retried for the remainder this often
STAGING_ALIGN_BYTES = 4096

_READ = 0
_WRITE = 1


# --------------------------------------------------------------------------------------------
# CUDA buffers -> (device address, nbytes)


@dataclass(frozen=True)
class CudaPointer:
    """An explicit device range: ``ptr`` is a CUDA device address, ``nbytes`` its length."""

    ptr: int
    nbytes: int

    def __post_init__(self):
        if not isinstance(self.ptr, int) or isinstance(self.ptr, bool) or self.ptr < 0:
            raise ValueError(f"CudaPointer.ptr must be a non-negative int address, got {self.ptr!r}")
        if not isinstance(self.nbytes, int) or isinstance(self.nbytes, bool) or self.nbytes < 0:
            raise ValueError(f"CudaPointer.nbytes must be a non-negative int, got {self.nbytes!r}")

    @property
    def __cuda_array_interface__(self) -> dict:
        return _cai(self.ptr, self.nbytes, readonly=False)


def _cai(ptr: int, nbytes: int, *, readonly: bool) -> dict:
    # "stream": None tells consumers no synchronisation is needed; the caller orders its kernels.
    return {"shape": (nbytes,), "typestr": "|u1", "data": (int(ptr), readonly), "strides": None,
            "version": 3, "stream": None}


class _DeviceSpan:
    """What kvikio's pread/pwrite take for a raw device range (they parse __cuda_array_interface__)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, nbytes: int, readonly: bool = False):
        self.__cuda_array_interface__ = _cai(ptr, nbytes, readonly=readonly)


def _itemsize(typestr: str) -> int:
    try:
        return np.dtype(typestr).itemsize
    except TypeError:
        raise TypeError(f"__cuda_array_interface__ typestr {typestr!r} is not a known dtype") from None


def _c_contiguous(shape: tuple, strides, itemsize: int) -> bool:
    if strides is None:
        return True
    if len(strides) != len(shape):
        return False
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expected:  # numpy's rule: a size-1 axis may have any stride
            return False
        expected *= dim
    return True


def cuda_buffer_address(buf, *, writable: bool = False) -> tuple[int, int] | None:
    """(device address, nbytes) of a contiguous CUDA buffer; None for host memory.

    Accepts a torch CUDA tensor, any object with ``__cuda_array_interface__`` (CuPy, Numba,
    ``CudaPointer``) and returns None for everything else (numpy, torch CPU tensors, memoryview,
    ``(address, nbytes)`` host pairs). Raises TypeError for a CUDA buffer it cannot use:
    non-contiguous, masked, or read-only when ``writable`` (a read destination).
    """
    if isinstance(buf, CudaPointer):
        return buf.ptr, buf.nbytes
    if hasattr(buf, "data_ptr") and hasattr(buf, "element_size"):  # torch.Tensor, without importing torch
        if not getattr(buf, "is_cuda", False):
            return None
        if not buf.is_contiguous():
            raise TypeError(f"CUDA tensor is not contiguous (shape {tuple(buf.shape)}, stride {buf.stride()})")
        return int(buf.data_ptr()), int(buf.numel() * buf.element_size())
    try:
        iface = getattr(buf, "__cuda_array_interface__", None)
    except Exception as e:  # some producers raise (e.g. a tensor that requires grad)
        raise TypeError(f"{type(buf).__name__}.__cuda_array_interface__ failed: {e}") from None
    if iface is None:
        return None
    if not isinstance(iface, dict):
        raise TypeError(f"__cuda_array_interface__ of {type(buf).__name__} is not a dict")
    if iface.get("mask") is not None:
        raise TypeError("masked CUDA arrays are not supported")
    ptr, readonly = iface["data"]
    shape = tuple(int(d) for d in iface["shape"])
    itemsize = _itemsize(iface["typestr"])
    if not _c_contiguous(shape, iface.get("strides"), itemsize):
        raise TypeError(f"CUDA array is not C-contiguous (shape {shape}, strides {iface.get('strides')})")
    if writable and readonly:
        raise TypeError(f"CUDA array of {type(buf).__name__} is read-only; a writable buffer is required")
    nbytes = itemsize
    for d in shape:
        nbytes *= d
    return int(ptr or 0), int(nbytes)


# --------------------------------------------------------------------------------------------
# Availability


_avail_lock = threading.Lock()
_avail: tuple[bool, str] | None = None


def _check_libcuda() -> str | None:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return f"libcuda.so.1 cannot be loaded (no NVIDIA driver on this machine: {e})"
    return None


def _check_torch_cuda() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed (it allocates device memory and copies for the GDS path)"
    try:
        ok = torch.cuda.is_available()
    except Exception as e:  # a broken driver can raise instead of returning False
        return f"torch.cuda.is_available() failed: {e}"
    if not ok:
        built = getattr(torch.version, "cuda", None)
        return f"torch {torch.__version__} sees no CUDA device" + ("" if built else " (a CPU-only build)")
    return None


_KVIKIO_SUBMODULES = ("defaults", "cufile_driver")


def _import_kvikio():
    """kvikio with the submodules the engine reads settings from.

    ``import kvikio`` alone does not import ``kvikio.defaults`` or ``kvikio.cufile_driver`` (the
    package's ``__init__`` never does): without importing them explicitly every setting would be
    silently ignored and the compat decision unknown.
    """
    import importlib

    kv = importlib.import_module("kvikio")
    for sub in _KVIKIO_SUBMODULES:
        try:
            importlib.import_module(f"kvikio.{sub}")
        except ImportError:
            pass  # an older kvikio without it: the legacy accessors below apply
        except Exception as e:  # e.g. cufile_driver failing to read the driver's properties
            log.info("importing kvikio.%s failed: %s: %s", sub, type(e).__name__, e)
    return kv


def _check_kvikio() -> str | None:
    try:
        _import_kvikio()
    except ImportError as e:
        cuda = _torch_cuda_major()
        pkg = f"kvikio-cu{cuda}" if cuda else "kvikio-cu12 or kvikio-cu13 (matching torch.version.cuda)"
        return f"kvikio is not importable ({e}); install {pkg}"
    except Exception as e:  # libkvikio/libcufile load errors surface as other exceptions
        return f"kvikio failed to import: {type(e).__name__}: {e}"
    return None


def _torch_cuda_major() -> str | None:
    try:
        import torch

        v = getattr(torch.version, "cuda", None)
        return v.split(".")[0] if v else None
    except ImportError:
        return None


def gds_available() -> tuple[bool, str]:
    """(True, description) when this machine can run KvikioEngine, else (False, reason). Cached."""
    global _avail
    with _avail_lock:
        if _avail is None:
            reason = _check_libcuda() or _check_torch_cuda() or _check_kvikio()
            if reason:
                _avail = (False, reason)
            else:
                kv = _import_kvikio()
                _avail = (True, f"kvikio {getattr(kv, '__version__', '?')}, {describe_kvikio(kv)}")
        return _avail


def _reset_availability_cache() -> None:
    """For tests."""
    global _avail
    with _avail_lock:
        _avail = None


def gds_unavailable_error(reason: str) -> EngineUnavailable:
    err = EngineUnavailable(errno.ENODEV, GDS_UNAVAILABLE.format(reason=reason))
    err.reason = reason
    return err


# --------------------------------------------------------------------------------------------
# kvikio settings across versions (24.x: compat_mode()/*_reset(); 25.x+: defaults.get/set)


# name -> (24.x getters, in preference order; 24.x setter)
_LEGACY = {"compat_mode": (("compat_mode",), "compat_mode_reset"),
           "num_threads": (("get_num_threads", "num_threads"), "num_threads_reset"),
           "gds_threshold": (("gds_threshold",), "gds_threshold_reset"),
           "task_size": (("task_size",), "task_size_reset")}


def _try_call(obj, attrs, *args) -> tuple[bool, object]:
    """(True, result) of the first callable among obj's attrs; (False, None) if none is or it raised."""
    for attr in attrs:
        fn = getattr(obj, attr, None)
        if callable(fn):
            try:
                return True, fn(*args)
            except Exception:
                return False, None
    return False, None


def kvikio_get(kv, name: str):
    d = getattr(kv, "defaults", None)
    ok, value = _try_call(d, ("get",), name)
    return value if ok else _try_call(d, _LEGACY.get(name, ((), ""))[0])[1]


def kvikio_set(kv, name: str, value) -> bool:
    """Set a kvikio default; True only when reading it back gives the value (it took effect)."""
    d = getattr(kv, "defaults", None)
    # defaults.set applies at once; the context manager it returns is only for `with`
    if not (callable(getattr(d, "get", None)) and _try_call(d, ("set",), name, value)[0]):
        if not _try_call(d, (_LEGACY.get(name, ((), ""))[1],), value)[0]:
            return False
    return _same_setting(kvikio_get(kv, name), value)


def _same_setting(got, want) -> bool:
    if got is None:
        return False
    if isinstance(want, bool) or isinstance(got, bool):
        return bool(got) == bool(want) if not hasattr(got, "name") else _mode_name(got) == _mode_name(want)
    try:
        return int(got) == int(want)
    except (TypeError, ValueError):
        return got == want


def _mode_name(mode) -> str | None:
    """'ON' | 'OFF' | 'AUTO' for a CompatMode, a legacy bool or a string; None if unknown."""
    if mode is None:
        return None
    name = getattr(mode, "name", None)
    if name is not None:
        return str(name).upper()
    if isinstance(mode, bool):
        return "ON" if mode else "OFF"
    if isinstance(mode, str):
        return mode.upper()
    return {0: "OFF", 1: "ON", 2: "AUTO"}.get(int(mode))


def _compat_value(kv, mode: str):
    enum = getattr(kv, "CompatMode", None)
    if enum is not None and hasattr(enum, mode.upper()):
        return getattr(enum, mode.upper())
    return {"on": True, "off": False, "auto": True}[mode]  # pre-CompatMode kvikio: a bool


def kvikio_compat_preferred(kv) -> bool | None:
    """True when kvikio does POSIX I/O + copies (its compat mode), False when cuFile is used."""
    ok, preferred = _try_call(getattr(kv, "defaults", None), ("is_compat_mode_preferred",))
    if ok:
        return bool(preferred)
    mode = kvikio_get(kv, "compat_mode")
    if mode is None:
        return None
    name = getattr(mode, "name", None)
    if name is not None:
        return None if name == "AUTO" else name == "ON"
    return bool(mode)


def kvikio_gds_driver_available(kv) -> bool | None:
    drv = getattr(kv, "cufile_driver", None)
    try:
        if drv is not None and callable(getattr(drv, "get", None)):
            return bool(drv.get("is_gds_available"))
        props = getattr(drv, "properties", None) if drv is not None else None
        if props is not None and hasattr(props, "is_gds_available"):
            return bool(props.is_gds_available)
        cls = getattr(kv, "DriverProperties", None) or getattr(drv, "DriverProperties", None)
        if cls is not None:
            return bool(cls().is_gds_available)
    except Exception:
        return False
    return None


def kvikio_settings(kv) -> dict:
    """What kvikio will do, read back from kvikio itself (None where it does not say)."""
    compat = kvikio_compat_preferred(kv)
    return {"compat_mode": _mode_name(kvikio_get(kv, "compat_mode")),
            "compat_decision": None if compat is None else ("posix" if compat else "cufile"),
            "gds_driver_available": kvikio_gds_driver_available(kv),
            "num_threads": kvikio_get(kv, "num_threads"),
            "gds_threshold": kvikio_get(kv, "gds_threshold"),
            "task_size": kvikio_get(kv, "task_size")}


def describe_kvikio(kv) -> str:
    s = kvikio_settings(kv)
    decision = {"posix": "POSIX+copy (kvikio compat mode)", "cufile": "cuFile where each file allows it",
                None: "unknown"}[s["compat_decision"]]
    gds = s["gds_driver_available"]
    return (f"io={decision}, compat_mode={s['compat_mode'] or 'unknown'}, "
            f"gds_driver={'unknown' if gds is None else gds}, num_threads={s['num_threads']}, "
            f"gds_threshold={s['gds_threshold']}")


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


def _errno_of(exc: BaseException) -> int:
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


def _is_kvikio_eof(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and KVIKIO_EOF_TEXT in str(exc)


# Which path served a file's bytes. kvikio decides per file (CompatModeManager: in AUTO a file
# whose O_DIRECT open or cuFile handle registration fails silently runs POSIX) and its Python API
# does not say which; its SummaryMonitor counts bytes per backend, so the engine measures.
PATH_CUFILE = "cufile"  # cuFile (GPUDirect Storage) moved every byte measured
PATH_POSIX = "posix"  # kvikio's POSIX read/write + copy (compat mode) moved them
PATH_MIXED = "mixed"
PATH_UNVERIFIED = "unverified"  # kvikio would try cuFile; no batch on the file measured yet


@dataclass(slots=True, eq=False)
class _CuFileEntry:
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


def _path_of(cufile_bytes: int, posix_bytes: int) -> str | None:
    if cufile_bytes and not posix_bytes:
        return PATH_CUFILE
    if posix_bytes and not cufile_bytes:
        return PATH_POSIX
    if cufile_bytes and posix_bytes:
        return PATH_MIXED
    return None


def _close_quietly(cufile) -> None:
    try:
        cufile.close()
    except Exception as e:  # closing must not fail a batch or close(); note it
        log.debug("closing a kvikio CuFile failed: %s", e)


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
        self._kv = kvikio if kvikio is not None else _import_kvikio()
        self.capabilities = Capabilities(
            name="kvikio", native_async=False, fixed_buffers=False, thread_safe=True,
            queue_depth=queue_depth, device_memory=True,
        )
        self._slots = threading.BoundedSemaphore(queue_depth)
        self._lock = threading.Lock()
        self._files: dict[int, _CuFileEntry] = {}
        self._retired: list[_CuFileEntry] = []  # dropped while a batch held them
        self._pending: set = set()  # (loop, asyncio.Future)
        self._registered: dict[int, _DeviceSpan] = {}  # allocation base -> the span registered
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=max_batches, thread_name_prefix="umbp-gds")
        # which path served the bytes: kvikio's per-backend counters, read around each batch
        self._monitor = None
        monitor_cls = getattr(self._kv, "SummaryMonitor", None)
        if monitor_cls is not None:
            try:
                self._monitor = monitor_cls()
            except Exception as e:
                log.info("kvikio.SummaryMonitor unavailable (%s); which I/O path ran is not measured", e)
        self._active = 0  # batches running
        self._started = 0  # batches ever started (to tell whether one ran alone)
        self._served = {op: {"cufile": 0, "posix": 0, "unattributed": 0} for op in ("read", "write")}

    # ---- protocol

    async def read_many(self, fds, offsets, addrs, lengths) -> np.ndarray:
        return await self._submit(_READ, IoBatch.of(fds, offsets, addrs, lengths))

    async def write_many(self, fds, offsets, addrs, lengths) -> np.ndarray:
        return await self._submit(_WRITE, IoBatch.of(fds, offsets, addrs, lengths))

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
        done: dict[int, _DeviceSpan] = {}
        try:
            for addr, nbytes in ranges:
                addr = int(addr)
                find_base = getattr(_device_ops, "allocation_base", None)
                base = find_base(addr) if find_base is not None else None
                key = addr if base is None else base
                if key in self._registered or key in done:
                    continue
                span = _DeviceSpan(addr, int(nbytes))
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
            _close_quietly(e.cufile)
        self._deregister(self._registered.values())
        self._registered = {}
        if self._monitor is not None:
            try:
                self._monitor.stop()
            except Exception:
                pass
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
        _close_quietly(e.cufile)

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
        with self._lock:
            served = {op: dict(v) for op, v in self._served.items()}
        return {"served": served, "files": self.file_paths(), "measured": self._monitor is not None,
                "path": self.path()}

    def path(self) -> str:
        """"gds" only when cuFile served every byte measured; "posix", "mixed", or "unmeasured"."""
        with self._lock:
            c = sum(v["cufile"] for v in self._served.values())
            p = sum(v["posix"] for v in self._served.values())
        got = _path_of(c, p)
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
            _close_quietly(stale.cufile)
        compat = kvikio_compat_preferred(self._kv) is True
        try:
            cufile = self._kv.CuFile(f"/proc/self/fd/{fd}", "r+" if writable else "r")
        except Exception as exc:
            return -_errno_of(exc)
        try:  # the magic link must have reached the same inode (guards a racing close/reuse)
            kfd = cufile.fileno()
            kst = os.fstat(kfd) if isinstance(kfd, int) and kfd >= 0 else None
        except Exception:
            kst = None
        if kst is not None and (kst.st_dev, kst.st_ino) != key:
            _close_quietly(cufile)
            return -errno.ESTALE
        with self._lock:
            if self._closed:
                _close_quietly(cufile)
                return -errno.ECANCELED
            e = self._files.get(fd)
            if e is None or e.key != key:  # another batch may have raced us to it
                if e is not None and self._retire(e):
                    _close_quietly(e.cufile)
                e = _CuFileEntry(cufile, key, writable)
                if compat:  # kvikio runs every file POSIX: certain without measuring
                    e.path, e.why = PATH_POSIX, "kvikio compat decision (ON, or AUTO without usable cuFile)"
                self._files[fd] = e
            else:
                _close_quietly(cufile)
            e.refs += 1
            return e, st.st_size

    def _retire(self, e: _CuFileEntry) -> bool:
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
            _close_quietly(e.cufile)

    def _run_batch(self, op: int, batch: IoBatch) -> np.ndarray:
        token = self._measure_start()
        res = None
        files: dict = {}
        try:
            res, files = self._run_ops(op, batch)
            return res
        finally:
            self._measure_end(token, op, res, files)

    def _measure_start(self):
        with self._lock:
            alone = self._active == 0
            self._active += 1
            self._started += 1
            seq = self._started
        before = None
        if self._monitor is not None:
            try:
                before = _backend_bytes(self._monitor.get())
            except Exception:
                before = None
        return alone, seq, before

    def _measure_end(self, token, op: int, res, files) -> None:
        alone, seq, before = token
        after = None
        if before is not None:
            try:
                after = _backend_bytes(self._monitor.get())
            except Exception:
                after = None
        entries = [f[0] for f in files.values() if not isinstance(f, int)]
        moved = int(np.maximum(res, 0).sum()) if res is not None else 0
        kind = "write" if op == _WRITE else "read"
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
            path = _path_of(c, p)
            if path is None:
                return
            if path == PATH_MIXED and len(entries) > 1:
                return  # a mix over several files: which file went which way is unknown
            for e in entries:
                e.path = path if e.path in (PATH_UNVERIFIED, path) else PATH_MIXED
                e.why = "measured (kvikio per-backend counters)"

    def _run_ops(self, op: int, batch: IoBatch):
        n = len(batch)
        res = np.zeros(n, dtype=RESULT_DTYPE)
        fds, offs, addrs, lens = batch.fds, batch.offsets, batch.addrs, batch.lengths
        files: dict[int, tuple] = {}
        for fd in np.unique(fds).tolist():
            files[fd] = self._acquire_file(int(fd), op == _WRITE)
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
                if op == _READ:
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
                    res[i] = -_errno_of(exc)
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
        span = _DeviceSpan(addr, size, readonly=(op == _WRITE))
        return (cufile.pread if op == _READ else cufile.pwrite)(span, size, off)

    def _finish_one(self, window, res, files) -> None:
        i, fut, size, cufile, op, addr, off = window.popleft()
        try:
            got = int(fut.get())
        except Exception as exc:
            # the file shrank under a read (we clipped to the size seen): a short count, as cuFile gives
            got = 0 if _is_kvikio_eof(exc) else -_errno_of(exc)
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


# --------------------------------------------------------------------------------------------
# Device memory helpers (torch). One object so tests can swap in host-memory fakes.


class _TorchDeviceOps:
    """Allocation, copies and pinning through torch; every copy group ends with one sync."""

    @staticmethod
    def _torch():
        import torch

        return torch

    def _dev_view(self, addr: int, nbytes: int):
        return self._torch().as_tensor(_DeviceSpan(addr, nbytes), device="cuda")

    def _host_view(self, addr: int, nbytes: int):
        return self._torch().frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=self._torch().uint8)

    def alloc(self, nbytes: int):
        t = self._torch().empty(max(nbytes, 1), dtype=self._torch().uint8, device="cuda")
        return t, int(t.data_ptr())

    def copy_d2h(self, pairs) -> None:
        """pairs: (device addr, host addr, nbytes); returns when all bytes are on the host."""
        self._copy((self._dev_view(d, n), self._host_view(h, n)) for d, h, n in pairs if n > 0)

    def copy_h2d(self, pairs) -> None:
        """pairs: (host addr, device addr, nbytes); returns when all bytes are on the device."""
        self._copy((self._host_view(h, n), self._dev_view(d, n)) for h, d, n in pairs if n > 0)

    def _copy(self, views) -> None:
        """(src, dst) tensor views: queued non-blocking on the current stream, then one sync."""
        device = None
        for src, dst in views:
            dst.copy_(src, non_blocking=True)
            device = src.device if src.is_cuda else dst.device
        if device is not None:
            self._torch().cuda.current_stream(device).synchronize()

    _CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11  # cuda.h CUpointer_attribute

    def allocation_base(self, addr: int) -> int | None:
        """Base address of the CUDA allocation holding addr (cuPointerGetAttribute), else None."""
        try:
            cu = ctypes.CDLL("libcuda.so.1")
            base = ctypes.c_uint64(0)
            rc = cu.cuPointerGetAttribute(ctypes.byref(base), ctypes.c_int(self._CU_POINTER_ATTRIBUTE_RANGE_START_ADDR),
                                          ctypes.c_uint64(addr))
            return int(base.value) if rc == 0 and base.value else None
        except (OSError, AttributeError):
            return None

    def pin(self, addr: int, nbytes: int) -> bool:
        try:
            rt = self._torch().cuda.cudart()
            rc = rt.cudaHostRegister(addr, nbytes, 0)
            return int(getattr(rc, "value", rc)) == 0
        except Exception as e:
            log.info("cudaHostRegister of %d bytes failed (%s); staging copies run unpinned", nbytes, e)
            return False

    def unpin(self, addr: int) -> None:
        try:
            self._torch().cuda.cudart().cudaHostUnregister(addr)
        except Exception:
            pass

    def available(self) -> tuple[bool, str]:
        reason = _check_libcuda() or _check_torch_cuda()
        return (reason is None, reason or "ok")


_device_ops = _TorchDeviceOps()


# --------------------------------------------------------------------------------------------
# CRC32C of host memory (the native extension; a slow Python fallback only for tests)

_crc_fn = None
_CRC_TABLE = None


def _py_crc32c(addr: int, nbytes: int, seed: int = 0) -> int:
    global _CRC_TABLE
    if _CRC_TABLE is None:
        table = []
        for b in range(256):
            c = b
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
            table.append(c)
        _CRC_TABLE = table
    t = _CRC_TABLE
    crc = seed ^ 0xFFFFFFFF
    for byte in ctypes.string_at(addr, nbytes):
        crc = t[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def host_crc32c(addr: int, nbytes: int, seed: int = 0) -> int:
    """CRC32C (Castagnoli) of host memory; umbp_nvme._uring.crc32c when built."""
    global _crc_fn
    if _crc_fn is None:
        try:
            from umbp_nvme import _uring

            _crc_fn = lambda a, n, s: int(_uring.crc32c((a, n), s))  # noqa: E731
        except ImportError:
            log.warning("umbp_nvme._uring is not built; GPU-path CRC32C uses a slow Python fallback")
            _crc_fn = _py_crc32c
    return _crc_fn(addr, nbytes, seed) if nbytes else seed


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
        owner, dev = _device_ops.alloc(nbytes)
        res = await engine.read_many(fd, [offset], [dev], [nbytes])
        if int(res[0]) != nbytes:
            from .base import errno_name

            return False, f"probe read of {nbytes} bytes returned {errno_name(int(res[0]))}"
        back = np.zeros(nbytes, dtype=np.uint8)
        _device_ops.copy_d2h([(dev, int(back.ctypes.data), nbytes)])
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


def configure_kvikio(kv, queue_depth: int, *, compat_mode: str | None = None,
                     num_threads: int | None = None, gds_threshold: int | None = None) -> list[str]:
    """Apply our defaults unless the KVIKIO_* environment variables already chose; returns the
    names of the settings kvikio did not take (each is read back after setting it).

    * ``num_threads``: kvikio's pool defaults to 1 thread, which serialises every op; we use
      min(queue_depth, 16) unless KVIKIO_NTHREADS is set.
    * ``gds_threshold``: below it kvikio's pread runs synchronously, by POSIX + copy, in the calling
      thread (kvikio's small-I/O shortcut), which would serialise a batch of KV pages; we lower it to
      one page unless KVIKIO_GDS_THRESHOLD is set.
    * ``compat_mode``: "on" | "off" | "auto"; default: kvikio's own (AUTO: cuFile when it works,
      POSIX + copy otherwise; KVIKIO_COMPAT_MODE overrides).
    """
    wanted = {}
    if compat_mode is not None:
        if compat_mode not in ("on", "off", "auto"):
            raise ValueError(f"compat_mode must be 'on', 'off' or 'auto', got {compat_mode!r}")
        wanted["compat_mode"] = _compat_value(kv, compat_mode)
    if num_threads is None and "KVIKIO_NTHREADS" not in os.environ:
        want = min(queue_depth, 16)
        cur = kvikio_get(kv, "num_threads")
        if cur is None or int(cur) < want:
            num_threads = want
    if num_threads is not None:
        wanted["num_threads"] = int(num_threads)
    if gds_threshold is None and "KVIKIO_GDS_THRESHOLD" not in os.environ:
        gds_threshold = PROBE_BYTES
    if gds_threshold is not None:
        wanted["gds_threshold"] = int(gds_threshold)
    failed = [name for name, value in wanted.items() if not kvikio_set(kv, name, value)]
    if failed:
        log.warning("kvikio did not take these settings (read back differs): %s; it runs with %s",
                    ", ".join(f"{n}={wanted[n]}" for n in failed), describe_kvikio(kv))
    return failed


async def open_gds_engine(queue_depth: int = DEFAULT_QUEUE_DEPTH, *, probe_dir: str | None = None,
                          probe_fd: int | None = None, compat_mode: str | None = None,
                          num_threads: int | None = None, gds_threshold: int | None = None) -> KvikioEngine:
    """A probed KvikioEngine, or EngineUnavailable('CUDA buffer given but GPUDirect Storage ...')."""
    ok, reason = gds_available()
    if not ok:
        raise gds_unavailable_error(reason)
    kv = _import_kvikio()
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
        self._opener = opener or open_gds_engine
        self.engine: KvikioEngine | None = None
        self._staging: StagingBuffer | None = None
        self.mode: str | None = None  # None until decided; then "gds" | "staging" | "off"
        self.reason: str = ""
        self._lock: asyncio.Lock | None = None

    @property
    def staging(self) -> StagingBuffer | None:
        """The pinned staging buffer for staged_read/staged_write in "staging" mode, else None."""
        if self._staging is None and self.mode == "staging":
            self._staging = StagingBuffer(self.staging_bytes)
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
            ok, why = _device_ops.available()
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


# --------------------------------------------------------------------------------------------
# Staging through pinned host memory (gds_staging=True), and CRC of device ranges


def _round_up(n, unit: int = STAGING_ALIGN_BYTES):
    """n (an int or an int array) rounded up to a multiple of unit."""
    return -(-n // unit) * unit


class StagingBuffer:
    """Page-aligned host memory, pinned with cudaHostRegister when possible (O_DIRECT-ready).

    One staged call uses it at a time (an asyncio lock, created on first use).
    """

    def __init__(self, nbytes: int, *, pin: bool = True):
        from ..buffers import AlignedBuffer

        if nbytes <= 0:
            raise ValueError(f"staging nbytes must be > 0, got {nbytes}")
        self.nbytes = _round_up(nbytes)
        self._buf = AlignedBuffer(self.nbytes)
        self.address = self._buf.address
        self.pinned = _device_ops.pin(self.address, self.nbytes) if pin else False
        self._lock: asyncio.Lock | None = None

    def lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def close(self) -> None:
        if self._buf is None:
            return
        if self.pinned:
            _device_ops.unpin(self.address)
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
    _device_ops.copy_d2h([(d, h, n) for d, h, n in zip(dev, host, lens) if n > 0])
    for h, n, p in zip(host, lens, io_lens):
        if p > n:
            ctypes.memset(h + n, 0, p - n)


def _crcs_into(out: np.ndarray, idx, host, lens) -> None:
    for k, h, n in zip(idx, host, lens):
        out[k] = host_crc32c(h, n)


async def _in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def _staged(op: int, host_engine, fds, offsets, dev_addrs, lengths, staging: StagingBuffer,
                  with_crc: bool):
    b = IoBatch.of(fds, offsets, dev_addrs, lengths)
    res = np.zeros(len(b), dtype=RESULT_DTYPE)
    crcs = np.zeros(len(b), dtype=np.uint32)
    io_lens = _round_up(b.lengths)  # O_DIRECT files take whole blocks only
    too_big = io_lens > staging.nbytes
    res[too_big] = -errno.ENOBUFS
    ok = np.flatnonzero(~too_big)
    transfer = host_engine.write_many if op == _WRITE else host_engine.read_many
    async with staging.lock():
        for idx, host in _plan_groups(io_lens[ok], staging.nbytes, staging.address):
            sel = ok[idx]
            dev, want = b.addrs[sel].tolist(), b.lengths[sel]
            if op == _WRITE:
                await _in_thread(_to_host, dev, host, want.tolist(), io_lens[sel].tolist())
            r = await transfer(b.fds[sel], b.offsets[sel], np.asarray(host, dtype=ADDR_DTYPE), io_lens[sel])
            res[sel] = r = np.minimum(r, want)  # the bytes past the object are not the caller's
            moved = want.tolist() if op == _WRITE else np.maximum(r, 0).tolist()
            if with_crc:
                _crcs_into(crcs, sel, host, moved)
            if op == _READ:
                pairs = [(h, d, n) for h, d, n in zip(host, dev, moved) if n > 0]
                await _in_thread(_device_ops.copy_h2d, pairs)
    return (res, crcs) if with_crc else res


async def staged_read(host_engine, fds, offsets, dev_addrs, lengths, staging: StagingBuffer, *,
                      with_crc: bool = False):
    """Read extents into device memory via host_engine (io_uring) and the pinned staging buffer.

    The host engine reads each op rounded up to STAGING_ALIGN_BYTES (O_DIRECT files refuse other
    lengths); only ``lengths`` bytes reach the device and the results are clipped to them.
    Returns the per-op results (the protocol's convention), and with ``with_crc`` also the CRC32C of
    the bytes read (computed on the host copy, before the device copy) as uint32.
    """
    return await _staged(_READ, host_engine, fds, offsets, dev_addrs, lengths, staging, with_crc)


async def staged_write(host_engine, fds, offsets, dev_addrs, lengths, staging: StagingBuffer, *,
                       with_crc: bool = False):
    """Copy device ranges to the pinned staging buffer, then write them with host_engine.

    Each op is written rounded up to STAGING_ALIGN_BYTES, the padding zeroed (no stale staging
    bytes reach the disk): the extent at each offset must be reserved rounded up too, as the
    store's slots are (slot-sized, 4 KiB aligned). Results are clipped to ``lengths``. The device
    copy runs on torch's current stream after the caller's queued work on it; work on other streams
    must be synchronised by the caller first.
    """
    return await _staged(_WRITE, host_engine, fds, offsets, dev_addrs, lengths, staging, with_crc)


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
        staging = StagingBuffer(max(int(lens.max()), 1) * min(len(lens), 8))
    if int(lens.max()) > staging.nbytes:
        raise ValueError(f"a range of {int(lens.max())} bytes exceeds the staging buffer ({staging.nbytes} bytes)")

    def work():
        for idx, host in _plan_groups(_round_up(lens), staging.nbytes, staging.address):
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
