"""The writer's in-memory table of published objects: one row per key, as parallel numpy arrays.

A row holds where the object lives (segment, offset, length), what to check (crc, flags), when
it was put (generation) and used (tick), its prefix depth, how many reads have it pinned, and
whether it is live (in the index). ``index`` maps key -> row; ``key`` maps row -> key. Rows of
deleted keys are reused; a row still pinned by a read keeps its slot until the read ends
(``dead_pinned``). Loop thread only, except ``index`` lookups (dict reads are atomic under the GIL).

State: its own (the table); a writer's is writer.rows (writer.keys is its dict).
"""

from __future__ import annotations

import numpy as np

COLUMNS = (
    ("seg", np.int64),
    ("off", np.int64),
    ("len", np.int64),
    ("crc", np.uint32),
    ("flags", np.uint32),
    ("gen", np.uint64),
    ("depth", np.int32),
    ("tick", np.uint64),  # last use, for LRU (a put or a hit stamps the store's clock)
    ("pins", np.int32),  # reads in flight on this row's slot
    ("live", bool),
)
ROWS_MIN = 1024


class RowTable:
    __slots__ = tuple(name for name, _ in COLUMNS) + ("key", "index", "n", "free", "dead_pinned", "_free_slot")

    def __init__(self, keys: list[str], recs: np.ndarray, free_slot):
        """Rows for ``keys`` and their index records ``recs``; ``free_slot(seg, off)`` gives a slot back."""
        n = len(keys)
        cap = max(ROWS_MIN, int(n * 1.25))
        for name, dtype in COLUMNS:
            setattr(self, name, np.zeros(cap, dtype))
        if n:
            self.seg[:n] = recs["segment"]
            self.off[:n] = recs["offset"]
            self.len[:n] = recs["length"]
            self.crc[:n] = recs["crc"]
            self.flags[:n] = recs["flags"]
            self.gen[:n] = recs["generation"]
            self.depth[:n] = recs["depth"]
            self.tick[:n] = recs["generation"]  # LRU order after a restart: put order
            self.live[:n] = True
        self.key: list[str | None] = keys
        self.index: dict[str, int] = dict(zip(keys, range(n)))
        self.n = n
        self.free: list[int] = []
        self.dead_pinned: set[int] = set()  # deleted rows whose slot waits for a read to finish
        self._free_slot = free_slot

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
            self.key.extend([None] * need)
        return np.asarray(rows, dtype=np.int64)

    def _grow(self, n: int) -> None:
        cap = max(n, 2 * len(self.seg))
        for name, _ in COLUMNS:
            a = getattr(self, name)
            b = np.zeros(cap, a.dtype)
            b[: len(a)] = a
            setattr(self, name, b)

    def release(self, rows) -> None:
        """Give back the slots of rows already gone from the index (deferred while pinned)."""
        for r in rows:
            if self.pins[r] > 0:
                self.dead_pinned.add(r)
            else:
                self._free_slot(int(self.seg[r]), int(self.off[r]))
                self.key[r] = None
                self.free.append(r)

    def pin(self, rows: np.ndarray) -> None:
        np.add.at(self.pins, rows, 1)

    def unpin(self, rows: np.ndarray) -> None:
        np.subtract.at(self.pins, rows, 1)
        if self.dead_pinned:
            done = [r for r in set(rows.tolist()) if r in self.dead_pinned and self.pins[r] == 0]
            for r in done:
                self.dead_pinned.discard(r)
            self.release(done)

    def candidates(self) -> np.ndarray:
        """Rows eviction may take: live and not pinned by a read."""
        n = self.n
        return np.flatnonzero(self.live[:n] & (self.pins[:n] == 0))

    def pinned_count(self) -> int:
        return int((self.pins[: self.n] > 0).sum())
