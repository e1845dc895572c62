"""The index's change log: what each write transaction did to the objects database, kept beside it.

A follower (a read-only opener) answers exists from a set of key hashes (follower_keys.py) that it
keeps equal to the objects database of its latest read snapshot. LMDB cannot say what changed
between two snapshots, so every write transaction that changes objects adds one entry to the
``changes`` database, in that same transaction (a kill leaves both or neither):

    key   transaction id, 8 bytes big endian (LMDB's order is the commit order)
    value crc32c of the rest (u32), deletes (u32), puts (u32), flags (u8: CLEAR first),
          then each deleted key's hash, then each put key's hash (u64 little endian)

Hashes are ``hash_keys(seed)`` of the index key bytes with the file's own seed (meta ``changes_seed``).
Applying an entry: clear when flagged, remove the deleted hashes, add the put ones (Index.commit's
order: deletes first, a key may be in both).

Two meta records tell a follower whether the log covers a span of snapshots:

- ``changes_head``: the id of the last write transaction by a writer that keeps this log. Every one
  of its write transactions sets it, so a snapshot whose id is not its head was written last by
  a writer that kept no log (an older version): the log says nothing about it.
- ``changes_floor``: the log holds every change of the transactions after it. A writer whose open
  finds the head behind LMDB's last transaction (or no log) drops the log and sets the floor to
  its own open; trimming to the last ``RETAIN`` transactions' entries raises it, and so does a commit of more than
  ``BIG`` keys (a rebuild's, an open's drop of unreadable records), which drops the log instead.

So a follower synced at S brings its set to snapshot T by the entries in (S, T] exactly when
head(T) == T and floor(T) <= S; otherwise it rebuilds from the objects database.

Every byte here is read back from our own file: an entry is taken only whole (its length, its
CRC, every hash with its top bit set); anything else is ``ChangeLogDamage`` and the follower
stops using its set (lookups read LMDB as before).
"""

from __future__ import annotations

import os
import struct

import numpy as np

from .._keyindex import hash_keys
from .._uring import crc32c

CHANGES_DB = b"changes"
SEED, HEAD, FLOOR = b"changes_seed", b"changes_head", b"changes_floor"  # meta records
RETAIN = 4096  # transactions whose entries are kept: a follower further behind rebuilds its set
BIG = 1 << 16  # a commit of more keys (a rebuild's, a reopen's drop) restarts the log instead
CLEAR = 1

_U64 = struct.Struct("<Q")
_TXN = struct.Struct(">Q")
_HDR = struct.Struct("<IIIB")
_TOP = np.uint64(1 << 63)


class ChangeLogDamage(Exception):
    """An entry or meta record of the change log is not whole: its file is damaged."""


def _u64(v: bytes | None) -> int | None:
    if v is None:
        return None
    if len(v) != _U64.size:
        raise ChangeLogDamage(f"a change log record of {len(v)} bytes")
    return _U64.unpack(v)[0]


def open_writer(txn, meta, changes) -> bool:
    """In the writer's first write transaction: keep the log when the last writer kept it up to its
    last transaction (nothing written), else start it here (a new seed only for a file that has
    none). Whether it wrote: the transaction changes meta and changes only, never objects."""
    try:
        seed, head = _u64(txn.get(SEED, db=meta)), _u64(txn.get(HEAD, db=meta))
    except ChangeLogDamage:
        seed = head = None
    if seed is not None and head == txn.id() - 1:  # LMDB's last committed transaction: this one comes next
        return False
    txn.drop(changes, delete=False)
    if seed is None:
        txn.put(SEED, os.urandom(8), db=meta)
    txn.put(FLOOR, _U64.pack(txn.id()), db=meta)
    stamp(txn, meta)
    return True


def stamp(txn, meta) -> None:
    """Every write transaction of a logging writer: the head is this transaction."""
    txn.put(HEAD, _U64.pack(txn.id()), db=meta)


def seed_of(txn, meta) -> int | None:
    return _u64(txn.get(SEED, db=meta))


