"""Is index.lmdb a sound LMDB environment, before LMDB maps it?

LMDB maps the file and trusts what it finds: a page number past the end of a truncated file is a
SIGBUS, a page of the wrong type an assertion (abort), a scribbled node size a wild read. So
``check_index_file`` reads the two meta pages with pread and checks them the way LMDB does, then
(``walk``) maps the file itself and walks every page of its trees (``walk_pages``), and raises
``IndexFileDamage`` with the reason instead of letting LMDB crash the process. ``index.py`` runs
it before every ``lmdb.open`` and re-exports ``check_index_file`` and ``check_own_file``.

State: none (reads the index file).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
from typing import NamedTuple

import numpy as np

from ..engine.files import open_regular
from ..errors import StoreError, UnsafeStorePathError

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


class IndexFileDamage(Exception):
    """index.lmdb is not safe to map; ``size`` is the file's size (a reader may be racing its creation)."""

    def __init__(self, reason: str, size: int):
        super().__init__(reason)
        self.size = size


def _read_meta(fd: int, off: int, size: int, which: str) -> tuple:
    buf = os.pread(fd, _META.size, off) if off + _META.size <= size else b""
    if len(buf) < _META.size:
        raise IndexFileDamage(f"file of {size} bytes ends before the {which} meta page", size)
    m = _META.unpack(buf)
    flags, magic, version, psize = m[2], m[3], m[4], m[7]
    if not flags & _P_META or magic != _MDB_MAGIC:
        raise IndexFileDamage(f"{which} meta page at offset {off} is not an LMDB meta page", size)
    if version != _MDB_DATA_VERSION:
        raise IndexFileDamage(f"{which} meta page has LMDB data version {version}, not {_MDB_DATA_VERSION}", size)
    if psize < 512 or psize > 65536 or psize & (psize - 1):
        raise IndexFileDamage(f"{which} meta page has page size {psize}", size)
    return m


