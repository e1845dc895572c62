"""Where a get's objects are, and whether keys are stored: a writer asks its rows (in memory), a
read-only opener the index (through its watch on the writer's file, follower.py). ``ReadBatch``
is what a lookup hands the read (get_path.py). A mixin of PageStore.

Reads: writer.keys and writer.rows (writers), state.watch and state.index (readers), state.files
(a reader opens the segment files its lookups name). Changes: nothing.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from ..keybytes import encode_key, key_error
from .checks import plain_keys
from .row_keys import HitCheck
from .index import REC_BYTES, REC_DTYPE
from .rows import OFF_SHIFT

log = logging.getLogger("umbp_nvme.store")


class ReadBatch:
    """The objects one get_many reads: key index, extent, checks and destination per object."""

    FIELDS = ("idx", "segs", "offs", "lens", "crcs", "flags", "gens", "rows", "dst", "devm")
    __slots__ = FIELDS + ("aligned",)

    def __init__(self, idx, segs, offs, lens, crcs, flags, gens, rows=None):
        self.idx, self.segs, self.offs, self.lens, self.crcs, self.flags, self.gens, self.rows = (
            idx, segs, offs, lens, crcs, flags, gens, rows,
        )  # fmt: skip
        self.dst = self.devm = None
        self.aligned = False  # every dst is host memory that O_DIRECT takes as it is (nothing to bounce)

    def keep(self, sel) -> None:
        for name in self.FIELDS:
            a = getattr(self, name)
            if a is not None:
                setattr(self, name, a[sel])

    def __len__(self) -> int:
        return len(self.idx)


class Lookups:
    def exists_many_nowait(self, keys: list[str]) -> list[bool]:
        """``exists_many`` without the event loop: callable from any thread (reads the index directly).

        Thread-safe: dict reads are atomic under the GIL; LMDB read txns are per call. A key
        that cannot be stored (not a str, empty, no lossless bytes) is False alone."""
        if self.state.closed:
            self._closed_call("exists_many")
            return [False] * len(keys)
        if self.writer is None:  # from the follower's key set once built (follower_keys.py), else LMDB
            got = self.state.watch.read(lambda ix: self.state.watch.keys.contains(ix, keys), None)
            return got.tolist() if got is not None else [v is not None for v in self._index_lookup(keys)]
        if self._loading():  # loading.py: nothing is served before it was loaded and checked
            self._loading_misses(len(keys))
            return [False] * len(keys)
        # from the hash alone: a false positive is a miss on get, at N / 2**63 per absent key (keymap.py)
        return self.writer.keys.present(keys).tolist()  # a key that is not a str is absent

    def exists_prefix_nowait(self, keys: list[str]) -> int:
        """``exists_prefix`` without the event loop: callable from any thread (reads the index directly)."""
        if self.state.closed:
            self._closed_call("exists_prefix")
            return 0
        if self.writer is None:
            return self.state.watch.read(lambda ix: self._follower_prefix(ix, keys), 0)
        if self._loading():
            self._loading_misses(len(keys))
            return 0
        return self.writer.keys.prefix(keys)  # a key that is not a str is absent: the prefix ends there

    async def exists_many(self, keys: list[str]) -> list[bool]:
        """Per key, whether ``get_many`` would find it now (True) or it is absent (False).

        A key that cannot be stored (not a str, empty, too long) is False alone; a closed store answers
        all False. Never raises for a key; reads only the index (no data I/O).
        """
        return self.exists_many_nowait(keys)

    async def exists_prefix(self, keys: list[str]) -> int:
        """How many of ``keys``, from the first on, are stored: the index of the first absent key.

        SGLang's prefix match: ``keys`` are a page sequence's keys in order. 0 when the first is absent,
        the store is closed, or a key cannot be stored. Never raises for a key; reads only the index.
        """
        return self.exists_prefix_nowait(keys)

    def _follower_prefix(self, ix, keys) -> int:
        """A follower's exists_prefix: from its key set once built (follower_keys.py), else one LMDB get a key."""
        n = self.state.watch.keys.prefix(ix, keys)
        if n is not None:
            return n
        enc = self._index_keys(keys)
        if None in enc:
            enc = enc[: enc.index(None)]
        return ix.exists_prefix(enc)

    def _index_keys(self, keys) -> list[bytes | None]:
        """Index key bytes per key; None for a key no index key can hold (not a str, empty, no
        lossless bytes, too long): that key alone is a miss."""
        if self.state.index is None:  # a reader whose index opens in the background (loading.py): misses
            return [None] * len(keys)
        maxk = self.state.index.max_key_bytes
        if plain_keys(keys) and (not keys or max(map(len, keys)) <= maxk):
            return [k.encode() for k in keys]
        enc = []
        for k in keys:
            b = encode_key(k) if key_error(k) is None else None
            enc.append(b if b is not None and len(b) <= maxk else None)
        return enc

    def _index_lookup(self, keys) -> list[bytes | None]:
        """Readers: the index record per key (None: absent, or a key that cannot be stored)."""
        enc = self._index_keys(keys)
        if None not in enc:
            return self.state.watch.records(enc)
        found = iter(self.state.watch.records([b for b in enc if b is not None]))
        return [None if b is None else next(found) for b in enc]

    def generation_of(self, key: str) -> int:
        """The generation of ``key``'s object here (it orders puts, also across the drives of one
        writer: drive_clock.py); -1 when it is absent."""
        w = self.writer
        if w is None:
            v = self._index_lookup([key])[0]
            if v is None or len(v) != REC_BYTES:
                return -1
            return int(np.frombuffer(v, dtype=REC_DTYPE)["generation"][0])
        r = w.keys.get(key)
        return -1 if r is None else int(w.rows.gen[r])

    def _writer_rows(self, keys) -> list:
        """Writers: the row per key, None when absent (a key that is not a str is never present)."""
        return [None if r < 0 else r for r in self.writer.keys.rows(keys).tolist()]

    def _lookup_reader(self, keys: list[str]) -> ReadBatch | None:
        """Readers: records from LMDB for the present keys."""
        vals = self._index_lookup(keys)
        idx = [i for i, v in enumerate(vals) if v is not None and len(v) == REC_BYTES]
        if not idx:
            return None
        recs = np.frombuffer(b"".join(vals[i] for i in idx), dtype=REC_DTYPE)
        return ReadBatch(
            np.asarray(idx, np.int64),
            recs["segment"].astype(np.int64),
            recs["offset"].astype(np.int64),
            recs["length"].astype(np.int64),
            recs["crc"].astype(np.uint32),
            recs["flags"].astype(np.uint32),
            recs["generation"].astype(np.uint64),
        )

    def _lookup(self, keys) -> ReadBatch | None:
        """The stored objects among ``keys`` (None when there is none). A writer's rows are its key
        table's candidates: a get confirms them while it reads (``_confirm_begin``)."""
        if self.writer is None:
            b = self._lookup_reader(keys)
            if b is None:
                return None
            for s in np.unique(b.segs).tolist():
                if not self.state.files.ensure(s):
                    b.keep(b.segs != s)
            return b if len(b) else None
        km, t = self.writer.keys, self.writer.rows
        if type(keys) is list:
            got = km.take(keys, (t.seg, t.off_4k, t.len, t.crc, t.flags, t.gen), OFF_SHIFT)
            if got is not None:  # one pass (keyindex.c); the rows are candidates, confirmed while reading
                return ReadBatch(*got) if got.shape[1] else None
        rows = km.candidates(keys, -1)
        if rows.min(initial=0) == -2:
            for i in np.flatnonzero(rows == -2).tolist():  # a hash shared by stored keys (rare): the key's own row, confirmed now
                rows[i] = km.get(keys[i], -1)
        return self._batch_of_rows(rows)

    def _records_in_memory(self, b) -> bool:
        """Writers: confirming the rows of read batch ``b`` reads no record from disk."""
        src = self.writer.keys.source
        return src is None or src.in_memory(b.segs, b.offs, b.lens)

    async def _confirm_begin(self, b: ReadBatch, keys, in_memory: bool):
        """Writers: a task answering, per object of ``b``, whether its row holds the key (a hash hit
        is a candidate: keymap.py): held long keys in memory, the others by their records, read
        while the data is (row_keys.py) unless ``in_memory``."""
        if not in_memory:
            task = asyncio.ensure_future(self._confirmed(b, keys))
            await asyncio.sleep(0)  # it submits its few record reads now, ahead of the data's (a full ring queues the rest)
            return task
        # nothing to read: the comparison runs once the data's reads are submitted, while they are in flight
        return asyncio.ensure_future(self._confirmed(b, keys, behind=True))

    async def _confirmed(self, b: ReadBatch, keys, behind: bool = False) -> np.ndarray:
        if behind:
            await asyncio.sleep(0)  # the data read's task, started after this one, runs (submits) first
        hits = Hits(self.writer.keys, b, keys)
        rr = hits.reads
        if rr is not None:  # the record blocks as a batch of their own; unreadable ones confirm nothing (a miss)
            read = asyncio.ensure_future(self.state.read_engine.read_many(
                self.state.files.batch(rr.segs), rr.offs, rr.addrs, rr.lens))  # fmt: skip
            try:  # None at io_timeout_s; it returns (or raises our caller's cancellation) once the batch has ended
                rr.res = await self._await_io(read, "read", rr.segs)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                log.error("%s: reading %d record blocks failed: %r", self.path, len(rr.lens), e)
        return hits.answer()

    def _batch_of_rows(self, rows) -> ReadBatch | None:
        if not len(rows):
            return None
        hit = rows >= 0
        if hit.all():
            idx = np.arange(len(rows), dtype=np.int64)
        else:
            idx = np.flatnonzero(hit)
            if not len(idx):
                return None
            rows = rows[idx]
        t = self.writer.rows
        # the columns are narrow (rows.py); the read path computes in int64
        return ReadBatch(idx, t.seg[rows].astype(np.int64), t.off[rows], t.len[rows].astype(np.int64), t.crc[rows],
                         t.flags[rows].astype(np.uint32), t.gen[rows], rows)  # fmt: skip

    def _unchanged(self, b: ReadBatch, keys) -> np.ndarray:
        """Readers: which keys still have the generation looked up (another process may have
        evicted and reused the slot while we read it)."""
        m = len(b)
        after = self._lookup_reader([keys[i] for i in b.idx.tolist()])
        now = np.zeros(m, np.uint64)
        present = np.zeros(m, bool)
        if after is not None:
            now[after.idx] = after.gens
            present[after.idx] = True
        return present & (now == b.gens)


