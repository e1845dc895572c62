"""The writer's key -> row map over the native key table (native/keyindex.c): no Python object
and no key bytes in memory per stored key (issue 36).

The table keeps a 64-bit keyed hash per row (a multimap: colliding keys keep their own rows). A
hash match is only a candidate: ``rows``, ``get``, ``in``, ``del`` and ``set_rows`` confirm it
against the key itself before answering, so a collision never serves, deletes or overwrites
another key's row. Where the key is: keys longer than ``held_over`` bytes are held here (a
record keeps only KEY_INLINE bytes of a key); the others come from ``source`` (the writer's:
row_keys.py, the LMDB index to confirm a key and the rows' records in the segments to name a
row's key). A map without a source (``held_over=0``) holds every key: tests and tools.

``present(keys)`` and ``prefix(keys)`` answer from the hash alone (exists): a false positive
needs an absent key to match one of N stored 63-bit hashes, N / 2**63 per key (5e-11 at 500 M
objects), and costs a get that then misses, as any evicted page does.

Thread-safety: every native call holds the GIL throughout, so another thread's lookup sees a
whole update or none of it (as with a dict). State: its own; a writer's is writer.keys.
"""

from __future__ import annotations

import os

import numpy as np

from .._keyindex import KeyIndex
from ..keybytes import encode_key, key_error


def storable_bytes(key) -> bytes | None:
    """The key's bytes, None when it cannot be a key (not a str, empty, no lossless byte form)."""
    if type(key) is str and key.isascii():
        return key.encode("ascii") if key else None
    return encode_key(key) if key_error(key) is None else None


RECENT = 4096


