"""The persistent index: component key -> extent record, in LMDB.

LMDB because other processes (follower ranks) must read it while the writer runs: every read
transaction sees the latest committed snapshot, writers never block readers, and a commit is
atomic, so a record is visible only together with everything committed beside it.

One record (``REC_DTYPE``, 48 bytes little endian) per key in the ``objects`` database; the
``meta`` database holds the generation high-water mark, the ``changes`` database what each commit
did to ``objects`` (change_log.py). The writer keeps its own in-memory view (rows.py, keymap.py)
built at open from ``scan_walked()``: the records the page walk before the open already read
(index_check.py, walked_keys.py), keys hashed, no Python object per key; readers query LMDB
directly, and answer exists from key sets kept on the change log (follower_keys.py).

LMDB must not be opened twice in one process (closing a second handle drops the first one's
POSIX locks), so environments are shared per process through ``_ENVS`` with a reference count.
Sharing a writer's environment, every write transaction begins with ``begin(write=True)``, which
waits for LMDB's writer lock without the GIL (py-lmdb's implicit ones hold it: ``_open_dbs``).

State: its own (the LMDB environment); a store's is state.index.
"""

from __future__ import annotations

import gc
import itertools
import logging
import operator
import os
import struct
import threading
import time

import lmdb
import numpy as np

from ..errors import IndexDamagedError, StoreError
from ..keybytes import decode_keys
from . import change_log
from .index_check import IndexFileDamage, check_index_file, check_own_file, walk_tree  # noqa: F401 - re-exported
from .file_ident import aside_name, file_id, opened_id
from .index_room import MapRoom, in_place_fs
from .key_checks import key_crcs  # noqa: F401 - re-exported

log = logging.getLogger("umbp_nvme.index")  # the name operators know; kept across the move

INDEX_FILE = "index.lmdb"

REC_DTYPE = np.dtype(
    [
        ("segment", "<u4"),
        ("length", "<u4"),  # object bytes (the slot is length rounded up to the size class)
        ("offset", "<u8"),  # byte offset in the segment file
        ("generation", "<u8"),  # unique per put batch, monotonic: tells reuse apart cross-process
        ("group", "<u8"),  # put batch id: components of one page (same depth) evict together
        ("crc", "<u4"),  # CRC32C of the object bytes
        ("depth", "<i4"),  # prefix depth given to put_many, -1 when none
        ("flags", "<u4"),
        ("key_crc", "<u4"),  # CRC32C of the key bytes (FLAG_KEYCRC): a key renamed on disk is not served
    ]
)
REC_BYTES = REC_DTYPE.itemsize
assert REC_BYTES == 48
FLAG_CRC = 1  # crc field is valid
FLAG_KEYCRC = 2  # key_crc field is valid (records written before it existed lack it)

_CREATING_WAIT_S = 2.0  # how long a reader waits for a new store's writer to create its databases
_NEW_ENV_BYTES = 2 * 4096  # an environment whose two meta pages are not written yet is being created
_META_NEXT_GEN = b"next_generation"
_META_WRITER_STATE = b"writer_state"
_META_GEN_BOUND = b"generation_bound"  # no generation handed out reaches it (clock.py)
_U64 = struct.Struct("<Q")
_U16 = struct.Struct("<H")
_LOG_OPS = 4  # the change log's entry, its trim and the meta records it sets
_first = operator.itemgetter(0)


def foreign_records(keys: list[bytes], vals: list[bytes]) -> np.ndarray:
    """Whether each record's key checksum says it is another key's (one C call for the CRCs)."""
    if set(map(len, vals)) == {REC_BYTES}:  # the usual lookup: no per-key selection (half a reader's exists)
        recs = np.frombuffer(b"".join(vals), REC_DTYPE)
        return ((recs["flags"] & FLAG_KEYCRC) != 0) & (recs["key_crc"] != key_crcs(keys))
    whole = [i for i, v in enumerate(vals) if len(v) == REC_BYTES]  # a shorter value: scan's business
    out = np.zeros(len(vals), bool)
    if whole:
        recs = np.frombuffer(b"".join([vals[i] for i in whole]), REC_DTYPE)
        out[whole] = ((recs["flags"] & FLAG_KEYCRC) != 0) & (recs["key_crc"] != key_crcs([keys[i] for i in whole]))
    return out