class LogWriter:
    """A writable handle's side of the log: its databases, and the seed read once."""

    def __init__(self, meta, changes):
        self._meta, self._changes, self._seed = meta, changes, None

    def stamp(self, txn) -> None:
        stamp(txn, self._meta)

    def record(self, txn, deletes, put_keys, *, clear: bool = False) -> None:
        """The entry of this transaction (``deletes`` and ``put_keys``: index key bytes), then the trim."""
        if self._seed is None:
            self._seed = seed_of(txn, self._meta)
            if self._seed is None:  # open_writer sets it in the writer's first transaction
                raise ChangeLogDamage("the change log has no seed")
        now, changes = txn.id(), self._changes
        body = b"" if len(deletes) + len(put_keys) > BIG else (
            hash_keys(self._seed, list(deletes)) + hash_keys(self._seed, list(put_keys)))
        if len(body) != 8 * (len(deletes) + len(put_keys)) or not np.frombuffer(body, np.uint64).all():
            # too many keys to replay (a rebuild's), or one with no bytes to hash: followers rebuild
            txn.drop(changes, delete=False)
            txn.put(FLOOR, _U64.pack(now), db=self._meta)
            return
        rest = _HDR.pack(0, len(deletes), len(put_keys), CLEAR if clear else 0)[4:] + body
        txn.put(_TXN.pack(now), struct.pack("<I", crc32c(rest)) + rest, db=changes)
        cur, gone = txn.cursor(db=changes), None
        while cur.first() and len(cur.key()) == _TXN.size and _TXN.unpack(cur.key())[0] <= now - RETAIN:
            gone = _TXN.unpack(cur.key())[0]  # the last RETAIN transactions' entries are kept
            cur.delete()
        if gone is not None:
            txn.put(FLOOR, _U64.pack(gone), db=self._meta)


def parse(key: bytes, val: bytes) -> tuple[bool, np.ndarray, np.ndarray]:
    """(clear, deleted hashes, put hashes) of one entry; ChangeLogDamage unless it is whole."""
    if len(key) != _TXN.size or len(val) < _HDR.size:
        raise ChangeLogDamage(f"a change log entry of {len(key)}/{len(val)} bytes")
    crc, nd, np_, flags = _HDR.unpack_from(val)
    if flags & ~CLEAR or len(val) != _HDR.size + 8 * (nd + np_) or crc32c(val[4:]) != crc:
        raise ChangeLogDamage(f"change log entry {_TXN.unpack(key)[0]} is damaged")
    h = np.frombuffer(val, "<u8", nd + np_, _HDR.size)
    if not (h & _TOP).all():
        raise ChangeLogDamage(f"change log entry {_TXN.unpack(key)[0]} holds an impossible hash")
    return bool(flags & CLEAR), h[:nd], h[nd:]


UNLOGGED, BEHIND = "unlogged", "behind"  # why the log cannot bring a set forward


def logged(txn, meta) -> bool:
    """Whether the snapshot's last transaction was a logging writer's (its head)."""
    return _u64(txn.get(HEAD, db=meta)) == txn.id()


def since(txn, meta, changes, synced: int):
    """(snapshot id, seed, entries in (synced, snapshot]) from a read transaction; instead of the
    entries, UNLOGGED when a writer that keeps no log wrote the snapshot, BEHIND when the log no
    longer reaches back to ``synced``. ChangeLogDamage on a damaged record."""
    now = txn.id()
    if now == synced:
        return now, None, []
    seed, head, floor = _u64(txn.get(SEED, db=meta)), _u64(txn.get(HEAD, db=meta)), _u64(txn.get(FLOOR, db=meta))
    if seed is None or head != now:
        return now, seed, UNLOGGED
    if floor is not None and floor > now:
        raise ChangeLogDamage(f"the change log's floor {floor} is past its snapshot {now}")
    if floor is None or floor > synced:
        return now, seed, BEHIND
    cur = txn.cursor(db=changes)
    out = []
    if cur.set_range(_TXN.pack(synced + 1)):
        for k, v in cur:
            out.append(parse(k, v))
            if _TXN.unpack(k)[0] > now:
                raise ChangeLogDamage(f"change log entry {_TXN.unpack(k)[0]} is newer than its snapshot {now}")
    return now, seed, out
