"""Which objects leave when the store is full.

A policy is a function ``(rows, candidates, slot_bytes, bytes_needed) -> rows to evict``: the
fewest candidates, in its order, whose slots add up to ``bytes_needed``. ``POLICIES`` is the table
``StoreConfig.eviction_policy`` names into. ``reclaim_segment`` picks a whole segment to empty
when a size class has no free slot anywhere.
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
    return cand[order[:m]].tolist()


_DEPTH_BITS = 31


def _lru_key(rows: RowTable, cand: np.ndarray) -> np.ndarray:
    """One sortable int per row: tick, then deepest first (rows without a depth last in a tick)."""
    tick = rows.tick[cand].astype(np.int64)
    depth = rows.depth[cand].astype(np.int64)
    if len(tick) and int(tick.max()) >= 1 << (62 - _DEPTH_BITS):
        # a clock this far on (2**31 batches) gives up the tie-break rather than overflow
        return tick
    return (tick << _DEPTH_BITS) + ((1 << _DEPTH_BITS) - 1 - np.clip(depth, -1, (1 << _DEPTH_BITS) - 2) - 1)


def prefix_aware(rows: RowTable, cand: np.ndarray, slot_bytes: np.ndarray, bytes_needed: int) -> list[int]:
    """Deepest prefix pages first across the whole store, then least recently used.

    Not recommended (kept for configurations that name it): measured on Mooncake's conversation
    trace with SGLang passing prefix keys it keeps 0.57-0.59x LRU's hit rate, as it evicts the
    live conversations' deep context and keeps finished conversations' shallow pages (issue 26).
    ``lru`` already evicts the deepest first among pages used together.

    A page's components share (put batch generation, depth): they leave together. The unit is
    (generation, depth) for rows put with depths; a row of its own otherwise.
    """
    tick = rows.tick[cand]
    depth = rows.depth[cand].astype(np.int64)
    gen = rows.gen[cand]
    solo = depth < 0
    k1 = np.where(solo, cand.astype(np.uint64), gen)
    k2 = np.where(solo, -1, depth)
    k0 = solo.astype(np.int8)
    order0 = np.lexsort((k2, k1, k0))
    s0, s1, s2 = k0[order0], k1[order0], k2[order0]
    new_unit = np.ones(len(order0), bool)
    new_unit[1:] = (s0[1:] != s0[:-1]) | (s1[1:] != s1[:-1]) | (s2[1:] != s2[:-1])
    unit_sorted = np.cumsum(new_unit) - 1
    inv = np.empty(len(cand), np.int64)
    inv[order0] = unit_sorted
    first = order0[new_unit]
    u_bytes = np.bincount(inv, weights=slot_bytes)
    u_tick = np.zeros(len(first), np.uint64)
    np.maximum.at(u_tick, inv, tick)
    u_depth = depth[first]
    order = np.lexsort((u_tick, -u_depth))  # deepest first, then least recently used
    csum = np.cumsum(u_bytes[order])
    m = int(np.searchsorted(csum, bytes_needed)) + 1
    chosen = np.zeros(len(first), bool)
    chosen[order[:m]] = True
    return cand[chosen[inv]].tolist()


POLICIES: dict[str, Policy] = {"lru": lru, "prefix_aware": prefix_aware}


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
    np.maximum.at(recent, segs, rows.tick[live])
    ok = (count > 0) & (pinned == 0) & (count == np.asarray(seg_used))
    if not ok.any():
        return []
    cand = np.flatnonzero(ok)
    seg = int(cand[np.argmin(recent[cand])])
    return live[segs == seg].tolist()
