"""Opening data files for the engines: O_DIRECT when the file system takes it, buffered otherwise.

``open_data_file`` is the one place that decides how a data file is opened:

* O_DIRECT is tried first (unless ``direct=False``). A file system that refuses it (EINVAL at
  open, e.g. tmpfs before Linux 6.6, some FUSE and overlay mounts) gets a buffered file instead,
  logged once per file system; the refusal is remembered per device so later opens skip the probe.
* The DIO alignment comes from ``statx(STATX_DIOALIGN)`` (Linux 6.1+), read through libc with
  ctypes because Python has no statx; without it, 4096 (the page size, safe for every device).
* Files are created 0600, never through a symlink (O_NOFOLLOW: a store directory must not be
  redirectable), with O_CLOEXEC so forked workers do not inherit them; an open file must be a
  regular file owned by this user (fstat), or it is refused: another user's file is not ours to
  serve or overwrite.
* What an engine must know of a file to submit to it without asking the kernel travels with the
  file: ``DataFile.facts`` (a ``FileFacts``: O_DIRECT alignment, or a page-cache file). An engine is
  handed the ``DataFile`` itself or a ``Files`` (a batch's fds and the strictest facts among them),
  checks each batch against the facts before any SQE is written and sends large page-cache copies
  to io-wq. There is no table keyed by fd: a closed file's number, reused by the next open, can
  never lend it the old file's facts. A bare fd carries no facts: the engine treats it as a
  page-cache file and the kernel refuses a misaligned op on it alone (EINVAL).
* ``size`` preallocates with ``posix_fallocate`` so later writes do not allocate blocks on the
  hot path and ENOSPC shows up at open time, not mid-batch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import stat
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from ..buffers import DIO_ALIGN_BYTES

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

DEFAULT_DIO_ALIGN_BYTES = DIO_ALIGN_BYTES  # when statx cannot tell

_AT_EMPTY_PATH = 0x1000
_STATX_DIOALIGN = 0x2000
# struct statx: stx_mask at 0, stx_dio_mem_align at 152, stx_dio_offset_align at 156 (256 bytes).
_STATX_SIZE = 256
_STATX_DIO_MEM_OFF = 152
_STATX_DIO_OFFSET_OFF = 156

_lock = threading.Lock()
_no_direct_devices: set[int] = set()  # st_dev values whose file system refused O_DIRECT


def direct_refusals() -> frozenset[int]:
    """st_dev of the file systems that refused O_DIRECT in this process (their opens go buffered)."""
    return frozenset(_no_direct_devices)


def forget_direct_refusals() -> None:
    """Forget which file systems refused O_DIRECT: the next open on each asks again (a test that
    fakes a refusal calls it before and after, so the refusal outlives neither)."""
    _no_direct_devices.clear()
_libc = None
_statx = None


def _statx_fn():
    global _libc, _statx
    if _statx is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fn = _libc.statx
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            _statx = fn
        except (OSError, AttributeError):
            _statx = False  # glibc < 2.28: no wrapper; keep the default alignment
    return _statx


def dio_alignment(fd: int) -> tuple[int, int]:
    """(memory alignment, file offset alignment) for O_DIRECT on fd; (0, 0) when unknown."""
    fn = _statx_fn()
    if not fn:
        return 0, 0
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if fn(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, buf) != 0:
        return 0, 0
    mask = int.from_bytes(buf.raw[0:4], "little")
    if not mask & _STATX_DIOALIGN:
        return 0, 0
    mem = int.from_bytes(buf.raw[_STATX_DIO_MEM_OFF : _STATX_DIO_MEM_OFF + 4], "little")
    off = int.from_bytes(buf.raw[_STATX_DIO_OFFSET_OFF : _STATX_DIO_OFFSET_OFF + 4], "little")
    return mem, off


@dataclass(frozen=True, slots=True)
class FileFacts:
    """What an engine needs to know of a file (or of the files of one batch) to submit to it.

    ``mem_align``: an op's memory address must be a multiple of it; ``off_align``: its file offset
    and length (both 1 for a page-cache file). ``buffered``: a page-cache file (among them), whose
    large copies the io_uring engine hands to io-wq instead of running them inline."""

    mem_align: int = 1
    off_align: int = 1
    buffered: bool = True

    def merge(self, other: "FileFacts") -> "FileFacts":
        """The facts of a batch over both: the strictest alignment; buffered if either is."""
        if other == self:
            return self
        return FileFacts(
            max(self.mem_align, other.mem_align), max(self.off_align, other.off_align), self.buffered or other.buffered
        )


PAGE_CACHE = FileFacts()  # a page-cache file, and what a bare fd is taken for: nothing known of it
NO_FILES = FileFacts(1, 1, False)  # merge's identity: a batch without files


class Files(NamedTuple):
    """A batch's files as engines take them: ``fds`` (an int for every op, or int32 per op) and
    ``facts``, true of every one of them (``FileFacts.merge`` of each file's)."""

    fds: int | np.ndarray
    facts: FileFacts


def split_files(files) -> tuple:
    """(fds, FileFacts) of what an engine was handed: ``Files``, a ``DataFile`` (refused once
    closed: its number may already name another file) or bare fds (``PAGE_CACHE``)."""
    t = type(files)
    if t is Files:
        return files
    if t is DataFile:
        if files.closed:
            raise ValueError(f"data file {files.path} is closed")
        return files.fd, files.facts
    return files, PAGE_CACHE


@dataclass
class DataFile:
    fd: int
    path: str
    direct: bool  # opened with O_DIRECT: memory, offsets and lengths must be aligned to ``align``
    align: int  # bytes; the larger of the DIO memory and offset alignments (4096 when unknown)
    readonly: bool = False
    facts: FileFacts = PAGE_CACHE  # what engines check ops on this file against
    _closed: bool = field(default=False, repr=False)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self.fd)

    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        return self.fd

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_regular(path: str, flags: int, mode: int = 0o600) -> int:
    """``os.open`` of a file we expect to be regular, that never blocks on a FIFO planted in its place.

    O_NONBLOCK covers the open itself (a read-only open of a FIFO waits for a writer forever), fstat
    then proves a regular file (else OSError EINVAL naming the path, the fd closed) and the flag is
    cleared again (io_uring answers EAGAIN for an O_NONBLOCK file instead of waiting for the disk)."""
    fd = os.open(path, flags | os.O_NONBLOCK, mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        if not flags & os.O_NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return True  # gone meanwhile: the plain open below reports it


def _parent_dev(path: str) -> int | None:
    try:
        return os.stat(os.path.dirname(os.path.abspath(path)) or ".").st_dev
    except OSError:
        return None


def open_data_file(
    path: str | os.PathLike,
    *,
    create: bool = False,
    size: int | None = None,
    direct: bool = True,
    readonly: bool = False,
    check_owner: bool = True,
) -> DataFile:
    """Open (or create) a data file for engine I/O. Raises OSError with the path on failure."""
    path = os.fspath(path)
    if size is not None and size < 0:
        raise ValueError(f"size must be >= 0 bytes, got {size}")
    if readonly and (create or size):
        raise ValueError(f"{path}: readonly open cannot create or preallocate")
    # O_NONBLOCK until fstat proved a regular file: a FIFO planted as a segment never blocks the open
    flags = (os.O_RDONLY if readonly else os.O_RDWR) | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    if create:
        flags |= os.O_CREAT
    dev = _parent_dev(path)
    want_direct = direct and dev not in _no_direct_devices
    fd = -1
    is_direct = False
    try:
        if want_direct:
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o600)
                is_direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                if not _is_regular(path):  # a FIFO refuses O_DIRECT too: not the file system's verdict
                    raise OSError(errno.EINVAL, f"{path} is not a regular file") from None
                with _lock:
                    first = dev not in _no_direct_devices
                    if dev is not None:
                        _no_direct_devices.add(dev)
                if first:
                    log.warning(
                        "O_DIRECT refused on the file system of %s (%s); using buffered I/O there",
                        path,
                        os.strerror(e.errno),
                    )
        if fd < 0:
            fd = os.open(path, flags, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(e.errno, f"{path} is a symlink; data files are never opened through symlinks") from None
        raise OSError(e.errno, f"cannot open data file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        os.set_blocking(fd, True)  # io_uring answers EAGAIN for an O_NONBLOCK file instead of waiting
        if check_owner and st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"{path} is owned by uid {st.st_uid}, not by this process (uid {os.geteuid()})")
        if size is not None and st.st_size < size:
            preallocate(fd, path, size)
        mem, off = dio_alignment(fd) if is_direct else (0, 0)
        align = max(mem, off) or DEFAULT_DIO_ALIGN_BYTES
        facts = FileFacts(mem or DEFAULT_DIO_ALIGN_BYTES, off or DEFAULT_DIO_ALIGN_BYTES, False) if is_direct else PAGE_CACHE
        return DataFile(fd=fd, path=path, direct=is_direct, align=align, readonly=readonly, facts=facts)
    except BaseException:
        os.close(fd)
        raise


def preallocate(fd: int, path: str, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        # EINVAL: glibc emulates a missing fallocate with 1-byte writes, which O_DIRECT refuses.
        if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            os.ftruncate(fd, size)  # sparse: blocks are allocated at write time instead
        else:
            raise OSError(e.errno, f"cannot preallocate {size} bytes for {path}: {e.strerror}") from None


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE, _FALLOC_FL_ZERO_RANGE = 0x01, 0x02, 0x10


def _fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if libc.fallocate(fd, mode, offset, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Give the range's blocks back to the file system; it reads as zeros, the size stays."""
    _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length)


def zero_range(fd: int, offset: int, length: int) -> None:
    """Make the range read as zeros without writing them where the file system can (it keeps the
    blocks allocated); else punch a hole, else write zeros. Not synced."""
    for mode in (_FALLOC_FL_ZERO_RANGE | _FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE):
        try:
            return _fallocate(fd, mode, offset, length)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
    zeros = bytes(min(length, 1 << 20))
    pos = 0
    while pos < length:
        pos += os.pwrite(fd, zeros[: min(len(zeros), length - pos)], offset + pos)
