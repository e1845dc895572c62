"""Index records in the segments: the durable truth the LMDB index caches.

Each segment file holds its slots from the start and, at its tail, a record area: one 256-byte
record per slot (slot index = offset // size class, so a segment's records are dense whatever
its class), 16 to a 4 KiB block; block b is the b-th 4 KiB block from the end of the file. A
class gets as many slots as leave room for their record blocks (``layout.record_slots``), so
the files keep their size and the store its capacity. A strict put writes its objects' records beside their data and one
fdatasync per segment covers both; the LMDB commit after it is not synced. A delete clears the
slot's record (a tombstone) the same way before the slot can be reused.

The writer keeps each segment's area in memory and writes whole blocks copied from it
(O_DIRECT needs aligned blocks). Writes of one block never overlap in flight: a later image of
a block is submitted only once the earlier one completed, so an older image can never land
after a newer one and drop a record that was acknowledged.

A record says ``CONFIRMED`` only in images written after its data's fdatasync completed: a
rebuild trusts confirmed records and checks the data CRC of the others (the last batch or so
per segment after a crash). Confirmations ride along with the next write to the segment, and
flush/close write the rest.

State: its own (the record areas in memory); a writer's is writer.areas.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from .layout import SEGMENT_RECORD_BYTES, SLOT_ALIGN_BYTES, record_slots

log = logging.getLogger("umbp_nvme.store")

RECORD_BYTES = SEGMENT_RECORD_BYTES
KEY_INLINE = 208  # key bytes held in a record; longer keys keep a prefix and cannot be rebuilt
PER_BLOCK = SLOT_ALIGN_BYTES // RECORD_BYTES
MAGIC = 0x5552
R_VALID, R_CONFIRMED, R_KEY_TRUNC = 1, 2, 4

RECORD_DTYPE = np.dtype(
    [
        ("rcrc", "<u4"),  # CRC32C of the record's bytes 4..256
        ("magic", "<u2"),
        ("flags", "<u2"),
        ("segment", "<u4"),
        ("length", "<u4"),
        ("offset", "<u8"),
        ("generation", "<u8"),
        ("crc", "<u4"),  # CRC32C of the object bytes
        ("key_crc", "<u4"),  # CRC32C of the whole key
        ("depth", "<i4"),
        ("key_len", "<u2"),
        ("pad", "<u2"),
        ("key", "u1", (KEY_INLINE,)),
    ]
)
assert RECORD_DTYPE.itemsize == RECORD_BYTES
# whole records as one opaque item: fancy-index copies of the structured dtype go field by field
# (~3x slower for a batch's records)
_WHOLE = np.dtype((np.void, RECORD_BYTES))


def _place(area: np.ndarray, slots: np.ndarray, recs: np.ndarray, confirm: bool) -> list[int]:
    """Records copied into their slots of ``area`` in one C call (native/uring_records.c
    place_records); the blocks touched, ascending. ``confirm``: only where the slot still holds the
    same generation, valid and unconfirmed, and slots outside the area skipped; else every slot
    must lie in the area (ValueError before any copy)."""
    from .._uring import place_records

    out = np.empty(len(slots), np.int64)
    k = place_records(area.view(np.uint8), np.ascontiguousarray(slots, np.int64),
                      np.ascontiguousarray(recs, RECORD_DTYPE).view(np.uint8), confirm, out)  # fmt: skip
    return out[:k].tolist()


def block_offset(segment_bytes: int, blk: int) -> int:
    """File offset of record block ``blk`` (block 0 is the segment's last 4 KiB)."""
    return segment_bytes - (blk + 1) * SLOT_ALIGN_BYTES


def area_blocks(segment_bytes: int, cls: int) -> int:
    return -(-record_slots(segment_bytes, cls) // PER_BLOCK)


def slot_index(offs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    cls = (-(-lens.astype(np.int64) // SLOT_ALIGN_BYTES)) * SLOT_ALIGN_BYTES
    return offs.astype(np.int64) // cls


def seal(recs: np.ndarray) -> None:
    """Set each record's own CRC (over its bytes 4..256), in one C call."""
    from .._uring import crc32c_many

    n = len(recs)
    if not n:
        return
    recs = np.ascontiguousarray(recs)
    base = np.uint64(recs.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(RECORD_BYTES) + np.uint64(4)
    out = np.empty(n, np.uint32)
    crc32c_many(base, np.full(n, RECORD_BYTES - 4, np.int64), out)
    recs["rcrc"] = out


def record_crcs(recs: np.ndarray) -> np.ndarray:
    """What each record's ``rcrc`` should be (records contiguous)."""
    from .._uring import crc32c_many

    n = len(recs)
    out = np.empty(n, np.uint32)
    if n:
        base = np.uint64(recs.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(RECORD_BYTES) + np.uint64(4)
        crc32c_many(base, np.full(n, RECORD_BYTES - 4, np.int64), out)
    return out


def make_records(segs, offs, lens, gens, crcs, depths, key_crcs, enc_keys: list[bytes], flags: int) -> np.ndarray:
    """Sealed records (RECORD_DTYPE) for objects; keys over KEY_INLINE bytes keep a prefix (R_KEY_TRUNC)."""
    n = len(enc_keys)
    r = np.zeros(n, RECORD_DTYPE)
    r["magic"] = MAGIC
    r["segment"], r["length"], r["offset"] = segs, lens, offs
    r["generation"], r["crc"], r["depth"], r["key_crc"] = gens, crcs, depths, key_crcs
    klen = np.fromiter(map(len, enc_keys), np.int64, n)
    r["key_len"] = np.minimum(klen, 0xFFFF)
    r["flags"] = flags | np.where(klen > KEY_INLINE, R_KEY_TRUNC, 0)
    if n:  # numpy's fixed-width bytes: cut at KEY_INLINE, zero-padded, in one C pass
        r["key"] = np.array(enc_keys, dtype=f"S{KEY_INLINE}").view(np.uint8).reshape(n, KEY_INLINE)
    seal(r)
    return r


def batch_records(enc_keys: list[bytes], segs, offs, lens, depths, crcs, gen: int, index_dtype, confirmed: bool):
    """A put batch's (LMDB values as ``index_dtype`` records, sealed segment records, their confirmed
    copies or None) in one C pass (native/uring_records.c); the same bytes as make_records and
    confirmed_copy with ``R_VALID``, and index records with FLAG_CRC | FLAG_KEYCRC and group = generation."""
    from .._uring import put_records

    n = len(enc_keys)
    out48 = np.empty(n, index_dtype)
    recs = np.empty(n, RECORD_DTYPE)
    conf = np.empty(n, RECORD_DTYPE) if confirmed else None
    put_records(enc_keys if type(enc_keys) is list else list(enc_keys), np.ascontiguousarray(segs, np.int64),
                np.ascontiguousarray(offs, np.int64), np.ascontiguousarray(lens, np.int64),
                np.ascontiguousarray(depths, np.int32), np.ascontiguousarray(crcs, np.uint32), int(gen),
                out48.view(np.uint8), recs.view(np.uint8), None if conf is None else conf.view(np.uint8))  # fmt: skip
    return out48, recs, conf


def record_values(recs: np.ndarray) -> list[bytes]:
    """Each record's bytes (the index's LMDB values), cut in C rather than by slicing a blob per record."""
    return np.ascontiguousarray(recs).view(np.dtype((np.void, recs.dtype.itemsize))).tolist()


def confirmed_copy(recs: np.ndarray) -> np.ndarray:
    """The records as they read once their data's fdatasync completed (R_CONFIRMED, sealed): made
    while the data is in flight, so confirming costs a copy after the sync."""
    c = np.array(recs, RECORD_DTYPE, copy=True)
    c["flags"] |= R_CONFIRMED
    seal(c)
    return c


class RecordAreas:
    """The writer's in-memory copy of every segment's record area, and the block writes from it.

    Not thread-safe: the loop thread only. ``areas[seg]`` is a RECORD_DTYPE array of the
    segment's slots for its current size class.
    """

    def __init__(self, segment_bytes: int, loader=None):
        self.segment_bytes = segment_bytes
        # seg -> the sealed records it holds now (from the writer's rows), called once per segment
        # on its first use: opening a store of a million objects builds no area
        self._loader = loader
        self._loaded: set[int] = set()
        self.areas: dict[int, np.ndarray] = {}
        self.cls: dict[int, int] = {}
        self.dirty: dict[int, set[int]] = {}  # seg -> blocks whose disk image is behind memory
        self._busy: dict[tuple[int, int], asyncio.Future] = {}  # (seg, block) -> its write in flight
        self._tasks: dict = {}  # write task -> its image buffer
        self._confirms: list[np.ndarray] = []  # confirm_later's records, placed at the next use
        # blocks holding records of slots that went back unpublished, until their cleared image is
        # known on disk: (seg, block) -> the mark's sequence number (a write whose image predates
        # the mark does not clear it). A delete or clear writes them before it is acknowledged.
        self.dead: dict[tuple[int, int], int] = {}
        self._seq = 0

    def _ensure(self, seg: int) -> None:
        if seg in self._loaded:
            return
        self._loaded.add(seg)
        recs = self._loader(seg) if self._loader is not None else None
        if recs is not None and len(recs):
            self.put(recs)

    def loaded(self, seg: int) -> bool:
        """Whether segment ``seg``'s area is in memory (then it, not the disk, holds the truth)."""
        return seg in self._loaded

    def size_class(self, seg: int) -> int | None:
        """The size class segment ``seg``'s area holds records for (its records loaded first); None: no area."""
        self._ensure(seg)
        return self.cls.get(seg)

    def _area(self, seg: int, cls: int) -> np.ndarray:
        self._ensure(seg)
        a = self.areas.get(seg)
        if a is None or self.cls[seg] != cls:
            n = record_slots(self.segment_bytes, cls)
            nb = -(-n // PER_BLOCK)
            if a is not None and (a["flags"] != 0).any():
                # the segment changed class while old records remain (the store retires an area
                # before a new class's data goes in, so this is a leftover): wipe those inside the
                # new area; the rest of the old area lies in the new class's slots
                old = np.unique(np.flatnonzero(a["flags"]) // PER_BLOCK)
                log.error("segment %d changed size class with %d old record blocks in memory", seg, len(old))
                self.dirty.setdefault(seg, set()).update(old[old < nb].tolist())
            # blocks computed for the old area that lie beyond the new one are the new class's data
            # slots now: writing them would zero its objects
            d = self.dirty.get(seg)
            if d:
                d.difference_update([b for b in d if b >= nb])
            for k in [k for k in self.dead if k[0] == seg and k[1] >= nb]:
                del self.dead[k]
            a = np.zeros(n, RECORD_DTYPE)
            self.areas[seg], self.cls[seg] = a, cls
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
            touched.update((s, b) for b in _place(a, idx[js], recs[js], False))
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
                # a segment not used yet this session whose rows are all leaving: its area is built
                # from the live rows, so it is empty in memory while its blocks on disk still hold
                # these records; build it for their class, and the zeros below get written
                m = np.flatnonzero(segs == s)[0]
                a = self._area(s, int(-(-int(lens[m]) // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES))
            js = idx[segs == s]
            js = js[js < len(a)]
            av = a.view(_WHOLE)
            undo.append((s, self.cls[s], js, av[js]))  # fancy indexing copies
            av[js] = np.zeros(1, _WHOLE)
            touched.update((s, b) for b in np.unique(js // PER_BLOCK).tolist())
        return touched, undo

    def mark_dead(self, touched) -> None:
        """Blocks whose records of unpublished slots were cleared in memory: due on disk before
        any delete or clear is acknowledged (RecordSteps._tombstone)."""
        for k in touched:
            self._seq += 1
            self.dead[k] = self._seq
            self.dirty.setdefault(k[0], set()).add(k[1])

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
        self.areas.pop(seg, None)
        self.cls.pop(seg, None)
        self.dirty.pop(seg, None)
        self._loaded.add(seg)

    def restore(self, undo) -> None:
        self._place_confirms()
        for s, cls, js, old in undo:
            if self.cls.get(s) == cls:
                self.areas[s].view(_WHOLE)[js] = old

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
            mine = (a["generation"][js] == g) & ((a["flags"][js] & (R_VALID | R_CONFIRMED)) == R_VALID)
            js = js[mine]
            if not len(js):
                continue
            av = a.view(_WHOLE)
            sub = av[js].view(RECORD_DTYPE)
            sub["flags"] |= R_CONFIRMED
            seal(sub)
            av[js] = sub.view(_WHOLE)
            self.dirty.setdefault(s, set()).update(np.unique(js // PER_BLOCK).tolist())

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
            blocks = _place(a, idx[m], conf[m], True)  # only over the same generation, still unconfirmed
            if blocks:
                self.dirty.setdefault(s, set()).update(blocks)

    def dirty_blocks(self) -> set[tuple[int, int]]:
        self._place_confirms()
        return {(s, b) for s, bs in self.dirty.items() for b in bs}

    def _image(self, seg: int, blk: int, out: np.ndarray) -> None:
        self._ensure(seg)
        a = self.areas.get(seg)
        out[:] = 0
        if a is not None:
            part = a[blk * PER_BLOCK : (blk + 1) * PER_BLOCK]
            out[: len(part) * RECORD_BYTES] = part.view(np.uint8)

    def _images(self, order: list[tuple[int, int]], buf: np.ndarray) -> None:
        """Block i of ``order`` (segment, block) imaged into ``buf``'s i-th 4 KiB, as _image does
        it, in one C call per segment (native/uring_records.c area_images)."""
        from .._uring import area_images

        i, n = 0, len(order)
        while i < n:
            s = order[i][0]
            j = i
            while j < n and order[j][0] == s:
                j += 1
            self._ensure(s)
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
                for s, b in blocks:
                    self.dirty.setdefault(s, set()).add(b)
                return segs
            await asyncio.wait(pending, timeout=deadline - loop.time())
        sb = self.segment_bytes
        order = sorted(blocks, key=lambda sb_: (sb_[0], -sb_[1]))  # file order: higher blocks sit lower
        for s in segs:
            self.dirty.pop(s, None)
        n = len(order)
        raw = np.zeros((n + 1) * SLOT_ALIGN_BYTES, np.uint8)
        pad = -raw.ctypes.data % SLOT_ALIGN_BYTES
        buf = raw[pad : pad + n * SLOT_ALIGN_BYTES]
        self._images(order, buf)
        # contiguous blocks of one segment go in one op (file order: consecutive blocks, descending)
        o_seg = np.fromiter((s for s, _ in order), np.int64, n)
        o_blk = np.fromiter((b for _, b in order), np.int64, n)
        start = np.ones(n, bool)
        start[1:] = (o_seg[1:] != o_seg[:-1]) | (o_blk[1:] != o_blk[:-1] - 1)
        first = np.flatnonzero(start)
        run_s = o_seg[first].tolist()
        run_o = (sb - (o_blk[first] + 1) * SLOT_ALIGN_BYTES).tolist()  # block_offset of each run's first block
        run_a = (np.uint64(buf.ctypes.data) + first.astype(np.uint64) * np.uint64(SLOT_ALIGN_BYTES)).tolist()
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
        for s, b in order:
            if s in failed:
                self.dirty.setdefault(s, set()).add(b)
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

    def load_all(self, segs) -> None:
        """Build the areas of these segments now (open paths that write every area)."""
        self._place_confirms()
        for s in segs:
            self._ensure(int(s))