class KeyMap:
    __slots__ = ("_t", "_held", "_recent", "held_over", "source", "adds")
    narrow_bits_for_tests: int | None = None  # tests: every new map keeps only this many hash bits

    def __init__(self, seed: int | None = None, *, held_over: int = 0, source=None):
        # a per-open random seed: keys crafted to collide cost probes, never a wrong row
        self._t = KeyIndex(int.from_bytes(os.urandom(8), "little") if seed is None else seed)
        self._held: dict[int, bytes] = {}  # row -> key bytes, for keys over held_over bytes
        # row -> key of the last RECENT rows ``get`` confirmed: a re-put names its rows' keys
        # next (put_path.py), and would otherwise read each one's record
        self._recent: dict[int, str] = {}
        self.held_over = held_over
        self.adds = 0  # calls that mapped keys (set_rows, load): a key found absent stays so while it is unchanged
        self.source = source  # keys_of(rows) -> [bytes | None]; confirm(enc, rows) -> bool array
        if KeyMap.narrow_bits_for_tests is not None:
            self._t.narrow_hash_for_tests(KeyMap.narrow_bits_for_tests)

    # --- batched (the data path) ---

    def candidates(self, keys: list, nth: int = 0) -> np.ndarray:
        """Each key's nth row of the same hash (int64, -1 where none): not confirmed. nth -1: the
        row where it is the hash's only one, -2 where the hash has several (one pass for the get path)."""
        if type(keys) is not list:
            keys = list(keys)
        out = np.empty(len(keys), np.int64)
        self._t.lookup(keys, out, nth)
        return out

    def take(self, keys: list, cols: tuple, off_shift: int) -> np.ndarray | None:
        """The get path's lookup and gather in one native pass: an int64 array (8, hits) of the key
        index, ``cols`` (rows.py's seg, off_4k (as bytes), len, crc, flags, gen) and row of each key
        with a candidate row (not confirmed), in key order; None where a hash has several rows."""
        out = np.empty((8, len(keys)), np.int64)
        m = self._t.take(keys, cols, off_shift, out)
        return None if m < 0 else out[:, :m]

    def fresh(self, keys: list, max_len: int) -> bool:
        """The put path's one-pass check (keyindex.c): every key an ASCII str of 1..max_len chars,
        none stored, no two with one hash (so none repeated). False: decide key by key."""
        return self._t.fresh(keys, max_len)

    def present(self, keys: list) -> np.ndarray:
        """Whether each key is stored, from the hash alone (see the module doc)."""
        return self.candidates(keys) >= 0

    def rows(self, keys: list) -> np.ndarray:
        """Each key's row (int64), -1 where absent or not a storable key; confirmed against the key."""
        if type(keys) is not list:
            keys = list(keys)
        out = self.candidates(keys)
        hit = np.flatnonzero(out >= 0)
        if not len(hit):
            return out
        ok = self._confirm([keys[i] for i in hit.tolist()], out[hit])
        if not ok.all():
            for i in hit[~ok].tolist():  # a collision (rare): the key's other candidates, one at a time
                out[i] = self._other_row(keys[i])
        return out

    def _other_row(self, key) -> int:
        nth = 1
        while True:
            r = self.candidates([key], nth)
            if r[0] < 0 or self._confirm([key], r)[0]:
                return int(r[0])
            nth += 1

    def held(self, rows: np.ndarray) -> np.ndarray:
        """Whether each row's key is held in memory (longer than held_over bytes)."""
        held = self._held
        if not held:
            return np.zeros(len(rows), bool)
        return np.fromiter((r in held for r in rows.tolist()), bool, len(rows))

    def confirm(self, keys: list, rows: np.ndarray) -> np.ndarray:
        """Whether row rows[i] holds keys[i] (held keys in memory, the others through the source)."""
        return self._confirm(keys, rows)

    def _confirm(self, keys: list, rows: np.ndarray) -> np.ndarray:
        enc = [storable_bytes(k) for k in keys]
        ok = np.zeros(len(keys), bool)
        held = self._held
        ask = []
        for j, (e, r) in enumerate(zip(enc, rows.tolist())):
            if e is None:
                continue
            h = held.get(r)
            if h is not None:
                ok[j] = h == e
            elif len(e) > self.held_over or self.source is None:
                ok[j] = False  # a key held here would be in held: this row holds another key
            else:
                ask.append(j)
        if ask:
            ok[ask] = self.source.confirm([enc[j] for j in ask], rows[ask])
        return ok

    def prefix(self, keys: list) -> int:
        """How many keys, from the first, are stored (from the hash alone: see the module doc)."""
        return self._t.prefix(keys if type(keys) is list else list(keys))

    def set_rows(self, keys: list, rows, *, absent_since: int | None = None) -> None:
        """Row rows[i] holds keys[i] (distinct keys) and the key maps to it, replacing its earlier row
        (all or nothing: a bad key raises ValueError). ``absent_since``: ``adds`` when ``rows(keys)``
        found none of the keys; while it is unchanged no earlier row can be mapped, so none is looked up."""
        keys = keys if type(keys) is list else list(keys)
        rows = np.ascontiguousarray(rows, np.int64)
        fresh = absent_since is not None and absent_since == self.adds
        self.adds += 1
        old = None if fresh else self.candidates(keys)
        if old is not None and (old >= 0).any():  # keys that may be stored already: their confirmed row leaves the map
            old = self.rows(keys)
            gone = old[(old >= 0) & (old != rows)]
            if len(gone):
                self._t.unmap(gone)
        over = self.held_over
        longer = self._t.add(keys, rows, over)
        if self._recent:
            for r in rows.tolist():
                self._recent.pop(r, None)
        if over and not longer:  # the put path's batches: no key held, no per-key step
            if self._held:
                for r in rows.tolist():
                    self._held.pop(r, None)
            return
        for j, k in enumerate(keys):
            if over == 0 or len(k) * 4 > over:  # a str of n chars has at most 4n bytes
                e = k if type(k) is bytes else encode_key(k)
                if len(e) > over:
                    self._held[int(rows[j])] = e
                else:
                    self._held.pop(int(rows[j]), None)
            elif self._held:
                self._held.pop(int(rows[j]), None)

    def keys_bytes_of(self, rows) -> list[bytes | None]:
        """The key each row holds (mapped, or dropped but not released); None where none."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        out: list = [None] * len(rows)
        ask = []
        held, recent = self._held, self._recent
        for j, r in enumerate(rows.tolist()):
            h = held.get(r)
            if h is None and recent:
                k = recent.get(r)
                h = None if k is None else storable_bytes(k)
            if h is not None:
                out[j] = h
            else:
                ask.append(j)
        if ask and self.source is not None:
            got = self.source.keys_of(rows[ask])
            ok = np.zeros(len(ask), np.uint8)
            self._t.holds([b"" if e is None else e for e in got], rows[ask], ok)
            for j, e in zip(ask, got):
                out[j] = e
            if not ok.all():  # the record names another key than the row's (damage): the index says
                lost = [ask[i] for i in np.flatnonzero(ok == 0).tolist()]
                for j, e in zip(lost, self.source.keys_by_index(rows[lost])):
                    out[j] = e
        return out

    def keys_of(self, rows) -> list[str | None]:
        return [None if e is None else e.decode("utf-8", "surrogateescape") for e in self.keys_bytes_of(rows)]

    def key_of(self, row: int) -> str | None:
        """The key row ``row`` holds (mapped or dropped but not released); None when none."""
        return self.keys_of([int(row)])[0]

    def key_bytes_of(self, row: int) -> bytes | None:
        return self.keys_bytes_of([int(row)])[0]

    def mapped(self, rows) -> np.ndarray:
        """Whether each row is mapped (served) now."""
        rows = np.ascontiguousarray(rows, np.int64).reshape(-1)
        out = np.zeros(len(rows), np.uint8)
        self._t.mapped(rows, out)
        return out.view(bool)

    def unmap(self, rows) -> None:
        """The rows are no longer mapped (they keep their key until released)."""
        self._t.unmap(np.ascontiguousarray(rows, np.int64).reshape(-1))

    def forget_row(self, row: int) -> None:
        """The row holds no key any more (released); unmapped if it still was."""
        self.forget_rows([row])

    def forget_rows(self, rows) -> None:
        rows = np.ascontiguousarray(rows, np.int64).reshape(-1)
        self._t.forget(rows)
        if self._held or self._recent:
            for r in rows.tolist():
                self._held.pop(r, None)
                self._recent.pop(r, None)

    def load(self, keys) -> None:
        """Rows 0..n-1 hold ``keys`` (PackedKeys, or walked_keys.HashedKeys: their hashes, the
        table taking their seed) and each maps to its row; an empty map only."""
        self.adds += 1
        if hasattr(keys, "hashes"):
            self._t.load_hashes(keys.seed, np.ascontiguousarray(keys.hashes, np.uint64))
        else:
            self._t.load(np.ascontiguousarray(keys.lens, np.uint16), keys.blob)
        long = np.flatnonzero(keys.lens > self.held_over)
        self._held.update(zip(long.tolist(), keys.key_bytes(long)))

    def mapped_rows(self, limit: int = -1) -> np.ndarray:
        return np.frombuffer(self._t.mapped_rows(limit), np.int64)

    def nbytes(self) -> int:
        return self._t.nbytes()

    def narrow_hash_for_tests(self, bits: int) -> None:
        """Tests: keep only ``bits`` bits of each key's hash, so that distinct keys collide."""
        self._t.narrow_hash_for_tests(bits)

    # --- the dict face (control paths) ---

    def get(self, key, default=None):
        r = self._t.first(key)
        if r < 0:  # no row of its hash: absent without a confirmation (the common answer)
            return default
        if not self._confirm([key], np.asarray([r], np.int64))[0]:
            r = self._other_row(key)
        if r < 0:
            return default
        if type(key) is str:
            rec = self._recent
            rec[r] = key
            if len(rec) > RECENT:
                del rec[next(iter(rec))]
        return r

    def __contains__(self, key) -> bool:
        return self.get(key) is not None

    def __len__(self) -> int:
        return len(self._t)

    def __bool__(self) -> bool:
        return len(self._t) > 0

    def __iter__(self):
        return iter(self.keys_of(self.mapped_rows()))

    def __getitem__(self, key) -> int:
        r = self.get(key)
        if r is None:
            raise KeyError(key)
        return r

    def __setitem__(self, key, row: int) -> None:
        self.set_rows([key], np.asarray([row], np.int64))

    def __delitem__(self, key) -> None:
        r = self.get(key)
        if r is None:
            raise KeyError(key)
        self._t.unmap(np.asarray([r], np.int64))

    def update(self, pairs) -> None:
        pairs = list(pairs)
        if pairs:
            self.set_rows([k for k, _ in pairs], np.fromiter((r for _, r in pairs), np.int64, len(pairs)))

    def any_key(self) -> str | None:
        r = self.mapped_rows(1)
        return self.key_of(int(r[0])) if len(r) else None

    def values(self) -> list[int]:
        return self.mapped_rows().tolist()

    def clear(self) -> None:
        """Unmap every key (rows keep theirs until released, as with the dict and list before)."""
        self._t.unmap(self.mapped_rows())


