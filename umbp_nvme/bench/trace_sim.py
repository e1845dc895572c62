"""In-memory cache simulator for prefix-cache traces: LRU, clairvoyant (Belady with admission),
and any admission policy in front of LRU, in well under a second per run.

It makes the calls SGLang's controller makes, per request in trace order: an optional LRU host
tier (``l2``) matches the leading blocks it holds; the L3 answers how many of the following
blocks are present as a run from the first (the prefix hit), those are read, and every block
after the hit is written (backup). A block present after the first missing one is not a hit
and is written again (the store keeps the first copy, the write refreshes it).

Hit rates: block-weighted (hit blocks / request blocks) and token-weighted (hit tokens, at most
the request's input length / input tokens). ``written`` counts blocks the cache stored, so
``written / hits`` is device bytes per hit byte.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from .trace_file import BLOCK_TOKENS, HitRates, Trace

NEVER = np.iinfo(np.int64).max


@dataclass
class SimResult(HitRates):
    policy: str
    capacity: int
    written: int = 0  # blocks stored in L3
    declined: int = 0  # writes the admission policy refused
    extra: dict = field(default_factory=dict)

    @property
    def written_per_hit(self) -> float:
        return self.written / self.hit_blocks if self.hit_blocks else float("inf")

    @property
    def mean_held(self) -> float:
        return self.held_sum / self.requests if self.requests else 0.0

    def as_dict(self) -> dict:
        return {"policy": self.policy, "capacity_blocks": self.capacity, "hit_rate": round(self.hit_rate, 4),
                "token_hit_rate": round(self.token_hit_rate, 4), "hit_blocks": self.hit_blocks,
                "total_blocks": self.total_blocks, "l2_hit_blocks": self.l2_hit_blocks, "written_blocks": self.written,
                "declined_blocks": self.declined, "written_per_hit": round(self.written_per_hit, 3),
                "mean_held_blocks": round(self.mean_held, 1), **self.extra}  # fmt: skip


class Cache:
    """The L3 under simulation. ``now`` is the request index; ``pos`` the block's position in
    the trace's flat order (the clairvoyant policy looks its next use up by it)."""

    name = "cache"

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.declined = 0
        self.written = 0

    def __len__(self) -> int:
        raise NotImplementedError

    def prefix(self, blocks: np.ndarray, now: int) -> int:
        raise NotImplementedError

    def read(self, blocks: np.ndarray, pos: int, now: int) -> None:
        raise NotImplementedError

    def write(self, blocks: np.ndarray, pos: int, now: int) -> None:
        raise NotImplementedError


class LRU(Cache):
    """Least recently used. ``admission`` (optional) has the store's admission interface
    (``store/admission.py``): ``offer(page ids) -> bool mask`` for new blocks, ``used(page ids)``
    for hits, ``evicted(page ids)``; page ids are ``block_page_ids`` of the block numbers."""

    name = "lru"

    def __init__(self, capacity: int, admission=None, name: str | None = None):
        super().__init__(capacity)
        self.d: dict[int, None] = {}
        self.admission = admission
        if name:
            self.name = name

    def __len__(self) -> int:
        return len(self.d)

    def prefix(self, blocks, now) -> int:
        d = self.d
        n = 0
        for b in blocks.tolist():
            if b not in d:
                break
            n += 1
        return n

    def read(self, blocks, pos, now) -> None:
        d = self.d
        for b in blocks.tolist():
            del d[b]
            d[b] = None
        if self.admission is not None:
            self.admission.used(block_page_ids(blocks))

    def write(self, blocks, pos, now) -> None:
        d = self.d
        bl = blocks.tolist()
        adm = self.admission
        ok = None
        if adm is not None:
            held = np.fromiter((b in d for b in bl), bool, len(bl))
            if held.any():
                adm.used(block_page_ids(blocks[held]))
            new = blocks[~held]
            if len(new):
                ok = dict(zip(new.tolist(), adm.offer(block_page_ids(new)).tolist()))
        cap = self.capacity
        gone = []
        for b in bl:
            if b in d:
                del d[b]
                d[b] = None
                continue
            if ok is not None and not ok.get(b, True):  # held when the write began: evicted by it
                self.declined += 1
                continue
            if len(d) >= cap:
                v = next(iter(d))
                del d[v]
                gone.append(v)
            d[b] = None
            self.written += 1
        if gone and adm is not None:
            adm.evicted(block_page_ids(np.asarray(gone, np.int64)))


