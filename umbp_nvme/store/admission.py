"""Which new pages the store writes: admission chosen by measurement (issue 26).

Most pages a prefix cache is handed are never asked for again (three quarters of the distinct
blocks of Mooncake's conversation trace); writing them costs write bandwidth, endurance and the
place of a page that would have been reused. No fixed rule is right at every size: "admit on the
second write" gains 27 % at 6,000 blocks of that trace and loses 26 % at 20,000, where even pages
reused late still hit. So the store runs several rules side by side in miniature and follows
the one that would have hit most:

* **Rules** (``RULES``): ``all`` (admit every page: LRU), ``second`` (a page only when it is
  written for the second time within the horizon: the doorkeeper), and ``class30`` / ``class50``:
  a first-time page when its class's measured reuse rate is at least 30 % / 50 %, else as
  ``second``. A page's class is the size of the write batch it came in (log2 of its pages: a
  long first prompt and a two-page tail are reused differently).
* **Miniature simulation** (Waldspurger et al., ATC'17; the sampling is SHARDS'): pages whose
  hash falls in a fixed 1/2**k slice are followed; each rule drives its own LRU of
  ``capacity / 2**k`` such pages over the same requests (``offer``: new pages to write, ``used``:
  pages asked for and present). Its hits, decayed over a few capacities of traffic, score the
  rule; the store adopts the best one once it leads the current one by ``SWITCH_MARGIN``.
* **Class reuse rates**: each sampled first-time page is remembered for ``HORIZON_X`` capacities
  of offered pages; asked for again within that, it counts as reused for its class.

Per batch the real decision is numpy (hashing, the doorkeeper bitmaps, a class lookup); the
per-page Python work is on the sample only (about ``SHADOW_PAGES`` pages per rule in all). The
state is in memory: after a restart the store admits everything until the miniatures have seen
enough traffic to say otherwise, i.e. it starts as a cold LRU.

State: its own (the sampled miniature LRUs); the store keeps one as writer.admission
(admit_gate.py).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

RULES = ("all", "second", "class30", "class50")
CLASS_THRESHOLDS = {"class30": 0.3, "class50": 0.5}
SIZE_CLASSES = 9  # write batches of 1, 2-3, 4-7, ..., 256+ pages
HORIZON_X = 32  # doorkeeper and class statistics look back this many capacities of offered pages
SHADOW_PAGES = 1024  # sampled pages each miniature LRU holds (at least; fewer when the cache is smaller)
SCORE_DECAY = 0.5  # weight left on the miniatures' hits every capacity of requests
SWITCH_MARGIN = 1.03  # a rule must beat the current one's hits by this much to take over, or
HIT_TIE = 0.01  # hit within this share of the best rule's hits and
WRITE_MARGIN = 0.2  # write this much less than the current rule
MIN_CLASS_SAMPLES = 16  # a class with fewer finished samples counts as reused (admitted)
MIN_EVIDENCE = 16.0  # the best miniature's decayed hits before any switch: with fewer, every rule
# "ties" at nothing and the write tie-break alone would leave `all`
NOISE_SIGMAS = 3.0  # a switch for hits needs a lead of this many sqrt(hits of both): a prefix hit
# comes in bursts of a request's pages, so a lead of a burst or two is noise. Without both, a cold
# store over the first 1,000 requests of the synthetic trace got 0.20-0.36x LRU's hits (0.69-0.90x now)
MIX = np.uint64(0x9E3779B97F4A7C15)


def size_class(batch_pages: int) -> int:
    return min(SIZE_CLASSES - 1, max(0, int(batch_pages).bit_length() - 1))


class _Mini:
    """One rule's LRU over the sampled pages."""

    __slots__ = ("rule", "lru", "cap", "hits", "score", "writes", "wscore")

    def __init__(self, rule: str, cap: int):
        self.rule, self.cap = rule, cap
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.hits = self.writes = 0
        self.score = self.wscore = 0.0


