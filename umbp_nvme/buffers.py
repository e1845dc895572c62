"""Caller memory as raw (address, nbytes), and page-aligned buffers for O_DIRECT.

Engines take raw addresses; this module is the one place that turns Python buffer objects
(numpy, torch CPU tensors, memoryview, mmap, bytearray, ctypes) into them. The caller keeps
the object alive while the address is in use.
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

# O_DIRECT's alignment of offsets, lengths and memory: 4 KiB is the most any device we know asks
# (statx's STATX_DIOALIGN reports 512 or 4096). The one name for that fact: segment sizes, slot
# offsets, staging rounding, the fallback when statx cannot tell, and the warm-up's blob layout.
DIO_ALIGN_BYTES = 4096
# The CPU page, mmap's granularity: a different fact that happens to share the value (a
# page-aligned buffer is DIO-aligned because PAGE_BYTES % DIO_ALIGN_BYTES == 0).
PAGE_BYTES = 4096
HUGE_PAGE_BYTES = 2 << 20


def address_of(buf, *, writable: bool = True) -> tuple[int, int]:
    """(address, nbytes) of a contiguous buffer. Raises TypeError with the reason otherwise."""
    if isinstance(buf, tuple) and len(buf) == 2 and all(isinstance(x, int) for x in buf):
        return int(buf[0]), int(buf[1])
    if hasattr(buf, "data_ptr") and hasattr(buf, "element_size"):  # torch.Tensor without importing torch
        if getattr(buf, "is_cuda", False):
            raise TypeError("CUDA tensor given where host memory is required")
        if not buf.is_contiguous():
            raise TypeError(f"tensor is not contiguous (shape {tuple(buf.shape)}, stride {buf.stride()})")
        return int(buf.data_ptr()), int(buf.numel() * buf.element_size())
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise TypeError(f"array is not C-contiguous (shape {buf.shape}, strides {buf.strides})")
        if writable and not buf.flags.writeable:
            raise TypeError("array is read-only; a writable buffer is required")
        return int(buf.ctypes.data), int(buf.nbytes)
    try:
        mv = memoryview(buf)
    except TypeError:
        raise TypeError(f"{type(buf).__name__} does not support the buffer protocol") from None
    if not mv.contiguous:
        raise TypeError("buffer is not contiguous")
    if writable and mv.readonly:
        raise TypeError(f"{type(buf).__name__} is read-only; a writable buffer is required")
    nbytes = mv.nbytes
    if nbytes == 0:
        return 0, 0
    if mv.readonly:
        # ctypes cannot take a read-only buffer; numpy can expose its address without copying.
        arr = np.frombuffer(mv, dtype=np.uint8)
        return int(arr.ctypes.data), nbytes
    c = (ctypes.c_char * nbytes).from_buffer(mv.cast("B"))
    return ctypes.addressof(c), nbytes


class AlignedBuffer:
    """Anonymous mmap memory: page aligned (4 KiB pages or 2 MiB hugetlb pages).

    ``.array`` is a uint8 numpy view; ``.address``/``.nbytes`` feed the engines.
    """

    def __init__(self, nbytes: int, *, huge: bool = False):
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        self.huge = huge
        unit = HUGE_PAGE_BYTES if huge else PAGE_BYTES
        self.nbytes = nbytes
        self._map_bytes = -(-nbytes // unit) * unit
        # MAP_POPULATE: fault every page in at once, off the data path, and in one sweep, which
        # hands out physically adjacent pages far more often than first touch by a memset does
        # (measured here: ~128 vs 256 contiguous runs per MiB); fewer runs, fewer device segments.
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0x8000)
        if huge:
            flags |= getattr(mmap, "MAP_HUGETLB", 0x40000)
        try:
            self._mmap = mmap.mmap(-1, self._map_bytes, flags=flags)
        except OSError as e:
            if huge:
                raise OSError(
                    e.errno,
                    f"cannot map {self._map_bytes} bytes of 2 MiB hugetlb pages ({e.strerror}); "
                    "reserve them with: echo N > /proc/sys/vm/nr_hugepages",
                ) from None
            raise
        self.array = np.frombuffer(self._mmap, dtype=np.uint8, count=nbytes)
        self.address = int(self.array.ctypes.data)

    def close(self) -> None:
        self.array = None
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with it

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def reserve_hugepages(nbytes: int) -> bool:
    """Make at least nbytes of 2 MiB hugetlb pages free (root only). True when they are."""
    need = -(-nbytes // HUGE_PAGE_BYTES)
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: line.split(":")[1].split()[0] for line in f}
        free = int(info.get("HugePages_Free", 0))
        total = int(info.get("HugePages_Total", 0))
        if free >= need:
            return True
        with open("/proc/sys/vm/nr_hugepages", "w") as f:
            f.write(str(total + need - free))
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: line.split(":")[1].split()[0] for line in f}
        return int(info.get("HugePages_Free", 0)) >= need
    except (OSError, ValueError):
        return False