def block_page_ids(blocks: np.ndarray) -> np.ndarray:
    """uint64 page ids of block numbers (splitmix64: the store's ids are hashes too)."""
    z = blocks.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class Belady(Cache):
    """Clairvoyant: evicts the block used farthest in the future and declines a block whose
    next use is farther than every held block's (or that is never used again)."""

    name = "clairvoyant"

    def __init__(self, capacity: int, next_use: np.ndarray):
        super().__init__(capacity)
        self.next_use = next_use  # per flat position: the next request using that block, NEVER if none
        self.d: dict[int, int] = {}
        self.heap: list[tuple[int, int]] = []  # (-next use, block), stale entries skipped

    def __len__(self) -> int:
        return len(self.d)

    prefix = LRU.prefix

    def _touch(self, b: int, nu: int) -> None:
        self.d[b] = nu
        heapq.heappush(self.heap, (-nu, b))

    def _top(self) -> tuple[int, int]:
        h, d = self.heap, self.d
        while True:
            nu, b = h[0]
            if d.get(b) == -nu:
                return -nu, b
            heapq.heappop(h)

    def read(self, blocks, pos, now) -> None:
        nus = self.next_use[pos : pos + len(blocks)].tolist()
        for b, nu in zip(blocks.tolist(), nus):
            self._touch(b, nu)

    def write(self, blocks, pos, now) -> None:
        d = self.d
        nus = self.next_use[pos : pos + len(blocks)].tolist()
        for b, nu in zip(blocks.tolist(), nus):
            if b in d:
                self._touch(b, nu)
                continue
            if nu == NEVER:
                self.declined += 1
                continue
            if len(d) >= self.capacity:
                far, victim = self._top()
                if far <= nu:
                    self.declined += 1
                    continue
                heapq.heappop(self.heap)
                del d[victim]
            self._touch(b, nu)
            self.written += 1


def next_use(trace: Trace) -> np.ndarray:
    """Per flat position: the index of the next request holding the same block (NEVER if none)."""
    out = np.empty(trace.total_blocks, np.int64)
    last = np.full(trace.n_blocks, NEVER, np.int64)
    pos = trace.total_blocks
    for i in range(len(trace.reqs) - 1, -1, -1):
        blocks = trace.reqs[i]
        pos -= len(blocks)
        out[pos : pos + len(blocks)] = last[blocks]
        last[blocks] = i
    return out


class PerfectAdmission:
    """An admission oracle: admit a block only if some later request uses it again."""

    def __init__(self, trace: Trace, nxt: np.ndarray):
        self._by_req: list[dict[int, bool]] = []
        pos = 0
        for blocks in trace.reqs:
            ids = block_page_ids(blocks).tolist()
            self._by_req.append(dict(zip(ids, (nxt[pos : pos + len(blocks)] != NEVER).tolist())))
            pos += len(blocks)
        self.now = 0

    def offer(self, pages: np.ndarray) -> np.ndarray:
        m = self._by_req[self.now]
        return np.asarray([m[p] for p in pages.tolist()], bool)

    def used(self, pages) -> None:
        pass

    def evicted(self, pages) -> None:
        pass


def simulate(trace: Trace, cache: Cache, *, l2_blocks: int = 0) -> SimResult:
    """Replay the trace against ``cache`` (see the module docstring)."""
    res = SimResult(cache.name, cache.capacity)
    l2: dict[int, None] = {}
    pos = 0
    clocked = getattr(getattr(cache, "admission", None), "now", None) is not None
    for now, (blocks, tokens) in enumerate(zip(trace.reqs, trace.input_tokens.tolist())):
        n = len(blocks)
        if clocked:
            cache.admission.now = now
        k2 = 0
        if l2_blocks:
            for b in blocks.tolist():
                if b not in l2:
                    break
                k2 += 1
        rest = blocks[k2:]
        k3 = cache.prefix(rest, now)
        if k3:
            cache.read(rest[:k3], pos + k2, now)
        if k2 + k3 < n:
            cache.write(blocks[k2 + k3 :], pos + k2 + k3, now)
        if l2_blocks:
            for b in blocks.tolist():
                l2.pop(b, None)
                l2[b] = None
                if len(l2) > l2_blocks:
                    del l2[next(iter(l2))]
        res.hit_blocks += k3
        res.l2_hit_blocks += k2
        res.total_blocks += n
        res.hit_tokens += min(k3 * BLOCK_TOKENS, max(0, tokens - k2 * BLOCK_TOKENS))
        res.total_tokens += tokens
        res.held_sum += len(cache)
        res.requests += 1
        pos += n
    res.written, res.declined = cache.written, cache.declined
    return res


def infinite(trace: Trace) -> SimResult:
    r = simulate(trace, LRU(trace.n_blocks + 1))
    r.policy = "infinite"
    return r


def reference(trace: Trace, capacity: int, *, l2_blocks: int = 0, nxt: np.ndarray | None = None) -> dict[str, SimResult]:
    """LRU and the clairvoyant policy at ``capacity`` blocks."""
    nxt = next_use(trace) if nxt is None else nxt
    return {"lru": simulate(trace, LRU(capacity), l2_blocks=l2_blocks),
            "clairvoyant": simulate(trace, Belady(capacity, nxt), l2_blocks=l2_blocks)}  # fmt: skip