class Admission:
    """Per write batch, which new pages to write. Pages are uint64 ids (``page_ids``)."""

    def __init__(self, capacity_pages: int, *, sample_shift: int | None = None):
        self.capacity = max(1, int(capacity_pages))
        self.horizon = HORIZON_X * self.capacity
        if sample_shift is None:  # the largest slice that still leaves SHADOW_PAGES per miniature
            sample_shift = max(0, (self.capacity // SHADOW_PAGES).bit_length() - 1)
        self.sample_mask = np.uint64((1 << sample_shift) - 1)
        self.sample_shift = sample_shift
        bits = max(1 << 16, 1 << (4 * self.horizon // 2).bit_length())  # >= 4 bits per page of half a horizon
        self._dk = [np.zeros(bits // 8, np.uint8), np.zeros(bits // 8, np.uint8)]  # doorkeeper bitmaps, newest first
        self._dk_mask = np.uint64(bits - 1)
        self._dk_fill = 0
        self.clock = 0  # pages offered so far
        self._requests = 0  # sampled pages asked for (offered or used) since the last decay
        self._ghost: OrderedDict[int, tuple[int, int]] = OrderedDict()  # sampled page -> (class, offered at)
        self._seen: OrderedDict[int, int] = OrderedDict()  # sampled page -> last offered (the miniatures' doorkeeper)
        self.class_done = np.zeros(SIZE_CLASSES)
        self.class_reused = np.zeros(SIZE_CLASSES)
        self._rates = None  # class_rates(), cached between rescores
        cap = max(1, self.capacity >> sample_shift)
        self.minis = [_Mini(r, cap) for r in RULES]
        self.rule = "all"
        self.fixed = False
        self.declined = 0
        self.switches = 0

    # -- the store's calls -------------------------------------------------------------------

    def offer(self, pages: np.ndarray) -> np.ndarray:
        """New pages of one write batch, in order: which to write."""
        pages = np.ascontiguousarray(pages, np.uint64)
        n = len(pages)
        if not n:
            return np.ones(0, bool)
        cls = size_class(n)
        seen = self._doorkeep(pages)
        ok = self._decide(self.rule, seen, cls)
        sampled = pages[(pages & self.sample_mask) == 0]
        if len(sampled) and not self.fixed:
            self._observe(sampled.tolist(), cls)
        self.clock += n
        self.declined += n - int(ok.sum())
        return ok

    def used(self, pages: np.ndarray) -> None:
        """Pages asked for and present (hits; re-puts of stored pages)."""
        pages = np.ascontiguousarray(pages, np.uint64)
        sampled = pages[(pages & self.sample_mask) == 0]
        if len(sampled) and not self.fixed:
            self._observe(sampled.tolist(), None)

    def evicted(self, pages: np.ndarray) -> None:
        """Pages the store evicted (the miniatures keep their own LRU; nothing to learn here)."""

    def fix(self, rule: str) -> None:
        """Follow ``rule`` always (no miniatures; ``StoreConfig.admission_policy`` "second")."""
        if rule not in RULES:
            raise ValueError(f"admission rule must be one of {RULES}, got {rule!r}")
        self.rule, self.fixed = rule, True

    def stats(self) -> dict:
        return {"admission_rule": self.rule, "admission_declined": self.declined, "admission_switches": self.switches,
                "admission_scores": {m.rule: round(m.score + m.hits, 1) for m in self.minis}}  # fmt: skip

    # -- decisions -----------------------------------------------------------------------------

    def class_rates(self) -> np.ndarray:
        """Per size class: the share of first-time pages asked for again within the horizon
        (1 where fewer than MIN_CLASS_SAMPLES finished). Recomputed at each rescore."""
        if self._rates is None:
            rate = np.divide(self.class_reused, self.class_done, out=np.ones(SIZE_CLASSES), where=self.class_done > 0)
            rate[self.class_done < MIN_CLASS_SAMPLES] = 1.0
            self._rates = rate
        return self._rates

    def _decide(self, rule: str, seen, cls: int):
        """``seen``: bool array (or one bool) of pages offered before within the horizon."""
        if rule == "all":
            return np.ones(np.shape(seen), bool) if isinstance(seen, np.ndarray) else True
        if rule != "second" and self.class_rates()[cls] >= CLASS_THRESHOLDS[rule]:
            return np.ones(np.shape(seen), bool) if isinstance(seen, np.ndarray) else True
        return seen.copy() if isinstance(seen, np.ndarray) else seen

    def _doorkeep(self, pages: np.ndarray) -> np.ndarray:
        """Whether each page was offered within the last one to two half-horizons (a bitmap per
        half-horizon, two generations); records them in the newest."""
        idx = (((pages * MIX) >> np.uint64(24)) & self._dk_mask).astype(np.int64)
        byte, bit = idx >> 3, (np.uint8(1) << (idx & 7).astype(np.uint8))
        seen = ((self._dk[0][byte] | self._dk[1][byte]) & bit) != 0
        np.bitwise_or.at(self._dk[0], byte, bit)
        self._dk_fill += len(pages)
        if self._dk_fill >= self.horizon // 2:
            self._dk = [np.zeros_like(self._dk[1]), self._dk[0]]
            self._dk_fill = 0
        return seen

    # -- measurement -----------------------------------------------------------------------------

    def _observe(self, pages: list[int], cls: int | None) -> None:
        """Sampled pages asked for: offered (``cls`` set: absent from the store) or used."""
        ghost, seen_at, clock = self._ghost, self._seen, self.clock
        limit = clock - self.horizon
        rates = self.class_rates() if cls is not None else None
        for p in pages:
            g = ghost.pop(p, None)
            if g is not None:  # asked for again within the horizon
                self.class_done[g[0]] += 1
                self.class_reused[g[0]] += 1
            seen = cls is None or (p in seen_at and seen_at[p] >= limit)
            if cls is not None:
                if not seen:
                    ghost[p] = (cls, clock)
                seen_at.pop(p, None)
                seen_at[p] = clock
            for m in self.minis:
                lru = m.lru
                if p in lru:
                    m.hits += 1
                    lru.move_to_end(p)
                    continue
                rule = m.rule
                if rule == "all" or seen or (rule != "second" and rates[cls] >= CLASS_THRESHOLDS[rule]):
                    lru[p] = None
                    m.writes += 1
                    if len(lru) > m.cap:
                        lru.popitem(last=False)
        self._requests += len(pages)
        while ghost:
            p, (c, t0) = next(iter(ghost.items()))
            if t0 >= limit:
                break
            ghost.popitem(last=False)
            self.class_done[c] += 1
        while seen_at:
            p, t0 = next(iter(seen_at.items()))
            if t0 >= limit:
                break
            seen_at.popitem(last=False)
        if self._requests >= self.minis[0].cap:
            self._rescore()

    def _rescore(self) -> None:
        self._requests = 0
        self._rates = None
        for m in self.minis:
            m.score = SCORE_DECAY * m.score + m.hits
            m.wscore = SCORE_DECAY * m.wscore + m.writes
            m.hits = m.writes = 0
        self.class_done *= SCORE_DECAY ** (1 / HORIZON_X)
        self.class_reused *= SCORE_DECAY ** (1 / HORIZON_X)
        cur = next(m for m in self.minis if m.rule == self.rule)
        top = max(m.score for m in self.minis)
        if top < MIN_EVIDENCE:
            return
        # of the rules that hit (nearly) as much as the best, the one that writes least: hits
        # first, then device writes (bandwidth beside reads, endurance)
        near = [m for m in self.minis if m.score >= top * (1 - HIT_TIE)]
        pick = min(near, key=lambda m: (m.wscore, -m.score))
        lead = pick.score - cur.score
        better_hits = pick.score > cur.score * SWITCH_MARGIN and lead >= NOISE_SIGMAS * math.sqrt(pick.score + cur.score)
        fewer_writes = cur in near and pick.wscore < cur.wscore * (1 - WRITE_MARGIN)
        if pick is not cur and (better_hits or fewer_writes):
            self.rule = pick.rule
            self.switches += 1


_HEX = np.full(256, 255, np.uint8)
_HEX[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16, dtype=np.uint8)
_HEX[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16, dtype=np.uint8)


def page_ids(pages: list[str]) -> np.ndarray:
    """uint64 ids of page hashes: the first 16 hex digits (SGLang's hashes are 64 hex digits),
    parsed in one numpy pass; a page name that does not start so gets a blake2b of itself."""
    n = len(pages)
    if not n:
        return np.zeros(0, np.uint64)
    out, ok = np.zeros(n, np.uint64), np.zeros(n, bool)
    try:
        arr = np.array(pages, dtype=str)  # one C pass: UCS-4 code points, NUL-padded to the longest
    except (TypeError, ValueError):
        arr = None
    if arr is not None and arr.dtype.itemsize >= 64:
        codes = arr.view(np.uint32).reshape(n, -1)[:, :16]
        nib = _HEX[np.minimum(codes, 255)]
        ok = ((nib != 255) & (codes < 128)).all(axis=1)  # NUL padding and non-ASCII are not digits
        packed = (nib[:, 0::2] << 4) | (nib[:, 1::2] & 15)
        out = packed.view(">u8").reshape(n).astype(np.uint64)
        if ok.all():
            return out
    import hashlib
    import re

    hex16 = re.compile(r"[0-9a-fA-F]{16}")
    for i in np.flatnonzero(~ok).tolist():
        p = pages[i]
        if hex16.match(p):
            out[i] = int(p[:16], 16)
        else:
            out[i] = int.from_bytes(hashlib.blake2b(p.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")
    return out
