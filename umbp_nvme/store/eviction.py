"""Which objects leave when the store is full.

A policy is a function ``(rows, candidates, slot_bytes, bytes_needed) -> rows to evict``: the
fewest candidates, in its order, whose slots add up to ``bytes_needed``. ``POLICIES`` is the table
``StoreConfig.eviction_policy`` names into. ``reclaim_segment`` picks a whole segment to empty
when a size class has no free slot anywhere.

Reads: the writer's rows handed in (writer.rows). Changes: nothing (the store drops what it picks).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .rows import RowTable
from .segments import size_classes


class Policy(Protocol):
    def __call__(self, rows: RowTable, cand: np.ndarray, slot_bytes: np.ndarray, bytes_needed: int) -> list[int]: ...


def lru(rows: RowTable, cand: np.ndarray, slot_bytes: np.ndarray, bytes_needed: int) -> list[int]:
    """Least recently used first (a put or a hit makes a row recent); among rows used together
    (one tick: a put batch, a read batch), the deepest prefix page first, so an ancestor does not
    leave before the descendants it was used with (rows without a depth keep their row order).

    Eviction runs in small steps near the high watermark, so only the few rows that leave are
    sorted: a partition picks every candidate that can be among them (O(n), not a full sort)."""
    key = _lru_key(rows, cand)
    k = min(len(cand), int(-(-bytes_needed // max(1, int(slot_bytes.min())))) + 1)
    pick = np.argpartition(key, k - 1)[:k] if k < len(cand) else np.arange(len(cand))
    order = pick[np.lexsort((pick, key[pick]))]
    csum = np.cumsum(slot_bytes[order])
    m = int(np.searchsorted(csum, bytes_needed)) + 1
    out = order[:m]
    last = out[-1]
    depth = rows.depth[cand]
    if depth[last] >= 0:  # the components of the last page (same tick and depth) leave with it
        tick = rows.used(cand)
        out = np.union1d(out, np.flatnonzero((tick == tick[last]) & (depth == depth[last])))
    return cand[out].tolist()


_DEPTH_BITS = 31


def _lru_key(rows: RowTable, cand: np.ndarray) -> np.ndarray:
    """One sortable int per row: tick, then deepest first (rows without a depth last in a tick).
    Ticks are the generation clock's (clock.py: they start far up), so they are taken relative to
    the oldest candidate's."""
    tick = rows.used(cand)
    if not len(tick):
        return tick.astype(np.int64)
    rel = (tick - tick.min()).astype(np.int64)
    if int(rel.max()) >= 1 << (62 - _DEPTH_BITS):
        # 2**31 batches between the oldest and newest candidate: order by tick alone rather than overflow
        return rel
    depth = rows.depth[cand].astype(np.int64)
    return (rel << _DEPTH_BITS) + ((1 << _DEPTH_BITS) - 2 - np.clip(depth, -1, (1 << _DEPTH_BITS) - 2))


# "prefix_aware" names lru: its old meaning, deepest first across the whole store, kept 0.29-0.59x
# LRU's hit rate on Mooncake's trace with SGLang passing prefix keys (docs/cache-policy.md); lru
# evicts the deepest first among pages used together, which is the prefix-aware part that helps
POLICIES: dict[str, Policy] = {"lru": lru, "prefix_aware": lru}


def victims(policy: Policy, rows: RowTable, bytes_needed: int) -> list[int]:
    cand = rows.candidates()
    if not len(cand) or bytes_needed <= 0:
        return []
    return policy(rows, cand, size_classes(rows.len[cand]), bytes_needed)


def reclaim_segment(rows: RowTable, n_segments: int, seg_used) -> list[int]:
    """The rows of the least recently used segment whose slots are all published and unpinned
    (empty list when there is none)."""
    live = np.flatnonzero(rows.live[: rows.n])
    if not len(live):
        return []
    segs = rows.seg[live]
    count = np.bincount(segs, minlength=n_segments)
    pinned = np.bincount(segs, weights=rows.pins[live] > 0, minlength=n_segments)
    recent = np.zeros(n_segments, np.uint64)
    np.maximum.at(recent, segs, rows.used(live))
    ok = (count > 0) & (pinned == 0) & (count == np.asarray(seg_used))
    if not ok.any():
        return []
    cand = np.flatnonzero(ok)
    seg = int(cand[np.argmin(recent[cand])])
    return live[segs == seg].tolist()
