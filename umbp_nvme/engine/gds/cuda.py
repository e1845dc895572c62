"""CUDA buffers -> device addresses, device memory helpers (torch), and CRC32C of host memory."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from ._common import log, pkg

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


class DeviceSpan:
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
# Device memory helpers (torch). One object so tests can swap in host-memory fakes.


class _TorchDeviceOps:
    """Allocation, copies and pinning through torch; every copy group ends with one sync."""

    @staticmethod
    def _torch():
        import torch

        return torch

    def _dev_view(self, addr: int, nbytes: int):
        return self._torch().as_tensor(DeviceSpan(addr, nbytes), device="cuda")

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
        g = pkg()
        reason = g._check_libcuda() or g._check_torch_cuda()
        return (reason is None, reason or "ok")


_device_ops = _TorchDeviceOps()

# --------------------------------------------------------------------------------------------
# CRC32C of host memory (the native extension; a slow Python fallback only for tests)

_crc_fn = None
_CRC_TABLE = None


def py_crc32c(addr: int, nbytes: int, seed: int = 0) -> int:
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
            _crc_fn = py_crc32c
    return _crc_fn(addr, nbytes, seed) if nbytes else seed