def check_index_file(path: str, *, walk: bool = True, readonly: bool = False, capture: dict | None = None) -> None:
    """Raise IndexFileDamage unless ``path`` is an LMDB file that LMDB can map without SIGBUS.

    LMDB maps the file and trusts its newest meta page: a page number past the end of a truncated
    file is a SIGBUS in whichever process touches it, not an error. So before LMDB sees the file,
    both meta pages are read here with pread, checked the way LMDB checks them (flag, magic,
    version), and the newest one's ``last_pg`` and roots must lie inside the file. ``walk`` also
    checks every page of its trees (``walk_pages``): LMDB asserts (aborts) on a page of the wrong
    type and reads node sizes unchecked, so a zeroed or scribbled page is a crash there. Raises
    FileNotFoundError when the file is missing and UnsafeStorePathError when it is not this
    user's regular file. ``capture`` (a dict) receives what the walk read of the ``objects``
    database (``_capture_leaves``) and the transaction it saw: a writer's open scan without LMDB.
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
            raise IndexFileDamage("empty file", size)
        m0 = _read_meta(fd, 0, size, "first")
        psize = m0[7]
        m1 = _read_meta(fd, psize, size, "second")
        if m1[7] != psize:
            raise IndexFileDamage(f"meta pages disagree on the page size ({psize} and {m1[7]})", size)
        newest = m1 if m1[-1] > m0[-1] else m0  # LMDB's choice: the higher txnid, page 0 on a tie
        last_pg, roots = newest[-2], (newest[14], newest[22])
        # a live writer grows the file before it writes the meta page naming the new pages:
        # the size taken after reading the meta page is at least what that page needs
        size = os.fstat(fd).st_size
        if not 1 <= last_pg < _MAX_PAGES:
            raise IndexFileDamage(f"meta page says the last page is {last_pg}", size)
        need = (last_pg + 1) * psize
        if size < need:
            raise IndexFileDamage(
                f"file is {size} bytes but its meta page (txn {newest[-1]}) needs {need} "
                f"(pages 0..{last_pg} of {psize} bytes): truncated",
                size,
            )
        for db, root in zip(("free-list", "main"), roots):
            if root != _P_INVALID and not 2 <= root <= last_pg:
                raise IndexFileDamage(f"meta page puts the {db} root at page {root}, outside 2..{last_pg}", size)
        pages = sum(newest[10:13]) + sum(newest[18:21])
        if pages > last_pg + 1:
            raise IndexFileDamage(f"meta page counts {pages} pages in a file of {last_pg + 1}", size)
        if walk and (not readonly or not _writer_alive(path)):
            # a live writer reuses free pages under a reader that holds no LMDB snapshot: only a
            # file no writer holds is walked (the writer walked it at its own open)
            reason = _walk_file(fd, psize, last_pg, ((newest[14], newest[9]), (newest[22], newest[17])), capture)
            if reason is not None:
                raise IndexFileDamage(f"{reason} (txn {newest[-1]})", size)
            if capture is not None:
                capture["txnid"] = newest[-1]
    except OSError as e:
        raise StoreError(f"cannot read store index {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def used_bytes(path: str) -> int:
    """Bytes of ``path`` its newest meta page uses (pages 0..last_pg): a writemap file is sized to
    its whole map. The bytes written to it when its meta pages do not read (a damaged file is the open's
    business, not this estimate's); OSError when it cannot be read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        size = st.st_size
        try:
            m0 = _read_meta(fd, 0, size, "first")
            m1 = _read_meta(fd, m0[7], size, "second")
        except IndexFileDamage:  # its blocks: a killed writemap writer's file spans its map
            return min(size, st.st_blocks * 512)
        newest = m1 if m1[-1] > m0[-1] else m0
        return min(size, (newest[-2] + 1) * newest[7])
    finally:
        os.close(fd)


_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_P_TYPES = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40  # branch, leaf, overflow, meta, leaf2, sub-page
_F_BIGDATA, _F_SUBDATA, _F_DUPDATA = 0x01, 0x02, 0x04
_DB_BYTES = 48  # MDB_db: pad u32, flags u16, depth u16, 4 page/entry counts u64, root u64
_MAX_DEPTH = 64
_REC_BYTES = 48  # index.REC_BYTES (index.py imports this module)


def _walk_file(fd: int, psize: int, last_pg: int, roots, capture=None) -> str | None:
    import mmap

    mm = mmap.mmap(fd, (last_pg + 1) * psize, mmap.MAP_SHARED, mmap.PROT_READ)
    try:
        if hasattr(mmap, "MADV_WILLNEED"):  # the walk goes in tree order: a cold file is read ahead whole instead
            mm.madvise(mmap.MADV_WILLNEED)
        if _native_walk is None:
            return walk_pages(np.frombuffer(mm, np.uint8), psize, last_pg, roots, capture)
        return walk_pages_native(mm, psize, last_pg, roots, capture)
    finally:
        trim_heap()  # the walk's large temporaries are freed: hand their pages back
        try:
            if capture is None or capture.get("objects", (None, None))[1] is not mm:  # a hashed capture reads keys from it
                mm.close()
        except BufferError:  # a view is still referenced: the map goes when it does
            pass


def newest_meta(head: bytes) -> tuple[int, int, tuple]:
    """(page size, last page, ((free-list root, depth), (main root, depth))) of the newest meta page
    in ``head`` (the file's first two pages, unchecked: check_index_file checks them)."""
    m0 = _META.unpack_from(head, 0)
    m1 = _META.unpack_from(head, m0[7])
    newest = m1 if m1[-1] > m0[-1] else m0
    return newest[7], newest[-2], ((newest[14], newest[9]), (newest[22], newest[17]))


try:  # the same walk in C (native/lmdbwalk.c): ~20x faster; the numpy walk stays as its reference
    from .._lmdbwalk import walk as _native_walk
except ImportError:  # an extension built before it existed: the numpy walk
    _native_walk = None


def walk_pages_native(buf, psize: int, last_pg: int, roots, capture=None) -> str | None:
    """``walk_pages`` by native/lmdbwalk.c: the same checks, the same capture."""
    (froot, fdepth), (mroot, mdepth) = roots
    seed = None if capture is None else capture.get("seed")
    got = _native_walk(buf, psize, last_pg, int(froot), int(fdepth), int(mroot), int(mdepth),
                       b"objects" if capture is not None else None, seed)  # fmt: skip
    if got is None or isinstance(got, str):
        return got
    if seed is not None:  # keys hashed, not copied: their bytes stay in the map (walked_keys.py)
        capture["objects"] = ("hashed", buf, psize, last_pg) + got[1:]
        return None
    _, klen, keys, is_rec, recs = got
    capture["objects"] = (np.frombuffer(klen, np.int64), keys, np.frombuffer(is_rec, np.bool_), recs)
    return None


STOPPED = "stopped"  # walk_tree's answer when its caller's stop flag ended it (native/lmdbwalk.c)


def walk_tree(path: str, ident, psize: int, root: int, depth: int, seed: int, rec_check, stop: bytearray):
    """A follower's snapshot of one database: the C walk of the tree at ``root`` in the file at
    ``path``, its keys hashed with ``seed`` and its records checked in place (``rec_check``: flags
    offset, key CRC offset, flag), none copied: (hashes, lengths, CRCs, bits) as bytes, or why the
    tree is unsafe (str). None when the C walk is missing or the file at ``path`` is not ``ident``
    (st_dev, st_ino), the one the caller's read snapshot names. That snapshot, held for the call,
    keeps the file's writer from reusing any page of the tree meanwhile. ``stop[0]`` set by another
    thread ends the walk early: STOPPED."""
    import mmap

    if _native_walk is None or ident is None:
        return None
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != tuple(ident):
            return None
        last_pg = st.st_size // psize - 1
        if last_pg < 1:
            return "the file is shorter than two pages"
        mm = mmap.mmap(fd, (last_pg + 1) * psize, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        got = _native_walk(mm, psize, last_pg, _P_INVALID, 0, root, depth, None, seed, True, rec_check, stop)
    finally:
        mm.close()
    if got is None:  # an empty database has no tree
        return b"", b"", b"", b""
    return got if isinstance(got, str) else got[1:5]


class _Bad(Exception):
    """Why the walk stops: the message is ``walk_pages``'s answer."""


class _Pages:
    """The mapped file as whole pages: aligned gathers, and the pages reached so far."""

    def __init__(self, buf: np.ndarray, psize: int, last_pg: int):
        self.buf, self.psize, self.last_pg = buf, psize, last_pg
        self.b16, self.b64 = buf.view("<u2"), buf.view("<u8")  # the map is whole pages: aligned views
        self.seen = np.zeros(last_pg + 1, bool)
        self.seen[:2] = True  # the meta pages

    def u16(self, o):  # o even (checked for node pointers): one aligned gather
        return self.b16[o >> 1].astype(np.int64)

    def u64(self, o, nbytes=8):
        v = np.zeros(len(o), np.uint64)
        for i in range(nbytes):
            v |= self.buf[o + i].astype(np.uint64) << np.uint64(8 * i)
        return v


class _Nodes(NamedTuple):
    """The nodes of one tree level (one entry per node, across all its pages)."""

    node: np.ndarray  # file offset of the node header
    lo: np.ndarray  # data size low / child page bits 0..15
    hi: np.ndarray  # data size high / child page bits 16..31
    nflags: np.ndarray  # node flags / child page bits 32..47
    ksize: np.ndarray
    dsize: np.ndarray
    big: np.ndarray  # the value lives on overflow pages
    end: np.ndarray  # page offset where the node ends


def walk_pages(buf: np.ndarray, psize: int, last_pg: int, roots, capture=None) -> str | None:
    """Why the trees from ``roots`` ((root, depth) of the free list and the main DB, whose leaves
    name the sub-databases) are not what LMDB may walk safely, or None.

    Every reachable page, once only, is stamped with its own number, has the type its depth
    calls for and sane bounds; every node lies inside its page; every child, overflow run and
    free-list page number lies inside the file. Vectorised per tree level: ~0.1 s per 1M keys.
    """
    pg = _Pages(buf, psize, last_pg)
    trees = [("free-list", roots[0][0], roots[0][1], b""), ("main", roots[1][0], roots[1][1], b"")]
    try:
        while trees:
            name, root, depth, db = trees.pop()
            if root != _P_INVALID:
                trees.extend(_walk_tree(pg, name, root, depth, capture if db == b"objects" else None))
    except _Bad as e:
        return str(e)
    return None


def _walk_tree(pg: _Pages, name: str, root: int, depth: int, capture=None) -> list:
    """Check one tree, level by level; returns the (name, root, depth, db name) of the sub-databases
    its leaves name. With ``capture``, its leaves' keys and values are kept there."""
    if not 1 <= depth <= _MAX_DEPTH:
        raise _Bad(f"{name} tree has depth {depth}")
    level = np.array([root], np.uint64)
    for _ in range(depth - 1):
        n = _level_nodes(pg, name, level, _P_BRANCH)
        level = (n.lo | (n.hi << 16) | (n.nflags << 32)).astype(np.uint64)  # child page number: 48 bits
    leaves = _level_nodes(pg, name, level, _P_LEAF)
    trees = _check_leaves(pg, name, leaves)
    if capture is not None:
        _capture_leaves(pg, leaves, capture)
    return trees


def _capture_leaves(pg: _Pages, n: _Nodes, capture: dict) -> None:
    """The leaves of a checked tree in key order (levels are walked left to right): key lengths,
    keys back to back, which values are one record wide, and those records back to back."""
    from .._keyindex import gather

    koff = (n.node + 8).astype(np.int64)
    klen = n.ksize.astype(np.int64)
    rec = ~n.big & (n.dsize == _REC_BYTES)
    capture["objects"] = (klen, gather(pg.buf, koff, klen), rec,
                          gather(pg.buf, (koff + klen)[rec], np.full(int(rec.sum()), _REC_BYTES, np.int64)))


def _check_level_pages(pg: _Pages, name: str, level: np.ndarray, want: int):
    """The pages of one level: inside the file, reached once, stamped, of type ``want``, sane bounds.
    Returns (file offset, lower, upper) per page."""
    last_pg, psize = pg.last_pg, pg.psize
    if (level < 2).any() or (level > last_pg).any():
        raise _Bad(f"{name} tree points at page {int(level[(level < 2) | (level > last_pg)][0])} outside 2..{last_pg}")
    lv = level.astype(np.int64)
    if pg.seen[lv].any() or len(np.unique(lv)) != len(lv):
        raise _Bad(f"{name} tree reaches a page twice")
    pg.seen[lv] = True
    base = lv * psize
    stamp = pg.b64[base >> 3]
    if (stamp != level).any():
        i = int(np.flatnonzero(stamp != level)[0])
        raise _Bad(f"page {int(level[i])} of the {name} tree is stamped as page {int(stamp[i])} (zeroed or overwritten)")
    flags = pg.u16(base + 10) & _P_TYPES
    if (flags != want).any():
        i = int(np.flatnonzero(flags != want)[0])
        raise _Bad(f"page {int(level[i])} of the {name} tree has type flags {int(flags[i]):#x}, not {want:#x}")
    lower, upper = pg.u16(base + 12), pg.u16(base + 14)
    if ((lower < 16) | (lower > upper) | (upper > psize) | (lower & 1)).any():
        raise _Bad(f"a page of the {name} tree has bounds outside its {psize} bytes")
    return base, lower, upper


def _level_nodes(pg: _Pages, name: str, level: np.ndarray, want: int) -> _Nodes:
    """Check the pages of one level and the nodes on them: inside their page, never overlapping."""
    psize = pg.psize
    base, lower, upper = _check_level_pages(pg, name, level, want)
    nk = (lower - 16) // 2
    if want == _P_BRANCH and (nk < 1).any():
        raise _Bad(f"a branch page of the {name} tree has no children")
    total = int(nk.sum())
    pidx = np.repeat(np.arange(len(base)), nk)
    slot = np.arange(total) - np.repeat(np.cumsum(nk) - nk, nk)
    ptr = pg.u16(base[pidx] + 16 + 2 * slot)
    if ((ptr < upper[pidx]) | (ptr + 8 > psize) | (ptr & 1)).any():  # LMDB keeps nodes 2-byte aligned
        raise _Bad(f"a node of the {name} tree lies outside its page")
    node = base[pidx] + ptr
    lo, hi, nflags, ksize = pg.u16(node), pg.u16(node + 2), pg.u16(node + 4), pg.u16(node + 6)
    kend = ptr + 8 + ksize
    if (kend > psize).any():
        raise _Bad(f"a key in the {name} tree runs past its page")
    dsize = lo | (hi << 16)
    big = (nflags & _F_BIGDATA) != 0
    # nodes of a page never overlap, and each begins where a slot points: a flipped slot
    # pointer would otherwise read one key with another key's value
    end = kend if want == _P_BRANCH else kend + np.where(big, 8, dsize)
    order = np.argsort(pidx * (psize + 1) + ptr)
    sp, se, sg = ptr[order], end[order], pidx[order]
    if ((sg[1:] == sg[:-1]) & (sp[1:] < se[:-1])).any():
        raise _Bad(f"nodes of a page of the {name} tree overlap")
    return _Nodes(node, lo, hi, nflags, ksize, dsize, big, end)


def _check_leaves(pg: _Pages, name: str, n: _Nodes) -> list:
    """The leaf nodes of a tree: flags, values inside their page or overflow run, then what the tree
    lists (sub-databases of the main tree, reusable pages of the free list). Returns the sub-databases."""
    psize, last_pg = pg.psize, pg.last_pg
    bad_flags = (n.nflags & ~(_F_BIGDATA | _F_SUBDATA)) | (n.nflags & _F_DUPDATA)
    if name != "main":
        bad_flags |= n.nflags & _F_SUBDATA
    if bad_flags.any():
        raise _Bad(f"a node of the {name} tree has flags {int(n.nflags[bad_flags != 0][0]):#x}")
    if (n.end > psize).any():
        raise _Bad(f"a value in the {name} tree runs past its page")
    data = n.node + 8 + n.ksize
    big = n.big
    if big.any():
        ov, osz = pg.u64(data[big]), n.dsize[big]
        if (ov < 2).any() or (ov > last_pg).any():
            raise _Bad(f"an overflow value of the {name} tree points outside the file")
        ovi = ov.astype(np.int64)
        if ((ovi * psize + 16 + osz) > (last_pg + 1) * psize).any():
            raise _Bad(f"an overflow value of the {name} tree runs past the end of the file")
        if (pg.u64(ovi * psize) != ov).any() or ((pg.u16(ovi * psize + 10) & _P_TYPES) != _P_OVERFLOW).any():
            raise _Bad(f"an overflow page of the {name} tree is damaged")
    if name == "main":
        return _sub_databases(pg, n, data)
    if name == "free-list":
        _check_free_list(pg, n, data)
    return []


def _sub_databases(pg: _Pages, n: _Nodes, data: np.ndarray) -> list:
    """The sub-database records in the main tree's leaves, as trees still to walk."""
    sub = (n.nflags & _F_SUBDATA) != 0
    if (sub & (n.big | (n.dsize != _DB_BYTES))).any():
        raise _Bad("a sub-database record in the main tree is damaged")
    trees = []
    for o in data[sub].tolist():
        sflags, sdepth = int(pg.u64(np.array([o + 4]), 2)[0]), int(pg.u64(np.array([o + 6]), 2)[0])
        if sflags & ~0x0E:  # REVERSEKEY, DUPSORT... none of them is ours except none at all
            raise _Bad(f"a sub-database has flags {sflags:#x}")
        trees.append((f"sub-database at {o}", int(pg.u64(np.array([o + 40]))[0]), sdepth, _key_at(pg, n, o)))
    return trees


def _key_at(pg: _Pages, n: _Nodes, data_at: int) -> bytes:
    """The key of the leaf node whose value starts at ``data_at`` (a sub-database's name)."""
    i = int(np.flatnonzero(n.node + 8 + n.ksize == data_at)[0])
    start = int(n.node[i]) + 8
    return pg.buf[start : start + int(n.ksize[i])].tobytes()


def _check_free_list(pg: _Pages, n: _Nodes, data: np.ndarray) -> None:
    """Each free-list entry lists pages LMDB will reuse: they must lie inside the file."""
    for o, size, b in zip(data.tolist(), n.dsize.tolist(), n.big.tolist()):
        if b:
            o = int(pg.u64(np.array([o]))[0]) * pg.psize + 16
        count = int(pg.u64(np.array([o]))[0]) if size >= 8 else -1
        if count < 0 or (count + 1) * 8 > size:
            raise _Bad("a free-list entry is damaged")
        pages = pg.u64(o + 8 + 8 * np.arange(count, dtype=np.int64))
        if (pages < 2).any() or (pages > pg.last_pg).any():
            raise _Bad("a free-list entry names pages outside the file")


def trim_heap() -> None:
    """Give the C heap's free pages back to the kernel (glibc's malloc_trim; nothing elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _writer_alive(index_path: str) -> bool:
    """Whether a writer holds the store's LOCK (the file beside the index); never takes it."""
    try:
        fd = open_regular(os.path.join(os.path.dirname(index_path), "LOCK"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
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
