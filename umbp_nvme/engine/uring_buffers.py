"""Fixed-buffer registration for UringEngine: the registered ranges and the per-op buffer lookup.

The ring's table of registered buffers (READ_FIXED/WRITE_FIXED) is the sorted, overlap-merged
union of every range registered so far, cut into pieces of at most 1 GiB (the kernel's per-buffer
limit). ``submit(auto_fixed=True)`` finds each op's buffer in C; ``index`` is the same lookup in
numpy, for the general path's up-front ``ring.check``.
"""

from __future__ import annotations

import logging

import numpy as np

from .base import ADDR_DTYPE, MAX_OP_BYTES

log = logging.getLogger(__name__.rpartition(".")[0] + ".uring")  # the engine's logger, as before


class FixedBuffers:
    """The registered ranges of one ring; ``on`` is whether any are registered now."""

    __slots__ = ("ranges", "starts", "ends", "on", "_warned")

    def __init__(self):
        self.ranges: list[tuple[int, int]] = []
        self.starts = None  # sorted registered pieces, for index()
        self.ends = None
        self.on = False
        self._warned = False

    def register(self, ring, ranges, max_buffers: int, before_change) -> bool:
        """Register ``ranges`` (added to earlier ones) on ``ring``; False, logged once, if refused.

        ``before_change()`` runs just before the ring's table is replaced (queued SQEs name buffer
        indexes of the current table, so the engine flushes them there).
        """
        new = [(int(a), int(n)) for a, n in ranges if int(n) > 0]
        pieces = split_ranges(self.ranges + new)
        if not pieces:
            return bool(self.ranges)
        if len(pieces) > max_buffers:
            return self._failed(f"{len(pieces)} ranges exceed the {max_buffers} fixed-buffer limit")
        before_change()
        try:
            ring.register_buffers(pieces)
        except (OSError, ValueError) as e:
            self._set([], [])
            return self._failed(str(e))
        self._set(self.ranges + new, pieces)
        return True

    def index(self, addrs: np.ndarray, lens: np.ndarray):
        """int16 registered-buffer index per op (-1 = plain op), or None with none registered."""
        starts = self.starts
        if starts is None:
            return None
        i = np.searchsorted(starts, addrs, side="right") - 1
        np.maximum(i, 0, out=i)
        inside = (addrs >= starts[i]) & (addrs + lens.view(ADDR_DTYPE) <= self.ends[i])
        return np.where(inside, i, -1).astype(np.int16)

    def _set(self, ranges, pieces) -> None:
        self.ranges = list(ranges)
        self.on = bool(pieces)
        if pieces:
            self.starts = np.array([a for a, _ in pieces], dtype=ADDR_DTYPE)
            self.ends = np.array([a + n for a, n in pieces], dtype=ADDR_DTYPE)
        else:
            self.starts = self.ends = None

    def _failed(self, why: str) -> bool:
        if not self._warned:
            self._warned = True
            log.warning(
                "io_uring: cannot register buffers (%s); using plain reads/writes into the same memory. "
                "Raise RLIMIT_MEMLOCK (ulimit -l) to enable fixed buffers.",
                why,
            )
        return False


def split_ranges(ranges) -> list[tuple[int, int]]:
    """Sorted, overlap-merged ranges cut into pieces of at most 1 GiB."""
    spans = sorted((a, a + n) for a, n in ranges if n > 0)
    merged: list[list[int]] = []
    for s, e in spans:
        if merged and s < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    out = []
    for s, e in merged:
        while s < e:
            k = min(MAX_OP_BYTES, e - s)
            out.append((s, k))
            s += k
    return out
