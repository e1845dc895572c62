"""Generations that compare across the drives of a multi-drive store, and the newest copy of a key.

A key should live on one drive, but two copies can meet: two put batches racing for a new key
placed it on two drives, a drop of a stale copy failed, a store written before drive membership
had memory (drive_sessions.py). A lookup then serves the copy with the newest generation, never
the first drive in root order (drives.MultiDriveStore._holders).

That needs one clock: each PageStore counts its generations (one per put batch, also its LRU
ticks) on its own, so drive A's 900th batch and drive B's 12th say nothing about which came
later. ``SetClock`` makes every writer drive of the set draw from one counter, started at the
highest clock of the drives as they open; each store's own ``_clock`` (what it persists as its
high-water mark) follows what it drew. Readers draw nothing: they compare the generations the
writer recorded in LMDB.

This reaches into PageStore's ``_tick`` / ``_clock``; when PageStore takes a clock of its own
(``PageStore.open(..., clock=...)``), the multi-drive store passes one to every drive instead.
"""

from __future__ import annotations

import logging

import numpy as np

from .index import REC_BYTES, REC_DTYPE

log = logging.getLogger("umbp_nvme.store")


class SetClock:
    """One generation counter for the writer drives of a set."""

    def __init__(self):
        self.now = 0

    def attach(self, st) -> None:
        """Make ``st`` (an open writer PageStore) draw its generations from this clock."""
        if st.readonly or type(getattr(st, "_clock", None)) is not int:
            return  # a reader draws none; a store with a clock object of its own is not rewired here
        self.now = max(self.now, st._clock)

        def tick() -> int:
            self.now += 1
            st._clock = self.now  # the store persists its high-water mark from this
            return self.now

        st._tick = tick


def generation(st, key: str) -> int:
    """The generation of ``key``'s copy on ``st`` (-1 when it has none)."""
    if st.readonly:
        v = st._index_lookup([key])[0]
        if v is None or len(v) != REC_BYTES:
            return -1
        return int(np.frombuffer(v, dtype=REC_DTYPE)["generation"][0])
    r = st._keys.get(key)
    return -1 if r is None else int(st._rows.gen[r])


def newest(stores, key: str, drives: list[int]) -> int:
    """Of ``drives`` (each holding ``key``, in lookup order), the one whose copy is newest; a tie
    keeps the earlier one."""
    best, best_gen = drives[0], generation(stores[drives[0]], key)
    for d in drives[1:]:
        g = generation(stores[d], key)
        if g > best_gen:
            best, best_gen = d, g
    return best
