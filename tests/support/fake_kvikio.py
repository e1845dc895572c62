"""A test double of kvikio 26.10, built from the real wheel's Python API, and stubs of its compiled core.

Two layers, as in the real package:

* ``Core`` stands in for the compiled modules (``kvikio._lib.*``: libkvikio + cuFile). Its
  "device" memory is host memory behind ``__cuda_array_interface__``; everything else follows what
  the real headers and Python layer say:

  - settings live in the core (``compat_mode`` as ``CompatMode``, ``thread_pool_nthreads``,
    ``gds_threshold``, ``task_size``, ...), kvikio's defaults: AUTO, 1 thread, 16 KiB, 4 MiB;
    every setter call is recorded in ``core.set_calls``;
  - the compat decision is per file, as kvikio's ``CompatModeManager`` makes it: ON -> POSIX;
    OFF/AUTO -> a second descriptor is opened with O_DIRECT and the file registered with cuFile;
    in AUTO a failure of either (or no usable cuFile: ``core.cufile_available``, which the real
    library derives from libcufile loading and ``/run/udev`` being readable) falls back to POSIX
    for that file, in OFF it raises;
  - ``pread``/``pwrite`` futures run at submit, in a pool of ``thread_pool_nthreads`` threads;
    ops under ``gds_threshold`` run synchronously in the caller's thread by POSIX (the real
    small-I/O shortcut) and return a finished future;
  - the POSIX path raises at EOF ("POSIX error on pread: EOF"), cuFile returns short;
  - errors are ``RuntimeError`` with kvikio's message formats (no errno attribute);
  - ``memory_register`` takes no size: it registers the whole allocation holding the pointer
    (``core.allocations``), and registering an allocation twice raises as cuFile does; a no-op in
    compat mode;
  - every op is counted per backend ("POSIX" / "GDS") for ``SummaryMonitor`` readings.

* The public layer (``CuFile``, ``IOFuture``, ``defaults``, ``cufile_driver``, ``memory_register``,
  ``SummaryMonitor`` ...) has the real package's names and signatures (tests/engine/test_gds_engine.py checks
  them against the real wheel when it is at hand). ``install(core)`` puts it behind ``import
  kvikio`` with the real import behaviour: ``import kvikio`` does not import ``kvikio.defaults``
  or ``kvikio.cufile_driver``; they appear as attributes only once imported.

``install_real(core, wheel_dir)`` instead loads the real package's Python files from a downloaded
``kvikio-cu12``/``kvikio-cu13`` wheel over stubs of ``kvikio._lib.*`` backed by the same core (see
``find_kvikio_wheel``). Both return an ``Installed`` to ``uninstall()``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import errno
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
import time
import types
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Union

VERSION = "26.10.0"
BACKENDS = ("POSIX", "GDS", "MMAP", "REMOTE_HTTP", "REMOTE_HDFS")


class CompatMode(enum.IntEnum):  # kvikio/compat_mode.hpp: OFF, ON, AUTO
    OFF = 0
    ON = 1
    AUTO = 2


class RemoteIOBackend(enum.IntEnum):
    LIBCURL_EASY = 0


class RemoteReactorDispatch(enum.IntEnum):
    ROUND_ROBIN = 0


def fail(where: str, msg: str) -> RuntimeError:
    return RuntimeError(f"KvikIO failure at: {where}: {msg}")


def cufile_error(where: str, msg: str) -> RuntimeError:
    return RuntimeError(f"cuFile error at: {where}: {msg}")


def system_error(where: str, err: int) -> RuntimeError:
    # GenericSystemError (std::system_error) reaches Python as RuntimeError(what()), no errno
    return RuntimeError(f"Linux system/library function call error at: {where}: {os.strerror(err)}")


# ------------------------------------------------------------------------------------------ core


class Core:
    """The state behind kvikio._lib: settings, files, pool, registrations, per-backend counts."""

    def __init__(self):
        self.settings: dict[str, Any] = {
            "compat_mode": CompatMode.AUTO, "thread_pool_nthreads": 1, "task_size": 4 << 20,
            "gds_threshold": 16 << 10, "bounce_buffer_size": 16 << 20, "http_max_attempts": 3,
            "http_status_codes": [429, 500, 502, 503, 504], "http_timeout": 60,
            "auto_direct_io_read": False, "auto_direct_io_write": True, "remote_io_backend": RemoteIOBackend(0),
            "remote_io_num_reactors": 1, "remote_io_reactor_dispatch": RemoteReactorDispatch(0),
            "remote_io_max_concurrent_requests": 64,
        }
        self.set_calls: list[tuple[str, Any]] = []
        self.cufile_available = True  # libcufile loads and /run/udev is readable
        self.odirect_fails: set[str] = set()  # paths whose O_DIRECT open fails (e.g. tmpfs)
        self.register_fails: set[str] = set()  # paths whose cuFileHandleRegister fails
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="fake-kvikio")
        self.pool_threads = 1
        self.opened: list[FileCore] = []
        self.calls: list[tuple] = []  # (op, path, offset, size, backend)
        self.fail_at: dict[int, BaseException] = {}
        self.short_once: set[int] = set()
        self.corrupt_at: set[int] = set()
        self.gate: threading.Event | None = None  # when set: pool work waits on it
        self.started = threading.Event()
        self.outstanding = 0  # submitted, not yet collected with get()
        self.max_outstanding = 0
        self.allocations: dict[int, int] = {}  # "device" allocations: base -> size
        self.registered: list[int] = []  # allocation bases registered with cuFile
        self.register_calls: list[int] = []  # pointers memory_register was called with
        self.totals = {b: [0, 0, 0] for b in BACKENDS}  # ops, bytes, errors
        self.reads = 0
        self.writes = 0

    # settings (kvikio::defaults)
    def get(self, name: str):
        return self.settings[name]

    def set(self, name: str, value) -> None:
        if name == "compat_mode":
            value = CompatMode(value) if not isinstance(value, str) else CompatMode[value.upper()]
        elif name in ("thread_pool_nthreads", "task_size", "gds_threshold"):
            value = int(value)
            if value <= 0 and name != "gds_threshold":
                raise ValueError(f"{name} must be positive")
        self.set_calls.append((name, value))
        self.settings[name] = value
        if name == "thread_pool_nthreads" and value != self.pool_threads:
            old, self.pool = self.pool, ThreadPoolExecutor(value, thread_name_prefix="fake-kvikio")
            self.pool_threads = value
            old.shutdown(wait=True)

    def is_compat_mode_preferred(self, mode=None) -> bool:
        mode = self.settings["compat_mode"] if mode is None else mode
        if mode == CompatMode.ON:
            return True
        if mode == CompatMode.OFF:
            return False
        return not self.cufile_available

    def count(self, backend: str, nbytes: int, write: bool, error: bool = False) -> None:
        with self.lock:
            t = self.totals[backend]
            t[0] += 1
            t[1] += max(nbytes, 0)
            t[2] += int(error)
            if write:
                self.writes += 1
            else:
                self.reads += 1

    def alloc(self, nbytes: int):
        """A "device" allocation (host memory) that memory_register can find the base of."""
        import numpy as np

        a = np.zeros(max(nbytes, 1), dtype=np.uint8)
        self.allocations[int(a.ctypes.data)] = a.nbytes
        return a, int(a.ctypes.data)

    def allocation_of(self, ptr: int):
        for base, size in self.allocations.items():
            if base <= ptr < base + size:
                return base, size
        return None

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for f in self.opened:
            f.close()


def _buffer_range(buf, size) -> tuple[int, int]:
    iface = getattr(buf, "__cuda_array_interface__", None)
    if iface is None:
        raise ValueError("fake kvikio: the buffer is not a CUDA array")
    ptr, nbytes = int(iface["data"][0]), int(iface["shape"][0])
    if size is None:
        size = nbytes
    if size > nbytes:
        raise ValueError(f"Buffer size {nbytes} is smaller than size {size}")
    return ptr, int(size)


_FLAG_BITS = {"r": os.O_RDONLY, "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND}


def _open_flags(flags: str) -> int:
    base = _FLAG_BITS[flags[0]]
    if "+" in flags:
        base = (base & ~os.O_ACCMODE) | os.O_RDWR
    return base


class FileCore:
    """kvikio::FileHandle: two descriptors (one O_DIRECT), the per-file compat decision."""

    def __init__(self, core: Core, file, flags: str = "r"):
        self.core = core
        self.path = os.fspath(file)
        self.flags = flags
        bits = _open_flags(flags)
        try:
            self.fd = os.open(self.path, bits, 0o644)
        except OSError as e:
            raise system_error("file_utils.cpp:112", e.errno) from None
        self.fd_direct = -1
        self.registered = False
        mode = core.settings["compat_mode"]
        self.compat = core.is_compat_mode_preferred(mode)
        self.why = "compat mode ON" if mode == CompatMode.ON else ("cuFile unavailable" if self.compat else "")
        if not self.compat:
            try:
                if self.path in core.odirect_fails:
                    raise OSError(errno.EINVAL, "O_DIRECT refused")
                self.fd_direct = os.open(self.path, (bits & ~(os.O_CREAT | os.O_TRUNC)) | os.O_DIRECT)
                if self.path in core.register_fails:
                    raise cufile_error("compat_mode_manager.cpp:88", "GPUDirect Storage not supported on current file")
                self.registered = True
            except (OSError, RuntimeError) as e:
                if mode == CompatMode.OFF:
                    self.close()
                    raise (system_error("file_handle.cpp:73", e.errno) if isinstance(e, OSError) else e) from None
                self.compat = True
                self.why = "O_DIRECT open failed" if isinstance(e, OSError) else "cuFile handle registration failed"
        self._closed = False
        core.opened.append(self)

    # -- what kvikio._lib.file_handle.CuFile exposes
    def close(self) -> None:
        for fd in (self.fd, self.fd_direct):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.fd = self.fd_direct = -1
        self._closed = True

    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        return self.fd

    def open_flags(self) -> int:
        return _open_flags(self.flags)

    def is_direct_io_supported(self) -> bool:
        return self.fd_direct >= 0

    def pread(self, buf, size, file_offset, task_size):
        return self._submit(False, buf, size, file_offset, task_size)

    def pwrite(self, buf, size, file_offset, task_size):
        return self._submit(True, buf, size, file_offset, task_size)

    def read(self, buf, size, file_offset, dev_offset):
        ptr, size = _buffer_range(buf, size)
        return self._run(False, ptr + dev_offset, size, file_offset, "GDS" if not self.compat else "POSIX")

    def write(self, buf, size, file_offset, dev_offset):
        ptr, size = _buffer_range(buf, size)
        return self._run(True, ptr + dev_offset, size, file_offset, "GDS" if not self.compat else "POSIX")

    # -- the work
    def _submit(self, write: bool, buf, size, file_offset, task_size):
        if self._closed:
            raise fail("file_handle.cpp:140", "file handle is closed")
        ptr, size = _buffer_range(buf, size)
        core = self.core
        small = size < core.settings["gds_threshold"]
        backend = "POSIX" if (self.compat or small) else "GDS"
        core.calls.append(("pwrite" if write else "pread", self.path, file_offset, size, backend))
        with core.lock:
            core.outstanding += 1
            core.max_outstanding = max(core.max_outstanding, core.outstanding)
        fut: Future = Future()
        if small:  # the small-I/O shortcut: synchronous, in this thread, POSIX
            try:
                fut.set_result(self._run(write, ptr, size, file_offset, backend))
            except BaseException as e:
                fut.set_exception(e)
        else:
            def work():
                if core.gate is not None:
                    core.started.set()
                    core.gate.wait(10)
                return self._run(write, ptr, size, file_offset, backend)

            inner = core.pool.submit(work)
            inner.add_done_callback(lambda f: fut.set_exception(f.exception()) if f.exception()
                                    else fut.set_result(f.result()))
        return FutureCore(core, fut)

    def _run(self, write: bool, ptr: int, size: int, off: int, backend: str) -> int:
        core = self.core
        try:
            if off in core.fail_at:
                raise core.fail_at[off]
            if write:
                acc = _open_flags(self.flags) & os.O_ACCMODE
                if acc == os.O_RDONLY:
                    # what kvikio says for pwrite(2) -> EBADF on a read-only descriptor
                    raise system_error("posix_io.hpp:131", errno.EPERM)
                n = os.pwrite(self.fd, ctypes.string_at(ptr, size), off)
            else:
                want = size
                if off in core.short_once:
                    core.short_once.discard(off)
                    want = size // 2
                data = os.pread(self.fd, want, off)
                if len(data) < want and backend == "POSIX":
                    raise fail("posix_io.hpp:173", "POSIX error on pread: EOF")
                if off in core.corrupt_at:
                    data = bytes(b ^ 0xFF for b in data)
                ctypes.memmove(ptr, data, len(data))
                n = len(data)
        except BaseException:
            core.count(backend, 0, write, error=True)
            raise
        core.count(backend, n, write)
        return n


class FutureCore:
    """std::future<size_t> as kvikio._lib.future exposes it: get() once, done()."""

    def __init__(self, core: Core, fut: Future):
        self._core = core
        self._fut = fut
        self._got = False

    def get(self) -> int:
        try:
            return self._fut.result()
        finally:
            if not self._got:
                self._got = True
                with self._core.lock:
                    self._core.outstanding -= 1

    def done(self) -> bool:
        return self._fut.done()


class SummaryCore:
    def __init__(self, core: Core, base: dict, start_ns: int, end_ns: int):
        self._d = _summary_dict(core, base, start_ns, end_ns)
        self._raw = base
        self._core = core

    def as_dict(self) -> dict:
        return dict(self._d)

    def since(self, previous: "SummaryCore"):
        raise NotImplementedError("fake kvikio: Summary.since")

    def to_json(self) -> str:
        import json

        return json.dumps(self._d)

    def report(self, all_rows: bool = False) -> str:
        return "\n".join(f"{k}: {v}" for k, v in self._d.items()) + "\n"

    def serialize(self) -> bytes:
        raise NotImplementedError("fake kvikio: Summary.serialize")


def _snapshot(core: Core) -> dict:
    with core.lock:
        return {"totals": {b: list(v) for b, v in core.totals.items()}, "reads": core.reads, "writes": core.writes}


def _summary_dict(core: Core, base: dict, start_ns: int, end_ns: int) -> dict:
    now = _snapshot(core)
    by = {}
    for b in BACKENDS:
        ops, nb, errs = (now["totals"][b][i] - base["totals"][b][i] for i in range(3))
        by[b] = {"num_ops": ops, "bytes_transferred": nb, "total_duration_ns": 0, "num_errors": errs}
    ops = sum(v["num_ops"] for v in by.values())
    moved = sum(v["bytes_transferred"] for v in by.values())
    return {"start_unix_ns": start_ns, "end_unix_ns": end_ns, "num_ops": ops,
            "num_reads": now["reads"] - base["reads"], "num_writes": now["writes"] - base["writes"],
            "bytes_requested": moved, "bytes_transferred": moved, "bytes_read": 0, "bytes_written": 0,
            "num_errors": sum(v["num_errors"] for v in by.values()), "busy_ns": 0, "total_duration_ns": 0,
            "by_backend": by, "counters": {}, "wall_ns": end_ns - start_ns, "busy_bytes_per_sec": 0.0,
            "busy_fraction": 0.0, "mean_duration_ns": 0}


class MonitorCore:
    def __init__(self, core: Core):
        self._core = core
        self.reset()

    def reset(self) -> None:
        self._base = _snapshot(self._core)
        self._start = time.time_ns()
        self._stopped = None

    def get(self) -> SummaryCore:
        end = time.time_ns()
        return SummaryCore(self._core, self._base, self._start, end)

    def since(self, previous: SummaryCore) -> SummaryCore:
        raise NotImplementedError("fake kvikio: SummaryMonitor.since")

    def stop(self) -> None:
        self._stopped = time.time_ns()


def _register(core: Core, buf) -> None:
    ptr, _ = _buffer_range(buf, None)
    core.register_calls.append(ptr)
    if core.is_compat_mode_preferred():
        return  # "In compatibility mode ... this function is a no-op."
    alloc = core.allocation_of(ptr)
    if alloc is None:
        raise RuntimeError("CUDA error at: buffer.cpp:31: CUDA_ERROR_INVALID_VALUE(invalid argument)")
    if alloc[0] in core.registered:
        raise cufile_error("buffer.cpp:36", "memory already registered")
    core.registered.append(alloc[0])


def _deregister(core: Core, buf) -> None:
    ptr, _ = _buffer_range(buf, None)
    if core.is_compat_mode_preferred():
        return
    alloc = core.allocation_of(ptr)
    if alloc is None or alloc[0] not in core.registered:
        raise cufile_error("buffer.cpp:48", "buffer not registered")
    core.registered.remove(alloc[0])


# ------------------------------------------------------------------------------ public layer
# Same names, argument order, keywords and defaults as kvikio 26.10's Python modules.


def build_public(core: Core) -> dict[str, dict[str, Any]]:
    """name -> attributes, for the modules kvikio, kvikio.cufile, kvikio.defaults, kvikio.cufile_driver."""

    class IOFuture:
        __slots__ = "_handle"

        def __init__(self, handle):
            self._handle = handle

        def get(self) -> int:
            return self._handle.get()

        def done(self) -> bool:
            return self._handle.done()

    class CuFile:
        def __init__(self, file: Union[os.PathLike, str], flags: str = "r"):
            self._handle = FileCore(core, file, flags)

        def close(self) -> None:
            self._handle.close()

        @property
        def closed(self) -> bool:
            return self._handle.closed()

        def fileno(self) -> int:
            return self._handle.fileno()

        def open_flags(self) -> int:
            return self._handle.open_flags()

        def __enter__(self):
            return self

        def __exit__(self, exc_type, exc_val, exc_tb) -> None:
            self.close()

        def pread(self, buf, size: Optional[int] = None, file_offset: int = 0,
                  task_size: Optional[int] = None) -> IOFuture:
            return IOFuture(self._handle.pread(buf, size, file_offset, task_size))

        def pwrite(self, buf, size: Optional[int] = None, file_offset: int = 0,
                   task_size: Optional[int] = None) -> IOFuture:
            return IOFuture(self._handle.pwrite(buf, size, file_offset, task_size))

        def read(self, buf, size: Optional[int] = None, file_offset: int = 0,
                 task_size: Optional[int] = None) -> int:
            return self.pread(buf, size, file_offset, task_size).get()

        def write(self, buf, size: Optional[int] = None, file_offset: int = 0,
                  task_size: Optional[int] = None) -> int:
            return self.pwrite(buf, size, file_offset, task_size).get()

        def raw_read(self, buf, size: Optional[int] = None, file_offset: int = 0, dev_offset: int = 0) -> int:
            return self._handle.read(buf, size, file_offset, dev_offset)

        def raw_write(self, buf, size: Optional[int] = None, file_offset: int = 0, dev_offset: int = 0) -> int:
            return self._handle.write(buf, size, file_offset, dev_offset)

        def is_direct_io_supported(self) -> bool:
            return self._handle.is_direct_io_supported()

    @dataclasses.dataclass(frozen=True)
    class Summary:
        start_unix_ns: int
        end_unix_ns: int
        num_ops: int
        num_reads: int
        num_writes: int
        bytes_requested: int
        bytes_transferred: int
        bytes_read: int
        bytes_written: int
        num_errors: int
        busy_ns: int
        total_duration_ns: int
        by_backend: dict = dataclasses.field(hash=False)
        counters: dict = dataclasses.field(hash=False)
        wall_ns: int
        busy_bytes_per_sec: float
        busy_fraction: float
        mean_duration_ns: int

        def since(self, previous: "Summary") -> "Summary":
            raise NotImplementedError("fake kvikio: Summary.since")

        def to_json(self) -> str:
            import json

            return json.dumps(dataclasses.asdict(self))

        def report(self, all_rows: bool = False) -> str:
            return "\n".join(f"{f.name}: {getattr(self, f.name)}" for f in dataclasses.fields(self)) + "\n"

    class SummaryMonitor:
        __slots__ = ("_handle",)

        def __init__(self):
            self._handle = MonitorCore(core)

        def get(self) -> Summary:
            return Summary(**self._handle.get().as_dict())

        def reset(self) -> None:
            self._handle.reset()

        def since(self, previous: Summary) -> Summary:
            raise NotImplementedError("fake kvikio: SummaryMonitor.since")

        def stop(self) -> None:
            self._handle.stop()

        def __enter__(self):
            return self

        def __exit__(self, exc_type, exc_value, traceback) -> None:
            self.stop()

    def memory_register(buf) -> None:
        return _register(core, buf)

    def memory_deregister(buf) -> None:
        _deregister(core, buf)

    def bounce_buffer_free() -> int:
        return 0

    def d_set(*config):
        if len(config) == 1 and isinstance(config[0], dict):
            items = list(config[0].items())
        elif len(config) == 2 and isinstance(config[0], str):
            items = [config]
        else:
            raise ValueError("Valid arguments are kvikio.defaults.set(config: dict) or "
                             "kvikio.defaults.set(key: str, value: Any)")
        for key, value in items:
            core.set("thread_pool_nthreads" if key == "num_threads" else key, value)
        return None

    def d_get(config_name: str):
        return core.get("thread_pool_nthreads" if config_name == "num_threads" else config_name)

    def is_compat_mode_preferred() -> bool:
        return core.is_compat_mode_preferred()

    driver_props = {"is_gds_available": lambda: core.cufile_available, "major_version": lambda: 1,
                    "minor_version": lambda: 15, "allow_compat_mode": lambda: True,
                    "per_buffer_cache_size": lambda: 1024, "poll_mode": lambda: False,
                    "poll_thresh_size": lambda: 4, "max_device_cache_size": lambda: 128 << 10,
                    "max_pinned_memory_size": lambda: 32 << 20}

    def c_get(config_name: str):
        if config_name not in driver_props:
            raise KeyError
        if not core.cufile_available and config_name != "is_gds_available":
            raise RuntimeError("cuFile error at: driver.cpp:20: driver not opened")
        return driver_props[config_name]()

    def c_set(*config):
        raise KeyError("fake kvikio: cufile_driver settings are read-only here")

    def libcufile_version():
        return (1, 15)

    def driver_open() -> None:
        return None

    def driver_close() -> None:
        return None

    def initialize() -> None:
        return None

    for fn, qual in ((d_set, "set"), (d_get, "get"), (c_set, "set"), (c_get, "get")):
        fn.__name__ = fn.__qualname__ = qual
    defaults = {"get": d_get, "set": d_set, "is_compat_mode_preferred": is_compat_mode_preferred}
    driver = {"get": c_get, "set": c_set, "libcufile_version": libcufile_version, "driver_open": driver_open,
              "driver_close": driver_close, "initialize": initialize, "properties": types.SimpleNamespace()}
    root = {"__version__": VERSION, "CompatMode": CompatMode, "RemoteIOBackend": RemoteIOBackend,
            "RemoteReactorDispatch": RemoteReactorDispatch, "CuFile": CuFile,
            "memory_register": memory_register, "memory_deregister": memory_deregister,
            "bounce_buffer_free": bounce_buffer_free, "Summary": Summary, "SummaryMonitor": SummaryMonitor}
    return {"kvikio": root, "kvikio.cufile": {"CuFile": CuFile, "IOFuture": IOFuture},
            "kvikio.defaults": defaults, "kvikio.cufile_driver": driver}


# -------------------------------------------------------------- stubs of the compiled modules


def build_lib_stubs(core: Core) -> dict[str, dict[str, Any]]:
    """kvikio._lib.* for the real Python layer, backed by the core."""
    d: dict[str, Any] = {"CompatMode": CompatMode, "RemoteIOBackend": RemoteIOBackend,
                         "RemoteReactorDispatch": RemoteReactorDispatch,
                         "is_compat_mode_preferred": lambda: core.is_compat_mode_preferred()}
    for name in core.settings:
        d[name] = (lambda n: lambda: core.get(n))(name)
        d["set_" + name] = (lambda n: lambda value: core.set(n, value))(name)

    class DriverProperties:
        def _ro(key, value):
            def get(self):
                if not core.cufile_available and key != "is_gds_available":
                    raise RuntimeError("cuFile error at: driver.cpp:20: driver not opened")
                return value() if callable(value) else value

            def put(self, v):
                raise AttributeError(f"{key} is read-only")

            return property(get, put)

        is_gds_available = _ro("is_gds_available", lambda: core.cufile_available)
        major_version = _ro("major_version", 1)
        minor_version = _ro("minor_version", 15)
        allow_compat_mode = _ro("allow_compat_mode", True)
        per_buffer_cache_size = _ro("per_buffer_cache_size", 1024)
        poll_mode = _ro("poll_mode", False)
        poll_thresh_size = _ro("poll_thresh_size", 4)
        max_device_cache_size = _ro("max_device_cache_size", 128 << 10)
        max_pinned_memory_size = _ro("max_pinned_memory_size", 32 << 20)
        del _ro

    def file_handle_cufile(file, flags):
        return FileCore(core, file, flags)

    def page_cache_info(file, offset, length):
        return (0, 0)

    return {
        "kvikio._lib": {},
        "kvikio._lib.defaults": d,
        "kvikio._lib.file_handle": {"CuFile": file_handle_cufile, "get_page_cache_info": page_cache_info,
                                    "drop_file_page_cache": lambda *a: None,
                                    "drop_system_page_cache": lambda *a: False},
        "kvikio._lib.buffer": {"memory_register": lambda buf: _register(core, buf),
                               "memory_deregister": lambda buf: _deregister(core, buf),
                               "bounce_buffer_free": lambda: 0},
        "kvikio._lib.cufile_driver": {"DriverProperties": DriverProperties,
                                      "libcufile_version": lambda: 1150,
                                      "driver_open": lambda: None, "driver_close": lambda: None},
        "kvikio._lib.statistics": {"SummaryMonitor": lambda: MonitorCore(core), "Summary": SummaryCore},
        "kvikio._lib.mmap": {"InternalMmapHandle": type("InternalMmapHandle", (), {})},
        "kvikio._lib.stream": {"stream_register": lambda raw_stream, flags: None,
                               "stream_deregister": lambda raw_stream: None},
    }


# ---------------------------------------------------------------------------- import plumbing


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, modules: dict[str, dict[str, Any]], packages: set[str]):
        self.modules = modules
        self.packages = packages

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.modules:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=fullname in self.packages)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__dict__.update(self.modules[module.__name__])


@dataclasses.dataclass
class Installed:
    core: Core
    finder: _Finder
    real: bool
    path: str | None = None
    saved: dict = dataclasses.field(default_factory=dict)  # the kvikio modules there before

    def module(self):
        return importlib.import_module("kvikio")

    def uninstall(self) -> None:
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)
        if self.path and self.path in sys.path:
            sys.path.remove(self.path)
        _drop_kvikio_modules()
        sys.modules.update(self.saved)  # an installed kvikio (extension modules load once a process)
        self.core.close()


def _drop_kvikio_modules() -> dict:
    gone = {}
    for name in [n for n in sys.modules if n == "kvikio" or n.startswith("kvikio.") or n == "libkvikio"]:
        gone[name] = sys.modules.pop(name)
    importlib.invalidate_caches()
    return gone


def install(core: Core | None = None) -> Installed:
    """The fake public layer behind `import kvikio` (kvikio.defaults/cufile_driver import lazily)."""
    core = core or Core()
    saved = _drop_kvikio_modules()
    finder = _Finder(build_public(core), {"kvikio"})
    sys.meta_path.insert(0, finder)
    return Installed(core, finder, real=False, saved=saved)


def find_kvikio_wheel() -> str | None:
    """A kvikio-cu12/-cu13 wheel: $KVIKIO_WHEEL, else the first in $KVIKIO_WHEEL_DIR, the cache
    tools/fetch_kvikio_wheel.sh fills (~/.cache/umbp-nvme/kvikio-wheels), .whl/ (what
    tools/gpu_check.sh carries) or /tmp/kvikio-wheels/."""
    w = os.environ.get("KVIKIO_WHEEL")
    if w and os.path.isfile(w):
        return w
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "umbp-nvme", "kvikio-wheels")
    for d in (os.environ.get("KVIKIO_WHEEL_DIR"), cache, os.path.join(root, ".whl"), "/tmp/kvikio-wheels"):
        if d and os.path.isdir(d):
            for name in sorted(os.listdir(d)):
                if name.startswith(("kvikio_cu12-", "kvikio_cu13-")) and name.endswith(".whl"):
                    return os.path.join(d, name)
    return None


def extract_python_layer(wheel: str, dest: str) -> str:
    """Unpack the wheel's Python files (never its compiled modules) into dest; returns dest."""
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith("kvikio/") and (name.endswith(".py") or name.endswith("VERSION")
                                                or name.endswith("GIT_COMMIT")):
                z.extract(name, dest)
    return dest


def install_real(dest: str, core: Core | None = None) -> Installed:
    """The real kvikio Python layer unpacked in dest (extract_python_layer), over stubbed _lib."""
    core = core or Core()
    saved = _drop_kvikio_modules()
    stubs = build_lib_stubs(core)
    stubs["libkvikio"] = {"load_library": lambda: None}
    finder = _Finder(stubs, {"kvikio._lib"})
    sys.meta_path.insert(0, finder)
    sys.path.insert(0, dest)
    importlib.invalidate_caches()
    inst = Installed(core, finder, real=True, path=dest, saved=saved)
    kv = inst.module()
    if not os.path.abspath(kv.__file__).startswith(os.path.abspath(dest)):
        inst.uninstall()
        raise RuntimeError(f"kvikio resolved to {kv.__file__}, not the unpacked wheel in {dest}")
    return inst