class Hits:
    """A writer's get hits to confirm (a hash hit is a candidate: keymap.py): keys longer than a
    record holds in memory, the others by their records (row_keys.HitCheck: ``reads`` are the
    record blocks to read, as a batch of their own), what neither confirms by the index."""

    def __init__(self, km, b: ReadBatch, keys):
        rows = b.rows
        whole = len(rows) == len(keys) and bool((np.diff(b.idx) > 0).all())  # idx is 0..n-1 (not reordered)
        self.km, self.rows = km, rows
        self.ks = ks = keys if whole else [keys[i] for i in b.idx.tolist()]
        self.held = km.held(rows)
        self.rest = np.flatnonzero(~self.held)
        self.check = None
        if len(self.rest) and km.source is not None:
            sub = ks if len(self.rest) == len(ks) else [ks[j] for j in self.rest.tolist()]
            self.check = HitCheck(km.source, sub, rows[self.rest])
        self.reads = None if self.check is None else self.check.reads

    def answer(self) -> np.ndarray:
        """Whether each row holds its key (the record reads, if any, have ended)."""
        km, ks, rows, held = self.km, self.ks, self.rows, self.held
        ok = np.zeros(len(rows), bool)
        if held.any():
            ok[held] = km.confirm([ks[j] for j in np.flatnonzero(held).tolist()], rows[held])
        if self.check is not None:
            ok[self.rest] = self.check.finish()
        no = np.flatnonzero(~ok)
        if len(no):  # a collision, or a record that disagrees with the index (damage): the index decides
            ok[no] = km.confirm([ks[j] for j in no.tolist()], rows[no])
        return ok
