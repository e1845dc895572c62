"""Where a writer's keys are, now that its memory holds only their hashes (keymap.py, issue 36).

- Confirming that a candidate row holds a key: the LMDB index, which maps the full key to its
  record (the writer's index is mapped and already what a reader's get asks; one read txn per
  batch): the row is the key's when the key's record names the row's segment, offset and
  generation. The record areas would be cheaper where they are in memory, but after an open
  they are not, and loading a segment's area for one get costs 256 B per slot of RAM.
- Naming a row's key (eviction's and delete's index deletes, events, export): the row's record
  in its segment's area (records.py), which the writer loads from the segment on first use and
  keeps, as it did before; a record that does not match its row (damage) is looked up in the
  index by a scan, once per segment.

State: none of its own beyond the references (a writer's is writer.keys.source).
"""

from __future__ import annotations

import logging
import os

import numpy as np

from .index import REC_BYTES, REC_DTYPE
from .records import MAGIC, R_CONFIRMED, R_KEY_TRUNC, R_VALID, make_records, record_crcs, seal, slot_index

log = logging.getLogger("umbp_nvme.store")


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

    def keys_of(self, rows: np.ndarray) -> list[bytes | None]:
        """Each row's key from its record (loading the segment's area on first use); None where the
        record and the index both do not name it."""
        t = self.st.writer.rows
        areas = self.st.writer.areas
        out: list = [None] * len(rows)
        if areas is None or not len(rows):
            return out
        segs = t.seg[rows].astype(np.int64)
        offs, lens = t.off[rows], t.len[rows]
        idx = slot_index(offs, lens)
        missing = []
        for s in np.unique(segs).tolist():
            js = np.flatnonzero(segs == s)
            areas.size_class(s)  # loads the area
            a = areas.areas.get(s)
            if a is None:
                missing.extend(js.tolist())
                continue
            inside = idx[js] < len(a)
            for j in js[~inside].tolist():
                missing.append(j)
            js = js[inside]
            rec = a[idx[js]]
            good = ((rec["flags"] & R_VALID) != 0) & (rec["generation"] == t.gen[rows[js]]) & (
                rec["offset"] == offs[js]) & ((rec["flags"] & R_KEY_TRUNC) == 0)  # fmt: skip
            kl = rec["key_len"].astype(np.int64)
            for j, k, n, g in zip(js.tolist(), rec["key"], kl.tolist(), good.tolist()):
                if g:
                    out[j] = k[:n].tobytes()
                else:
                    missing.append(j)
        if missing:
            found = self._from_index(rows[missing])
            for j, e in zip(missing, found):
                out[j] = e
        return out

    def _from_index(self, rows: np.ndarray) -> list[bytes | None]:
        """Damage only: the rows' keys by a scan of the index (its records name segment, offset, generation)."""
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

    def segment_records(self, seg: int):
        """The sealed records of segment ``seg``'s published objects, all confirmed (a clean close
        confirmed them on disk; other opens write every area before serving, from ``open_keys``:
        the index scan, row i's key at i). After an open: the segment's own records of its live rows."""
        t = self.st.writer.rows
        n = t.n
        rows = np.flatnonzero(t.live[:n] & (t.seg[:n] == seg))
        if not len(rows):
            return None
        open_keys = self.open_keys
        if open_keys is not None:
            enc = [self.st.writer.keys.key_bytes_of(r) if r >= len(open_keys) else _bytes(open_keys[r])
                   for r in rows.tolist()]  # fmt: skip
            return _made(t, rows, enc)
        from .rebuild import read_area
        from .segments import segment_name

        try:
            area, _ = read_area(os.path.join(self.st.path, segment_name(seg)), self.st.segment_bytes)
        except OSError as e:
            log.error("%s: reading the records of segment %d failed: %s", self.st.path, seg, e)
            area = np.zeros(0, area_dtype())
        idx = slot_index(t.off[rows], t.len[rows])
        inside = idx < len(area)
        rec = np.zeros(len(rows), area.dtype)
        rec[inside] = area[idx[inside]]
        good = inside & (rec["magic"] == MAGIC) & ((rec["flags"] & R_VALID) != 0)
        good &= (rec["segment"] == seg) & (rec["offset"] == t.off[rows]) & (rec["length"] == t.len[rows])
        good &= (rec["generation"] == t.gen[rows]) & (record_crcs(np.ascontiguousarray(rec)) == rec["rcrc"])
        rec = rec[good]
        unconf = (rec["flags"] & R_CONFIRMED) == 0
        if unconf.any():
            rec["flags"] |= R_CONFIRMED
            seal(rec)
        bad = rows[~good]
        if len(bad):
            log.error("%s: %d records of segment %d do not match the index; rewritten from it", self.st.path,
                      len(bad), seg)  # fmt: skip
            enc = self._from_index(bad)
            keep = np.fromiter((e is not None for e in enc), bool, len(enc))
            if keep.any():
                rec = np.concatenate([rec, _made(t, bad[keep], [e for e in enc if e is not None])])
        return rec


def area_dtype():
    from .records import RECORD_DTYPE

    return RECORD_DTYPE


def _bytes(k) -> bytes:
    return k.encode("utf-8", "surrogateescape") if type(k) is str else bytes(k)


def _made(t, rows, enc):
    from .index import key_crcs

    return make_records(t.seg[rows], t.off[rows], t.len[rows], t.gen[rows], t.crc[rows], t.depth[rows],
                        key_crcs(enc), enc, R_VALID | R_CONFIRMED)  # fmt: skip