# LMDB's answers for a file that is not (or no longer) a readable LMDB environment
_DAMAGED = (
    lmdb.InvalidError,
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.VersionMismatchError,
    lmdb.PanicError,
    lmdb.BadRslotError,
    lmdb.BadTxnError,
    lmdb.BadValsizeError,
    lmdb.IncompatibleError,
)


_ENVS: dict[str, list] = {}  # realpath -> [env, refcount, writable, (st_dev, st_ino) of its file]
_DETACHED: list[list] = []  # entries of files moved aside while another handle still held them
_ENVS_LOCK = threading.Lock()
_ROOMS: dict[lmdb.Environment, MapRoom] = {}  # writemap environments: their blocks allocated ahead


def _acquire_env(path: str, *, readonly: bool, map_size: int, durable: bool, capture: dict | None = None,
                 writemap: bool = False) -> lmdb.Environment:
    real = os.path.realpath(path)
    with _ENVS_LOCK:
        entry = _ENVS.get(real)
        if entry is not None and entry[3] != file_id(path):  # replaced by another process: never share it
            _DETACHED.append(_ENVS.pop(real))
            entry = None
        if entry is not None:
            if not readonly and not entry[2]:
                raise StoreError(
                    f"{path} is open read-only in this process; close those handles before opening it for writing"
                )
            entry[1] += 1
            return entry[0]
        if readonly and not os.path.exists(path):
            raise FileNotFoundError(f"no store index at {path}; a writer must create the store first")
        # LMDB opens both files itself (following symlinks): check them first. A missing index is
        # a new store (writer) or FileNotFoundError above (reader).
        check_own_file(f"{path}-lock")
        try:
            check_index_file(path, readonly=readonly, capture=capture)
        except FileNotFoundError:
            if readonly:
                raise FileNotFoundError(f"no store index at {path}; a writer must create the store first") from None
        writemap = writemap and not readonly and in_place_fs(os.path.dirname(real)) is not None
        env, ident = _open_env(path, readonly=readonly, map_size=map_size, durable=durable, writemap=writemap)
        if writemap:
            room = None
            try:
                room = MapRoom(path, ident)
                room.ensure(env, 0)  # before the databases are created
            except OSError as e:  # no room (ENOSPC): written with pwrite, failing commits as it always did
                if room is not None:
                    room.close(env)
                env.close()
                log.warning("%s: index not mapped writable (%s)", path, e.strerror or e)
                env, ident = _open_env(path, readonly=readonly, map_size=map_size, durable=durable, writemap=False)
            else:
                _ROOMS[env] = room
        _ENVS[real] = [env, 1, not readonly, ident]
        return env


def _open_env(path: str, *, readonly: bool, map_size: int, durable: bool, writemap: bool):
    """lmdb.open, and the identity of the file it mapped."""
    before = file_id(path)
    env = lmdb.open(
        path,
        subdir=False,
        readonly=readonly,
        lock=True,
        map_size=map_size,
        max_dbs=4,
        max_readers=1024,
        mode=0o600,
        create=not readonly,
        # relaxed: no fsync per commit; a process crash still loses nothing committed because
        # the pages are in the OS page cache. strict: fsync at every commit.
        sync=durable,
        metasync=durable,
        readahead=False,
        writemap=writemap,  # index_room.py: commits write into the map, its blocks allocated ahead
    )
    ident = opened_id(path, before, created=not readonly)
    if ident is None:  # another process replaced the file during the open: which one LMDB maps is unknown
        env.close()
        raise IndexFileDamage("replaced by its writer while it was being opened", 0)
    return env, ident


