"""The writer's in-memory table of published objects: one row per key, as parallel numpy arrays.

A row holds where the object lives (segment, offset, length), what to check (crc, flags), when
it was put (generation) and used (tick), its prefix depth, how many reads have it pinned, and
whether it is live (in the index). ``index`` maps key -> row (a hash per row in the native key
table, confirmed against the key on disk: keymap.py) and ``key[r]`` is row r's key, read from its
record (row_keys.py): no Python object and no key bytes in memory per row. Columns are as narrow as their
values allow (42 bytes a row: the offset is kept in 4 KiB units, ``off`` reads and writes bytes);
a writer's are reserved for every slot of the store as anonymous mappings (``zeros``), so
memory holds only the pages written and filling never copies a column. Rows of deleted keys are
reused; a row still pinned by a read keeps its slot until the read ends (``dead_pinned``).
Loop thread only, except ``index`` lookups (keymap.py).

State: its own (the table); a writer's is writer.rows (writer.keys is its key map).
"""

from __future__ import annotations

import mmap

import numpy as np

from .._keyindex import add_at, scatter
from .keymap import KeyMap, PackedKeys, RowKeys
from .records import KEY_INLINE
from .walked_keys import HashedKeys

COLUMNS = (
    ("seg", np.int32),  # segment numbers come from capacity // segment bytes: far below 2**31
    ("off_4k", np.uint32),  # offset / 4 KiB (slots are 4 KiB-aligned; 2**32 of them reach 16 TiB > segments' 1 TiB)
    ("len", np.uint32),  # object bytes; records hold them as uint32 too
    ("crc", np.uint32),
    ("flags", np.uint8),  # FLAG_CRC | FLAG_KEYCRC
    ("gen", np.uint64),
    ("depth", np.int32),
    ("tick", np.uint64),  # last hit or re-put (the store's clock), 0 when none since its put: ``used``
    ("pins", np.int32),  # reads in flight on this row's slot
    ("live", bool),
)
ROWS_MIN = 1024
OFF_SHIFT = 12  # the offset column's unit: SLOT_ALIGN_BYTES
MAPPED_MIN_BYTES = 1 << 20  # a column this large is an anonymous mapping of its own (zeros)


def zeros(n: int, dtype) -> np.ndarray:
    """n zeros. A large column is a private anonymous mapping: its pages cost memory only once
    written and go back to the kernel with the array, so room reserved ahead and a grown-out
    column leave no resident memory (from the heap, glibc keeps freed columns: issue 36)."""
    nbytes = n * np.dtype(dtype).itemsize
    if nbytes < MAPPED_MIN_BYTES:
        return np.zeros(n, dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype, n)


class ByteOffsets:
    """``rows.off``: the offset column in bytes (int64) over its 4 KiB units, for reads and writes."""

    __slots__ = ("_a",)

    def __init__(self, a: np.ndarray):
        self._a = a

    def __getitem__(self, i):
        v = self._a[i]
        return v.astype(np.int64) << OFF_SHIFT if isinstance(v, np.ndarray) else int(v) << OFF_SHIFT

    def __setitem__(self, i, v) -> None:
        v = np.asarray(v, np.int64)
        if (v & ((1 << OFF_SHIFT) - 1)).any():
            raise ValueError("object offsets are 4 KiB-aligned")
        self._a[i] = v >> OFF_SHIFT

    def __len__(self) -> int:
        return len(self._a)


