"""What the C page walk read of ``objects`` (index_check.py): a writer's open scan, a follower's key set.

The walk before a writer's open reads every leaf of the ``objects`` database already, so the
open scans nothing twice. Given the key table's seed, the walk (native/lmdbwalk.c) hands over
each key's hash, length and CRC32C and whether it breaks LMDB's order, plus the records, and
copies no key: 10 M keys are ~0.7 GB of fresh memory, and this VM's first touch of fresh memory
made a reopen swing by seconds (issue 36). ``HashedKeys`` reads the few key bytes an open needs
(records it drops, keys longer than a record holds, every key when it rewrites all record areas)
from the walk's map of the file. The map shows what was walked until the open's first commit to
``objects``: the writer holds the file's lock, and LMDB frees a page only in a transaction that
changes its tree. So the open reads those bytes first and then ``release``s the map.

Without the native walk (an extension built before it) the capture holds the keys' bytes
(``PackedKeys``), checked the same way. A follower's key set (follower_keys.py) walks one read
snapshot's tree the same way and keeps only the hashes of the keys a scan would keep
(``walked_hashes``).
"""

from __future__ import annotations

import logging

import numpy as np

from .index import FLAG_KEYCRC, REC_DTYPE
from .keymap import PackedKeys
from .records import KEY_INLINE

log = logging.getLogger("umbp_nvme.store")

# the walk's bits per node: the value is record-sized, the key is not above the one before, the
# record is not its key's (a follower's walk, which checks records in place: Index.walk_objects)
RECORD, ORDER_BREAK, FOREIGN = 1, 2, 4


def drop_breaks(keep: np.ndarray, breaks: np.ndarray) -> None:
    """LMDB keeps keys strictly ascending: both sides of each break are dropped (as Index.scan)."""
    keep[breaks] = keep[breaks - 1] = False


def walked_hashes(got) -> tuple[np.ndarray, np.ndarray]:
    """(hashes, keep) of a follower's walk (index_check.walk_tree): keep says whose keys ``Index.scan`` would keep."""
    hashes, _, _, bits = got
    bits = np.frombuffer(bits, np.uint8)
    keep = (bits & (RECORD | FOREIGN)) == RECORD
    drop_breaks(keep, np.flatnonzero(bits & ORDER_BREAK))
    return np.frombuffer(hashes, np.uint64), keep


class HashedKeys:
    """An open's keys as their KeyIndex hashes under ``seed`` (uint64) and lengths (uint16); the
    bytes stay in the walked map (``src``) until ``release``."""

    __slots__ = ("hashes", "lens", "seed", "_src", "_ords", "_cache")

    def __init__(self, hashes: np.ndarray, lens: np.ndarray, seed: int, src, ords=None, cache=None):
        self.hashes, self.lens, self.seed = hashes, lens, seed
        self._src = src  # (map, page size, last page, the capture's leaf pages) or None once released
        self._ords = ords  # each key's ordinal in the walk (int64), None: its position
        self._cache: dict[int, bytes] = cache or {}

    def __len__(self) -> int:
        return len(self.hashes)

    def key_bytes(self, idx) -> list[bytes]:
        """The keys at positions ``idx`` (increasing), read from the map in one pass."""
        from .._lmdbwalk import node_keys

        idx = np.asarray(idx, np.int64).reshape(-1)
        out: list = [self._cache.get(i) for i in idx.tolist()]
        need = [j for j, v in enumerate(out) if v is None]
        if need:
            if self._src is None:
                raise RuntimeError("the open's keys were released: their pages may have been reused")
            mm, psize, last_pg, pages = self._src
            at = idx[need] if self._ords is None else self._ords[idx[need]]
            for j, k in zip(need, node_keys(mm, psize, last_pg, pages, at.tobytes())):
                out[j] = k
        return out

    def __getitem__(self, i: int) -> bytes:
        return self.key_bytes([i])[0]

    def __iter__(self):
        step = 1 << 16
        for lo in range(0, len(self), step):
            yield from self.key_bytes(np.arange(lo, min(len(self), lo + step)))

    def take(self, idx) -> HashedKeys:
        """The keys at ``idx`` (increasing), the same map behind them."""
        idx = np.asarray(idx, np.int64)
        where = {int(i): j for j, i in enumerate(idx.tolist())} if self._cache else {}
        cache = {where[i]: v for i, v in self._cache.items() if i in where}
        ords = idx if self._ords is None else self._ords[idx]
        return HashedKeys(self.hashes[idx], self.lens[idx], self.seed, self._src, ords, cache)

    def hold_long(self, limit: int) -> None:
        """Read now the keys longer than ``limit`` (the key table keeps those: a record holds a prefix)."""
        long = np.flatnonzero(self.lens > limit)
        if len(long):
            self._cache.update(zip(long.tolist(), self.key_bytes(long)))

    def packed(self) -> PackedKeys:
        return PackedKeys(self.lens.copy(), b"".join(self))

    def release(self) -> None:
        self._src = None


