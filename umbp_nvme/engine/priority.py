"""Kernel I/O priorities for reads and writes: what this kernel accepts, chosen once per process.

A prefetch (read) is on the path of a request's first token; a backup (write) is not. The store
stamps reads with a higher ioprio than writes: per SQE on io_uring (``ring.read_ioprio`` /
``ring.write_ioprio``), per worker thread (``ioprio_set``) in the posix engine.

Which class the kernel allows is probed once: IOPRIO_CLASS_RT needs CAP_SYS_NICE/CAP_SYS_ADMIN,
best-effort levels 0-7 are open to anyone. The block scheduler decides what the value is worth:
``bfq`` honours classes and levels, ``mq-deadline`` classes only (RT before BE before IDLE),
``kyber`` and ``none`` ignore it; the engines' own queues (read rings apart from write rings,
bounded write slices: see ``arbiter.py``) do the work where the device does not.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import threading
from dataclasses import dataclass

from ..config import READ_PRIORITY_CHOICES

log = logging.getLogger(__name__)

IOPRIO_CLASS_SHIFT = 13
IOPRIO_CLASS_RT, IOPRIO_CLASS_BE, IOPRIO_CLASS_IDLE = 1, 2, 3
IOPRIO_WHO_PROCESS = 1  # with a thread id: that thread only
_CLASS_NAMES = {0: "none", IOPRIO_CLASS_RT: "rt", IOPRIO_CLASS_BE: "be", IOPRIO_CLASS_IDLE: "idle"}
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "arm64": 30}.get(platform.machine())
_SYS_IOPRIO_GET = {"x86_64": 252, "aarch64": 31, "arm64": 31}.get(platform.machine())



def ioprio_value(klass: int, level: int) -> int:
    """IOPRIO_PRIO_VALUE(class, level) as the kernel packs it into 16 bits."""
    if klass not in _CLASS_NAMES or not 0 <= level <= 7:
        raise ValueError(f"ioprio class must be 0-3 and level 0-7, got class {klass} level {level}")
    return (klass << IOPRIO_CLASS_SHIFT) | level


def describe(value: int) -> str:
    if not value:
        return "default"
    return f"{_CLASS_NAMES.get(value >> IOPRIO_CLASS_SHIFT, '?')}/{value & 7}"


@dataclass(frozen=True)
class IoPriorities:
    """What read and write ops carry (0 = the task's own priority, the kernel default)."""

    read: int = 0
    write: int = 0
    why: str = "off"

    def __str__(self) -> str:
        return f"reads {describe(self.read)}, writes {describe(self.write)} ({self.why})"


OFF = IoPriorities()

_lock = threading.Lock()
_chosen: IoPriorities | None = None


def _rt_allowed() -> bool:
    """Does the kernel accept an RT ioprio on an io_uring read from this process? (one 1-byte read)"""
    try:
        from .. import _uring as u
    except ImportError:
        return _ioprio_set_allowed(ioprio_value(IOPRIO_CLASS_RT, 7))
    import numpy as np

    try:
        ring = u.Ring(2)
    except OSError:
        return _ioprio_set_allowed(ioprio_value(IOPRIO_CLASS_RT, 7))
    fd = os.open("/dev/zero", os.O_RDONLY)
    buf = np.zeros(1, np.uint8)
    try:
        ring.read_ioprio = ioprio_value(IOPRIO_CLASS_RT, 7)
        ring.submit(u.OP_READ, fd, np.zeros(1, np.int64), np.array([buf.ctypes.data], np.uint64), np.ones(1, np.int64))
        ring.wait(1, 2.0)
        ud, res = np.zeros(1, np.uint64), np.zeros(1, np.int32)
        n = ring.reap(ud, res)
        return n == 1 and int(res[0]) >= 0
    except (OSError, ValueError):
        return False
    finally:
        ring.close()
        os.close(fd)


def _ioprio_set_allowed(value: int) -> bool:
    """Probe with ioprio_set on the calling thread, restoring its default afterwards."""
    if set_thread_ioprio(value) != 0:
        return False
    set_thread_ioprio(0)
    return True


def choose(read_priority: str = "on") -> IoPriorities:
    """The priorities for this process (probed once, logged once); ``"off"`` -> no ioprio at all."""
    global _chosen
    if read_priority not in READ_PRIORITY_CHOICES:
        raise ValueError(f"ssd_read_priority must be one of {READ_PRIORITY_CHOICES}, got {read_priority!r}")
    if read_priority == "off":
        return OFF
    with _lock:
        if _chosen is None:
            write = ioprio_value(IOPRIO_CLASS_BE, 7)
            if _rt_allowed():  # mq-deadline and bfq both dispatch RT before BE
                _chosen = IoPriorities(ioprio_value(IOPRIO_CLASS_RT, 7), write, "rt allowed")
            else:  # bfq still tells BE levels apart; mq-deadline does not
                _chosen = IoPriorities(ioprio_value(IOPRIO_CLASS_BE, 0), write, "rt refused (no CAP_SYS_NICE)")
            log.info("I/O priorities: %s; block schedulers: %s", _chosen, schedulers_summary())
        return _chosen


_libc_handle = None


def _libc():
    global _libc_handle
    if _libc_handle is None:
        _libc_handle = ctypes.CDLL(None, use_errno=True)
    return _libc_handle


def set_thread_ioprio(value: int, tid: int | None = None) -> int:
    """ioprio_set(IOPRIO_WHO_PROCESS, tid) for one thread (default: the caller). 0 or errno."""
    if _SYS_IOPRIO_SET is None:
        return errno.ENOSYS
    libc = _libc()
    who = threading.get_native_id() if tid is None else int(tid)
    if libc.syscall(_SYS_IOPRIO_SET, IOPRIO_WHO_PROCESS, who, int(value)) != 0:
        return ctypes.get_errno() or errno.EPERM
    return 0


def get_thread_ioprio(tid: int | None = None) -> int:
    """ioprio_get(IOPRIO_WHO_PROCESS, tid): the thread's ioprio value, or -errno."""
    if _SYS_IOPRIO_GET is None:
        return -errno.ENOSYS
    who = threading.get_native_id() if tid is None else int(tid)
    r = _libc().syscall(_SYS_IOPRIO_GET, IOPRIO_WHO_PROCESS, who)
    return int(r) if r >= 0 else -(ctypes.get_errno() or errno.EINVAL)


def schedulers() -> dict[str, str]:
    """{block device: active scheduler} for the non-virtual disks (loop/ram devices left out)."""
    out = {}
    try:
        names = sorted(os.listdir("/sys/block"))
    except OSError:
        return out
    for name in names:
        if name.startswith(("loop", "ram", "zram")):
            continue
        try:
            with open(f"/sys/block/{name}/queue/scheduler") as f:
                text = f.read()
        except OSError:
            continue
        active = text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()
        out[name] = active
    return out


_HONOURS = {"bfq": "classes and levels", "mq-deadline": "classes only", "kyber": "ignored", "none": "ignored"}


def schedulers_summary() -> str:
    s = schedulers()
    if not s:
        return "unknown"
    return ", ".join(f"{dev}={sch} (ioprio {_HONOURS.get(sch, '?')})" for dev, sch in s.items())
