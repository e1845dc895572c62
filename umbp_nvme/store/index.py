"""The persistent index: component key -> extent record, in LMDB.

LMDB because other processes (follower ranks) must read it while the writer runs: every read
transaction sees the latest committed snapshot, writers never block readers, and a commit is
atomic, so a record is visible only together with everything committed beside it.

One record (``REC_DTYPE``, 48 bytes little endian) per key in the ``objects`` database; the
``meta`` database holds the generation high-water mark. The writer keeps its own in-memory view
(see ``store.py``) built from one ``scan()`` at open; readers query LMDB directly.

LMDB must not be opened twice in one process (closing a second handle drops the first one's
POSIX locks), so environments are shared per process through ``_ENVS`` with a reference count.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import itertools
import logging
import operator
import os
import stat
import struct
import threading
import time

import lmdb
import numpy as np

from ..errors import IndexDamagedError, StoreError, UnsafeStorePathError
from ..keybytes import decode_keys

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
_FLAGS_KEYCRC = struct.Struct("<II")  # (flags, key_crc) at the end of a record
_FLAGS_AT = REC_DTYPE.fields["flags"][1]

_CREATING_WAIT_S = 2.0  # how long a reader waits for a new store's writer to create its databases
_NEW_ENV_BYTES = 2 * 4096  # an environment whose two meta pages are not written yet is being created
_META_NEXT_GEN = b"next_generation"
_U64 = struct.Struct("<Q")


def key_crcs(keys: list[bytes]) -> np.ndarray:
    """CRC32C of each key's bytes (uint32), in one C call over the joined keys."""
    from .._uring import crc32c_many

    n = len(keys)
    out = np.zeros(n, np.uint32)
    if not n:
        return out
    lens = np.fromiter(map(len, keys), np.int64, n)
    buf = np.frombuffer(b"".join(keys) or b"\0", np.uint8)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.uint64)
    crc32c_many(np.uint64(buf.ctypes.data) + starts, lens, out)
    return out


def _key_matches(key: bytes, rec: bytes) -> bool:
    flags, kcrc = _FLAGS_KEYCRC.unpack_from(rec, _FLAGS_AT)
    if not flags & FLAG_KEYCRC:
        return True
    from .._uring import crc32c

    return crc32c(key) == kcrc

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

# LMDB's file format (mdb.c, 0.9.x, 64-bit): pages 0 and 1 are meta pages. Page header: pgno u64,
# pad u16, flags u16, lower/upper u16; then MDB_meta: magic u32, version u32, address u64, mapsize
# u64, two MDB_db (pad u32 = page size in db 0, flags u16, depth u16, branch/leaf/overflow pages,
# entries, root: u64 each), last_pg u64, txnid u64.
_META = struct.Struct("<QHH4xIIQQIHHQQQQQIHHQQQQQQQ")
_P_META = 0x08
_MDB_MAGIC = 0xBEEFC0DE
_MDB_DATA_VERSION = 1
_P_INVALID = (1 << 64) - 1
_MAX_PAGES = 1 << 40  # 4 PiB of 4 KiB pages: anything larger is a damaged field


class _IndexFileDamage(Exception):
    """index.lmdb is not safe to map; ``size`` is the file's size (a reader may be racing its creation)."""

    def __init__(self, reason: str, size: int):
        super().__init__(reason)
        self.size = size


def _read_meta(fd: int, off: int, size: int, which: str) -> tuple:
    buf = os.pread(fd, _META.size, off) if off + _META.size <= size else b""
    if len(buf) < _META.size:
        raise _IndexFileDamage(f"file of {size} bytes ends before the {which} meta page", size)
    m = _META.unpack(buf)
    pgno, flags, magic, version, psize = m[0], m[2], m[3], m[4], m[7]
    if not flags & _P_META or magic != _MDB_MAGIC:
        raise _IndexFileDamage(f"{which} meta page at offset {off} is not an LMDB meta page", size)
    if version != _MDB_DATA_VERSION:
        raise _IndexFileDamage(f"{which} meta page has LMDB data version {version}, not {_MDB_DATA_VERSION}", size)
    if psize < 512 or psize > 65536 or psize & (psize - 1):
        raise _IndexFileDamage(f"{which} meta page has page size {psize}", size)
    return m