def scan_capture(got: dict, path: str):
    """(keys, records, damage) from a walk's capture of ``objects`` (index_check.walk_pages*): the
    checks of ``Index.scan`` drop the same damage (nodes out of order, record-sized values only,
    keys that do not match their record's key checksum); damage says what was dropped, or None."""
    cap = got.pop("objects")
    if cap[0] == "hashed":
        _, mm, psize, last_pg, hashes, klen, crcs, bits, rec_blob, pages = cap
        hashes, klen = np.frombuffer(hashes, np.uint64), np.frombuffer(klen, np.uint16)
        bits = np.frombuffer(bits, np.uint8)
        breaks = np.flatnonzero(bits & ORDER_BREAK)
        is_rec = (bits & RECORD).astype(bool)
        crcs = np.frombuffer(crcs, np.uint32)
        keys = HashedKeys(hashes, klen, got["seed"], (mm, psize, last_pg, pages))
    else:
        from .._keyindex import unordered
        from .._uring import crc32c_many

        klen, blob, is_rec, rec_blob = cap
        breaks = np.asarray(unordered(blob, klen), np.int64)
        starts = np.concatenate([[0], np.cumsum(klen)[:-1]]).astype(np.int64)
        crcs = np.zeros(len(klen), np.uint32)
        base = np.frombuffer(blob or b"\0", np.uint8)
        crc32c_many(np.uint64(base.ctypes.data) + starts.astype(np.uint64), klen, crcs)
        keys = PackedKeys(klen.astype(np.uint16), blob)
        packed = (base, starts, klen)
    n, damage = len(keys), None
    keep = np.ones(n, bool)
    if len(breaks):
        drop_breaks(keep, breaks)
        damage = f"{int((~keep).sum())} keys out of order (damaged nodes)"
    if not is_rec.all():
        log.warning("%s: %d index records have a bad size; ignoring them", path, int((~is_rec).sum()))
    if is_rec.all():  # the usual case: the records as they came, no copy (read-only, as scan()'s)
        recs = np.frombuffer(rec_blob, REC_DTYPE) if n else np.zeros(0, REC_DTYPE)
    else:
        recs = np.zeros(n, REC_DTYPE)
        recs[is_rec] = np.frombuffer(rec_blob, REC_DTYPE)
    keep &= is_rec
    has = (recs["flags"] & FLAG_KEYCRC) != 0
    renamed = keep & has & (crcs != recs["key_crc"])
    if renamed.any():
        why = f"{int(renamed.sum())} keys that do not match their record's key checksum"
        damage = why if damage is None else f"{damage}; {why}"
        keep &= ~renamed
    if not keep.all():
        idx = np.flatnonzero(keep)
        recs = recs[idx]
        if isinstance(keys, HashedKeys):
            keys = keys.take(idx)
        else:
            from .._keyindex import gather

            base, starts, klen = packed
            keys = PackedKeys(klen[idx].astype(np.uint16), gather(base, starts[idx], klen[idx]))
    if isinstance(keys, HashedKeys):
        keys.hold_long(KEY_INLINE)
    return keys, recs, damage
