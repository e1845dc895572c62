"""Where a writer's keys are, now that its memory holds only their hashes (keymap.py, issue 36).

- Confirming a get's candidate rows (``HitCheck``, the data path): the row's record holds
  the key (its first KEY_INLINE bytes and length; longer keys are held in memory) and the row's
  generation. The record is in memory where the writer holds its block (record_areas.py: the
  blocks it is changing and a bounded cache of clean ones); otherwise its 4
  KiB block is read through the read engine, one read per distinct block, all in one batch (a
  prefix's pages were put together, so ~16 of them share a block). The LMDB index was the other
  candidate, but its leaf pages are page cache the VM drops: 256 keys then cost 256 serial page
  faults on the loop thread (get(256) at 1 M objects went from 7 to 20-24 ms), where the record
  blocks are read in parallel beside nothing else.
- Confirming elsewhere (put dedup, delete, generation_of: control paths, synchronous): the LMDB
  index, which maps the full key to its record: the row is the key's when that record names the
  row's segment, offset and generation.
- Naming a row's key (eviction's and delete's index deletes, events, export): the row's record,
  from memory where its block is held, else read from the segment (pread: these paths are
  synchronous); a record that does not match its row (damage) is looked up in the index by a scan.

State: none of its own beyond the references (a writer's is writer.keys.source).
"""

from __future__ import annotations

import logging
import os

import numpy as np

from .._uring import records_name
from ..buffers import AlignedBuffer
from .index import REC_BYTES, REC_DTYPE
from .layout import SLOT_ALIGN_BYTES
from .keymap import storable_bytes
from .records import (MAGIC, PER_BLOCK, R_CONFIRMED, R_KEY_TRUNC, R_VALID, RECORD_DTYPE, block_buffer, block_offset,
                      make_records, slot_index)  # fmt: skip

log = logging.getLogger("umbp_nvme.store")
_WHOLE = np.dtype((np.void, RECORD_DTYPE.itemsize))
WHOLE_AREA_ROWS = 4096  # naming more rows of one segment than this reads its whole area once  # a record as one item: copies in one pass, not field by field


