"""Whether this machine can run the GDS engine: libcuda, torch CUDA, kvikio (cached)."""

from __future__ import annotations

import ctypes
import errno
import threading

from ..base import EngineUnavailable
from ._common import GDS_UNAVAILABLE, log
from ._common import pkg as _pkg
from .kvikio_settings import describe_kvikio

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
        _pkg()._import_kvikio()
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
            g = _pkg()
            reason = g._check_libcuda() or g._check_torch_cuda() or g._check_kvikio()
            if reason:
                _avail = (False, reason)
            else:
                kv = g._import_kvikio()
                _avail = (True, f"kvikio {getattr(kv, '__version__', '?')}, {describe_kvikio(kv)}")
        return _avail


def reset_availability_cache() -> None:
    """For tests."""
    global _avail
    with _avail_lock:
        _avail = None


def gds_unavailable_error(reason: str) -> EngineUnavailable:
    err = EngineUnavailable(errno.ENODEV, GDS_UNAVAILABLE.format(reason=reason))
    err.reason = reason
    return err