class RowTable:
    __slots__ = tuple(name for name, _ in COLUMNS) + ("key", "index", "n", "free", "dead_pinned", "_free_slot")

    def __init__(self, keys: list, recs: np.ndarray, free_slot, reserve: int = 0):
        """Rows for ``keys`` (str, their bytes, PackedKeys or HashedKeys) and their index records ``recs``; ``free_slot(seg,
        off)`` gives a slot back. ``reserve``: rows to make room for now (the store's slots: puts
        then never grow the columns; room never written costs no memory, ``zeros``)."""
        n = len(keys)
        cap = max(ROWS_MIN, n + n // 64)  # little slack: puts grow it by a quarter
        try:
            cols = [zeros(max(cap, reserve), dtype) for _, dtype in COLUMNS]
        except OSError:  # no address space or commit charge for the reserve (strict overcommit): grown as needed
            cols = [zeros(cap, dtype) for _, dtype in COLUMNS]
        for (name, _), col in zip(COLUMNS, cols):
            setattr(self, name, col)
        if n:
            self.seg[:n] = recs["segment"]
            self.off[:n] = recs["offset"]
            self.len[:n] = recs["length"]
            self.crc[:n] = recs["crc"]
            self.flags[:n] = recs["flags"]
            self.gen[:n] = recs["generation"]
            self.depth[:n] = recs["depth"]
            self.live[:n] = True
        self.index = KeyMap(held_over=KEY_INLINE)  # longer keys than a record holds stay in memory
        if isinstance(keys, (PackedKeys, HashedKeys)):
            self.index.load(keys)
        elif n:
            self.index.set_rows(keys, np.arange(n, dtype=np.int64))
        self.key = RowKeys(self.index)
        self.n = n
        self.free: list[int] = []
        self.dead_pinned: set[int] = set()  # deleted rows whose slot waits for a read to finish
        self._free_slot = free_slot

    @property
    def off(self) -> ByteOffsets:
        return ByteOffsets(self.off_4k)

    def new(self, k: int) -> np.ndarray:
        """k unused rows (reused ones first)."""
        free = self.free
        take = min(k, len(free))
        rows = free[len(free) - take :][::-1]
        del free[len(free) - take :]
        need = k - take
        if need:
            if self.n + need > len(self.seg):
                self._grow(self.n + need)
            rows.extend(range(self.n, self.n + need))
            self.n += need
        return np.asarray(rows, dtype=np.int64)

    def fill(self, rows: np.ndarray, seg, off, length, crc, flags: int, gen: int, depth) -> None:
        """Rows just published: their columns in one native pass (a numpy call per column cost
        ~5-10 us each on a put batch's cold caches). ``off`` in bytes (4 KiB-aligned, else
        ValueError and nothing written); the rows are live, last used at ``gen`` (``used``). Rows
        from ``new`` have pins and tick 0 already (``release`` frees only unpinned rows, resetting
        tick): left unwritten, a filling writer's pages of them stay untouched (no memory, issue 36)."""
        cols = (self.seg, self.off_4k, self.len, self.crc, self.flags, self.gen, self.depth, self.live)
        scatter(np.ascontiguousarray(rows, np.int64), cols,
                (seg, (off, OFF_SHIFT), length, crc, int(flags), int(gen), depth, 1))  # fmt: skip

    def _grow(self, n: int) -> None:
        cap = max(n, len(self.seg) + len(self.seg) // 4)
        for name, _ in COLUMNS:
            a = getattr(self, name)
            b = zeros(cap, a.dtype)
            b[: len(a)] = a
            setattr(self, name, b)

    def release(self, rows) -> None:
        """Give back the slots of rows already gone from the index (deferred while pinned)."""
        gone = []
        for r in rows:
            if self.pins[r] > 0:
                self.dead_pinned.add(r)
            else:
                self._free_slot(int(self.seg[r]), int(self.off[r]))
                gone.append(r)
        if gone:
            self.index.forget_rows(gone)
            self.tick[gone] = 0  # a reused row starts unused since its put (fill leaves tick alone)
            self.free.extend(gone)

    def pin(self, rows: np.ndarray) -> None:
        # a repeated row counts each time (a fancy-index add would count it once)
        add_at(self.pins, np.ascontiguousarray(rows, np.int64), 1)

    def unpin(self, rows: np.ndarray) -> None:
        add_at(self.pins, np.ascontiguousarray(rows, np.int64), -1)
        if self.dead_pinned:
            done = [r for r in set(rows.tolist()) if r in self.dead_pinned and self.pins[r] == 0]
            for r in done:
                self.dead_pinned.discard(r)
            self.release(done)

    def used(self, rows: np.ndarray) -> np.ndarray:
        """When each row was last used (LRU): its last hit or re-put, else its put. A put leaves its
        tick 0 rather than a copy of its generation: a filling writer's and a reopened writer's
        tick pages stay untouched, 8 B of memory per row (issue 36)."""
        return np.maximum(self.tick[rows], self.gen[rows])

    def candidates(self) -> np.ndarray:
        """Rows eviction may take: live and not pinned by a read."""
        n = self.n
        return np.flatnonzero(self.live[:n] & (self.pins[:n] == 0))

    def pinned_count(self) -> int:
        return int((self.pins[: self.n] > 0).sum())

