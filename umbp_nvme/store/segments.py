"""Segment files and the size-class slot allocator.

On disk: ``seg-00000.dat`` ... each exactly ``segment_bytes`` long, preallocated, created lazily
and never more than ``capacity // segment_bytes`` of them, so the bytes on disk stay under the
configured capacity whatever is stored.

A segment that holds data belongs to one size class (object bytes rounded up to 4 KiB) and is
carved into equal slots; per class, the segments with free slots keep a stack of free offsets.
A segment whose slots are all free goes back to the free-segment pool and can serve any class
next time. Objects of one pool have one size, so in practice each pool owns a few segments and
there is no fragmentation inside a class. The allocator does no I/O; ``SegmentFiles`` opens
and creates the files.

State: its own (files and allocator); a store's are state.files and writer.alloc.
"""

from __future__ import annotations

import errno
import heapq
import logging
import os
import threading

import numpy as np

from ..engine.files import NO_FILES, DataFile, Files, preallocate, open_data_file
from .layout import SLOT_ALIGN_BYTES, record_slots, segment_files, segment_name  # noqa: F401 - re-exported

log = logging.getLogger("umbp_nvme.segments")  # the name operators know; kept across the move



def size_class(nbytes: int) -> int:
    return -(-nbytes // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES


REBUILD_CHUNK = 1 << 20  # records a rebuild pass takes at once (see SegmentAllocator.rebuild)


def _chunks(n: int):
    return (slice(lo, lo + REBUILD_CHUNK) for lo in range(0, n, REBUILD_CHUNK))


def size_classes(lengths: np.ndarray) -> np.ndarray:
    return (-(-np.asarray(lengths, np.int64) // SLOT_ALIGN_BYTES)) * SLOT_ALIGN_BYTES


def max_object_bytes(segment_bytes: int, *, records: bool = True) -> int:
    """The largest object a segment takes: the largest size class that still has a slot (with
    ``records``, as every writer runs, the slot and its block in the record area at the tail: one
    segment less 4 KiB). A put of a larger object could never get a slot, whatever was evicted."""
    cls = segment_bytes // SLOT_ALIGN_BYTES * SLOT_ALIGN_BYTES
    while cls > 0 and not (record_slots(segment_bytes, cls) if records else segment_bytes // cls):
        cls -= SLOT_ALIGN_BYTES
    return cls


class SegmentAllocator:
    """Slots in ``n_segments`` segments of ``segment_bytes`` each. Not thread-safe (loop thread)."""

    def __init__(self, n_segments: int, segment_bytes: int, *, records: bool = False):
        if type(segment_bytes) is not int or segment_bytes <= 0 or segment_bytes % SLOT_ALIGN_BYTES:
            raise ValueError(f"segment_bytes={segment_bytes!r} must be a positive multiple of {SLOT_ALIGN_BYTES}")
        if type(n_segments) is not int or n_segments < 0:
            raise ValueError(f"n_segments={n_segments!r} must be a non-negative integer")
        self.n_segments = n_segments
        self.segment_bytes = segment_bytes
        self.records = records  # each segment's tail holds its slots' records: fewer slots per segment
        self.seg_class = [0] * n_segments  # slot bytes; 0 = unassigned
        self.seg_used = [0] * n_segments  # slots handed out (published or in flight)
        self._free_segs = list(range(n_segments))  # a heap: low indices first, their files exist first
        # class -> {segment: free offsets as a stack, lowest offset on top}
        self._class_free: dict[int, dict[int, list[int]]] = {}
        # segment -> which of its slots are handed out: a free of a slot not handed out (a double
        # free) would give one slot to two objects, so it is refused before anything changes
        self._in_use: dict[int, np.ndarray] = {}
        self.used_bytes = 0
        self.max_object_bytes = max_object_bytes(segment_bytes, records=records)

    def slots(self, cls: int) -> int:
        """Slots of class ``cls`` per segment."""
        if self.records:
            return record_slots(self.segment_bytes, cls)
        return self.segment_bytes // cls if 0 < cls <= self.segment_bytes else 0

    @property
    def capacity_bytes(self) -> int:
        return self.n_segments * self.segment_bytes

    def free_segments(self) -> int:
        return len(self._free_segs)

    def next_free_segment(self) -> int | None:
        return self._free_segs[0] if self._free_segs else None

    def alloc(self, cls: int, ensure_file=None) -> tuple[int, int] | None:
        """A slot of size class ``cls``; None when every segment is taken (or its file cannot be made)."""
        segs = self._class_free.get(cls)
        if segs:
            seg = next(iter(segs))
            offs = segs[seg]
            off = offs.pop()
            if not offs:
                del segs[seg]
            self._in_use[seg][off // cls] = True
        else:
            if not self._free_segs or not self.slots(cls):
                return None
            seg = heapq.heappop(self._free_segs)
            if ensure_file is not None and not ensure_file(seg):
                heapq.heappush(self._free_segs, seg)
                return None
            self.seg_class[seg] = cls
            n = self.slots(cls)
            self._in_use[seg] = used = np.zeros(n, bool)
            used[0] = True
            offs = list(range((n - 1) * cls, -1, -cls))
            off = offs.pop()
            if offs:
                self._class_free.setdefault(cls, {})[seg] = offs
        self.seg_used[seg] += 1
        self.used_bytes += cls
        return seg, off

    def alloc_many(self, cls: int, n: int, ensure_file=None) -> list[tuple[int, int] | None]:
        """n slots of one class (None for each that has no room), taking whole runs of free offsets."""
        out: list[tuple[int, int] | None] = []
        segs = self._class_free.get(cls)
        while len(out) < n:
            if segs:
                seg = next(iter(segs))
                offs = segs[seg]
                k = min(n - len(out), len(offs))
                take = offs[len(offs) - k :][::-1]  # lowest offsets first: sequential on disk
                del offs[len(offs) - k :]
                if not offs:
                    del segs[seg]
                self._in_use[seg][np.asarray(take, np.int64) // cls] = True
                self.seg_used[seg] += k
                self.used_bytes += cls * k
                out.extend((seg, o) for o in take)
                continue
            slot = self.alloc(cls, ensure_file)  # assigns a fresh segment
            if slot is None:
                out.extend([None] * (n - len(out)))
                break
            out.append(slot)
            segs = self._class_free.get(cls)
        return out

    def alloc_array(self, cls: int, n: int, ensure_file=None) -> tuple[np.ndarray, np.ndarray]:
        """alloc_many as two int64 arrays (segment, offset); -1 in both where there was no room."""
        segs = np.full(n, -1, np.int64)
        offs = np.full(n, -1, np.int64)
        got = 0
        classes = self._class_free
        while got < n:
            free_segs = classes.get(cls)
            if free_segs:
                seg = next(iter(free_segs))
                stack = free_segs[seg]
                k = min(n - got, len(stack))
                offs[got : got + k] = stack[len(stack) - k :][::-1]  # lowest offsets first: sequential on disk
                del stack[len(stack) - k :]
                if not stack:
                    del free_segs[seg]
                segs[got : got + k] = seg
                self._in_use[seg][offs[got : got + k] // cls] = True
                self.seg_used[seg] += k
                self.used_bytes += cls * k
                got += k
                continue
            slot = self.alloc(cls, ensure_file)  # assigns a fresh segment
            if slot is None:
                break
            segs[got], offs[got] = slot
            got += 1
        return segs, offs

    def free_many(self, segs, offs) -> None:
        free = self.free
        for s, o in zip(np.asarray(segs).tolist(), np.asarray(offs).tolist()):
            free(s, o)

    def free(self, seg: int, off: int) -> None:
        cls = self.seg_class[seg]
        used = self._in_use.get(seg)
        if not cls or used is None or off % cls or not 0 <= off < len(used) * cls or not used[off // cls]:
            # a double free would hand one slot to two objects: refuse loudly, change nothing
            raise RuntimeError(f"slot {off} of segment {seg} is not allocated")
        used[off // cls] = False
        self.seg_used[seg] -= 1
        self.used_bytes -= cls
        if self.seg_used[seg] == 0:
            segs = self._class_free.get(cls)
            if segs is not None:
                segs.pop(seg, None)
            self.seg_class[seg] = 0
            del self._in_use[seg]
            heapq.heappush(self._free_segs, seg)
        else:
            self._class_free.setdefault(cls, {}).setdefault(seg, []).append(off)

    def rebuild(self, segs: np.ndarray, offs: np.ndarray, lengths: np.ndarray, gens: np.ndarray) -> np.ndarray:
        """Mark the slots of existing records used; returns the mask of records to keep.

        Dropped: records outside the current segments (capacity shrank), misaligned ones, ones
        whose size class differs from their segment's majority class, and all but the newest of
        records sharing a slot (a relaxed-mode power loss can resurrect an evicted record whose
        slot was reused; its CRC would fail anyway).
        """
        # offsets are u64 on disk: one of 2**63 or more wraps negative in int64, so it is dropped
        # by ``offs >= 0``; every sum below then stays far inside int64
        segs = np.asarray(segs, np.int64)  # a copy only when not int64 already (an open passes int64)
        offs = np.asarray(offs, np.int64)
        n = len(segs)
        keep = np.zeros(n, bool)
        self._reset()
        if not n:
            return keep
        table = self._class_slots(lengths)
        # a pass at a time over REBUILD_CHUNK records: their temporaries are reused, where whole
        # arrays of 10 M would each be fresh pages (a page fault costs ~5 us here: issue 36's reopen)
        seg_cls = np.zeros(self.n_segments, np.int64)
        mixed = False
        for sl in _chunks(n):
            s, o, cls = segs[sl], offs[sl], size_classes(lengths[sl])
            room = table[cls // SLOT_ALIGN_BYTES]
            c1 = np.maximum(cls, 1)
            k = (cls > 0) & (o >= 0) & (s >= 0) & (s < self.n_segments) & (room > 0) & (o % c1 == 0) & (o // c1 < room)
            keep[sl] = k
            ks, kc = s[k], cls[k]
            was = seg_cls[ks]
            seg_cls[ks] = kc
            mixed = mixed or bool(((was != 0) & (was != kc)).any() or (seg_cls[ks] != kc).any())
        if not keep.any():
            return keep
        if mixed:  # one size class per segment by construction: the majority class heals damage (rare)
            idx = self._majority_class(segs, size_classes(lengths), keep, np.flatnonzero(keep))
            seg_cls[:] = 0
            seg_cls[segs[idx]] = size_classes(lengths[idx])
        # one record per slot, at 4 KiB granularity (slots of every class start on one): a slot
        # named twice keeps its newest record (rare, sorted)
        per_seg = self.segment_bytes // SLOT_ALIGN_BYTES
        occ = np.zeros(self.n_segments * per_seg, bool)
        kept = 0
        for sl in _chunks(n):
            k = keep[sl]
            occ[segs[sl][k] * per_seg + offs[sl][k] // SLOT_ALIGN_BYTES] = True
            kept += int(np.count_nonzero(k))
        if np.count_nonzero(occ) != kept:
            self._newest_per_slot(segs, offs, gens, keep, np.flatnonzero(keep))
        counts = np.zeros(self.n_segments, np.int64)
        for sl in _chunks(n):
            counts += np.bincount(segs[sl][keep[sl]], minlength=self.n_segments)
        used_segs = np.flatnonzero(counts)
        for seg in used_segs.tolist():
            c, k = int(seg_cls[seg]), int(counts[seg])
            nslots, step = self.slots(c), c // SLOT_ALIGN_BYTES
            self.seg_class[seg], self.seg_used[seg] = c, k
            self.used_bytes += c * k
            # slot i of the segment starts at 4 KiB grain i * step: its bits are one strided slice
            used = occ[seg * per_seg : seg * per_seg + nslots * step : step].copy()
            self._in_use[seg] = used
            if k < nslots:
                self._class_free.setdefault(c, {})[seg] = (np.flatnonzero(~used)[::-1] * c).tolist()
        free = np.ones(self.n_segments, bool)
        free[used_segs] = False
        self._free_segs = np.flatnonzero(free).tolist()  # ascending: already a heap
        return keep

    def _class_slots(self, lengths) -> np.ndarray:
        """Per 4 KiB grain g: the slots a segment of class g * 4 KiB holds (0: none, or no record has it)."""
        top = int(np.max(lengths)) if len(lengths) else 0  # lengths are u32: at most 2**20 grains
        seen = np.zeros(-(-top // SLOT_ALIGN_BYTES) + 1, bool)
        for sl in _chunks(len(lengths)):
            seen[size_classes(lengths[sl]) // SLOT_ALIGN_BYTES] = True
        table = np.zeros(len(seen), np.int64)
        for g in np.flatnonzero(seen).tolist():  # classes are few (one per pool)
            table[g] = self.slots(g * SLOT_ALIGN_BYTES)
        return table

    def _majority_class(self, segs, cls, keep, idx) -> np.ndarray:
        """Drop (from ``keep``) the records whose class is not their segment's most common one; the kept indices."""
        per_seg = self.segment_bytes // SLOT_ALIGN_BYTES + 1
        sc = segs[idx] * per_seg + cls[idx] // SLOT_ALIGN_BYTES
        u, counts = np.unique(sc, return_counts=True)
        order = np.lexsort((-counts, u // per_seg))
        u = u[order]
        first = np.ones(len(u), dtype=bool)
        first[1:] = (u[1:] // per_seg) != (u[:-1] // per_seg)
        seg_cls = np.zeros(self.n_segments, dtype=np.int64)
        seg_cls[u[first] // per_seg] = (u[first] % per_seg) * SLOT_ALIGN_BYTES
        keep[idx] &= seg_cls[segs[idx]] == cls[idx]
        return np.flatnonzero(keep)

    def _newest_per_slot(self, segs, offs, gens, keep, idx) -> None:
        """Of records sharing a slot, keep (in ``keep``) only the newest generation's."""
        slot = segs[idx] * self.segment_bytes + offs[idx]
        order = np.lexsort((gens[idx], slot))
        sk = slot[order]
        last = np.ones(len(order), dtype=bool)
        last[:-1] = sk[1:] != sk[:-1]
        keep[idx[order[~last]]] = False

    def _reset(self) -> None:
        self.seg_class = [0] * self.n_segments
        self.seg_used = [0] * self.n_segments
        self._free_segs = list(range(self.n_segments))
        self._class_free = {}
        self._in_use = {}
        self.used_bytes = 0

    def class_counts(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for c, u in zip(self.seg_class, self.seg_used):
            if c:
                out[c] = out.get(c, 0) + u
        return out


class SegmentFiles:
    """Open segment files by index; created (and preallocated) on first use by the writer."""

    def __init__(self, directory: str, segment_bytes: int, *, readonly: bool, o_direct: bool, n_segments: int = 16):
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.readonly = readonly
        self.o_direct = o_direct
        self.files: dict[int, DataFile] = {}
        # sized for every segment up front, so a background open never reallocates under a reader
        n = max(16, n_segments)
        self.fds = np.full(n, -1, dtype=np.int32)
        self.direct = np.zeros(n, dtype=bool)
        self.align = np.full(n, SLOT_ALIGN_BYTES, dtype=np.int64)
        self._facts = NO_FILES  # the facts of every open segment merged: what a batch hands the engines
        self._mixed = False  # segments with different facts (a file system that refused O_DIRECT later)
        self._failed_errno: int | None = None
        self._lock = threading.Lock()  # ensure() also runs on a worker thread (precreate)
        self._precreating: set[int] = set()
        self._closed = False

    def path(self, i: int) -> str:
        return os.path.join(self.directory, segment_name(i))

    def exists(self, i: int) -> bool:
        try:
            return os.lstat(self.path(i)).st_size >= self.segment_bytes
        except OSError:
            return False

    def ensure(self, i: int) -> bool:
        """Open segment i (creating and preallocating it for the writer). False on failure, logged."""
        if i in self.files:
            return True
        with self._lock:
            return self._ensure_locked(i)

    def precreate(self, i: int) -> None:
        """Create segment i ahead of need (on a worker thread): fallocate stays off the put path."""
        try:
            self.ensure(i)
        finally:
            self._precreating.discard(i)

    def want_precreate(self, i: int) -> bool:
        if self.readonly or self._closed or self._failed_errno is not None or i in self.files or i in self._precreating:
            return False
        self._precreating.add(i)
        return True

    def open_existing(self, i: int) -> None:
        """Open segment i, which must exist (the writer's load path). Raises OSError; never creates
        or removes anything. A short file is extended to full size when the disk allows it."""
        with self._lock:
            if i in self.files:
                return
            if self._closed:
                raise OSError(errno.EBADF, "segment files are closed")
            if self.readonly:
                f = open_data_file(self.path(i), readonly=True, direct=self.o_direct)
            else:
                f = open_data_file(self.path(i), direct=self.o_direct)
                try:
                    if os.fstat(f.fd).st_size < self.segment_bytes:
                        preallocate(f.fd, self.path(i), self.segment_bytes)
                except OSError as e:  # slots past the end are written (and allocated) on use instead
                    log.warning("segment %s is short and cannot be extended now: %s", self.path(i), e)
            self.install(i, f)

    def _ensure_locked(self, i: int) -> bool:
        if i in self.files:
            return True
        if self._closed:
            return False
        try:
            if self.readonly:
                f = open_data_file(self.path(i), readonly=True, direct=self.o_direct)
            else:
                f = open_data_file(self.path(i), create=True, size=self.segment_bytes, direct=self.o_direct)
        except OSError as e:
            if e.errno != self._failed_errno:  # one line per failure kind, not per attempt
                self._failed_errno = e.errno
                log.warning("segment %s unavailable: %s", self.path(i), e)
            if e.errno == errno.ENOSPC and not self.readonly:
                # posix_fallocate may leave a partial file; give its blocks back
                try:
                    os.unlink(self.path(i))
                except OSError:
                    pass
            return False
        self._failed_errno = None
        self.install(i, f)
        return True

    def install(self, i: int, f: DataFile) -> None:
        if i >= len(self.fds):
            n = max(i + 1, 2 * len(self.fds))
            self.fds = np.concatenate([self.fds, np.full(n - len(self.fds), -1, dtype=np.int32)])
            self.direct = np.concatenate([self.direct, np.zeros(n - len(self.direct), dtype=bool)])
            self.align = np.concatenate([self.align, np.full(n - len(self.align), SLOT_ALIGN_BYTES, dtype=np.int64)])
        self.fds[i] = f.fd
        self.direct[i] = f.direct
        self.align[i] = max(f.align, 1)
        self._mixed = self._mixed or (bool(self.files) and f.facts != self._facts)
        self._facts = self._facts.merge(f.facts)
        # last: ensure() answers from `files` without the lock, so fds/direct/align must be set first
        self.files[i] = f

    def batch(self, segs: np.ndarray) -> Files:
        """The files of an engine batch over segments ``segs`` (int64[]) with their O_DIRECT facts:
        the facts every open segment shares, or the ones of these segments when they differ."""
        fds = self.fds[segs]
        if not self._mixed:
            return Files(fds, self._facts)
        facts = NO_FILES
        for s in np.unique(segs).tolist():
            f = self.files.get(s)
            if f is not None:
                facts = facts.merge(f.facts)
        return Files(fds, facts)

    @property
    def failed_errno(self) -> int | None:
        """The errno of the last segment file that could not be created (None: none failed)."""
        return self._failed_errno

    @property
    def any_direct(self) -> bool | None:
        if not self.files:
            return None
        return bool(self.direct[list(self.files)].all())

    def disk_bytes(self) -> int:
        total = 0
        for f in list(self.files.values()):  # precreate() may install a segment on a worker meanwhile
            try:
                total += os.fstat(f.fd).st_blocks * 512
            except OSError:
                pass
        return total

    def unlink_beyond(self, n_segments: int) -> None:
        """Remove segment files past the current capacity (a deliberate shrink, after the index
        entries pointing into them were deleted durably). The store calls it only then."""
        for i, name in segment_files(self.directory).items():
            if i >= n_segments:
                try:
                    os.unlink(os.path.join(self.directory, name))
                except OSError as e:
                    log.warning("cannot remove %s beyond capacity: %s", name, e)

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        self._closed = True
        for f in self.files.values():
            f.close()
        self.files.clear()
        self.fds[:] = -1
