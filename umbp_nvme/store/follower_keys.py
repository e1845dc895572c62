"""A follower's key set: its exists answered from key hashes in memory, kept equal to the writer's index.

A read-only opener used to answer each exists by one LMDB get per key (~30 us for 128 at 10 M
objects, most of it py-lmdb's call cost). Here it holds the set of its index's key hashes
(``HashSet``: 8 bytes a slot, ~11-15 per key) and answers from the hash alone, as the writer does
(keymap.py): a false positive, at N / 2**63 per absent key, is a miss on get, which reads LMDB.

The set is built on a thread of its own while lookups read LMDB as before, then kept on the
writer's change log (change_log.py). The build walks the objects tree of one read snapshot T0 in C
(``Index.walk_objects``: every page checked as the writer's open checks it, keys hashed, records
checked against their key's CRC in place, all without the GIL; ~1.5 s at 10 M keys), holding T0
for the walk so the writer reuses none of its pages, and replays the log after T0. A damaged page
turns the set off for that file; close() stops a walk through its stop flag. Without the C walk
(or the file at the path no longer the handle's) it reads chunks from LMDB, each in its own read
transaction (no snapshot held for seconds): the build notes the snapshot T0 it started from and
replays the log after T0 once the chunks are in. A key no write touched after T0 is in every
chunk's snapshot as it was at T0; for one that was, the replay's last operation on it decides, so
the set ends equal to the snapshot the replay reaches.

Every lookup first brings the set to a read snapshot it takes (nothing to do when no commit came
since), under the set's lock, so an answer is never older than the call. The thread also syncs it
every ``POLL_S``, so a follower does not fall ``change_log.RETAIN`` commits behind between lookups.
When the log cannot bring the set forward (a writer without the log, the follower too far behind,
the file replaced) the set is dropped and rebuilt; a damaged log turns the set off for that
file. Until a set is ready, lookups return None and the caller reads LMDB.

Reads and changes: its own fields, under its lock; the index through the watch (follower.py), so
a handle is never closed under a chunk or a sync.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import weakref

import numpy as np

from .._keyindex import HashSet, hash_keys
from ..errors import StoreError
from . import change_log
from .change_log import ChangeLogDamage
from .index import REC_BYTES, foreign_records
from .index_check import STOPPED
from .walked_keys import walked_hashes

log = logging.getLogger("umbp_nvme.store")

POLL_S = 0.05  # the thread's sync of an idle follower
CHUNK = 1 << 13  # keys read per read transaction while building (~2 ms of the GIL, then a yield)
ADD_STEP = 1 << 15  # walked hashes added per call (<= ~10 ms of the GIL as the set's pages first fault, then a yield)
PAGE_WALK = True  # build from a page walk of a snapshot (index_check.walk_tree); False: chunks from LMDB
RETRY_S, RETRY_MAX_S = 1.0, 60.0  # after a failed build or sync, doubling


class FollowerKeys:
    def __init__(self, watch, counters: dict | None = None):
        self._watch = watch  # follower.IndexWatch: read(fn, miss) runs fn on the current handle, held
        self._counters = {} if counters is None else counters  # the store's: key_set_builds
        self._lock = threading.Lock()
        self._set: HashSet | None = None
        self._for = None  # the Index whose file the set describes
        self._synced = 0  # the snapshot the set equals
        self._off = weakref.WeakSet()  # handles whose log is damaged: LMDB only
        self._stop = threading.Event()
        self._halt = bytearray(1)  # the page walk's stop flag (native: read without the GIL)
        self._thread: threading.Thread | None = None

    # --- lookups (any thread, inside the watch's read of ``ix``) ---

    def prefix(self, ix, keys: list) -> int | None:
        with self._lock:
            if self._current(ix):
                return self._set.prefix(keys)
        self._start()
        return None

    def contains(self, ix, keys: list) -> np.ndarray | None:
        with self._lock:
            if self._current(ix):
                out = np.zeros(len(keys), np.uint8)
                self._set.contains(keys, out)
                return out.view(bool)
        self._start()
        return None

    def _current(self, ix) -> bool:
        """Bring the set to a snapshot taken now; whether it describes it (lock held)."""
        if self._set is None or self._for is not ix:
            return False
        try:
            now, seed, entries = ix.read_log(lambda txn, o, m, c: change_log.since(txn, m, c, self._synced))
        except ChangeLogDamage as e:
            self._turn_off(ix, str(e))
            return False
        except StoreError as e:  # LMDB could not read it: LMDB's own lookups answer (or fail) as before
            log.info("%s: the change log cannot be read (%s)", ix.path, e)
            return False
        if isinstance(entries, str) or (seed is not None and seed != self._set.seed):
            self._set = self._for = None  # rebuilt on the thread once a logging writer wrote last
            return False
        try:
            for clear, dels, puts in entries:
                if clear:
                    self._set.clear()
                self._set.discard(dels)
                self._set.add(puts)
        except MemoryError:  # a set half brought forward answers nothing: rebuilt when there is room
            self._set = self._for = None
            return False
        self._synced = now
        return True

    def _turn_off(self, ix, why: str) -> None:
        log.warning("%s: %s; exists reads the index itself from now on", ix.path, why)
        self._off.add(ix)
        self._set = self._for = None

    def state(self, ix) -> str:
        """"ready" (exists answers from the set), "off" (a damaged log: from LMDB for this file), or
        "building" (from LMDB until the set is built or a logging writer wrote last)."""
        with self._lock:
            if ix in self._off:
                return "off"
            return "ready" if self._set is not None and self._for is ix else "building"

    # --- the thread ---

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(target=self._run, name="umbp-follower-keys", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        said, backoff = None, RETRY_S
        while not self._stop.is_set():
            wait = POLL_S
            try:
                self._watch.read(self._step, None)
                backoff = RETRY_S
            except Exception as e:  # noqa: BLE001 - the thread must outlive a bad moment; lookups read LMDB
                if str(e) != said:
                    log.warning("follower key set: %s; exists reads the index meanwhile", e)
                    said = str(e)
                with self._lock:
                    self._set = self._for = None
                wait, backoff = backoff, min(backoff * 2, RETRY_MAX_S)  # a build that keeps failing costs little
            self._stop.wait(wait)

    def _step(self, ix) -> None:
        with self._lock:
            if ix in self._off or self._current(ix):
                return
        try:
            self._build(ix)
        except ChangeLogDamage as e:
            with self._lock:
                self._turn_off(ix, str(e))

    def _build(self, ix) -> None:
        """``ix``'s keys into a new set (a page walk, else chunks), then the log replayed from where they began."""
        t0, seed, count = ix.read_log(_start_point)
        if seed is None:  # a file whose last writer kept no log: nothing to keep a set on
            return
        new = HashSet(seed)
        new.reserve(min(count, os.path.getsize(ix.path) // 16))  # a count read from the file: no entry is under 16 B
        t1, walked = ix.walk_objects(seed, self._halt) if PAGE_WALK else (t0, None)
        if walked == STOPPED:
            return
        if isinstance(walked, str):  # a damaged page: LMDB's own reads of it are not safe to run whole
            raise ChangeLogDamage(f"the index's objects tree is damaged ({walked})")
        if walked is not None:
            t0, (hashes, keep) = t1, walked_hashes(walked)
            for lo in range(0, len(hashes), ADD_STEP):
                new.add(hashes[lo : lo + ADD_STEP][keep[lo : lo + ADD_STEP]])
                time.sleep(0)  # lookups waiting for the GIL go first
                if self._stop.is_set():
                    return
        start = None
        while walked is None and not self._stop.is_set():
            hashes, start = ix.read_log(lambda txn, o, m, c: read_chunk(txn, o, seed, start))
            new.add(hashes)
            if start is None:
                break
            time.sleep(0)
            if self._watch_moved(ix):
                return
        if self._stop.is_set():
            return
        with self._lock:
            self._set, self._for, self._synced = new, ix, t0
            self._counters["key_set_builds"] = self._counters.get("key_set_builds", 0) + 1
            if not self._current(ix) and ix not in self._off:  # the thread backs off: 1, 2, 4 ... 60 s
                raise RuntimeError(f"{ix.path}: more commits came during the key set's build than the change "
                                   f"log keeps ({change_log.RETAIN}); building again later")  # fmt: skip

    def _watch_moved(self, ix) -> bool:
        return self._watch.read(lambda now: now is not ix, True)

    def stop(self) -> None:
        """Stop the thread and wait for it (before the watch closes its handles)."""
        self._stop.set()
        self._halt[0] = 1
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()
        with self._lock:
            self._set = self._for = None


def _start_point(txn, objects, meta, changes):
    """(snapshot id, seed, keys) where a build starts; seed None unless a logging writer wrote last."""
    if changes is None or not change_log.logged(txn, meta):
        return txn.id(), None, 0
    return txn.id(), change_log.seed_of(txn, meta), txn.stat(objects)["entries"]


def read_chunk(txn, objects, seed: int, start: bytes | None):
    """(hashes of up to CHUNK keys from ``start`` on whose records are theirs, the next key or None at the end)."""
    cur = txn.cursor(db=objects)
    if not (cur.first() if start is None else cur.set_range(start)):
        return np.zeros(0, np.uint64), None
    items = list(itertools.islice(cur.iternext(), CHUNK))
    nxt = cur.key() if cur.next() else None
    keys, vals = map(list, zip(*items)) if items else ([], [])
    if set(map(len, vals)) != {REC_BYTES}:  # another size is not a record (scan drops it too)
        keys, vals = [k for k, v in items if len(v) == REC_BYTES], [v for k, v in items if len(v) == REC_BYTES]
    if keys:
        bad = foreign_records(keys, vals)
        if bad.any():
            keys = [k for k, b in zip(keys, bad.tolist()) if not b]
    h = np.frombuffer(hash_keys(seed, keys), np.uint64)
    return h[h != 0], nxt  # 0: a key with no bytes (damage), never stored
