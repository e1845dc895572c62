"""The writer's key -> row map over the native key table (native/keyindex.c): no Python object
per stored key, a hash of the key probed and the full key bytes compared (a hash collision is a
miss, never another key's row).

``KeyMap`` answers what the writer's code asked of the dict it replaces (get, in, del, len,
iteration, update) plus batched calls for the hot paths: ``rows(keys)`` (a numpy array, -1 where
absent) and ``prefix(keys)``. Each row also keeps its key (``key_of``) until the row is released,
as the list it replaces did: a dropped row's key is what its index delete removes.

Thread-safety: every native call holds the GIL throughout, so another thread's lookup sees a
whole update or none of it (as with a dict). State: its own; a writer's is writer.keys.
"""

from __future__ import annotations

import os

import numpy as np

from .._keyindex import KeyIndex


class KeyMap:
    __slots__ = ("_t",)

    def __init__(self, seed: int | None = None):
        # a per-open random seed: keys crafted to collide cost probes, never a wrong row
        self._t = KeyIndex(int.from_bytes(os.urandom(8), "little") if seed is None else seed)

    # --- batched (the data path) ---

    def rows(self, keys: list) -> np.ndarray:
        """Each key's row (int64), -1 where absent or not a storable key."""
        if type(keys) is not list:
            keys = list(keys)
        out = np.empty(len(keys), np.int64)
        self._t.lookup(keys, out)
        return out

    def prefix(self, keys: list) -> int:
        """How many keys, from the first, are mapped."""
        return self._t.prefix(keys if type(keys) is list else list(keys))

    def set_rows(self, keys: list, rows) -> None:
        """Row rows[i] holds keys[i] and the key maps to it (all or nothing: a bad key raises ValueError)."""
        self._t.set_many(keys if type(keys) is list else list(keys), np.ascontiguousarray(rows, np.int64))

    def key_of(self, row: int) -> str | None:
        """The key row ``row`` holds (mapped or dropped but not released); None when none."""
        return self._t.key(int(row))

    def key_bytes_of(self, row: int) -> bytes | None:
        return self._t.key_bytes(int(row))

    def forget_row(self, row: int) -> None:
        """The row holds no key any more (released); unmapped if it still was."""
        self._t.forget(int(row))

    def load(self, keys: "PackedKeys") -> None:
        """Rows 0..n-1 hold ``keys`` and each maps to its row; an empty map only."""
        self._t.load(keys.lens.tobytes() if not keys.lens.flags.c_contiguous else keys.lens, keys.blob)

    def nbytes(self) -> int:
        return self._t.nbytes()

    def narrow_hash_for_tests(self, bits: int) -> None:
        """Tests: keep only ``bits`` bits of each key's hash, so that distinct keys collide."""
        self._t.narrow_hash_for_tests(bits)

    # --- the dict face (control paths) ---

    def get(self, key, default=None):
        r = self._t.get(key)
        return default if r < 0 else r

    def __contains__(self, key) -> bool:
        return self._t.get(key) >= 0

    def __len__(self) -> int:
        return len(self._t)

    def __bool__(self) -> bool:
        return len(self._t) > 0

    def __iter__(self):
        return iter(self._t.mapped_keys())

    def __getitem__(self, key) -> int:
        r = self._t.get(key)
        if r < 0:
            raise KeyError(key)
        return r

    def __setitem__(self, key, row: int) -> None:
        self.set_rows([key], np.asarray([row], np.int64))

    def __delitem__(self, key) -> None:
        if not self._t.discard(key):
            raise KeyError(key)

    def update(self, pairs) -> None:
        pairs = list(pairs)
        if pairs:
            self.set_rows([k for k, _ in pairs], np.fromiter((r for _, r in pairs), np.int64, len(pairs)))

    def any_key(self) -> str | None:
        ks = self._t.mapped_keys(1)
        return ks[0] if ks else None

    def values(self) -> list[int]:
        keys = self._t.mapped_keys()
        return self.rows(keys).tolist()

    def clear(self) -> None:
        """Unmap every key (rows keep theirs until released, as with the dict and list before)."""
        for k in self._t.mapped_keys():
            self._t.discard(k)


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

    def take(self, idx: np.ndarray) -> "PackedKeys":
        """The keys at ``idx`` (increasing), packed."""
        s = self._start()
        parts = [self.blob[int(s[i]) : int(s[i + 1])] for i in np.asarray(idx).tolist()]
        return PackedKeys(self.lens[idx].copy(), b"".join(parts))
