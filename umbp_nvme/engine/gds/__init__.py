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

Modules: ``cuda`` (buffer addresses, torch device ops, host CRC32C), ``availability``,
``kvikio_settings``, ``kvikio_io`` (kvikio errors -> errno, path accounting), ``engine``
(KvikioEngine), ``gate`` (probe, open, GdsGate), ``staging``. Everything is imported from the package
as before; the names tests and callers replace on it (``_device_ops``, ``gds_available``,
``_import_kvikio``, ``_check_libcuda``, ``_check_torch_cuda``, ``_check_kvikio``, ``open_gds_engine``,
``StagingBuffer``, ``host_crc32c``) are looked up through the package at call time (``_common.pkg``), so
``monkeypatch.setattr(gds, name, ...)`` reaches every module.
"""

from __future__ import annotations

# The package's names: the public API, the helpers tests check directly, and the names tests replace
# (the underscore ones below; tests/test_code_shape.py allows exactly these across modules).
from ._common import (
    DEFAULT_QUEUE_DEPTH,
    GDS_UNAVAILABLE,
    MAX_BATCH_WORKERS,
    MAX_SHORT_RETRIES,
    PROBE_BYTES,
    READ,
    STAGING_ALIGN_BYTES,
    WRITE,
    log,
)
from .availability import (
    _check_kvikio,
    _check_libcuda,
    _check_torch_cuda,
    _import_kvikio,
    gds_available,
    gds_unavailable_error,
    reset_availability_cache,
)
from .cuda import CudaPointer, DeviceSpan, _device_ops, cuda_buffer_address, host_crc32c, py_crc32c
from .engine import KvikioEngine
from .gate import GdsGate, open_gds_engine, probe_gds
from .kvikio_io import (
    KVIKIO_EOF_TEXT,
    PATH_CUFILE,
    PATH_MIXED,
    PATH_POSIX,
    PATH_UNVERIFIED,
    errno_of,
    is_kvikio_eof,
    path_of,
)
from .kvikio_settings import (
    configure_kvikio,
    describe_kvikio,
    kvikio_compat_preferred,
    kvikio_gds_driver_available,
    kvikio_get,
    kvikio_set,
    kvikio_settings,
)
from .staging import StagingBuffer, device_crc32c_many, round_up, staged_read, staged_write
