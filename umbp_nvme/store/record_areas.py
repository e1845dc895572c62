"""The writer's record blocks (records.py) in memory: the ones it changes, a bounded number of
clean ones beside them, and the block writes from them.

Each segment's area is a private anonymous mapping of its 4 KiB blocks, one page each. A block
is *resident* (memory holds its truth) or not (the disk does: the block was clean when its page
was given back, so its disk image is exactly what memory held). A put, clear or confirm of a
block that is not resident reads it first. Every change marks its block dirty at once; a block
leaves memory only when it is clean: its image landed, no write of it is in flight and nothing
changed it since. So a filling or evicting writer holds the blocks it is changing plus
``cache_blocks`` clean ones, not 256 B for every slot it ever touched (issue 36).

Writes of one block never overlap in flight: a later image of a block is submitted only once
the earlier one completed, so an older image can never land after a newer one and drop a record
that was acknowledged.

A record says ``CONFIRMED`` only in images written after its data's fdatasync completed: a
rebuild trusts confirmed records and checks the data CRC of the others (the last batch or so
per segment after a crash). Confirmations ride along with the next write to the segment, and
flush/close write the rest.

State: its own (the blocks in memory); a writer's is writer.areas. Not thread-safe: the loop
thread only.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
from collections import OrderedDict

import numpy as np

from .layout import SLOT_ALIGN_BYTES, record_slots
from .records import (PER_BLOCK, R_CONFIRMED, R_VALID, RECORD_BYTES, RECORD_DTYPE, block_buffer, block_offset,
                      place, seal, slot_index)  # fmt: skip

log = logging.getLogger("umbp_nvme.store")

# a record as one opaque item: fancy-index copies of the structured dtype go field by field (~3x slower)
_WHOLE = np.dtype((np.void, RECORD_BYTES))
CACHE_BYTES = 64 << 20  # clean record blocks kept beside the ones being changed (16 K blocks, 256 K records)
FETCH_TRIES = 4  # reads of a block that keeps racing changes of it before the caller leaves it alone
READ_RUN_BLOCKS = 256  # blocks one preadv reads (its iovecs stay far below IOV_MAX, 1024)
_PAGED = mmap.PAGESIZE == SLOT_ALIGN_BYTES  # a block is a page: it can leave memory alone


class BlockCache:
    """Which record blocks memory holds. ``areas[seg]``: a RECORD_DTYPE view of segment ``seg``'s
    slots for its current size class, correct where ``resident`` says so. ``read_at(seg, offset,
    buffers) -> bytes read`` reads record blocks from the segment (OSError when it cannot);
    ``class_of(seg)`` is the size class of the records a segment not used yet this session holds
    on disk (None: no record)."""

    def __init__(self, segment_bytes: int, read_at=None, class_of=None, cache_bytes: int = CACHE_BYTES):
        self.segment_bytes = segment_bytes
        self._read_at = read_at
        self._class_of = class_of
        self._cache = max(0, cache_bytes) // SLOT_ALIGN_BYTES if _PAGED else None  # None: never evict
        self._seen: set[int] = set()
        self.areas: dict[int, np.ndarray] = {}
        self.cls: dict[int, int] = {}
        self._maps: dict[int, mmap.mmap] = {}
        self._res: dict[int, np.ndarray] = {}  # seg -> per block: memory holds its truth
        self._unconf: dict[int, np.ndarray] = {}  # seg -> per block: left memory holding an unconfirmed record
        self._held: dict[int, np.ndarray] = {}  # seg -> per block: its page holds memory (read or changed)
        self._gone: dict[int, np.ndarray] = {}  # seg -> per block: times it left memory (fetch's staleness check)
        self._clean: OrderedDict = OrderedDict()  # (seg, block) resident, equal to its disk image, idle: LRU first
        self.dirty: dict[int, set[int]] = {}  # seg -> blocks whose disk image is behind memory
        self._busy: dict[tuple[int, int], asyncio.Future] = {}  # (seg, block) -> its write in flight
        self.fetched = 0  # blocks read back through the read engine (the loop serves meanwhile)
        self.read_on_loop = 0  # blocks read back by a blocking read on the loop thread (``_need``)

    def _ensure(self, seg: int) -> None:
        """First use this session: the area of the class its records on disk have, none resident."""
        if seg in self._seen:
            return
        self._seen.add(seg)
        cls = self._class_of(seg) if self._class_of is not None else None
        if cls:
            self._new_area(seg, cls, resident=False)

    def _new_area(self, seg: int, cls: int, resident: bool) -> np.ndarray:
        n = record_slots(self.segment_bytes, cls)
        nb = -(-n // PER_BLOCK)
        mm = mmap.mmap(-1, max(1, nb) * SLOT_ALIGN_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._forget_clean(seg)
        self._maps[seg] = mm  # pages cost memory only once written
        self.areas[seg] = a = np.frombuffer(mm, RECORD_DTYPE, count=n)
        self.cls[seg] = cls
        self._res[seg] = np.full(nb, resident, bool)
        self._unconf[seg] = np.zeros(nb, bool)
        self._held[seg] = np.zeros(nb, bool)
        self._gone[seg] = np.zeros(nb, np.uint32)
        return a

    def _forget_clean(self, seg: int) -> None:
        if self._clean and seg in self._res:
            for k in [k for k in self._clean if k[0] == seg]:
                del self._clean[k]

    def loaded(self, seg: int) -> bool:
        """Whether segment ``seg``'s area was used this session (some of its blocks may be in memory)."""
        return seg in self._seen

    def resident(self, segs: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """Per slot ``idx[i]`` of segment ``segs[i]``: memory holds its record's truth (else the disk does)."""
        out = np.zeros(len(segs), bool)
        if not len(segs):
            return out
        one = segs[0] == segs[-1] and (segs == segs[0]).all()  # the usual batch: one segment
        for s in [int(segs[0])] if one else np.unique(segs).tolist():
            res = self._res.get(s)
            if res is None or not len(res):
                continue
            m = slice(None) if one else segs == s
            b = idx[m] // PER_BLOCK
            ok = b < len(res)
            out[m] = res[np.where(ok, b, 0)] & ok
        return out

    def out(self, segs, offs, lens, only_unconfirmed: bool = False) -> np.ndarray:
        """Per slot: its record block left memory, so a change of it would read it back first (with
        ``only_unconfirmed``: only where the block left holding an unconfirmed record)."""
        segs = np.asarray(segs, np.int64)
        b = slot_index(np.asarray(offs), np.asarray(lens)) // PER_BLOCK
        out = np.zeros(len(segs), bool)
        for s in np.unique(segs).tolist():
            self._ensure(s)
            res = self._res.get(s)
            if res is None:
                continue
            m = np.flatnonzero(segs == s)
            bm = b[m]
            inside = bm < len(res)
            bm = np.where(inside, bm, 0)
            gone = inside & ~res[bm]
            out[m] = gone & self._unconf[s][bm] if only_unconfirmed else gone
        return out

    def _need(self, seg: int, blks, only_unconfirmed: bool = False) -> None:
        """Blocks ``blks`` of ``seg`` in memory (read from the segment where they are not); with
        ``only_unconfirmed``, only those that left memory holding an unconfirmed record."""
        res = self._res.get(seg)
        if res is None:
            return
        b = np.asarray(blks, np.int64)
        b = b[(b >= 0) & (b < len(res))]
        b = b[~res[b]]  # the usual call: every block in memory, nothing sorted
        if only_unconfirmed and len(b):
            b = b[self._unconf[seg][b]]
        if not len(b):
            return
        b = np.unique(b)
        mv = memoryview(self._maps[seg])
        # a run of consecutive blocks is one read: block b+k lies k blocks below block b in the file
        cut = np.flatnonzero(np.diff(b) != 1) + 1
        runs = [r[i : i + READ_RUN_BLOCKS] for r in np.split(b, cut) for i in range(0, len(r), READ_RUN_BLOCKS)]
        for run in runs:
            lo, hi = int(run[0]), int(run[-1])
            bufs = [mv[k * SLOT_ALIGN_BYTES : (k + 1) * SLOT_ALIGN_BYTES] for k in range(hi, lo - 1, -1)]
            want = len(bufs) * SLOT_ALIGN_BYTES
            try:
                got = self._read_at(seg, block_offset(self.segment_bytes, hi), bufs) if self._read_at else -1
            except OSError as e:
                got = -1
                log.error("reading record blocks %d-%d of segment %d failed: %s", lo, hi, seg, e)
            self.read_on_loop += hi + 1 - lo
            res[lo : hi + 1] = True
            self._held[seg][lo : hi + 1] = True
            self._unconf[seg][lo : hi + 1] = False
            if got == want:
                for k in range(lo, hi + 1):
                    self._clean[(seg, k)] = None
            else:  # unknown on disk: zeros here, and the blocks stay until a write of them lands
                mv[lo * SLOT_ALIGN_BYTES : (hi + 1) * SLOT_ALIGN_BYTES] = bytes(want)
                log.error("record blocks %d-%d of segment %d could not be read (%d of %d bytes); their "
                          "records are rewritten from memory", lo, hi, seg, got, want)  # fmt: skip

    def _changed(self, seg: int, blks) -> None:
        d = self.dirty.setdefault(seg, set())
        held = self._held.get(seg)
        for b in blks:
            d.add(b)
            self._clean.pop((seg, b), None)
            if held is not None and b < len(held):
                held[b] = True

    def _evict(self) -> None:
        """Clean blocks beyond the cache leave memory, least recently written or read first."""
        if self._cache is None or len(self._clean) <= self._cache + self._cache // 32:
            return  # a few writes' worth over the cache, then down to it in one go (fewer, longer runs)
        out: dict[int, list[int]] = {}
        for _ in range(len(self._clean) - self._cache):
            (s, b), _ = self._clean.popitem(last=False)
            out.setdefault(s, []).append(b)
        for s, bs in out.items():
            res = self._res.get(s)
            if res is None:
                continue
            d = self.dirty.get(s, ())
            b = np.array(sorted(b for b in bs if res[b] and b not in d and (s, b) not in self._busy), np.int64)
            if not len(b):
                continue
            flags = self.areas[s]["flags"]
            slots = b[:, None] * PER_BLOCK + np.arange(PER_BLOCK)
            inside = slots < len(flags)
            f = np.where(inside, flags[np.where(inside, slots, 0)], 0)
            self._unconf[s][b] = ((f & (R_VALID | R_CONFIRMED)) == R_VALID).any(axis=1)
            res[b] = self._held[s][b] = False
            self._gone[s][b] += 1
            for run in np.split(b, np.flatnonzero(np.diff(b) != 1) + 1):  # one madvise per run of pages
                lo, n = int(run[0]), len(run)
                self._maps[s].madvise(mmap.MADV_DONTNEED, lo * SLOT_ALIGN_BYTES, n * SLOT_ALIGN_BYTES)

    async def fetch(self, engine, files, segs, offs, lens, timeout_s: float, only_unconfirmed: bool = False) -> bool:
        """The blocks of these slots that memory does not hold (``out``), read back through ``engine``
        while the loop serves, so a change of them never blocks the loop on a slow or stalled drive.
        True when none is out any more; False when a read failed or ``timeout_s`` passed: the caller
        leaves those records alone (put_path, deletes, flushing). A block that came into memory or
        left it again while it was read (its disk image may have changed under the read) is read again."""
        segs = np.asarray(segs, np.int64)
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        for _ in range(FETCH_TRIES):
            gone = self.out(segs, offs, lens, only_unconfirmed)
            if not gone.any():
                return True
            blks = slot_index(np.asarray(offs)[gone], np.asarray(lens)[gone]) // PER_BLOCK
            want = sorted({(s, b) for s, b in zip(segs[gone].tolist(), blks.tolist())})
            if not await self._fetch_blocks(engine, files, want, end - loop.time()):
                return False
        return not self.out(segs, offs, lens, only_unconfirmed).any()

    async def _fetch_blocks(self, engine, files, want: list[tuple[int, int]], timeout_s: float) -> bool:
        """One read of blocks ``want``; each installed unless it raced a change. False: a read failed."""
        seen = [(self._res[s], int(self._gone[s][b])) for s, b in want]
        n = len(want)
        raw, buf, addrs = block_buffer(n)
        ws = np.array([s for s, _ in want], np.int64)
        offs_ = np.array([block_offset(self.segment_bytes, b) for _, b in want], np.int64)
        task = asyncio.ensure_future(engine.read_many(files.batch(ws), offs_, addrs, np.full(n, SLOT_ALIGN_BYTES)))
        # the buffer lives until the kernel is done with it; a late failure is retrieved, not logged at exit
        task.add_done_callback(lambda t, raw=raw: t.cancelled() or t.exception())
        try:
            got = await asyncio.wait_for(asyncio.shield(task), max(0.0, timeout_s))
        except Exception as e:  # noqa: BLE001 - the caller leaves these records alone
            log.warning("reading back %d record blocks failed: %r", n, e)
            return False
        if (got != SLOT_ALIGN_BYTES).any():
            log.warning("reading back %d record blocks: %d failed", n, int((got != SLOT_ALIGN_BYTES).sum()))
            return False
        for i, ((s, b), (res, left)) in enumerate(zip(want, seen)):
            if self._res.get(s) is not res or res[b] or self._gone[s][b] != left:
                continue
            self.fetched += 1
            lo = b * SLOT_ALIGN_BYTES
            img = buf[i * SLOT_ALIGN_BYTES : (i + 1) * SLOT_ALIGN_BYTES]
            memoryview(self._maps[s])[lo : lo + SLOT_ALIGN_BYTES] = img
            res[b] = self._held[s][b] = True
            self._unconf[s][b] = False
            self._clean[(s, b)] = None
        return True

    def clean_blocks(self) -> int:
        """Clean blocks in memory (the cache; the blocks being changed come on top)."""
        return len(self._clean)

    def blocks_in_memory(self) -> int:
        """Record blocks whose page holds memory (4 KiB each): read back or changed, not given back yet."""
        return int(sum(int(h.sum()) for h in self._held.values()))

    def _in_memory(self, blocks) -> set[tuple[int, int]]:
        """The blocks memory holds; the others are on disk as they are (clean when they left)."""
        out = set()
        for s, b in blocks:
            res = self._res.get(s)
            if res is None or b >= len(res) or res[b]:
                out.add((s, b))
        return out


class RecordAreas(BlockCache):
    """The record changes (put, clear, confirm, restore) on the blocks, and the block writes."""

    def __init__(self, segment_bytes: int, read_at=None, class_of=None, cache_bytes: int = CACHE_BYTES):
        super().__init__(segment_bytes, read_at, class_of, cache_bytes)
        self._tasks: dict = {}  # write task -> its image buffer
        self._confirms: list[np.ndarray] = []  # confirm_later's records, placed at the next use
        # blocks holding records of slots that went back unpublished, until their cleared image is
        # known on disk: (seg, block) -> the mark's sequence number (a write whose image predates
        # the mark does not clear it). A delete or clear writes them before it is acknowledged.
        self.dead: dict[tuple[int, int], int] = {}
        self._seq = 0

    def size_class(self, seg: int) -> int | None:
        """The size class segment ``seg``'s area holds records for; None: no area."""
        self._ensure(seg)
        return self.cls.get(seg)

    def _area(self, seg: int, cls: int) -> np.ndarray:
        self._ensure(seg)
        a = self.areas.get(seg)
        if a is None or self.cls[seg] != cls:
            n = record_slots(self.segment_bytes, cls)
            nb = -(-n // PER_BLOCK)
            old = []
            if a is not None:
                # the segment changed class while old records may remain (the store retires an area
                # before a new class's data goes in, so this is a leftover): wipe those inside the
                # new area (blocks not in memory may hold some); the rest of the old area lies in
                # the new class's slots
                res = self._res[seg]
                rec_blocks = np.unique(np.flatnonzero((a["flags"] != 0) & res.repeat(PER_BLOCK)[: len(a)]) // PER_BLOCK)
                old = sorted(set(rec_blocks.tolist()) | set(np.flatnonzero(~res).tolist()))
                if len(rec_blocks):
                    log.error("segment %d changed size class with %d old record blocks in memory", seg, len(rec_blocks))
            # blocks computed for the old area that lie beyond the new one are the new class's data
            # slots now: writing them would zero its objects
            d = self.dirty.get(seg)
            if d:
                d.difference_update([b for b in d if b >= nb])
            for k in [k for k in self.dead if k[0] == seg and k[1] >= nb]:
                del self.dead[k]
            a = self._new_area(seg, cls, resident=True)
            self._changed(seg, [b for b in old if b < nb])
        return a

    def put(self, recs: np.ndarray) -> set[tuple[int, int]]:
        """Place sealed records at their slots; returns the (segment, block) pairs touched."""
        self._place_confirms()
        touched: set[tuple[int, int]] = set()
        if not len(recs):
            return touched
        segs = recs["segment"].astype(np.int64)
        lens = recs["length"].astype(np.int64)
        idx = slot_index(recs["offset"], lens)
        cls = (-(-lens // SLOT_ALIGN_BYTES)) * SLOT_ALIGN_BYTES
        one = segs[0] == segs[-1] and (segs == segs[0]).all()  # the usual batch: one segment
        for s in [int(segs[0])] if one else np.unique(segs).tolist():
            js = slice(None) if one else np.flatnonzero(segs == s)
            a = self._area(s, int(cls[0 if one else js[0]]))
            blks = idx[js] // PER_BLOCK
            self._need(s, blks[blks < len(self._res[s])])
            placed = place(a, idx[js], recs[js], False)
            self._changed(s, placed)
            touched.update((s, b) for b in placed)
        return touched

    def clear(self, segs, offs, lens) -> tuple[set[tuple[int, int]], list]:
        """Tombstone the slots (records zeroed); returns (blocks touched, undo list for restore)."""
        self._place_confirms()
        touched: set[tuple[int, int]] = set()
        undo = []
        segs = np.asarray(segs, np.int64)
        lens = np.asarray(lens, np.int64)
        idx = slot_index(np.asarray(offs), lens)
        for s in np.unique(segs).tolist():
            self._ensure(s)
            a = self.areas.get(s)
            if a is None:
                # a segment with no record on disk as far as its live rows say (a class_of of None)
                # whose rows are leaving: build its area for their class, and the zeros get written
                m = np.flatnonzero(segs == s)[0]
                a = self._area(s, int(-(-int(lens[m]) // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES))
            js = idx[segs == s]
            js = js[js < len(a)]
            blks = np.unique(js // PER_BLOCK)
            self._need(s, blks)
            av = a.view(_WHOLE)
            undo.append((s, self.cls[s], js, av[js]))  # fancy indexing copies
            av[js] = np.zeros(1, _WHOLE)
            self._changed(s, blks.tolist())
            touched.update((s, b) for b in blks.tolist())
        return touched, undo

    def mark_dead(self, touched) -> None:
        """Blocks whose records of unpublished slots were cleared in memory: due on disk before
        any delete or clear is acknowledged (RecordSteps._tombstone)."""
        for k in touched:
            self._seq += 1
            self.dead[k] = self._seq
            self._changed(k[0], [k[1]])

    def mark_dirty(self, blocks) -> None:
        """Blocks (segment, block) whose disk image is behind memory again (a write that failed)."""
        for s, b in blocks:
            if self._res.get(s) is not None and b < len(self._res[s]) and self._res[s][b]:
                self._changed(s, [b])

    def forget_dead(self, snapshot: dict, synced_segs) -> None:
        """``snapshot`` (a copy of ``dead`` taken before the write) landed and the segments
        ``synced_segs`` were synced after it: those marks are done unless marked again since."""
        for k, seq in snapshot.items():
            if k[0] in synced_segs and self.dead.get(k) == seq:
                del self.dead[k]

    def busy(self, seg: int) -> set:
        """The block writes of segment ``seg`` in flight."""
        return {f for (s, _), f in self._busy.items() if s == seg}

    def drop(self, seg: int) -> None:
        """Forget segment ``seg``'s area (its blocks are known on disk as they are in memory, and
        no write of them is in flight): the next use builds it for its new class, empty."""
        self._forget_clean(seg)
        for d in (self.areas, self.cls, self.dirty, self._maps, self._res, self._unconf, self._held, self._gone):
            d.pop(seg, None)
        self._seen.add(seg)

    def restore(self, undo) -> None:
        self._place_confirms()
        for s, cls, js, old in undo:
            if self.cls.get(s) == cls:
                blks = np.unique(js // PER_BLOCK)
                self._need(s, blks)
                self.areas[s].view(_WHOLE)[js] = old
                self._changed(s, blks.tolist())

    def confirm(self, segs, offs, lens, gens) -> None:
        """Mark the slots' records confirmed (their data's fdatasync completed); written with the
        segment's next block write (or flush). A slot holding another generation is left alone."""
        self._place_confirms()
        segs = np.asarray(segs, np.int64)
        idx = slot_index(np.asarray(offs), np.asarray(lens))
        gens = np.asarray(gens, np.uint64)
        for s in np.unique(segs).tolist():
            self._ensure(s)
            a = self.areas.get(s)
            if a is None:
                continue
            m = segs == s
            js, g = idx[m], gens[m]
            ok = js < len(a)
            js, g = js[ok], g[ok]
            # a block out of memory (left unconfirmed: not fetched, or it left again) waits for the
            # next flush; a rebuild meanwhile checks its records against their data
            here = self._res[s][js // PER_BLOCK]
            js, g = js[here], g[here]
            mine = (a["generation"][js] == g) & ((a["flags"][js] & (R_VALID | R_CONFIRMED)) == R_VALID)
            js = js[mine]
            if not len(js):
                continue
            av = a.view(_WHOLE)
            sub = av[js].view(RECORD_DTYPE)
            sub["flags"] |= R_CONFIRMED
            seal(sub)
            av[js] = sub.view(_WHOLE)
            self._changed(s, np.unique(js // PER_BLOCK).tolist())

    def confirm_later(self, conf: np.ndarray) -> None:
        """Records sealed as confirmed (``confirmed_copy``; their data's fdatasync completed), placed
        at the next use of the areas (a put, clear, confirm or write: for a put batch, while the
        next batch's data lands), not on the acknowledging put's path. Until then only the flag
        waits, and a record without it is merely checked against its data by a rebuild."""
        self._confirms.append(conf)

    def _place_confirms(self) -> None:
        if self._confirms:
            q, self._confirms = self._confirms, []
            for conf in q:
                self._confirm_sealed(conf)

    def _confirm_sealed(self, conf: np.ndarray) -> None:
        """Place confirmed records where their slot still holds the same generation unconfirmed;
        written with the segment's next block write (or flush). A slot holding another generation
        (cleared or reused since) is left alone."""
        if not len(conf):
            return
        segs = conf["segment"].astype(np.int64)
        idx = slot_index(conf["offset"], conf["length"])
        one = segs[0] == segs[-1] and (segs == segs[0]).all()  # the usual batch: one segment
        for s in [int(segs[0])] if one else np.unique(segs).tolist():
            self._ensure(s)
            a = self.areas.get(s)
            if a is None:
                continue
            m = slice(None) if one else np.flatnonzero(segs == s)
            res = self._res[s]
            if not len(res):
                continue
            b = idx[m] // PER_BLOCK
            here = res[np.minimum(b, len(res) - 1)] | (b >= len(res))  # outside the area: place skips them
            if not here.all():  # out of memory: confirmed by the next flush, not read back on the loop
                m = np.arange(len(segs))[m][here]
            blocks = place(a, idx[m], conf[m], True)  # only over the same generation, still unconfirmed
            if blocks:
                self._changed(s, blocks)

    def dirty_blocks(self) -> set[tuple[int, int]]:
        self._place_confirms()
        return {(s, b) for s, bs in self.dirty.items() for b in bs}

    # --- block writes ---

    def _images(self, order: list[tuple[int, int]], buf: np.ndarray) -> None:
        """Block i of ``order`` (segment, block; all in memory) imaged into ``buf``'s i-th 4 KiB, in
        one C call per segment (native/uring_records.c area_images)."""
        from .._uring import area_images

        i, n = 0, len(order)
        while i < n:
            s = order[i][0]
            j = i
            while j < n and order[j][0] == s:
                j += 1
            a = self.areas.get(s)
            blks = np.fromiter((b for _, b in order[i:j]), np.int64, j - i)
            area_images(None if a is None else a.view(np.uint8), blks,
                        buf[i * SLOT_ALIGN_BYTES : j * SLOT_ALIGN_BYTES])  # fmt: skip
            i = j

    async def write(self, engine, files, blocks: set[tuple[int, int]], timeout_s: float) -> set[int]:
        """Write the blocks (and the dirty ones of the same segments) from memory; returns the
        segments whose blocks did not all land. Waits for earlier writes of the same blocks."""
        self._place_confirms()
        segs = {s for s, _ in blocks}
        for s in segs:
            blocks |= {(s, b) for b in self.dirty.get(s, ())}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            pending = {self._busy[b] for b in blocks if b in self._busy}
            if not pending:
                break
            if loop.time() >= deadline:  # an earlier image of these blocks is stuck in the device
                log.error("record blocks of segments %s are still being written after io_timeout_s", sorted(segs))
                self.mark_dirty(blocks)
                return segs
            await asyncio.wait(pending, timeout=deadline - loop.time())
        for s in segs:  # changed while this waited: they go too
            blocks |= {(s, b) for b in self.dirty.pop(s, ())}
        # file order: higher blocks sit lower
        order = sorted(self._in_memory(blocks), key=lambda sb_: (sb_[0], -sb_[1]))
        if not order:
            return set()
        for k in order:
            self._clean.pop(k, None)
        sb = self.segment_bytes
        n = len(order)
        raw, buf, addrs = block_buffer(n, zero=True)
        self._images(order, buf)
        # contiguous blocks of one segment go in one op (file order: consecutive blocks, descending)
        o_seg = np.fromiter((s for s, _ in order), np.int64, n)
        o_blk = np.fromiter((b for _, b in order), np.int64, n)
        start = np.ones(n, bool)
        start[1:] = (o_seg[1:] != o_seg[:-1]) | (o_blk[1:] != o_blk[:-1] - 1)
        first = np.flatnonzero(start)
        run_s = o_seg[first].tolist()
        run_o = (sb - (o_blk[first] + 1) * SLOT_ALIGN_BYTES).tolist()  # block_offset of each run's first block
        run_a = addrs[first].tolist()
        lens = np.diff(np.append(first, n)).astype(np.int64) * SLOT_ALIGN_BYTES
        task = asyncio.ensure_future(
            engine.write_many(files.batch(np.asarray(run_s, np.int64)), np.asarray(run_o, np.int64),
                              np.asarray(run_a, np.uint64), lens)
        )  # fmt: skip
        self._tasks[task] = raw  # the image buffer lives until the kernel is done with it
        done = asyncio.get_running_loop().create_future()
        for b in order:
            self._busy[b] = done

        def _release(t, order=order, done=done):
            self._tasks.pop(t, None)
            for b in order:
                if self._busy.get(b) is done:
                    del self._busy[b]
            done.set_result(None)

        task.add_done_callback(_release)
        try:
            res = await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except Exception as e:  # noqa: BLE001 - timeout, EngineClosed: those blocks are not known on disk
            log.error("record block write failed: %r", e)
            res = np.full(len(lens), -5, np.int64)
        failed = {run_s[i] for i in np.flatnonzero(np.asarray(res) != lens).tolist()}
        landed = []
        for s, b in order:
            if s in failed:
                self._changed(s, [b])
            elif b not in self.dirty.get(s, ()) and (s, b) not in self._busy:
                landed.append((s, b))  # memory equals the disk image now
        for k in landed:
            if self._res.get(k[0]) is not None:
                self._clean[k] = None
        self._evict()
        return failed

    async def settle(self, timeout_s: float) -> bool:
        """Wait (bounded) for every block write in flight (close); False when some outlived it:
        closing the engine then fails them, and their image buffers live until it has."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._busy:
            left = deadline - loop.time()
            if left <= 0:
                return False
            await asyncio.wait(set(self._busy.values()), timeout=left)
        return True