def wrap_lmdb_error(path: str, e: BaseException, what: str) -> StoreError:
    """A StoreError naming the index file and what to do, for an lmdb.Error."""
    if isinstance(e, StoreError):
        return e
    if isinstance(e, _DAMAGED):
        return IndexDamagedError(
            f"store index {path} is damaged ({type(e).__name__}: {e}) while {what}; a writer moves it aside "
            f"and starts empty on its next open (or remove {path} and {path}-lock yourself)"
        )
    if isinstance(e, lmdb.ReadersFullError):
        remedy = "too many processes read this store; close some followers (stale slots clear when the writer reopens)"
    elif isinstance(e, lmdb.MapFullError):
        remedy = "the index map is full; raise ssd_capacity_bytes (the map is sized from it) or clear the store"
    elif isinstance(e, (lmdb.DiskError, lmdb.MemoryError)):
        remedy = "check the file system (free space, I/O errors) and memory"
    else:
        remedy = f"check that {path} and its directory are readable and writable by this user and the disk is healthy"
    return StoreError(f"store index {path}: {type(e).__name__}: {e} while {what}; {remedy}")


def detach(path: str) -> None:
    """The file at ``path`` was moved or replaced: a handle still open in this process (a store
    whose close is finishing on its index thread, a follower) maps the old file, so the next open
    must get a new environment."""
    with _ENVS_LOCK:
        entry = _ENVS.pop(os.path.realpath(path), None)
        if entry is not None:
            _DETACHED.append(entry)


def quarantine(path: str, *, lock_file: bool = True) -> str:
    """Move a damaged file aside (``aside_name``); returns the new name.

    For the index, the LMDB lock file beside it is removed (``lock_file``): it describes the old
    environment. Only the writer calls this, holding the store's LOCK, with its own handle on the
    file closed.
    """
    dest = aside_name(path)
    os.rename(path, dest)
    detach(path)
    if lock_file:
        try:
            os.unlink(f"{path}-lock")
        except FileNotFoundError:
            pass
    return dest


def disk_bytes(path: str) -> int:
    """Bytes the index file occupies on disk (a writemap file is sized to its map, sparse); 0 when missing."""
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return 0


def _file_size(path: str) -> int:
    """Bytes written to the file: a writer creating it with writemap sizes it to its map first."""
    try:
        st = os.stat(path)
    except OSError:
        return 0
    return min(st.st_size, st.st_blocks * 512)


def open_environment_paths() -> list[str]:
    """The files of the LMDB environments this process holds open, moved-aside ones included (a
    test proves a reopened follower let go of the old one)."""
    with _ENVS_LOCK:
        return [e[0].path() for e in (*_ENVS.values(), *_DETACHED)]


def _release_env(env: lmdb.Environment) -> None:
    with _ENVS_LOCK:
        for real, entry in list(_ENVS.items()):
            if entry[0] is env:
                entry[1] -= 1
                if entry[1] == 0:
                    del _ENVS[real]
                    _close_env(env)
                return
        for entry in _DETACHED:
            if entry[0] is env:
                entry[1] -= 1
                if entry[1] == 0:
                    _DETACHED.remove(entry)
                    _close_env(env)
                return


def _close_env(env: lmdb.Environment) -> None:
    room = _ROOMS.pop(env, None)
    if room is not None:
        room.close(env)  # before LMDB closes: it names the last page
    env.close()


_DBI_LOCK = threading.Lock()  # LMDB: no two transactions of one process may open databases at once


def _open_dbs(env: lmdb.Environment, *, create: bool):
    """The objects, meta and changes databases (change_log.py; None in a read-only file written
    without it). On a writable environment (a writer's, or a reader's handle sharing it) inside a
    write transaction begun as ``begin`` does, without the GIL: ``open_db`` alone begins one holding
    the GIL and waits there for LMDB's writer lock, held by this process's committing thread, which
    waits for the GIL (a hang of the whole process)."""
    if env.flags()["readonly"]:
        with _DBI_LOCK:
            objects, meta = env.open_db(b"objects", create=False), env.open_db(b"meta", create=False)
            try:
                return objects, meta, env.open_db(change_log.CHANGES_DB, create=False), None
            except lmdb.NotFoundError:
                return objects, meta, None, None
    with env.begin(write=True) as txn, _DBI_LOCK:  # the writer lock first, always: no cycle
        dbs = [env.open_db(name, txn=txn, create=create) for name in (b"objects", b"meta", change_log.CHANGES_DB)]
        return (*dbs, txn.id() if change_log.open_writer(txn, dbs[1], dbs[2]) else None)


