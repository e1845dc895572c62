"""A read-only opener's watch on the index file: it notices that a writer replaced index.lmdb and reopens it.

A writer that rebuilds its index moves ``index.lmdb`` aside (or finds it deleted) and writes a
new file at the path (opening.py, rebuild.py). A follower that keeps reading the file it opened
misses every page put since and serves pages deleted since; so every lookup of a read-only store
goes through ``IndexWatch.read``, which applies three rules:

- A file is known by (st_dev, st_ino), taken when its LMDB environment is made (index.py keeps it
  with the environment) and compared to a stat() of the path after each lookup (about 2 us). A file moved aside never comes back to the path, and one held open cannot have
  its inode reused, so a lookup whose read transaction began while the path still named the held
  file saw the writer's current state: the lookup is answered. Otherwise it is a miss.
- A replaced file is reopened only once its writer marked it (``writer_state`` is set; every
  writer sets it after the records it wrote are committed and synced, rebuild or not). Until
  then, and while the path is missing or the new file cannot be opened, every lookup is a miss:
  never the old view. A follower whose first open found an unmarked file misses the same way.
- The new file stays open until its writer marks it (the mark is then a cheap read); the replaced
  handle is closed once no lookup runs on it (other threads may be reading it).

A failed open is tried again when the path's stat (identity, size, mtime) changes, each LMDB
commit changes it, or after ``RETRY_S``, so a follower never spins on opening a file.

Reads: a reader's state.index and state.closed. Changes: state.index (swapped for the writer's new
file once marked).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from ..errors import StoreError
from .file_ident import file_id
from .follower_keys import FollowerKeys
from .index import Index

log = logging.getLogger("umbp_nvme.store")

RETRY_S = 0.05  # a reopen that failed with the path unchanged is tried again at most this often


def _signature(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _marked(ix) -> bool:
    """Whether a writer finished the file: its records committed and synced, then the writer state set."""
    try:
        return ix.writer_state() is not None
    except Exception as e:  # noqa: BLE001 - a file that cannot tell is not ready: misses until it can
        log.info("%s: cannot read the writer state of the index: %s", ix.path, e)
        return False


class LoadingWatch:
    """A read-only opener's watch while its index opens in the background (loading.py): every lookup
    is a miss, never an answer from a file not yet checked."""

    def read(self, fn, miss):
        return miss

    def records(self, keys: list[bytes]) -> list[bytes | None]:
        return [None] * len(keys)

    def key_set(self) -> str:
        return "loading"

    def close(self) -> None:
        pass


class IndexWatch:
    """The index a read-only store answers from (``state.index``), kept on the file at the path."""

    def __init__(self, state, map_size: int):
        self._state = state  # the store's StoreState (state.py): its index is swapped here
        self._path = state.index.path
        self._map_size = map_size
        self._lock = threading.Lock()
        self._held = state.index.file_identity()
        self._ready = False  # the held file was seen marked by its writer
        self._stale = False  # the path names another file now (it never names ours again)
        self._users: dict[int, int] = {}  # id(Index) -> lookups running on it
        self._retired: list = []  # replaced handles, closed once no lookup runs on them
        self._pending = None  # (Index, id) on the path's new file until its writer marks it
        self._failed = None  # (path signature, monotonic time) of the last reopen that failed
        self.keys = FollowerKeys(self, state.counters)  # exists from key hashes in memory (follower_keys.py)

    def read(self, fn, miss):
        """``fn(index)`` answered from the file at the path; ``miss`` while that file cannot be read yet."""
        for _ in range(3):  # a first look at the writer's mark, a reopen, the lookup
            took = self._take()
            if took is None:
                if not self._advance():
                    return miss
                continue
            ix, held = took
            try:
                out = fn(ix)
            finally:
                self._drop(ix)
            if file_id(self._path) == held:  # the file read is still the writer's: the answer was current
                return out
            if not self._advance():
                return miss
        return miss

    def records(self, keys: list[bytes]) -> list[bytes | None]:
        """Index.get_records from the file at the path: all None (misses) while it cannot be read."""
        return self.read(lambda ix: ix.get_records(keys), [None] * len(keys))

    def key_set(self) -> str:
        """What answers exists (follower_keys.py): "ready" (the key set), "building" or "off" (LMDB)."""
        return self.keys.state(self._state.index)

    def _take(self):
        """(current index, its file's identity) with one more lookup on it; None unless it is current and marked."""
        with self._lock:
            ix = self._state.index
            if self._stale or not self._ready or ix is None or self._held is None:
                return None
            self._users[id(ix)] = self._users.get(id(ix), 0) + 1
            return ix, self._held

    def _drop(self, ix) -> None:
        with self._lock:
            n = self._users.pop(id(ix)) - 1
            if n:
                self._users[id(ix)] = n
                return
            if ix not in self._retired:
                return
            self._retired.remove(ix)
        ix.close()

    def _advance(self) -> bool:
        """Bring the store onto the marked file at the path; whether it is there now."""
        with self._lock:
            old = self._state.index
            if old is None or self._state.closed:
                return False
            now = file_id(self._path)
            if not self._stale and (self._held is None or now != self._held):
                self._stale = True
            if not self._stale:
                if not self._ready:
                    self._ready = _marked(old)
                return self._ready
            if self._pending is not None and self._pending[1] != now:
                self._pending[0].close()  # replaced again before its writer marked it
                self._pending = None
            if self._pending is None:
                self._pending = self._open_new()
            # kept open until marked: opening checks every page of the file first (~0.2 s for 1 M objects)
            if self._pending is None or not _marked(self._pending[0]):
                return False
            self._state.index, self._held = self._pending
            self._pending = None
            self._stale, self._ready = False, True
            busy = id(old) in self._users
            if busy:
                self._retired.append(old)
        if not busy:
            old.close()
        log.warning("%s: the writer replaced the index; reopened it (lookups missed meanwhile)", self._path)
        return True

    def _open_new(self):
        """(Index, id) on the file now at the path; None when there is none or it cannot be opened yet."""
        sig = _signature(self._path)
        if sig is None:
            return None
        if self._failed is not None and self._failed[0] == sig and time.monotonic() - self._failed[1] < RETRY_S:
            return None
        try:
            ix = Index(self._path, readonly=True, map_size=self._map_size, durable=False, wait_s=0.0)
        except (OSError, StoreError) as e:
            self._failed = (sig, time.monotonic())
            log.info("%s: the index was replaced; its new file cannot be opened yet (%s)", self._path, e)
            return None
        self._failed = None
        return ix, ix.file_identity()

    def close(self) -> None:
        """Close the handles besides ``state.index`` (the store closes that one): the new file's while
        it waits for its mark, old ones a lookup still held."""
        self.keys.stop()
        with self._lock:
            left = [p[0] for p in (self._pending,) if p is not None] + self._retired
            self._pending, self._retired = None, []
        for ix in left:
            ix.close()