class WriterKeys:
    """The key source of a writer's KeyMap (``keys_of``, ``confirm``) and its areas' loader."""

    def __init__(self, store):
        self.st = store
        self.open_keys = None  # the open's index scan (row i's key at i) while it writes every area

    def confirm(self, enc: list[bytes], rows: np.ndarray) -> np.ndarray:
        """Whether row rows[i] holds key enc[i]: the key's index record names the row's object."""
        ix = self.st.state.index
        if ix is None:
            return np.zeros(len(enc), bool)
        vals = ix.get_records(enc)
        ok = np.fromiter((v is not None and len(v) == REC_BYTES for v in vals), bool, len(vals))
        if not ok.any():
            return ok
        j = np.flatnonzero(ok)
        recs = np.frombuffer(b"".join(vals[i] for i in j.tolist()), REC_DTYPE)
        t = self.st.writer.rows
        r = rows[j]
        ok[j] = (
            (recs["segment"].astype(np.int64) == t.seg[r])
            & (recs["offset"].astype(np.int64) == t.off[r])
            & (recs["generation"] == t.gen[r])
        )
        return ok

    def in_memory(self, segs: np.ndarray, offs: np.ndarray, lens: np.ndarray) -> bool:
        """Whether the records of the rows at (segs, offs, lens) are all in memory (record_areas.py):
        confirming them reads nothing."""
        areas = self.st.writer.areas
        if areas is None or not len(segs):
            return areas is not None
        return bool(areas.resident(np.asarray(segs, np.int64), slot_index(offs, lens)).all())

    def gather(self, rows: np.ndarray):
        """The rows' records where they are in memory: (records, segments, offsets, slot indexes,
        which must come from disk instead)."""
        t = self.st.writer.rows
        areas = self.st.writer.areas
        m = len(rows)
        recs = np.zeros(m, RECORD_DTYPE)
        segs = t.seg[rows].astype(np.int64)
        offs, lens = t.off[rows], t.len[rows]
        idx = slot_index(offs, lens)
        here = areas.resident(segs, idx) if areas is not None else np.zeros(m, bool)
        if here.any():  # memory is the truth where it holds the block (changed or kept this session)
            _copy_resident(areas, recs, segs, idx, here)
        return recs, segs, offs, idx, ~here

    def name(self, recs: np.ndarray, enc: list, rows: np.ndarray, segs: np.ndarray, offs: np.ndarray) -> np.ndarray:
        """Whether record i is valid, names row rows[i]'s object and holds key enc[i] (str, its bytes,
        or None: not a storable key)."""
        gens = np.ascontiguousarray(self.st.writer.rows.gen[rows], np.uint64)
        keys = enc if type(enc) is list else list(enc)
        out = np.empty(len(rows), np.uint8)
        if records_name(recs, keys, segs, offs, gens, out):  # non-ASCII str keys: their stored bytes, again
            j = np.flatnonzero(out == 2)
            sub = np.empty(len(j), np.uint8)
            records_name(recs[j], [storable_bytes(keys[i]) for i in j.tolist()], segs[j], offs[j], gens[j], sub)
            out[j] = sub
        return out == 1

    def keys_of(self, rows: np.ndarray) -> list[bytes | None]:
        """Each row's key from its record: in memory where its block is held, else its 4 KiB block
        read from the segment (not kept for this); None where neither the record nor the index names it."""
        t = self.st.writer.rows
        areas = self.st.writer.areas
        m = len(rows)
        out: list = [None] * m
        if areas is None or not m:
            return out
        segs = t.seg[rows].astype(np.int64)
        offs, lens = t.off[rows], t.len[rows]
        idx = slot_index(offs, lens)
        recs = np.zeros(m, RECORD_DTYPE)
        here = areas.resident(segs, idx)
        if here.any():
            _copy_resident(areas, recs, segs, idx, here)
        disk = ~here
        for s in np.unique(segs[disk]).tolist():
            js = np.flatnonzero(disk & (segs == s))
            if len(js) > WHOLE_AREA_ROWS:  # many of its rows (a listing): the whole area in one read, not kept
                a = self._area_from_disk(s)
                ok = idx[js] < len(a)
                recs.view(_WHOLE)[js[ok]] = a.view(_WHOLE)[idx[js[ok]]]
                disk[js] = False
        if disk.any():
            recs[disk] = self._pread_records(segs[disk], idx[disk])
        gens = t.gen[rows]
        good = _names(recs, gens, offs, segs)
        again = here & ~good  # a listing on another thread may read a block the loop just gave back: the disk has it
        if again.any():
            recs[again] = self._pread_records(segs[again], idx[again])
            good = _names(recs, gens, offs, segs)
        kl = recs["key_len"].astype(np.int64).tolist()
        missing = []
        for j, (k, n, g) in enumerate(zip(recs["key"], kl, good.tolist())):
            if g:
                out[j] = k[:n].tobytes()
            else:
                missing.append(j)
        if missing:
            for j, e in zip(missing, self.keys_by_index(rows[missing])):
                out[j] = e
        return out

    def _area_from_disk(self, seg: int) -> np.ndarray:
        from .rebuild import read_area
        from .segments import segment_name

        try:
            return read_area(os.path.join(self.st.path, segment_name(seg)), self.st.segment_bytes)[0]
        except OSError as e:
            log.error("%s: reading the records of segment %d failed: %s", self.st.path, seg, e)
            return np.zeros(0, RECORD_DTYPE)

    def _pread_records(self, segs: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """The records of slots ``idx`` of segments ``segs``, each 4 KiB block read once (pread: the
        control paths that name a row's key are synchronous)."""
        out = np.zeros(len(segs), RECORD_DTYPE)
        blk = idx // PER_BLOCK
        buf = AlignedBuffer(SLOT_ALIGN_BYTES)  # O_DIRECT: 4 KiB-aligned
        files = self.st.state.files
        order = np.lexsort((blk, segs))
        cut = np.flatnonzero(np.diff(segs[order]) | np.diff(blk[order])) + 1
        for js in np.split(order, cut) if len(order) else ():  # one group per (segment, block), in file order
            s, b = int(segs[js[0]]), int(blk[js[0]])
            try:
                n = os.preadv(int(files.fds[s]), [buf.array], block_offset(self.st.segment_bytes, b))
            except OSError as e:
                log.error("%s: reading a record block of segment %d failed: %s", self.st.path, s, e)
                continue
            if n == SLOT_ALIGN_BYTES:
                out[js] = buf.array.view(RECORD_DTYPE)[idx[js] % PER_BLOCK]
        return out

    def keys_by_index(self, rows: np.ndarray) -> list[bytes | None]:
        """Damage only (a record that does not name its row's key): the rows' keys by a scan of the index
        (its records name segment, offset, generation)."""
        t = self.st.writer.rows
        log.error("%s: %d rows' records do not name their keys; looking them up in the index", self.st.path, len(rows))
        try:
            keys, recs = self.st.state.index.scan()
        except Exception as e:  # noqa: BLE001
            log.error("%s: scanning the index failed: %s", self.st.path, e)
            return [None] * len(rows)
        where = {(int(s), int(o), int(g)): i for i, (s, o, g) in
                 enumerate(zip(recs["segment"].tolist(), recs["offset"].tolist(), recs["generation"].tolist()))}
        out = []
        for r in rows.tolist():
            i = where.get((int(t.seg[r]), int(t.off[r]), int(t.gen[r])))
            k = None if i is None else keys[i]
            out.append(k.encode("utf-8", "surrogateescape") if type(k) is str else k)
        return out

    def open_records(self, seg: int):
        """The sealed records of segment ``seg``'s published objects, all confirmed, from the open's
        index scan (``open_keys``: row i's key at i) while the open writes every area; None: it has none."""
        t = self.st.writer.rows
        n = t.n
        rows = np.flatnonzero(t.live[:n] & (t.seg[:n] == seg))
        if not len(rows):
            return None
        open_keys = self.open_keys
        enc = [self.st.writer.keys.key_bytes_of(r) if r >= len(open_keys) else _bytes(open_keys[r])
               for r in rows.tolist()]  # fmt: skip
        return _made(t, rows, enc)


class RecordReads:
    """The 4 KiB blocks holding the records of slots ``idx`` of segments ``segs``, each block read
    once: the engine ops (``segs``, ``offs``, ``addrs``, ``lens``, into a buffer of its own) and,
    from their results, the records."""

    def __init__(self, st, segs: np.ndarray, idx: np.ndarray):
        self.idx = idx
        pairs, inv = np.unique(segs * (1 << 32) + idx // PER_BLOCK, return_inverse=True)  # (segment, block) once each
        self.inv = np.asarray(inv).reshape(-1)
        n = len(pairs)
        self.segs = pairs >> 32
        self.offs = st.segment_bytes - ((pairs & 0xFFFFFFFF) + 1) * SLOT_ALIGN_BYTES  # block_offset, vectorised
        self.raw, self.arr, self.addrs = block_buffer(n)
        self.lens = np.full(n, SLOT_ALIGN_BYTES, np.int64)
        self.res = None  # the block reads' results (get path: lookups._confirmed reads them)

    def records(self, res) -> np.ndarray:
        """Slot i's record where its block came back whole, zeros (no record) where not."""
        out = np.zeros(len(self.idx), RECORD_DTYPE)
        ok = (np.asarray(res) == SLOT_ALIGN_BYTES)[self.inv]
        if ok.any():
            out.view(_WHOLE)[ok] = self.arr.view(_WHOLE)[self.inv[ok] * PER_BLOCK + self.idx[ok] % PER_BLOCK]
        return out


class HitCheck:
    """Whether each of a get's hash hits (rows) holds its key (enc), by the rows' records: those in
    memory gathered at once, the others' blocks read (``reads``: by the get path, as a batch of
    their own submitted while the data is in flight, which sets ``reads.res``)."""

    def __init__(self, src: WriterKeys, enc: list, rows: np.ndarray):
        self.src, self.enc, self.rows = src, enc, rows
        self.recs, self.segs, self.offs, idx, self.disk = src.gather(rows)
        self.reads = RecordReads(src.st, self.segs[self.disk], idx[self.disk]) if self.disk.any() else None

    def finish(self) -> np.ndarray:
        if self.reads is not None:
            res = self.reads.res
            got = self.reads.records(np.full(len(self.reads.lens), -5) if res is None else res)
            if self.disk.all():  # after an open: every record from disk, no copy
                self.recs = got
            else:
                self.recs.view(_WHOLE)[self.disk] = got.view(_WHOLE)
        return self.src.name(self.recs, self.enc, self.rows, self.segs, self.offs)


def _names(recs: np.ndarray, gens: np.ndarray, offs: np.ndarray, segs: np.ndarray) -> np.ndarray:
    """Whether each record is valid, names its row's object and holds its whole key."""
    return ((recs["flags"] & R_VALID) != 0) & (recs["magic"] == MAGIC) & (recs["generation"] == gens) & (
        recs["offset"] == offs) & (recs["segment"] == segs) & ((recs["flags"] & R_KEY_TRUNC) == 0)  # fmt: skip


def _copy_resident(areas, recs: np.ndarray, segs: np.ndarray, idx: np.ndarray, here: np.ndarray) -> None:
    """recs[i] = the in-memory record of slot idx[i] of segment segs[i], where ``here``."""
    for s in _segments(segs[here]):
        js = np.flatnonzero(here & (segs == s))
        recs.view(_WHOLE)[js] = areas.areas[s].view(_WHOLE)[idx[js]]


def _segments(segs: np.ndarray) -> list[int]:
    """The distinct segments of a batch's rows; the common batch (one segment's pages) without np.unique's sort."""
    if len(segs) and (segs == segs[0]).all():
        return [int(segs[0])]
    return np.unique(segs).tolist()


def _bytes(k) -> bytes:
    return k.encode("utf-8", "surrogateescape") if type(k) is str else bytes(k)


def _made(t, rows, enc):
    from .index import key_crcs

    return make_records(t.seg[rows], t.off[rows], t.len[rows], t.gen[rows], t.crc[rows], t.depth[rows],
                        key_crcs(enc), enc, R_VALID | R_CONFIRMED)  # fmt: skip