class Index:
    def __init__(self, path: str, *, readonly: bool, map_size: int, durable: bool, wait_s: float = _CREATING_WAIT_S,
                 writemap: bool = False):
        """``writemap``: the serving writer's commits write into the map (index_room.py), where the
        file system allows it; handles sharing its environment allocate room the same way."""
        self.path, self.readonly, self.durable = path, readonly, durable
        # what the page walk before a writer's open read (scan_walked): keys hashed with this seed
        self._walked: dict = {"seed": int.from_bytes(os.urandom(8), "little")}
        # a writer creating the store makes the file, then its meta pages, then its databases:
        # a reader that races it waits that moment instead of failing
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self._env = _acquire_env(path, readonly=readonly, map_size=map_size, durable=durable,
                                         capture=None if readonly else self._walked, writemap=writemap)  # fmt: skip
                break
            except IndexFileDamage as e:
                if not readonly or time.monotonic() >= deadline or min(e.size, _file_size(path)) >= _NEW_ENV_BYTES:
                    msg = f"store index {path} is damaged ({e})"
                    if readonly:
                        msg += "; its writer moves it aside and starts empty on its next open"
                    raise IndexDamagedError(msg) from None
                time.sleep(0.01)
            except lmdb.InvalidError as e:
                if not readonly or time.monotonic() >= deadline or _file_size(path) >= _NEW_ENV_BYTES:
                    raise wrap_lmdb_error(path, e, "opening it") from None
                time.sleep(0.01)
            except lmdb.Error as e:
                raise wrap_lmdb_error(path, e, "opening it") from None
        try:
            if readonly:
                while True:
                    try:
                        self._objects, self._meta, self._changes, _ = _open_dbs(self._env, create=False)
                        break
                    except lmdb.NotFoundError:
                        if time.monotonic() >= deadline:
                            raise FileNotFoundError(
                                f"store index {path} has no databases yet; a writer must create the store first"
                            ) from None
                        time.sleep(0.01)
            else:
                self._objects, self._meta, self._changes, logged = _open_dbs(self._env, create=True)
                if logged is not None and self._walked.get("txnid") == logged - 1:
                    self._walked["txnid"] = logged  # the log's start wrote meta and changes: the walk's objects stand
                self._env.reader_check()  # clear reader slots of killed follower processes
        except lmdb.Error as e:
            _release_env(self._env)
            raise wrap_lmdb_error(path, e, "opening its databases") from None
        except BaseException:
            _release_env(self._env)
            raise
        self.max_key_bytes = self._env.max_key_size()
        self._room = _ROOMS.get(self._env)
        self._log = change_log.LogWriter(self._meta, self._changes)  # writes: every commit's entry and stamp
        self.scan_damage: str | None = None
        self._closed = False

    # --- reads (any thread; py-lmdb read transactions are not bound to a thread) ---

    def _read_txn(self, db):
        try:
            return self._env.begin(db=db)
        except lmdb.MapResizedError:
            # Another process (a writer opened with a larger capacity) grew the map: adopt its size.
            self._env.set_mapsize(0)
            return self._env.begin(db=db)

    def scan(self) -> tuple[list[str], np.ndarray]:
        """Every (key, record) in one read transaction: keys as str, records as one structured array.

        Keys out of LMDB's order are left out and ``scan_damage`` says how many (None when clean):
        the caller decides whether to rebuild the index from what is left.
        """
        # A million tuples trip the cyclic GC many times over; none of them can form a cycle.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            try:
                with self._read_txn(self._objects) as txn:
                    flat = list(itertools.chain.from_iterable(txn.cursor().iternext(keys=True, values=True)))
            except lmdb.Error as e:
                raise wrap_lmdb_error(self.path, e, "reading every record") from None
            keys, vals = flat[::2], flat[1::2]
            del flat
            self.scan_damage = None
            if not keys:
                return [], np.zeros(0, dtype=REC_DTYPE)
            if not all(map(operator.lt, keys, itertools.islice(keys, 1, None))):
                # LMDB keeps keys strictly ascending: a key out of order (or twice) is a damaged
                # node, which may carry another key's record; both sides of each break are dropped
                bad = set()
                for i in range(1, len(keys)):
                    if not keys[i - 1] < keys[i]:
                        bad.update((i - 1, i))
                self.scan_damage = f"{len(bad)} keys out of order (damaged nodes)"
                good = [i for i in range(len(keys)) if i not in bad]
                keys, vals = [keys[i] for i in good], [vals[i] for i in good]
            blob = b"".join(vals)
            if len(blob) != len(vals) * REC_BYTES:
                good = [i for i, v in enumerate(vals) if len(v) == REC_BYTES]
                log.warning("%s: %d index records have a bad size; ignoring them", self.path, len(vals) - len(good))
                keys = [keys[i] for i in good]
                blob = b"".join(vals[i] for i in good)
            del vals
            recs = np.frombuffer(blob, dtype=REC_DTYPE)
            has = (recs["flags"] & FLAG_KEYCRC) != 0
            if has.any():
                renamed = has & (key_crcs(keys) != recs["key_crc"])
                if renamed.any():
                    # a damaged key byte: the record belongs to another key, never serve it
                    why = f"{int(renamed.sum())} keys that do not match their record's key checksum"
                    self.scan_damage = why if self.scan_damage is None else f"{self.scan_damage}; {why}"
                    good = np.flatnonzero(~renamed)
                    keys = [keys[i] for i in good.tolist()]
                    blob = recs[good].tobytes()
            # one decode per key: a key's bytes may hold any byte (an older or crashed process, or
            # damage), so keys are never joined and split on a separator
            return decode_keys(keys), np.frombuffer(blob, dtype=REC_DTYPE)  # read-only view
        finally:
            if gc_was_enabled:
                gc.enable()

    def scan_walked(self, read):
        """``scan()`` from what the page walk before this open read (index_check.py):
        ``read(capture, path) -> (keys, records, damage)`` (walked_keys.scan_capture: keys as
        hashes, no Python object or bytes per key, the same checks dropping the same damage).
        ``scan()`` instead when the walk did not run here (the environment was already open in
        this process) or the index has changed since it did."""
        got, self._walked = self._walked, {}
        if "objects" not in got or got.get("txnid") != self._env.info()["last_txnid"]:
            return self.scan()
        keys, recs, self.scan_damage = read(got, self.path)
        return keys, recs

    def get_records(self, keys: list[bytes]) -> list[bytes | None]:
        """Each key's record, None when absent or when the record's key checksum says it is not this key's."""
        with self._read_txn(self._objects) as txn:
            get = txn.get
            vals = [get(k) for k in keys]
        found = [i for i, v in enumerate(vals) if v is not None]
        for i, bad in zip(found, foreign_records([keys[i] for i in found], [vals[i] for i in found])):
            if bad:
                vals[i] = None
        return vals

    def exists_prefix(self, keys: list[bytes]) -> int:
        vals = []
        with self._read_txn(self._objects) as txn:
            get = txn.get
            for k in keys:
                v = get(k)
                if v is None:
                    break
                vals.append(v)
        foreign = foreign_records(keys[: len(vals)], vals)
        return int(foreign.argmax()) if foreign.any() else len(vals)

    def read_log(self, fn):
        """``fn(txn, objects, meta, changes)`` in one read transaction (follower_keys.py); changes is None
        in a file whose databases were made without the change log."""
        try:
            with self._read_txn(self._objects) as txn:
                return fn(txn, self._objects, self._meta, self._changes)
        except lmdb.Error as e:
            raise wrap_lmdb_error(self.path, e, "reading the change log") from None

    def walk_objects(self, seed: int, stop: bytearray):
        """(snapshot id, ``index_check.walk_tree`` of ``objects`` at that snapshot): its keys hashed
        with ``seed`` by the C page walk, holding the snapshot while it walks (follower_keys.py)."""
        flags_at, crc_at = REC_DTYPE.fields["flags"][1], REC_DTYPE.fields["key_crc"][1]
        try:
            with self._read_txn(None) as txn:
                raw = txn.get(b"objects")  # the main database's record of it: MDB_db, root and depth
                if raw is None or len(raw) != 48:
                    return txn.id(), "the objects database's record is missing or damaged"
                depth, root = _U16.unpack_from(raw, 6)[0], _U64.unpack_from(raw, 40)[0]
                return txn.id(), walk_tree(self.path, self.file_identity(), txn.stat(self._objects)["psize"], root,
                                           depth, seed, (flags_at, crc_at, FLAG_KEYCRC), stop)  # fmt: skip
        except lmdb.Error as e:
            raise wrap_lmdb_error(self.path, e, "walking its objects") from None

    def next_generation(self) -> int:
        try:
            with self._read_txn(self._meta) as txn:
                v = txn.get(_META_NEXT_GEN)
        except lmdb.Error as e:
            raise wrap_lmdb_error(self.path, e, "reading the generation") from None
        if v is not None and len(v) != _U64.size:
            raise IndexDamagedError(f"store index {self.path} is damaged (generation record of {len(v)} bytes)")
        return _U64.unpack(v)[0] if v else 1

    def generation_bound(self) -> int:
        """The persisted generation bound (clock.py); 0 when none was recorded."""
        try:
            with self._read_txn(self._meta) as txn:
                v = txn.get(_META_GEN_BOUND)
        except lmdb.Error as e:
            raise wrap_lmdb_error(self.path, e, "reading the generation bound") from None
        return _U64.unpack(v)[0] if v is not None and len(v) == _U64.size else 0

    def set_generation_bound(self, bound: int) -> None:
        """Record the generation bound durably (commit and sync) before values below it are used."""
        self._make_room(1)
        with self._env.begin(write=True) as txn:
            txn.put(_META_GEN_BOUND, _U64.pack(bound), db=self._meta)
            self._log.stamp(txn)
        self._env.sync(True)

    def count(self) -> int:
        with self._read_txn(self._objects) as txn:
            return txn.stat(self._objects)["entries"]

    # --- writes (writer only; one thread at a time) ---

    def commit(self, puts=(), deletes=(), *, next_generation: int | None = None) -> None:
        """One atomic transaction: deletes first, then puts (a key may be in both)."""
        self._make_room(len(puts) + len(deletes) + _LOG_OPS, len(puts))
        with self._env.begin(write=True) as txn:
            for k in deletes:
                txn.delete(k, db=self._objects)
            if puts:
                txn.cursor(db=self._objects).putmulti(puts, overwrite=True)
            if next_generation is not None:
                txn.put(_META_NEXT_GEN, _U64.pack(next_generation), db=self._meta)
            if puts or deletes:
                self._log.record(txn, deletes, list(map(_first, puts)))
            self._log.stamp(txn)

    def file_identity(self) -> tuple[int, int] | None:
        """(st_dev, st_ino) of the file this handle's environment maps (follower.py compares it to the path's)."""
        with _ENVS_LOCK:
            for entry in (*_ENVS.values(), *_DETACHED):
                if entry[0] is self._env:
                    return entry[3]
        return None

    def writer_state(self) -> bytes | None:
        """What the last writer left: b"clean" after a clean close, b"open:<boot id>" while open."""
        try:
            with self._read_txn(self._meta) as txn:
                return txn.get(_META_WRITER_STATE)
        except lmdb.Error as e:
            raise wrap_lmdb_error(self.path, e, "reading the writer state") from None

    def set_writer_state(self, state: bytes) -> None:
        """Record the writer state durably (commit and sync)."""
        self._make_room(1)
        with self._env.begin(write=True) as txn:
            txn.put(_META_WRITER_STATE, state, db=self._meta)
            self._log.stamp(txn)
        self._env.sync(True)

    def drop_all(self, *, next_generation: int) -> None:
        self._make_room(1)  # the free list of every page: room's used // 256 term
        with self._env.begin(write=True) as txn:
            txn.drop(self._objects, delete=False)
            txn.put(_META_NEXT_GEN, _U64.pack(next_generation), db=self._meta)
            self._log.record(txn, (), (), clear=True)
            self._log.stamp(txn)

    def sync(self) -> None:
        self._env.sync(True)

    def _make_room(self, ops: int, puts: int = 0) -> None:
        if self._room is not None:
            try:
                self._room.ensure(self._env, ops, puts)
            except OSError as e:  # as a pwrite of the commit would have failed
                raise StoreError(f"no room to grow store index {self.path}: {e.strerror or e}") from None

    def file_bytes(self) -> int:
        return disk_bytes(self.path)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._walked = {}  # a walk never scanned: its map of the file goes
            _release_env(self._env)
