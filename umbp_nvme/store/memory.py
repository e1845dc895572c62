"""Caller memory: which buffers a call may read or write, and where they are.

A buffer is a buffer-protocol object (host memory), a CUDA tensor (device memory, for the GDS
engine or staging), or an ``(address, nbytes)`` pair inside a range the caller registered with
``PageStore.register_memory``. ``Ranges`` keeps the registered ranges and resolves buffers
against them: one at a time (``resolve``, with the reason when refused) or a whole batch of pairs
in a few numpy ops (``resolve_pairs``, the SGLang backend's hot path).

State: its own (registered ranges); a store's is state.memory.
"""

from __future__ import annotations

import bisect

import numpy as np

from ..buffers import address_of

try:
    from .._uring import pairs_into as _pairs_into
except ImportError:  # an extension built before it: numpy does the same, slower
    _pairs_into = None
try:
    from .._uring import pairs_dst as _pairs_dst, pairs_src as _pairs_src
except ImportError:
    _pairs_dst = _pairs_src = None

ADDR_END = 1 << 63  # addresses and lengths live in [1, 2**63): int64/uint64 arithmetic cannot wrap
FAST_ADDR_MIN = 4096  # the batch fast path leaves smaller values (bools, 0/1) to the checked path


def int_arg(x) -> int | None:
    """x as a Python int when it is an int or a numpy integer (never a bool); else None."""
    if type(x) is int:
        return x
    if isinstance(x, np.integer):
        return int(x)
    return None


class Ranges:
    """Registered (start, end) address ranges, sorted by start (they may overlap)."""

    def __init__(self):
        self.ranges: list[tuple[int, int]] = []
        self._starts: list[int] = []
        self._start_arr = np.zeros(0, np.int64)  # the same ranges as arrays, for resolve_pairs
        self._end_arr = np.zeros(0, np.int64)

    def add(self, address, nbytes) -> list[tuple[int, int]]:
        """Add a range (checked); returns every range as (address, nbytes) for the engines."""
        a, n = int_arg(address), int_arg(nbytes)
        if a is None or n is None:
            raise TypeError(
                f"register_memory needs int address and nbytes; got {type(address).__name__}, {type(nbytes).__name__}"
            )
        if not (0 < a < ADDR_END and 0 < n < ADDR_END and a + n < ADDR_END):
            raise ValueError(f"register_memory needs 0 < address, 0 < nbytes, address + nbytes < 2**63; got {a:#x}, {n}")
        i = bisect.bisect_left(self._starts, a)
        self.ranges.insert(i, (a, a + n))
        self._starts.insert(i, a)
        self._start_arr = np.asarray([s for s, _ in self.ranges], np.int64)
        self._end_arr = np.asarray([e for _, e in self.ranges], np.int64)
        return [(s, e - s) for s, e in self.ranges]

    def contains(self, addr: int, nbytes: int) -> bool:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0:
            a, b = self.ranges[i]
            if a <= addr and addr + nbytes <= b:
                return True
        while i >= 0:
            a, b = self.ranges[i]
            if a <= addr and addr + nbytes <= b:
                return True
            if b <= addr and i > 0 and self.ranges[i - 1][1] <= addr:
                break
            i -= 1
        return False

    def resolve(self, buf, *, writable: bool) -> tuple[int, int, bool] | str:
        """(address, nbytes, is_device) or the reason the buffer is refused."""
        if isinstance(buf, tuple):
            # (address, nbytes): checked in Python ints, so no sum can wrap (bools are refused)
            if len(buf) != 2:
                return "a tuple buffer must be (address, nbytes) of ints"
            addr, n = int_arg(buf[0]), int_arg(buf[1])
            if addr is None or n is None:
                return "a tuple buffer must be (address, nbytes) of ints"
            if not (0 < addr < ADDR_END and 0 < n < ADDR_END):
                return f"address {addr:#x} and nbytes {n} must both be in [1, 2**63)"
            if not self.contains(addr, n):
                return f"address range {addr:#x}+{n} is not inside a registered range (register_memory)"
            return addr, n, False
        try:
            a, n = address_of(buf, writable=writable)
            return a, n, False
        except TypeError as e:
            host_error = str(e)
        # not host memory: a CUDA buffer goes to the GDS engine (or staging), if this machine has one
        try:
            from ..engine.gds import cuda_buffer_address

            dev = cuda_buffer_address(buf, writable=writable)
        except TypeError as e:
            return str(e)
        except ImportError:
            dev = None
        if dev is None:
            return host_error
        return dev[0], dev[1], True

    def resolve_reads(self, buffers, idx, lens, segs, direct, align) -> np.ndarray | None:
        """A get's destinations (uint64) in one C pass (pairs_dst), where every read's buffer
        ``buffers[idx[j]]`` is an (address, nbytes) pair inside one registered range, holds its
        ``lens[j]`` bytes and is aligned as its O_DIRECT file needs (``direct``, ``align`` per
        segment): nothing to bounce. None otherwise: the checked path explains each buffer."""
        if _pairs_dst is None or not self.ranges:
            return None
        out = np.empty(len(idx), np.uint64)
        ok = _pairs_dst(buffers, idx, lens, segs, self._start_arr, self._end_arr, direct, align, FAST_ADDR_MIN, out)
        return out if ok else None

    def resolve_sources(self, buffers, max_bytes: int, align: int):
        """A put's sources in one C pass (pairs_src): (addrs uint64[], lens int64[], whether every
        address and length is a multiple of ``align``) when every buffer is an (address, nbytes)
        pair of 2..``max_bytes`` inside one registered range; None otherwise (the checked path)."""
        if _pairs_src is None or not self.ranges or not buffers:
            return None
        n = len(buffers)
        addrs, lens = np.empty(n, np.uint64), np.empty(n, np.int64)
        code = _pairs_src(buffers, self._start_arr, self._end_arr, FAST_ADDR_MIN, max_bytes, align, addrs, lens)
        return (addrs, lens, code == 2) if code else None

    def resolve_pairs(self, buffers):
        """(addrs uint64[], nbytes int64[]) when every buffer is an (address, nbytes) pair of ints wholly
        inside one registered range (the SGLang backend's hot path), in a few numpy ops; else None."""
        if not self.ranges or not buffers:
            return None
        n = len(buffers)
        addr, nb = np.empty(n, np.int64), np.empty(n, np.int64)
        # one C pass over tuples of Python ints (np.array over them costs ~1 us per buffer)
        if _pairs_into is None or not _pairs_into(buffers, addr, nb):
            if not all([type(b) is tuple for b in buffers]):
                return None
            try:
                a = np.array(buffers)
            except (ValueError, TypeError, OverflowError):
                return None
            if a.dtype != np.int64 or a.shape != (n, 2):
                return None
            addr, nb = a[:, 0], a[:, 1]
        if int(addr.min()) < FAST_ADDR_MIN or int(nb.min()) <= 1:
            return None  # 0, negatives and bools (True == 1) get the checked path
        i = np.searchsorted(self._start_arr, addr, side="right") - 1
        # nb <= end - addr, never addr + nb: that sum wraps in int64 for nb near 2**63
        if int(i.min()) < 0 or (nb > self._end_arr[i] - addr).any():
            return None  # maybe inside an overlapping earlier range: the general path walks them
        return addr.astype(np.uint64), np.ascontiguousarray(nb)
