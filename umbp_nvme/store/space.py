"""Room for a put: watermarks, eviction, reclaiming a whole segment, and running below the
configured capacity while the file system refuses new segment files (ENOSPC).

A mixin of PageStore: it works on the store's allocator, segment files and rows.

Reads: writer.high_bytes, writer.low_bytes, writer.rows, writer.put_doubt, writer.drop_doubt,
state.config. Changes: writer.alloc (slots), state.files (new segment files),
writer.space_limit_segments, writer.space_retry_at, writer.slot_cap; evicts through deletes.py.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections import Counter

import numpy as np

from ..engine.base import errno_name
from ..sizes import format_bytes
from . import eviction
from .segments import size_classes

log = logging.getLogger("umbp_nvme.store")

GROW_RETRY_S = 30.0  # after a segment file could not be created, try to grow again this often
RECLAIM_ROUNDS_MAX = 16  # segments reclaimed for one batch whose size class has no room


class SpaceSteps:
    def _effective_capacity(self) -> int:
        """Bytes the store runs with: the configured capacity, or, while the file system refuses
        new segment files below it, the segments it has (see _reserve)."""
        lim = self.writer.space_limit_segments
        full = self.writer.alloc.capacity_bytes
        return full if lim is None else min(full, lim * self.segment_bytes)

    async def _make_room(self, need_bytes: int) -> None:
        used = self.writer.alloc.used_bytes
        high, low = self.writer.high_bytes, self.writer.low_bytes
        if self.writer.space_limit_segments is not None:  # watermarks over the space the disk gave us
            eff = self._effective_capacity()
            high = min(high, int(eff * self.config.ssd_high_watermark))
            low = min(low, int(eff * self.config.ssd_low_watermark))
        # never above what the slots can hold: each segment's tail keeps its records (1/16 of a
        # 4 KiB block per slot: 6 % of a segment of 4 KiB objects), so a high watermark near 1 over
        # the raw capacity would never be reached and the allocator would run out first
        slots = self._slot_capacity()
        if high > slots:
            high, low = slots, max(0, min(low, slots - (high - low)))
        if used + need_bytes <= high:
            return
        victims = eviction.victims(eviction.POLICIES[self.config.eviction_policy], self.writer.rows, used + need_bytes - low)
        if victims:
            await self._drop_rows(victims, evicted=True)

    def _slot_capacity(self) -> int:
        """Bytes the segments' slots hold: a segment of a size class holds its slots, a free
        one counts whole. Recounted when a segment is taken or given back."""
        a = self.writer.alloc
        key = a.free_segments()
        cached = self.writer.slot_cap
        if cached is None or cached[0] != key:
            total = 0
            for cls, n in Counter(a.seg_class).items():
                total += n * (a.slots(cls) * cls if cls else a.segment_bytes)
            cached = self.writer.slot_cap = (key, total)
        return cached[1]

    def _try_grow(self) -> None:
        """Running below capacity after ENOSPC: create the next segment file if the file system
        has room again (once per GROW_RETRY_S; a create costs what any grow costs)."""
        files = self.state.files.files
        nxt = next((i for i in range(self.writer.alloc.n_segments) if i not in files), None)
        if nxt is None:
            self.writer.space_limit_segments = None
            return
        self._note_space(not self.state.files.ensure(nxt), True)

    def _note_space(self, failed_create: bool, tried: bool) -> None:
        """Adopt (or lift) the effective capacity after a batch's segment creation."""
        have = len(self.state.files.files)
        lim = self.writer.space_limit_segments
        if failed_create:
            self.writer.space_retry_at = time.monotonic() + GROW_RETRY_S
            if lim is None:
                self.writer.space_limit_segments = have
                # the one line of this episode: the puts it refuses log at DEBUG (put_path.py)
                log.warning("%s", self.space_shortage())
        elif lim is not None and tried and have > lim:
            self.writer.space_limit_segments = None
            log.warning("%s: the file system has room again; growing towards %d MiB", self.path, self.writer.alloc.capacity_bytes >> 20)

    def space_shortage(self) -> str | None:
        """While the file system refuses segment files below the capacity: what happened, its cause
        (the free space against one segment) and what to do; None while the store has room."""
        lim = None if self.writer is None else self.writer.space_limit_segments
        if lim is None:
            return None
        try:
            vfs = os.statvfs(self.path)
            free = f"{format_bytes(vfs.f_bavail * vfs.f_frsize)} free"
        except OSError as e:
            free = f"free space unknown: {e.strerror}"
        seg, cap = self.segment_bytes, self.writer.alloc.capacity_bytes
        why = (f"the file system has no room for segment {lim} of {format_bytes(seg)} "
               f"({errno_name(-(self.state.files.failed_errno or errno.EIO))}; {free})")
        if lim == 0:
            return (f"{self.path}: {why}: this store can hold nothing, so every put answers False until it has "
                    f"room (tried again every {GROW_RETRY_S:.0f} s; those puts are counted in put_failed, not logged "
                    "one by one). Free space on the drive, or make the store anew (a new directory) with a smaller "
                    "ssd_segment_size_bytes")
        return (f"{self.path}: {why}: running with the {lim} segments it has ({format_bytes(lim * seg)} of the "
                f"configured {format_bytes(cap)}), evicting within them; trying to grow again every "
                f"{GROW_RETRY_S:.0f} s. Free space on the drive, or lower ssd_capacity_bytes to what it holds")

    async def _reclaim_segment(self) -> bool:
        """Empty the least recently used segment whose slots are all published and unpinned."""
        rows = eviction.reclaim_segment(self.writer.rows, self.writer.alloc.n_segments, self.writer.alloc.seg_used)
        if not rows:
            return False
        return await self._drop_rows(rows, evicted=True)

    async def _reserve(self, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
        """(segment, offset) per object (-1 where there is no room), and whether a segment file
        could not be created. Evicts first when the batch would cross the high watermark."""
        m0 = len(lens)
        classes = size_classes(lens)
        if self.writer.space_limit_segments is not None and time.monotonic() >= self.writer.space_retry_at:
            self._try_grow()
        await self._make_room(int(classes.sum()))
        failed_create = False
        files = self.state.files
        # Once a segment file could not be created (a full file system below the configured
        # capacity), the store runs within the segments it has: no create per batch, eviction
        # over that space; every GROW_RETRY_S it tries to grow again.
        may_grow = self.writer.space_limit_segments is None or time.monotonic() >= self.writer.space_retry_at

        def ensure(seg: int) -> bool:
            nonlocal failed_create
            if seg in files.files:
                return True
            if failed_create or not may_grow:
                return False
            ok = files.ensure(seg)
            failed_create = not ok
            return ok

        alloc = self.writer.alloc
        uc = classes[:1] if m0 and (classes == classes[0]).all() else np.unique(classes)  # one size: the common batch
        if len(uc) == 1:
            segs, offs = alloc.alloc_array(int(uc[0]), m0, ensure)
        else:
            segs = np.full(m0, -1, np.int64)
            offs = np.full(m0, -1, np.int64)
            for c in uc.tolist():
                js = np.flatnonzero(classes == c)
                segs[js], offs[js] = alloc.alloc_array(c, len(js), ensure)
        self._note_space(failed_create, may_grow)
        rounds, settled = 0, False
        while (segs < 0).any() and rounds < RECLAIM_ROUNDS_MAX:
            # every segment is taken and this size class has no free slot: empty a whole segment
            rounds += 1
            if not await self._reclaim_segment():
                if settled or not (self.writer.put_doubt or self.writer.drop_doubt):
                    break
                settled = True  # slots of drops and puts in doubt are not rows: settle them (deletes.py)
                await self._settle_doubts(closing=False)
            for j in np.flatnonzero(segs < 0).tolist():
                slot = alloc.alloc(int(classes[j]), ensure)
                if slot is not None:
                    segs[j], offs[j] = slot
        nxt = alloc.next_free_segment()
        if nxt is not None and self.writer.space_limit_segments is None and self.state.files.want_precreate(nxt):
            asyncio.get_running_loop().run_in_executor(None, self.state.files.precreate, nxt)
        return segs, offs, failed_create
