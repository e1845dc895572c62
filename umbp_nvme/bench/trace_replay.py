"""Replay a prefix-cache trace through UMBPNvmeStore the way SGLang's cache controller drives it.

Per request, in trace order (one trace block = one SGLang page):

1. an optional LRU host tier (``l2_blocks``) matches the leading blocks it holds; the L3 sees
   only the rest, as HiCache prefetches only what the host tier misses;
2. ``batch_exists`` over the page keys, 128 pages per call, stopping at the first short answer
   (``_storage_hit_query``): the leading pages present are the prefix hit;
3. ``batch_get_v1`` of the hit pages into host-pool slots, 128 per call (``_page_transfer``);
   the hit counts the leading pages read; every byte of them is checked;
4. ``batch_set_v1`` of every page after the hit, 128 per call, stopping at a call with a False
   (``_page_backup``).

The byte oracle: a page's K and V objects hold words derived from (block, version, component,
word index); the version counts the writes of that block that reached the store (found absent
just before the write), so a stale copy, another block's bytes, the other component or a shifted
read all show as wrong bytes. Destination slots are poisoned before each read.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import numpy as np

from .trace_file import BLOCK_TOKENS, HitRates, Trace

BATCH_PAGES = 128  # SGLang's STORAGE_BATCH_SIZE
POISON = np.uint64(0xA5A5A5A5A5A5A5A5)
_W = np.uint64(0x9E3779B97F4A7C15)


def page_key(block: int) -> str:
    """The SGLang-style 64-hex page hash of a trace block."""
    return hashlib.sha256(b"trace-block:%d" % block).hexdigest()


def _mix(x: np.ndarray) -> np.ndarray:
    z = x + _W
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class Oracle:
    """The words every object must hold: ``pattern(block, version, comp)``."""

    def __init__(self, object_bytes: int):
        self.words = object_bytes // 8
        self._ramp = _mix(np.arange(self.words, dtype=np.uint64))

    def tag(self, block: int, version: int, comp: int) -> np.uint64:
        return _mix(np.asarray([(block << 24) ^ (version << 2) ^ comp], np.uint64))[0]

    def fill(self, view: np.ndarray, block: int, version: int, comp: int) -> None:
        np.bitwise_xor(self._ramp, self.tag(block, version, comp), out=view)

    def wrong_bytes(self, view: np.ndarray, block: int, version: int, comp: int) -> int:
        want = self._ramp ^ self.tag(block, version, comp)
        bad = view != want
        if not bad.any():
            return 0
        return int(np.count_nonzero(view[bad].view(np.uint8) != want[bad].view(np.uint8)))


@dataclass
class ReplayResult(HitRates):
    set_pages: int = 0  # pages handed to batch_set_v1
    set_failed: int = 0  # pages a batch_set_v1 answered False for
    get_missed: int = 0  # pages batch_exists reported and batch_get_v1 did not read
    wrong_bytes: int = 0
    wrong_pages: int = 0
    held_samples: int = 0  # held_sum: objects held, summed over these samples once the store was full
    seconds: float = 0.0
    store: dict = field(default_factory=dict)


class Replayer:
    """Drives one backend (``trace_pool.HostSide``) through a trace. Pool pages: [0, 128) are the
    read destination, [128, 256) the backup source."""

    POOL_PAGES = 2 * BATCH_PAGES

    def __init__(self, side, object_bytes: int, *, l2_blocks: int = 0, sample_every: int = 8, corrupt=None,
                 prefix_keys: bool = False):
        self.side = side
        self.prefix_keys = prefix_keys  # pass extra_info.prefix_keys (hicache_storage_pass_prefix_keys)
        self._above = None
        self.be = side.backend
        self.oracle = Oracle(object_bytes)
        self.page_bytes = 2 * object_bytes
        self.l2_blocks = l2_blocks
        self.sample_every = sample_every
        self.corrupt = corrupt  # test hook: corrupt(request index, block, views) after a read
        self.version: dict[tuple[int, int], int] = {}  # (block, component) -> version the store holds
        self.writes: dict[int, int] = {}  # block -> writes so far
        self._keys: dict[int, str] = {}
        self._views = [side.words(p) for p in range(self.POOL_PAGES)]

    def key(self, b: int) -> str:
        k = self._keys.get(b)
        if k is None:
            k = self._keys[b] = page_key(b)
        return k

    def run(self, trace: Trace) -> ReplayResult:
        res = ReplayResult()
        l2: dict[int, None] = {}
        full = False
        t0 = time.perf_counter()
        for i, (blocks, tokens) in enumerate(zip(trace.reqs, trace.input_tokens.tolist())):
            bl = blocks.tolist()
            k2 = 0
            if self.l2_blocks:
                for b in bl:
                    if b not in l2:
                        break
                    k2 += 1
            rest = bl[k2:]
            keys = [self.key(b) for b in rest]
            self._above = [self.key(b) for b in bl[:k2]] if self.prefix_keys else None
            k3 = self._hit_query(keys)
            got = self._read(i, rest[:k3], keys[:k3], res) if k3 else 0
            if got < len(rest):
                self._backup(rest[got:], keys[got:], res, keys[:got])
            if self.l2_blocks:
                for b in bl:
                    l2.pop(b, None)
                    l2[b] = None
                    if len(l2) > self.l2_blocks:
                        del l2[next(iter(l2))]
            res.requests += 1
            res.total_blocks += len(bl)
            res.hit_blocks += got
            res.l2_hit_blocks += k2
            res.total_tokens += tokens
            res.hit_tokens += min(got * BLOCK_TOKENS, max(0, tokens - k2 * BLOCK_TOKENS))
            if i % self.sample_every == 0:
                s = self.be.store_stats().get("store", {})
                full = full or s.get("evictions", 0) > 0
                if full:
                    res.held_sum += int(s.get("objects", 0))
                    res.held_samples += 1
        res.seconds = time.perf_counter() - t0
        res.store = self.be.store_stats().get("store", {})
        return res

    def _info(self, before: list[str]):
        """extra_info as the controller builds it: the page keys in front of this call's pages."""
        if self._above is None:
            return None
        from ..sglang.backend import HiCacheStorageExtraInfo

        return HiCacheStorageExtraInfo(prefix_keys=self._above + before)

    def _hit_query(self, keys: list[str]) -> int:
        hit = 0
        for s in range(0, len(keys), BATCH_PAGES):
            batch = keys[s : s + BATCH_PAGES]
            n = self.be.batch_exists(batch, self._info(keys[:s]))
            hit += n
            if n < len(batch):
                break
        return hit

    def _read(self, i: int, blocks: list[int], keys: list[str], res: ReplayResult) -> int:
        """batch_get_v1 of the hit pages; the leading pages read count. Every read page is checked."""
        done = 0
        for s in range(0, len(keys), BATCH_PAGES):
            bb, kk = blocks[s : s + BATCH_PAGES], keys[s : s + BATCH_PAGES]
            for p in range(len(kk)):
                for v in self._views[p]:
                    v[:] = POISON
            ok = self.be.batch_get_v1(kk, self.side.slots(0, len(kk)), self._info(keys[:s]))
            for p, (b, good) in enumerate(zip(bb, ok)):
                if not good:
                    continue
                views = self._views[p]
                if self.corrupt is not None:
                    self.corrupt(i, b, views)
                bad = sum(self.oracle.wrong_bytes(v, b, self.version.get((b, c), -1), c) for c, v in enumerate(views))
                if bad:
                    res.wrong_bytes += bad
                    res.wrong_pages += 1
            lead = ok.index(False) if False in ok else len(ok)
            done += lead
            if lead < len(kk):
                res.get_missed += len(kk) - lead
                break
        return done

    def _backup(self, blocks: list[int], keys: list[str], res: ReplayResult, hit_keys: list[str]) -> None:
        store = self.be.store
        sfx = self.be.v1_suffixes
        for s in range(0, len(keys), BATCH_PAGES):
            bb, kk = blocks[s : s + BATCH_PAGES], keys[s : s + BATCH_PAGES]
            objs = [k + x for k in kk for x in sfx]
            # which objects the store holds already (it keeps their first bytes; an eviction can
            # take one component of a page and leave the other): the oracle asks the store
            # directly, no backend call, so SGLang's call pattern is unchanged
            held = store.exists_many_nowait(objs)
            new_ver = {}
            for p, b in enumerate(bb):
                comps = held[2 * p : 2 * p + 2]
                if not all(comps):
                    new_ver[b] = self.writes[b] = self.writes.get(b, 0) + 1
                for c, (v, h) in enumerate(zip(self._views[BATCH_PAGES + p], comps)):
                    # a held object is not rewritten; its bytes in the host slot are the ones
                    # it holds, as in SGLang, where a page's bytes never change
                    self.oracle.fill(v, b, self.version.get((b, c), 0) if h else new_ver[b], c)
            ok = self.be.batch_set_v1(kk, self.side.slots(BATCH_PAGES, len(kk)), self._info(hit_keys + keys[:s]))
            res.set_pages += len(kk)
            now = store.exists_many_nowait(objs)
            for j, (h, there) in enumerate(zip(held, now)):
                if not h and there:  # written now (not declined, not failed): the store holds this version
                    b = bb[j // 2]
                    self.version[(b, j % 2)] = new_ver[b]
            if not all(ok):
                res.set_failed += ok.count(False)
                break