class RowKeys:
    """``rows.key[r]``: the key row r holds, read from the key table (None when it holds none)."""

    __slots__ = ("_m",)

    def __init__(self, m: KeyMap):
        self._m = m

    def __getitem__(self, row) -> str | None:
        return self._m.key_of(row)


class PackedKeys:
    """Keys as bytes back to back with uint16 lengths (an index scan's):
    what an open hands the row table instead of a Python object per key."""

    __slots__ = ("lens", "blob", "_starts")

    def __init__(self, lens: np.ndarray, blob: bytes):
        self.lens, self.blob = lens, blob
        self._starts = None

    def __len__(self) -> int:
        return len(self.lens)

    def _start(self) -> np.ndarray:
        if self._starts is None:
            self._starts = np.concatenate([[0], np.cumsum(self.lens, dtype=np.int64)])
        return self._starts

    def __getitem__(self, i: int) -> bytes:
        s = self._start()
        return self.blob[int(s[i]) : int(s[i + 1])]

    def __iter__(self):
        s = self._start().tolist()
        blob = self.blob
        return (blob[s[i] : s[i + 1]] for i in range(len(self.lens)))

    def key_bytes(self, idx) -> list[bytes]:
        """The keys at positions ``idx``."""
        s = self._start()
        return [self.blob[int(s[i]) : int(s[i + 1])] for i in np.asarray(idx).reshape(-1).tolist()]

    def take(self, idx: np.ndarray) -> "PackedKeys":
        """The keys at ``idx`` (increasing), packed."""
        s = self._start()
        parts = [self.blob[int(s[i]) : int(s[i + 1])] for i in np.asarray(idx).tolist()]
        return PackedKeys(self.lens[idx].copy(), b"".join(parts))
