"""Generations that compare across the drives of a multi-drive store, and the newest copy of a key.

A key should live on one drive, but two copies can meet: two put batches racing for a new key
placed it on two drives, a drop of a stale copy failed, a store written before drive membership
had memory (drive_sessions.py). A lookup then serves the copy with the newest generation, never
the first drive in root order (drives.MultiDriveStore._holders).

That needs one clock: the writer opens every drive on one ``clock.GenerationClock``
(``PageStore.open(clock=...)``), so generations order puts across drives, and every drive's
persisted bound covers them all. Readers draw nothing: they compare the generations the writer
recorded in LMDB.

Reads: each drive store's generations (``PageStore.generation_of``). Changes: nothing.
"""

from __future__ import annotations

import logging

log = logging.getLogger("umbp_nvme.store")


def generation(st, key: str) -> int:
    """The generation of ``key``'s copy on ``st`` (-1 when it has none)."""
    return st.generation_of(key)


def newest(stores, key: str, drives: list[int]) -> int:
    """Of ``drives`` (each holding ``key``, in lookup order), the one whose copy is newest; a tie
    keeps the earlier one."""
    best, best_gen = drives[0], generation(stores[drives[0]], key)
    for d in drives[1:]:
        g = generation(stores[d], key)
        if g > best_gen:
            best, best_gen = d, g
    return best