def check_index_file(path: str, *, walk: bool = True, readonly: bool = False) -> None:
    """Raise _IndexFileDamage unless ``path`` is an LMDB file that LMDB can map without SIGBUS.

    LMDB maps the file and trusts its newest meta page: a page number past the end of a truncated
    file is a SIGBUS in whichever process touches it, not an error. So before LMDB sees the file,
    both meta pages are read here with pread, checked the way LMDB checks them (flag, magic,
    version), and the newest one's ``last_pg`` and roots must lie inside the file. ``walk`` also
    checks every page of its trees (``_walk_pages``): LMDB asserts (aborts) on a page of the wrong
    type and reads node sizes unchecked, so a zeroed or scribbled page is a crash there. Raises
    FileNotFoundError when the file is missing and UnsafeStorePathError when it is not this
    user's regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeStorePathError(f"{path} is a symlink; refusing to use it") from None
        if e.errno == errno.ENOENT:
            raise
        raise StoreError(f"cannot open store index {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        check_own_file(path, st)
        size = st.st_size
        if size == 0:
            raise _IndexFileDamage("empty file", size)
        m0 = _read_meta(fd, 0, size, "first")
        psize = m0[7]
        m1 = _read_meta(fd, psize, size, "second")
        if m1[7] != psize:
            raise _IndexFileDamage(f"meta pages disagree on the page size ({psize} and {m1[7]})", size)
        newest = m1 if m1[-1] > m0[-1] else m0  # LMDB's choice: the higher txnid, page 0 on a tie
        last_pg, roots = newest[-2], (newest[14], newest[22])
        # a live writer grows the file before it writes the meta page naming the new pages:
        # the size taken after reading the meta page is at least what that page needs
        size = os.fstat(fd).st_size
        if not 1 <= last_pg < _MAX_PAGES:
            raise _IndexFileDamage(f"meta page says the last page is {last_pg}", size)
        need = (last_pg + 1) * psize
        if size < need:
            raise _IndexFileDamage(
                f"file is {size} bytes but its meta page (txn {newest[-1]}) needs {need} "
                f"(pages 0..{last_pg} of {psize} bytes): truncated",
                size,
            )
        for db, root in zip(("free-list", "main"), roots):
            if root != _P_INVALID and not 2 <= root <= last_pg:
                raise _IndexFileDamage(f"meta page puts the {db} root at page {root}, outside 2..{last_pg}", size)
        pages = sum(newest[10:13]) + sum(newest[18:21])
        if pages > last_pg + 1:
            raise _IndexFileDamage(f"meta page counts {pages} pages in a file of {last_pg + 1}", size)
        if walk and (not readonly or not _writer_alive(path)):
            # a live writer reuses free pages under a reader that holds no LMDB snapshot: only a
            # file no writer holds is walked (the writer walked it at its own open)
            reason = _walk_file(fd, psize, last_pg, ((newest[14], newest[9]), (newest[22], newest[17])))
            if reason is not None:
                raise _IndexFileDamage(f"{reason} (txn {newest[-1]})", size)
    except OSError as e:
        raise StoreError(f"cannot read store index {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)


_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_P_TYPES = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40  # branch, leaf, overflow, meta, leaf2, sub-page
_F_BIGDATA, _F_SUBDATA, _F_DUPDATA = 0x01, 0x02, 0x04
_DB_BYTES = 48  # MDB_db: pad u32, flags u16, depth u16, 4 page/entry counts u64, root u64
_MAX_DEPTH = 64


def _walk_file(fd: int, psize: int, last_pg: int, roots) -> str | None:
    import mmap

    mm = mmap.mmap(fd, (last_pg + 1) * psize, mmap.MAP_SHARED, mmap.PROT_READ)
    try:
        return _walk_pages(np.frombuffer(mm, np.uint8), psize, last_pg, roots)
    finally:
        try:
            mm.close()
        except BufferError:  # a view is still referenced: the map goes when it does
            pass


def _walk_pages(buf: np.ndarray, psize: int, last_pg: int, roots) -> str | None:
    """Why the trees from ``roots`` ((root, depth) of the free list and the main DB, whose leaves
    name the sub-databases) are not what LMDB may walk safely, or None.

    Every reachable page, once only, is stamped with its own number, has the type its depth
    calls for and sane bounds; every node lies inside its page; every child, overflow run and
    free-list page number lies inside the file. Vectorised per tree level: ~0.1 s per 1M keys.
    """

    b16, b64 = buf.view("<u2"), buf.view("<u8")  # the map is whole pages: aligned views

    def u16(o):  # o even (checked for node pointers): one aligned gather
        return b16[o >> 1].astype(np.int64)

    def u64(o, nbytes=8):
        v = np.zeros(len(o), np.uint64)
        for i in range(nbytes):
            v |= buf[o + i].astype(np.uint64) << np.uint64(8 * i)
        return v

    seen = np.zeros(last_pg + 1, bool)
    seen[:2] = True  # the meta pages
    trees = [("free-list", roots[0][0], roots[0][1]), ("main", roots[1][0], roots[1][1])]
    while trees:
        name, root, depth = trees.pop()
        if root == _P_INVALID:
            continue
        if not 1 <= depth <= _MAX_DEPTH:
            return f"{name} tree has depth {depth}"
        level = np.array([root], np.uint64)
        for d in range(depth):
            if (level < 2).any() or (level > last_pg).any():
                return f"{name} tree points at page {int(level[(level < 2) | (level > last_pg)][0])} outside 2..{last_pg}"
            lv = level.astype(np.int64)
            if seen[lv].any() or len(np.unique(lv)) != len(lv):
                return f"{name} tree reaches a page twice"
            seen[lv] = True
            base = lv * psize
            stamp = b64[base >> 3]
            if (stamp != level).any():
                i = int(np.flatnonzero(stamp != level)[0])
                return f"page {int(level[i])} of the {name} tree is stamped as page {int(stamp[i])} (zeroed or overwritten)"
            want = _P_LEAF if d == depth - 1 else _P_BRANCH
            flags = u16(base + 10) & _P_TYPES
            if (flags != want).any():
                i = int(np.flatnonzero(flags != want)[0])
                return f"page {int(level[i])} of the {name} tree has type flags {int(flags[i]):#x}, not {want:#x}"
            lower, upper = u16(base + 12), u16(base + 14)
            if ((lower < 16) | (lower > upper) | (upper > psize) | (lower & 1)).any():
                return f"a page of the {name} tree has bounds outside its {psize} bytes"
            nk = (lower - 16) // 2
            if want == _P_BRANCH and (nk < 1).any():
                return f"a branch page of the {name} tree has no children"
            total = int(nk.sum())
            pidx = np.repeat(np.arange(len(lv)), nk)
            slot = np.arange(total) - np.repeat(np.cumsum(nk) - nk, nk)
            ptr = u16(base[pidx] + 16 + 2 * slot)
            if ((ptr < upper[pidx]) | (ptr + 8 > psize) | (ptr & 1)).any():  # LMDB keeps nodes 2-byte aligned
                return f"a node of the {name} tree lies outside its page"
            node = base[pidx] + ptr
            lo, hi, nflags, ksize = u16(node), u16(node + 2), u16(node + 4), u16(node + 6)
            kend = ptr + 8 + ksize
            if (kend > psize).any():
                return f"a key in the {name} tree runs past its page"
            dsize = lo | (hi << 16)
            big = (nflags & _F_BIGDATA) != 0
            # nodes of a page never overlap, and each begins where a slot points: a flipped slot
            # pointer would otherwise read one key with another key's value
            end = kend if want == _P_BRANCH else kend + np.where(big, 8, dsize)
            order = np.argsort(pidx * (psize + 1) + ptr)
            sp, se, sg = ptr[order], end[order], pidx[order]
            if ((sg[1:] == sg[:-1]) & (sp[1:] < se[:-1])).any():
                return f"nodes of a page of the {name} tree overlap"
            if want == _P_BRANCH:
                level = (lo | (hi << 16) | (nflags << 32)).astype(np.uint64)  # child page number: 48 bits
                continue
            bad_flags = (nflags & ~(_F_BIGDATA | _F_SUBDATA)) | (nflags & _F_DUPDATA)
            if name != "main":
                bad_flags |= nflags & _F_SUBDATA
            if bad_flags.any():
                return f"a node of the {name} tree has flags {int(nflags[bad_flags != 0][0]):#x}"
            if (end > psize).any():
                return f"a value in the {name} tree runs past its page"
            data = node + 8 + ksize
            if big.any():
                ov, osz = u64(data[big]), dsize[big]
                if (ov < 2).any() or (ov > last_pg).any():
                    return f"an overflow value of the {name} tree points outside the file"
                ovi = ov.astype(np.int64)
                if ((ovi * psize + 16 + osz) > (last_pg + 1) * psize).any():
                    return f"an overflow value of the {name} tree runs past the end of the file"
                if (u64(ovi * psize) != ov).any() or ((u16(ovi * psize + 10) & _P_TYPES) != _P_OVERFLOW).any():
                    return f"an overflow page of the {name} tree is damaged"
            if name == "main":
                sub = (nflags & _F_SUBDATA) != 0
                if (sub & (big | (dsize != _DB_BYTES))).any():
                    return "a sub-database record in the main tree is damaged"
                for o in data[sub].tolist():
                    sflags, sdepth = int(u64(np.array([o + 4]), 2)[0]), int(u64(np.array([o + 6]), 2)[0])
                    if sflags & ~0x0E:  # REVERSEKEY, DUPSORT... none of them is ours except none at all
                        return f"a sub-database has flags {sflags:#x}"
                    trees.append((f"sub-database at {o}", int(u64(np.array([o + 40]))[0]), sdepth))
            elif name == "free-list":
                # each entry lists pages LMDB will reuse: they must lie inside the file
                for o, n, b in zip(data.tolist(), dsize.tolist(), big.tolist()):
                    if b:
                        o = int(u64(np.array([o]))[0]) * psize + 16
                    count = int(u64(np.array([o]))[0]) if n >= 8 else -1
                    if count < 0 or (count + 1) * 8 > n:
                        return "a free-list entry is damaged"
                    pg = u64(o + 8 + 8 * np.arange(count, dtype=np.int64))
                    if (pg < 2).any() or (pg > last_pg).any():
                        return "a free-list entry names pages outside the file"
    return None


def _writer_alive(index_path: str) -> bool:
    """Whether a writer holds the store's LOCK (the file beside the index); never takes it."""
    try:
        fd = os.open(os.path.join(os.path.dirname(index_path), "LOCK"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing drops a shared lock we got
    return False


def check_own_file(path: str, st: os.stat_result | None = None) -> None:
    """Refuse a store file that is not a regular file owned by this user (``st``: its lstat/fstat)."""
    if st is None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeStorePathError(f"{path} is a symlink; refusing to use it")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeStorePathError(f"{path} is not a regular file; refusing to use it")
    if st.st_uid != os.geteuid():
        raise UnsafeStorePathError(
            f"{path} is owned by uid {st.st_uid}, not by this process (uid {os.geteuid()}); refusing to use it"
        )


_ENVS: dict[str, list] = {}  # realpath -> [env, refcount, writable]
_DETACHED: list[list] = []  # entries of files moved aside while another handle still held them
_ENVS_LOCK = threading.Lock()


def _acquire_env(path: str, *, readonly: bool, map_size: int, durable: bool) -> lmdb.Environment:
    real = os.path.realpath(path)
    with _ENVS_LOCK:
        entry = _ENVS.get(real)
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
            check_index_file(path, readonly=readonly)
        except FileNotFoundError:
            if readonly:
                raise FileNotFoundError(f"no store index at {path}; a writer must create the store first") from None
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
        )
        _ENVS[real] = [env, 1, not readonly]
        return env


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


def quarantine(path: str, *, lock_file: bool = True) -> str:
    """Move a damaged file aside (``<path>.corrupt-<timestamp>``); returns the new name.

    For the index, the LMDB lock file beside it is removed (``lock_file``): it describes the old
    environment. Only the writer calls this, holding the store's LOCK, with its own handle on the
    file closed.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = f"{path}.corrupt-{stamp}"
    n = 1
    while os.path.lexists(dest):
        dest = f"{path}.corrupt-{stamp}.{n}"
        n += 1
    os.rename(path, dest)
    with _ENVS_LOCK:
        # A handle still open in this process (a store whose close is finishing on its index
        # thread, a follower) maps the old file: the next open must get a new environment.
        entry = _ENVS.pop(os.path.realpath(path), None)
        if entry is not None:
            _DETACHED.append(entry)
    if lock_file:
        try:
            os.unlink(f"{path}-lock")
        except FileNotFoundError:
            pass
    return dest


def _file_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _release_env(env: lmdb.Environment) -> None:
    with _ENVS_LOCK:
        for real, entry in list(_ENVS.items()):
            if entry[0] is env:
                entry[1] -= 1
                if entry[1] == 0:
                    del _ENVS[real]
                    env.close()
                return
        for entry in _DETACHED:
            if entry[0] is env:
                entry[1] -= 1
                if entry[1] == 0:
                    _DETACHED.remove(entry)
                    env.close()
                return


class Index:
    def __init__(self, path: str, *, readonly: bool, map_size: int, durable: bool):
        self.path = path
        self.readonly = readonly
        self.durable = durable
        # a writer creating the store makes the file, then its meta pages, then its databases:
        # a reader that races it waits that moment instead of failing
        deadline = time.monotonic() + _CREATING_WAIT_S
        while True:
            try:
                self._env = _acquire_env(path, readonly=readonly, map_size=map_size, durable=durable)
                break
            except _IndexFileDamage as e:
                if not readonly or time.monotonic() >= deadline or e.size >= _NEW_ENV_BYTES:
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
                        self._objects = self._env.open_db(b"objects", create=False)
                        self._meta = self._env.open_db(b"meta", create=False)
                        break
                    except lmdb.NotFoundError:
                        if time.monotonic() >= deadline:
                            raise FileNotFoundError(
                                f"store index {path} has no databases yet; a writer must create the store first"
                            ) from None
                        time.sleep(0.01)
            else:
                self._objects = self._env.open_db(b"objects")
                self._meta = self._env.open_db(b"meta")
                self._env.reader_check()  # clear reader slots of killed follower processes
        except lmdb.Error as e:
            _release_env(self._env)
            raise wrap_lmdb_error(path, e, "opening its databases") from None
        except BaseException:
            _release_env(self._env)
            raise
        self.max_key_bytes = self._env.max_key_size()
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

    def get_records(self, keys: list[bytes]) -> list[bytes | None]:
        """Each key's record, None when absent or when the record's key checksum says it is not this key's."""
        with self._read_txn(self._objects) as txn:
            get = txn.get
            vals = [get(k) for k in keys]
        for i, v in enumerate(vals):
            if v is not None and len(v) == REC_BYTES and not _key_matches(keys[i], v):
                vals[i] = None
        return vals

    def exists_prefix(self, keys: list[bytes]) -> int:
        n = 0
        with self._read_txn(self._objects) as txn:
            get = txn.get
            for k in keys:
                v = get(k)
                if v is None or (len(v) == REC_BYTES and not _key_matches(k, v)):
                    break
                n += 1
        return n

    def next_generation(self) -> int:
        try:
            with self._read_txn(self._meta) as txn:
                v = txn.get(_META_NEXT_GEN)
        except lmdb.Error as e:
            raise wrap_lmdb_error(self.path, e, "reading the generation") from None
        if v is not None and len(v) != _U64.size:
            raise IndexDamagedError(f"store index {self.path} is damaged (generation record of {len(v)} bytes)")
        return _U64.unpack(v)[0] if v else 1

    def count(self) -> int:
        with self._read_txn(self._objects) as txn:
            return txn.stat(self._objects)["entries"]

    # --- writes (writer only; one thread at a time) ---

    def commit(self, puts=(), deletes=(), *, next_generation: int | None = None) -> None:
        """One atomic transaction: deletes first, then puts (a key may be in both)."""
        with self._env.begin(write=True) as txn:
            for k in deletes:
                txn.delete(k, db=self._objects)
            if puts:
                txn.cursor(db=self._objects).putmulti(puts, overwrite=True)
            if next_generation is not None:
                txn.put(_META_NEXT_GEN, _U64.pack(next_generation), db=self._meta)

    def drop_all(self, *, next_generation: int) -> None:
        with self._env.begin(write=True) as txn:
            txn.drop(self._objects, delete=False)
            txn.put(_META_NEXT_GEN, _U64.pack(next_generation), db=self._meta)

    def sync(self) -> None:
        self._env.sync(True)

    def file_bytes(self) -> int:
        try:
            return os.stat(self.path).st_size
        except OSError:
            return 0

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _release_env(self._env)
