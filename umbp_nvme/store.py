"""PageStore: the asyncio key -> object store on local NVMe.

One call = one index pass, one engine submission, one CRC pass off the loop thread, one index
commit. The lifecycle of a put is reserve (slot) -> write -> [fdatasync] -> publish (index
commit); of a get: look up + pin -> read -> verify -> unpin. An entry is visible only after its
bytes are on the file (publish after write); a slot is reused only after the delete of its old
entry is committed (durable eviction) and no read of it is in flight here (pins). A reader in
another process cannot pin, so it checks the CRC and that the key still has the generation it
looked up once the read is done.

Directory layout: ``LOCK`` (writer pid, flock), ``MANIFEST.json`` (format, layout, namespace),
``index.lmdb`` (see index.py), ``seg-NNNNN.dat`` (see segments.py).

Reads never wait behind writes: reads and writes go to two engine instances (two rings or two
thread pools), and at most ``_WRITE_BATCHES_IN_FLIGHT`` put batches submit at a time, so the
device queue always has room for reads.
"""

from __future__ import annotations

import asyncio
import bisect
import ctypes
import errno
import fcntl
import gc
import json
import logging
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor

import lmdb
import numpy as np

from .buffers import AlignedBuffer, address_of
from .config import StoreConfig
from .engine import open_engine
from .engine.base import errno_name
from .errors import (
    CapacityShrinkError,
    IndexDamagedError,
    ManifestDamagedError,
    NamespaceMismatchError,
    NotAStoreError,
    ReadOnlyStoreError,
    StoreError,
    StoreLockedError,
    UnsafeStorePathError,
)
from .keybytes import encode_key, key_error, printable_key
from .index import FLAG_CRC, FLAG_KEYCRC, INDEX_FILE, REC_BYTES, REC_DTYPE, Index, key_crcs, check_own_file, quarantine, wrap_lmdb_error
from .segments import SLOT_ALIGN_BYTES, SegmentAllocator, SegmentFiles, segment_name, size_classes

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST_FILE = "MANIFEST.json"
LOCK_FILE = "LOCK"

_WRITE_BATCHES_IN_FLIGHT = 2
_BOUNCE_IDLE_MAX_BYTES = 256 << 20
_RECLAIM_ROUNDS_MAX = 16  # segments reclaimed for one batch whose size class has no room


def _crc32c_fn():
    try:
        from ._uring import crc32c, crc32c_many
    except ImportError as e:
        raise ImportError(
            f"umbp_nvme._uring (the native extension) is required for CRC32C: {e}; build it with "
            "`pip install -e .` (needs a C compiler)"
        ) from None
    return crc32c, crc32c_many


def _is_strict(mode: str) -> bool:
    m = (mode or "strict").strip().lower()
    if m in ("strict", "sync"):
        return True
    if m in ("relaxed", "async"):
        return False
    raise ValueError(f"ssd_durability_mode must be one of: strict, sync, relaxed, async; got {mode!r}")


def _map_size_bytes(capacity_bytes: int) -> int:
    # ~200 bytes of LMDB per record at worst (key <= 511 B is rare; typical keys ~100 B), one
    # record per 4 KiB slot at most, doubled for copy-on-write: the file stays sparse anyway.
    slots = max(1, capacity_bytes // SLOT_ALIGN_BYTES)
    return int(min(max(1 << 30, slots * 1024), 1 << 40))


# --- the store directory: path checks, lock, manifest ----------------------------------------


def _prepare_dir(path: str, *, readonly: bool) -> str:
    path = os.path.abspath(os.fspath(path))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if readonly:
            raise FileNotFoundError(f"store directory {path} does not exist; open it for writing first") from None
        # every directory we create is private (the configured root too, when the store lives in
        # a per-rank subdirectory); existing parents are left as the operator made them
        missing = []
        p = path
        while not os.path.lexists(p):
            missing.append(p)
            p = os.path.dirname(p)
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                pass
        st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeStorePathError(f"store directory {path} is a symlink; give the real directory path")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeStorePathError(f"store path {path} exists and is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeStorePathError(
            f"store directory {path} is owned by uid {st.st_uid}, not by this process (uid {os.geteuid()}); "
            "use a directory of your own"
        )
    if st.st_mode & 0o022:
        raise UnsafeStorePathError(
            f"store directory {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): they could "
            f"replace its files; chmod go-w {path}"
        )
    _check_ancestors(path)
    for name in (INDEX_FILE, INDEX_FILE + "-lock", MANIFEST_FILE, LOCK_FILE):
        check_own_file(os.path.join(path, name))  # LMDB follows symlinks: check before it opens
    return path


def _check_ancestors(path: str) -> None:
    """Refuse a store directory that another user could rename or replace.

    Every directory above it is checked, as written and as resolved (a symlinked ancestor is
    judged by the directory it lives in and the one it points to): each must be owned by root or
    by this user, and one writable by group or others must have the sticky bit (like /tmp), under
    which only an entry's owner can rename it, and the entries we pass through are checked in turn.
    A directory above that another user owns or may write lets them move ours away after open
    and put theirs in its place; later puts would land in their files.
    """
    uid = os.geteuid()
    dirs = []
    for start in (os.path.dirname(path), os.path.realpath(os.path.dirname(path))):
        d = start
        while True:
            if d not in dirs:
                dirs.append(d)
            up = os.path.dirname(d)
            if up == d:
                break
            d = up
    for d in dirs:
        try:
            st = os.stat(d)
        except OSError:
            continue  # not there (yet): the existing ones above decide
        if st.st_uid not in (0, uid):
            raise UnsafeStorePathError(
                f"{d}, above store directory {path}, is owned by uid {st.st_uid}: that user could replace the store; "
                "put the store under directories owned by you or root"
            )
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise UnsafeStorePathError(
                f"{d}, above store directory {path}, is writable by group or others without the sticky bit "
                f"(mode {stat.S_IMODE(st.st_mode):o}): another user could rename the store directory and put theirs in "
                f"its place; chmod go-w (or +t) {d}, or use another directory"
            )


def _take_lock(path: str) -> int:
    lock_path = os.path.join(path, LOCK_FILE)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        check_own_file(lock_path, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        except OSError:
            holder = "unknown"
        os.close(fd)
        raise StoreLockedError(
            f"store {path} is locked by pid {holder} (a writer holds {lock_path}); "
            "open it read-only or stop that process"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _write_json_atomic(path: str, obj) -> None:
    # a fresh name, created exclusively: never an existing file or a symlink someone planted
    tmp = f"{path}.tmp.{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
            while data:
                data = data[os.write(fd, data) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


_MANIFEST_CRC = "crc32c"  # of the other fields' canonical JSON: a flipped byte is damage, not another namespace


def _manifest_crc(m: dict) -> str:
    from ._uring import crc32c

    body = json.dumps({k: v for k, v in m.items() if k != _MANIFEST_CRC}, sort_keys=True, separators=(",", ":"))
    return f"{crc32c(body.encode()):08x}"


def _write_manifest(path: str, m: dict) -> None:
    m[_MANIFEST_CRC] = _manifest_crc(m)
    _write_json_atomic(path, m)


_MANIFEST_MAX_BYTES = 1 << 20  # a manifest is a few hundred bytes: anything this large is damage
_SEGMENT_BYTES_MAX = 1 << 40
_CAPACITY_BYTES_MAX = 1 << 60


def _manifest_int(p: str, field: str, v, lo: int, hi: int, align: int = 1) -> int:
    # bool is an int in Python: true/false in the JSON is damage, not 1/0
    if type(v) is not int or not lo <= v <= hi or v % align:
        rule = f"an integer in {lo}..{hi}" + (f", a multiple of {align}" if align > 1 else "")
        raise ManifestDamagedError(f"{p}: {field}={v!r} is not {rule}; the manifest is damaged")
    return v


def _check_manifest(p: str, m) -> dict:
    """The manifest ``m`` read from ``p`` if every field is in range; ManifestDamagedError naming the field."""
    if not isinstance(m, dict):
        raise ManifestDamagedError(f"{p} holds a JSON {type(m).__name__}, not an object; the manifest is damaged")
    if "format_version" not in m:
        raise ManifestDamagedError(f"{p}: format_version is missing; the manifest is damaged")
    fv = m["format_version"]
    if type(fv) is not int or fv != FORMAT_VERSION:
        raise ManifestDamagedError(f"{p}: format_version={fv!r} is not supported (expected {FORMAT_VERSION})")
    layout = m.get("layout")
    if not isinstance(layout, dict) or "segment_bytes" not in layout:
        raise ManifestDamagedError(f"{p}: layout.segment_bytes is missing; the manifest is damaged")
    _manifest_int(p, "layout.segment_bytes", layout["segment_bytes"], SLOT_ALIGN_BYTES, _SEGMENT_BYTES_MAX, SLOT_ALIGN_BYTES)
    if "slot_align_bytes" in layout and layout["slot_align_bytes"] != SLOT_ALIGN_BYTES:
        raise ManifestDamagedError(
            f"{p}: layout.slot_align_bytes={layout['slot_align_bytes']!r} is not {SLOT_ALIGN_BYTES}; the manifest is damaged"
        )
    ns = m.get("namespace")
    if ns is not None and not isinstance(ns, dict):
        raise ManifestDamagedError(f"{p}: namespace={ns!r} is not an object; the manifest is damaged")
    cap = m.get("ssd_capacity_bytes")
    if cap is not None:
        _manifest_int(p, "ssd_capacity_bytes", cap, layout["segment_bytes"], _CAPACITY_BYTES_MAX)
    # last, so a field out of range is named; manifests written before the checksum have none
    if _MANIFEST_CRC in m and m[_MANIFEST_CRC] != _manifest_crc(m):
        raise ManifestDamagedError(f"{p}: its checksum does not match its content; the manifest is damaged")
    return m


def _read_manifest(path: str) -> dict | None:
    """The manifest, or None when the directory has none; ManifestDamagedError for a damaged one."""
    p = os.path.join(path, MANIFEST_FILE)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeStorePathError(f"{p} is a symlink; refusing to use it") from None
        raise StoreError(f"cannot read {p}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        check_own_file(p, os.fstat(fd))
        data = f.read(_MANIFEST_MAX_BYTES + 1)
    if len(data) > _MANIFEST_MAX_BYTES:
        raise ManifestDamagedError(f"{p} is over {_MANIFEST_MAX_BYTES} bytes; the manifest is damaged")
    try:
        m = json.loads(data)
    except (ValueError, RecursionError) as e:  # ValueError covers bad UTF-8 too
        raise ManifestDamagedError(f"{p} is not valid JSON ({type(e).__name__}: {e}); the manifest is damaged") from None
    return _check_manifest(p, m)


def read_manifest(path) -> dict:
    """The store's MANIFEST.json as a dict (format_version, layout, namespace, ssd_capacity_bytes).

    Raises NotAStoreError (a FileNotFoundError and a StoreError) when ``path`` is not a store
    directory or has no manifest, and its subclass ManifestDamagedError when a field is damaged. Takes no lock; safe beside a writer
    (the manifest is replaced atomically).
    """
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise NotAStoreError(f"store directory {path} does not exist; check the path (--store), or create the store first")
    m = _read_manifest(path)
    if m is None:
        raise NotAStoreError(f"{path} is not a umbp_nvme store (no {MANIFEST_FILE}); check the path (--store)")
    return m


def recorded_capacity_bytes(manifest: dict) -> int | None:
    """ssd_capacity_bytes the store's writer last ran with (None for stores made before it was recorded)."""
    v = manifest.get("ssd_capacity_bytes")
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def lock_holder(path) -> int | None:
    """The pid of the writer holding the store's LOCK, or None when no writer holds it.

    Probes with a shared, non-blocking flock and never takes the lock. -1 when the lock is held
    but the pid cannot be read yet (a writer between its flock and writing its pid).
    """
    p = os.path.join(os.fspath(path), LOCK_FILE)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return int(os.pread(fd, 32, 0).decode(errors="replace").strip())
            except (OSError, ValueError):
                return -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


_GENERATION_MAX = 1 << 62  # generations (put batches) read from the index must stay below this
_SEGMENTS_MAX = 1 << 20  # a segment file name beyond this is not one the store made


def _segment_files_extent(path: str) -> int:
    """1 + the highest segment index with a file in ``path`` (0 when none)."""
    top = -1
    try:
        names = os.listdir(path)
    except OSError:
        return 0
    for name in names:
        if name.startswith("seg-") and name.endswith(".dat"):
            digits = name[4:-4]
            if digits.isascii() and digits.isdigit() and int(digits) < _SEGMENTS_MAX:
                top = max(top, int(digits))
    return top + 1


def _check_namespace(path: str, stored: dict, requested: dict | None) -> None:
    if requested is None or not stored:
        return
    for field in sorted(set(stored) | set(requested)):
        a, b = stored.get(field, "<absent>"), requested.get(field, "<absent>")
        if json.loads(json.dumps(a)) != json.loads(json.dumps(b)):
            raise NamespaceMismatchError(
                f"store {path} was created for {field}={a!r}, but this open declares {field}={b!r}; "
                "use another directory for this model/layout or clear this one"
            )


# --- bounce buffers --------------------------------------------------------------------------


class _BouncePool:
    """Page-aligned staging memory for callers whose memory O_DIRECT cannot use as is."""

    def __init__(self):
        self._idle: list[AlignedBuffer] = []
        self._idle_bytes = 0

    def get(self, nbytes: int) -> AlignedBuffer:
        for i, b in enumerate(self._idle):
            if nbytes <= b.nbytes <= 4 * nbytes:
                self._idle_bytes -= b.nbytes
                return self._idle.pop(i)
        return AlignedBuffer(max(nbytes, 1 << 20))

    def put(self, buf: AlignedBuffer) -> None:
        if self._idle_bytes + buf.nbytes <= _BOUNCE_IDLE_MAX_BYTES:
            self._idle.append(buf)
            self._idle_bytes += buf.nbytes
        else:
            buf.close()

    def close(self) -> None:
        for b in self._idle:
            b.close()
        self._idle.clear()
        self._idle_bytes = 0


class _Refusals:
    """One log line per call for the keys it refused, naming the first reason."""

    __slots__ = ("op", "count", "first")

    def __init__(self, op: str):
        self.op, self.count, self.first = op, 0, None

    def add(self, key, reason: str) -> None:
        self.count += 1
        if self.first is None:
            shown = repr(printable_key(key)) if type(key) is str else f"of type {type(key).__name__}"
            self.first = f"key {shown}: {reason}"

    def log(self, total: int) -> None:
        if self.count:
            log.warning("%s: %d of %d keys failed (first: %s)", self.op, self.count, total, self.first)


_memmove = ctypes.memmove

_ADDR_END = 1 << 63  # addresses and lengths live in [1, 2**63): int64/uint64 arithmetic cannot wrap
_MIN_FAST_ADDR = 4096  # the batch fast path leaves smaller values (bools, 0/1) to the checked path
_GROW_RETRY_S = 30.0  # after a segment file could not be created, try to grow again this often


async def _settle(fut) -> None:
    """Wait until ``fut`` has ended, whatever it ended with. A cancellation of our caller
    meanwhile is re-raised only after that: the engine batch or worker thread behind ``fut`` may
    use memory (caller buffers, slots, bounce buffers) that must not be reused before it ends."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.wait((fut,))
        except asyncio.CancelledError:
            cancelled = True
    if not fut.cancelled():
        fut.exception()  # retrieved: the batch already counts as failed
    if cancelled:
        raise asyncio.CancelledError


async def _wait_out(fut):
    """``fut``'s result (the common path: one shield); if our caller cancels us, the
    CancelledError comes only once ``fut`` has ended (see _settle)."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        if not fut.done():
            await _settle(fut)
        raise


def _plain_keys(keys) -> bool:
    """True when every key is a non-empty ASCII str (one C-level pass): such keys encode as they
    are. False sends the batch to the per-key checks (keybytes.key_error)."""
    try:
        return all(map(str.isascii, keys)) and "" not in keys
    except TypeError:  # a key that is not a str
        return False


def _encode_all(keys, idx=None) -> list[bytes]:
    """Bytes of keys (``keys[i] for i in idx``) already accepted by key_error (or plain):
    ``str.encode`` unless a key holds escaped bytes (U+DC80..U+DCFF), which only
    keybytes.encode_key maps back."""
    try:
        return [k.encode() for k in keys] if idx is None else [keys[i].encode() for i in idx]
    except UnicodeEncodeError:
        return [encode_key(k) for k in keys] if idx is None else [encode_key(keys[i]) for i in idx]


def _int_arg(x) -> int | None:
    """x as a Python int when it is an int or a numpy integer (never a bool); else None."""
    if type(x) is int:
        return x
    if isinstance(x, np.integer):
        return int(x)
    return None

_PART_MIN_BYTES = 1 << 20  # a read sub-batch moves at least this much (its submit and wake-up cost ~tens of us)
_PARTS_MAX = 8
_READ_PARTS_IN_FLIGHT = 3  # read sub-batches submitted at a time (see _get)


def _part_bounds(m: int, nbytes: int) -> list[int]:
    """Split m reads into sub-batches verified as each completes: a few large ones, then smaller
    ones, so the CRC left to do after the last completion is a small fraction of the batch."""
    if m == 0:
        return [0]
    p = max(1, min(_PARTS_MAX, m // 8, nbytes // _PART_MIN_BYTES))
    if p == 1:
        return [0, m]
    # weights 2,2,...,2,1,1: the last two parts are half size
    w = np.array([2] * (p - 2) + [1, 1], np.float64)
    edges = np.rint(np.concatenate([[0], np.cumsum(w)]) / w.sum() * m).astype(int)
    return sorted(set(edges.tolist()))


class PageStore:
    """See docs/architecture.md for the contract. Create with ``await PageStore.open(...)``."""

    # Per-instance once set; class defaults so every open path has them.
    _closed_logged = False  # the one log line for calls after close()
    _stalled_ops = 0  # ops that outlived io_timeout_s (the call waited for the kernel)
    _late_completions = 0  # of those, ended since (== stalled_ops when none is in flight)
    _stalled_wait_s = 0.0  # longest wait past io_timeout_s
    _space_limit_segments = None  # segments with files when one could not be created (ENOSPC)
    _space_retry_at = 0.0

    # ----------------------------------------------------------------------------- open/close

    @classmethod
    async def open(
        cls,
        path,
        config: StoreConfig | None = None,
        *,
        readonly: bool = False,
        namespace: dict | None = None,
        capacity_from_manifest: bool = False,
        shrink: bool = False,
    ) -> "PageStore":
        """Open (a writer creates) the store at ``path``.

        Capacity (writers): the manifest records the ``ssd_capacity_bytes`` the store runs with.
        ``capacity_from_manifest=True`` adopts the recorded capacity and ignores the config's
        (tools that open a store they did not size: the CLI without --capacity). Otherwise the
        config's capacity is used: a larger one grows the store; a smaller one that would take
        segments away raises CapacityShrinkError naming both values, unless ``shrink=True``, which
        evicts everything stored in the removed segments durably (index entries deleted and
        synced first, then the files) and records the new capacity.
        """
        self = cls.__new__(cls)
        await self._open(path, config or StoreConfig(), readonly, namespace, capacity_from_manifest, shrink)
        return self

    async def _open(
        self, path, cfg: StoreConfig, readonly: bool, namespace: dict | None, capacity_from_manifest: bool = False,
        shrink: bool = False,
    ) -> None:  # fmt: skip
        t0 = time.perf_counter()
        self.config = cfg
        self.readonly = readonly
        self.strict = _is_strict(cfg.ssd_durability_mode)
        self.verify_crc = bool(cfg.verify_crc)
        self.timeout_s = float(cfg.io_timeout_s)
        if not 0 < cfg.ssd_low_watermark <= cfg.ssd_high_watermark <= 1:
            raise ValueError(
                f"watermarks must satisfy 0 < low <= high <= 1; got low={cfg.ssd_low_watermark} "
                f"high={cfg.ssd_high_watermark}"
            )
        if cfg.eviction_policy not in ("lru", "prefix_aware"):
            raise ValueError(f"eviction_policy must be 'lru' or 'prefix_aware'; got {cfg.eviction_policy!r}")
        self._crc32c, self._crc32c_many = _crc32c_fn()
        self._closed = False
        self._lock_fd = -1
        self._index = None
        self._files = None
        self._engines = []
        self._index_pool = None
        self._bounce = _BouncePool()
        self._gds_gate = None  # opened on the first CUDA buffer (engine/gds.py)
        self._ranges: list[tuple[int, int]] = []  # sorted registered (start, end)
        self._range_starts: list[int] = []
        self._range_start_arr = np.zeros(0, np.int64)  # the same ranges as arrays, for _resolve_pairs
        self._range_end_arr = np.zeros(0, np.int64)
        self._inflight = 0
        self._late_writes = 0  # write batches that outlived io_timeout_s and still hold slots
        self._idle = asyncio.Event()
        self._idle.set()
        self._counters = dict.fromkeys(
            (
                "puts",
                "put_dedup",
                "put_failed",
                "gets",
                "hits",
                "misses",
                "crc_errors",
                "evictions",
                "deletes",
                "bytes_written",
                "bytes_read",
                "timeouts",
            ),
            0,
        )
        try:
            self.path = _prepare_dir(path, readonly=readonly)
            if not readonly:
                self._lock_fd = _take_lock(self.path)
            self._open_manifest(cfg, namespace, capacity_from_manifest, shrink)
            self._open_index()
            self._files = SegmentFiles(
                self.path,
                self.segment_bytes,
                readonly=readonly,
                o_direct=bool(cfg.o_direct),
                n_segments=max(1, self.capacity_bytes // self.segment_bytes),
            )
            if not readonly:
                self._load_writer_state()
                self._index_pool = ThreadPoolExecutor(1, thread_name_prefix="umbp-index")
                self._write_sem = asyncio.Semaphore(_WRITE_BATCHES_IN_FLIGHT)
                self._commit_lock = asyncio.Lock()
            qd = int(cfg.ssd_queue_depth)
            self._read_engine = await open_engine(cfg.ssd_io_backend, qd)
            self._engines.append(self._read_engine)
            if not readonly:
                self._write_engine = await open_engine(cfg.ssd_io_backend, qd)
                self._engines.append(self._write_engine)
        except BaseException:
            self._release_resources()
            raise
        self.open_seconds = time.perf_counter() - t0
        log.info(
            "opened store %s (%s, %s, %d objects, %.3f s, engine %s)",
            self.path,
            "read-only" if readonly else "writer",
            "strict" if self.strict else "relaxed",
            self._object_count(),
            self.open_seconds,
            self._read_engine.capabilities.name,
        )

    def _open_manifest(self, cfg: StoreConfig, namespace: dict | None, capacity_from_manifest: bool = False,
                       shrink: bool = False) -> None:  # fmt: skip
        if namespace is not None and not isinstance(namespace, dict):
            raise TypeError(f"namespace must be a dict of JSON values, got {type(namespace).__name__}")
        self._shrink_from = None  # (old capacity, old segment count) while a permitted shrink runs
        self._manifest_created = False  # this open wrote a new manifest (no index records to trust yet)
        mpath = os.path.join(self.path, MANIFEST_FILE)
        damage = None
        try:
            m = _read_manifest(self.path)
        except ManifestDamagedError as e:
            if self.readonly:
                raise
            m, damage = None, str(e)
        if m is None and damage is None and not self.readonly and (
            _segment_files_extent(self.path) or os.path.lexists(os.path.join(self.path, INDEX_FILE))
        ):
            damage = f"{mpath} is missing but the directory holds store files"
        if m is None:
            if self.readonly:
                raise FileNotFoundError(f"{self.path} has no {MANIFEST_FILE}; it is not a store (open it for writing first)")
            seg = min(int(cfg.ssd_segment_size_bytes), int(cfg.ssd_capacity_bytes))
            seg -= seg % SLOT_ALIGN_BYTES
            if seg <= 0:
                raise ValueError(
                    f"ssd_capacity_bytes={cfg.ssd_capacity_bytes} and ssd_segment_size_bytes="
                    f"{cfg.ssd_segment_size_bytes} leave no room for one {SLOT_ALIGN_BYTES}-byte slot"
                )
            m = {
                "format_version": FORMAT_VERSION,
                "layout": {"segment_bytes": seg, "slot_align_bytes": SLOT_ALIGN_BYTES},
                "namespace": namespace or {},
                "ssd_capacity_bytes": int(cfg.ssd_capacity_bytes),
            }
            if damage is not None:
                m = self._recover_manifest(mpath, m, damage)
                shrink = True  # the files' extent is a guess: fit it to the capacity asked for, never refuse
            else:
                self._manifest_created = True
            _write_manifest(mpath, m)
        else:
            stored = m.get("namespace") or {}
            _check_namespace(self.path, stored, namespace)
            if not stored and namespace and not self.readonly:
                m["namespace"] = namespace  # first declaration on a store created without one
                _write_manifest(mpath, m)
        self.manifest = m
        self.segment_bytes = int(m["layout"]["segment_bytes"])
        if self.segment_bytes != cfg.ssd_segment_size_bytes and not self.readonly:
            log.info("%s keeps its segment size of %d bytes (config asks %d)", self.path, self.segment_bytes, cfg.ssd_segment_size_bytes)
        recorded = recorded_capacity_bytes(m)
        if self.readonly:
            self.capacity_bytes = recorded or int(cfg.ssd_capacity_bytes)
            return
        self.capacity_bytes = self._writer_capacity(m, recorded, int(cfg.ssd_capacity_bytes), capacity_from_manifest, shrink)

    def _recover_manifest(self, mpath: str, fresh: dict, damage: str) -> dict:
        """A writer's manifest after damage: the damaged file moved aside, its facts re-derived.

        ``segment_bytes`` comes from the segment files when they all have one valid size (they
        are preallocated to it), else from the config (``fresh``); the namespace is the one this
        open declares; the capacity is re-recorded from the files' extent and the config by
        ``_writer_capacity``. Index records that do not fit the derived layout are dropped at load.
        """
        dest = None
        if os.path.lexists(mpath):
            try:
                dest = quarantine(mpath, lock_file=False)
            except OSError as e:
                raise StoreError(f"{damage}, and it cannot be moved aside ({e.strerror or e}); remove it") from None
        seg, source = fresh["layout"]["segment_bytes"], "the config"
        sizes = set()
        for name in os.listdir(self.path):
            if name.startswith("seg-") and name.endswith(".dat"):
                try:
                    st = os.lstat(os.path.join(self.path, name))
                except OSError:
                    continue
                sizes.add(st.st_size if stat.S_ISREG(st.st_mode) else -1)
        if len(sizes) == 1:
            (size,) = sizes
            if SLOT_ALIGN_BYTES <= size <= _SEGMENT_BYTES_MAX and size % SLOT_ALIGN_BYTES == 0:
                seg, source = size, "the segment files"
        m = dict(fresh, layout={"segment_bytes": seg, "slot_align_bytes": SLOT_ALIGN_BYTES})
        del m["ssd_capacity_bytes"]  # re-derived: the files' extent, fitted to the capacity asked for
        log.error(
            "%s: the store manifest is damaged (%s); %s and re-derived it (segment_bytes=%d from %s, namespace "
            "from this open); keeping the index records that fit it",
            self.path, damage, f"moved it to {dest}" if dest else "writing a new one", seg, source,
        )  # fmt: skip
        return m

    def _writer_capacity(self, m: dict, recorded: int | None, requested: int, from_manifest: bool, shrink: bool) -> int:
        """The capacity this writer runs with; records it in the manifest unless it shrinks (then later)."""
        seg = self.segment_bytes
        if recorded is None:
            # a store made before the manifest recorded its capacity: what is on disk is the floor
            floor = _segment_files_extent(self.path) * seg
            if from_manifest:
                requested = max(requested, floor)
            recorded = floor
        elif from_manifest:
            requested = recorded
        if requested < seg:
            raise ValueError(
                f"ssd_capacity_bytes={requested} is smaller than this store's segment size ({seg} bytes)"
            )
        old_n, new_n = recorded // seg, requested // seg
        if new_n < old_n:
            if not shrink:
                raise CapacityShrinkError(
                    f"store {self.path} has ssd_capacity_bytes={recorded} ({old_n} segments of {seg} bytes), but this "
                    f"open asks for ssd_capacity_bytes={requested} ({new_n} segments): that would drop what is stored "
                    f"in segments {new_n}..{old_n - 1}. Open it with ssd_capacity_bytes={recorded} (or "
                    "PageStore.open(..., capacity_from_manifest=True); the CLI: --capacity), or shrink it "
                    "deliberately with PageStore.open(..., shrink=True) (SGLang: lowering ssd_capacity_bytes in "
                    "its config does this), which evicts those objects"
                )
            self._shrink_from = (recorded, old_n)
            return requested  # recorded once the evictions are durable (_load_writer_state)
        if m.get("ssd_capacity_bytes") != requested:
            if recorded_capacity_bytes(m) is not None:
                log.info("%s: capacity %d -> %d bytes", self.path, recorded, requested)
            m["ssd_capacity_bytes"] = requested
            _write_manifest(os.path.join(self.path, MANIFEST_FILE), m)
        return requested

    def _open_index(self) -> None:
        """Open index.lmdb; a writer also reads every record (``self._scan``).

        The index is a cache of what the segments hold: a writer that finds it damaged moves it
        aside (``index.lmdb.corrupt-<time>``) and starts empty, so the segments' space is reused.
        A read-only opener raises IndexDamagedError naming the file.
        """
        ipath = os.path.join(self.path, INDEX_FILE)
        map_size = _map_size_bytes(self.capacity_bytes)
        self._scan = None
        if not self.readonly and not self._manifest_created and not os.path.lexists(ipath):
            log.error(
                "%s: the store index %s is missing; starting with an empty index (the objects it listed are lost; "
                "their space is reused)", self.path, ipath,
            )  # fmt: skip
        try:
            self._index = Index(ipath, readonly=self.readonly, map_size=map_size, durable=self.strict)
            if not self.readonly:
                self._scan = self._index.scan()
                self._scan_next_gen = self._index.next_generation()
                if self._index.scan_damage is not None:
                    self._rebuild_index(ipath, map_size)
            return
        except IndexDamagedError as e:
            if self.readonly:
                raise
            if self._index is not None:
                self._index.close()
                self._index = None
            reason = e
        try:
            dest = quarantine(ipath)
        except OSError as e:
            raise StoreError(
                f"store index {ipath} is damaged ({reason}) and cannot be moved aside ({e.strerror or e}); remove it"
            ) from None
        log.error(
            "%s: %s; moved it to %s and starting with an empty index (the objects it listed are lost; their "
            "space is reused)",
            self.path, reason, dest,
        )  # fmt: skip
        self._index = Index(ipath, readonly=False, map_size=map_size, durable=self.strict)
        self._scan = self._index.scan()
        # generations keep growing across the reset: a follower still reading the old index
        # can never match a new record's generation to an old one
        self._scan_next_gen = time.time_ns() // 1000

    def _rebuild_index(self, ipath: str, map_size: int) -> None:
        """The scan found damaged nodes (and left their keys out): move the file aside and write
        a new index holding every record that scanned clean, so nothing intact is lost and no
        damaged node stays where a later lookup or delete could land on it."""
        reason = self._index.scan_damage
        keys, recs = self._scan
        self._index.close()
        self._index = None
        try:
            dest = quarantine(ipath)
        except OSError as e:
            raise StoreError(
                f"store index {ipath} is damaged ({reason}) and cannot be moved aside ({e.strerror or e}); remove it"
            ) from None
        self._index = Index(ipath, readonly=False, map_size=map_size, durable=self.strict)
        blob = recs.tobytes()
        puts = [(encode_key(k), blob[i * REC_BYTES : (i + 1) * REC_BYTES]) for i, k in enumerate(keys)]
        try:
            self._index.commit(puts=puts, next_generation=self._scan_next_gen)
            self._index.sync()
        except lmdb.Error as e:
            raise wrap_lmdb_error(ipath, e, f"rebuilding it from {len(keys)} intact records") from None
        log.error(
            "%s: the store index %s is damaged (%s); moved it to %s and rebuilt it from its %d intact records",
            self.path, ipath, reason, dest, len(keys),
        )  # fmt: skip

    def _load_writer_state(self) -> None:
        gc_was_enabled = gc.isenabled()
        gc.disable()  # a million fresh dict entries and strs would trigger useless full collections
        try:
            self._load_writer_state_nogc()
        finally:
            if gc_was_enabled:
                gc.enable()

    def _load_writer_state_nogc(self) -> None:
        n_segments = self.capacity_bytes // self.segment_bytes
        if n_segments == 0:
            raise ValueError(
                f"ssd_capacity_bytes={self.capacity_bytes} is smaller than this store's segment size "
                f"({self.segment_bytes} bytes)"
            )
        self._alloc = SegmentAllocator(n_segments, self.segment_bytes)
        self._high_bytes = int(self._alloc.capacity_bytes * self.config.ssd_high_watermark)
        self._low_bytes = int(self._alloc.capacity_bytes * self.config.ssd_low_watermark)
        keys, recs = self._scan
        self._scan = None
        n = len(keys)
        segs = recs["segment"]
        shrunk = 0
        if n and self._shrink_from is not None:
            shrunk = int((segs >= n_segments).sum())
        keep = self._alloc.rebuild(segs, recs["offset"], recs["length"], recs["generation"])
        # generations count puts: one near 2**64 is damage and would overflow the clock
        keep &= recs["generation"] < _GENERATION_MAX
        if n:
            # A record whose segment file is gone (ENOENT) or too short for its extent cannot be
            # read back: drop it. Any other failure (EMFILE, EACCES, EIO...) may be transient:
            # refuse to open rather than destroy the index over it.
            kk = np.flatnonzero(keep)
            ks = segs[kk].astype(np.int64)
            sizes = np.full(n_segments, -1, np.int64)  # -1: the file is gone
            for s in np.unique(ks).tolist():
                size = self._segment_size(s)
                sizes[s] = -1 if size is None else size
            ends = recs["offset"][kk].astype(np.int64) + recs["length"][kk].astype(np.int64)
            keep[kk] = ends <= sizes[ks]
            for s in np.unique(segs[keep]).tolist():
                self._open_segment_for_load(s)
            if not keep.all():
                drop = [encode_key(keys[i]) for i in np.flatnonzero(~keep).tolist()]
                if shrunk:
                    log.warning(
                        "%s: shrinking from ssd_capacity_bytes=%d to %d (%d -> %d segments): evicting %d objects "
                        "stored in the removed segments",
                        self.path, self._shrink_from[0], self.capacity_bytes, self._shrink_from[1], n_segments, shrunk,
                    )  # fmt: skip
                if len(drop) > shrunk:
                    log.warning(
                        "%s: dropping %d index records whose data is gone (segment file missing or short) or that are damaged "
                        "(outside their segment, misaligned, overlapping another)",
                        self.path, len(drop) - shrunk,
                    )  # fmt: skip
                try:
                    self._index.commit(deletes=drop)
                except lmdb.Error as e:
                    raise wrap_lmdb_error(self._index.path, e, f"deleting {len(drop)} records at open") from None
                idx = np.flatnonzero(keep)
                keys = [keys[i] for i in idx.tolist()]
                recs = recs[idx]
                self._alloc.rebuild(recs["segment"], recs["offset"], recs["length"], recs["generation"])
        if self._shrink_from is not None:
            # durable order: index entries gone (and synced) first, then the files, then the record
            self._index.sync()
            self._files.unlink_beyond(n_segments)
            self.manifest["ssd_capacity_bytes"] = self.capacity_bytes
            _write_manifest(os.path.join(self.path, MANIFEST_FILE), self.manifest)
            log.warning(
                "%s: shrunk to ssd_capacity_bytes=%d (%d segments)", self.path, self.capacity_bytes, n_segments
            )
            self._shrink_from = None
        n = len(keys)
        cap = max(1024, int(n * 1.25))
        self._rows_seg = np.zeros(cap, np.int64)
        self._rows_off = np.zeros(cap, np.int64)
        self._rows_len = np.zeros(cap, np.int64)
        self._rows_crc = np.zeros(cap, np.uint32)
        self._rows_flags = np.zeros(cap, np.uint32)
        self._rows_gen = np.zeros(cap, np.uint64)
        self._rows_depth = np.zeros(cap, np.int32)
        self._rows_tick = np.zeros(cap, np.uint64)
        self._rows_pins = np.zeros(cap, np.int32)
        self._rows_live = np.zeros(cap, bool)
        if n:
            self._rows_seg[:n] = recs["segment"]
            self._rows_off[:n] = recs["offset"]
            self._rows_len[:n] = recs["length"]
            self._rows_crc[:n] = recs["crc"]
            self._rows_flags[:n] = recs["flags"]
            self._rows_gen[:n] = recs["generation"]
            self._rows_depth[:n] = recs["depth"]
            self._rows_tick[:n] = recs["generation"]  # LRU order after a restart: put order
            self._rows_live[:n] = True
        self._row_key: list[str | None] = keys
        self._keys: dict[str, int] = dict(zip(self._row_key, range(n)))
        self._nrows = n
        self._free_rows: list[int] = []
        self._dead_pinned: set[int] = set()  # deleted rows whose slot waits for a read to finish
        gen_max = int(recs["generation"].max()) if n else 0
        if self._scan_next_gen >= _GENERATION_MAX:
            log.error("%s: the index's next generation %d is damaged; continuing after its records' highest",
                      self.path, self._scan_next_gen)  # fmt: skip
            self._scan_next_gen = max(gen_max + 1, time.time_ns() // 1000)
        self._clock = max(self._scan_next_gen, gen_max + 1)

    def _segment_size(self, s: int) -> int | None:
        """Size of segment file s; None when it is gone. Raises StoreError for any other failure."""
        p = os.path.join(self.path, segment_name(s))
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(
                f"cannot stat segment file {p} ({e.strerror or e}); refusing to open the store rather than drop "
                "the index records of that segment: fix the cause and open it again"
            ) from None
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeStorePathError(
                f"segment file {p} is not a regular file (a symlink or special file); remove it and open the store again"
            )
        return st.st_size

    def _open_segment_for_load(self, s: int) -> None:
        """Open segment s, which holds records; any failure refuses the open (nothing is dropped)."""
        try:
            self._files.open_existing(s)
        except OSError as e:
            p = os.path.join(self.path, segment_name(s))
            raise StoreError(
                f"cannot open segment file {p} ({errno_name(-e.errno) if e.errno else ''} {e.strerror or e}); the "
                "store was not opened and its index was left as it is: fix the cause (open-file limit, "
                "permissions, disk) and open it again"
            ) from None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._inflight:
            try:
                await asyncio.wait_for(self._idle.wait(), self.timeout_s)
            except asyncio.TimeoutError:
                # every call ends once the kernel gave back its memory (see _await_io); closing
                # the engines before that would let a late completion land in freed memory
                log.warning("%s: close waits for %d calls whose I/O the kernel still holds", self.path, self._inflight)
                await self._idle.wait()
        if not self.readonly and self._index is not None and not self.strict:
            await self.flush_for_close()
        if self._index_pool is not None and self._index is not None:
            # close the index after whatever is queued on its thread, and wait for it (bounded):
            # a reopen in this process right after close() must not share the closing handle
            ix, self._index = self._index, None
            fut = asyncio.get_running_loop().run_in_executor(self._index_pool, ix.close)
            try:
                await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
            except asyncio.TimeoutError:
                log.warning("%s: the index closes in the background (a commit is still on its thread)", self.path)
        self._release_resources()

    def _release_resources(self) -> None:
        for e in self._engines:
            try:
                e.close()
            except Exception:  # noqa: BLE001
                pass
        self._engines = []
        gate, self._gds_gate = getattr(self, "_gds_gate", None), None
        if gate is not None:
            if gate.engine is not None and self._files is not None:
                for f in self._files.files.values():
                    gate.engine.forget_fd(f.fd)
            gate.close()
        if self._files is not None:
            self._files.close()
        if self._index_pool is not None:
            # A commit stuck on a slow fsync must not block the loop thread: the index closes on
            # its own thread after whatever is queued there (the env is refcounted per process,
            # so a reopen meanwhile shares it safely).
            if self._index is not None:
                self._index_pool.submit(self._index.close)
                self._index = None
            self._index_pool.shutdown(wait=False)
            self._index_pool = None
        if self._index is not None:
            self._index.close()
            self._index = None
        self._bounce.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    # ----------------------------------------------------------------------------- memory

    def register_memory(self, address: int, nbytes: int) -> bool:
        """Allow (address, nbytes) buffers inside this range; offer it to the engines as fixed buffers."""
        a, n = _int_arg(address), _int_arg(nbytes)
        if a is None or n is None:
            raise TypeError(
                f"register_memory needs int address and nbytes; got {type(address).__name__}, {type(nbytes).__name__}"
            )
        if not (0 < a < _ADDR_END and 0 < n < _ADDR_END and a + n < _ADDR_END):
            raise ValueError(f"register_memory needs 0 < address, 0 < nbytes, address + nbytes < 2**63; got {a:#x}, {n}")
        address, nbytes = a, n
        i = bisect.bisect_left(self._range_starts, address)
        self._ranges.insert(i, (address, address + nbytes))
        self._range_starts.insert(i, address)
        self._range_start_arr = np.asarray([a for a, _ in self._ranges], np.int64)
        self._range_end_arr = np.asarray([b for _, b in self._ranges], np.int64)
        fixed = False
        for e in self._engines:
            try:
                fixed = bool(e.register_buffers([(a, b - a) for a, b in self._ranges])) or fixed
            except Exception as ex:  # noqa: BLE001 - registration is an optimisation
                log.info("engine %s did not take registered buffers: %s", e.capabilities.name, ex)
        return fixed

    def _in_registered(self, addr: int, nbytes: int) -> bool:
        i = bisect.bisect_right(self._range_starts, addr) - 1
        if i >= 0:
            a, b = self._ranges[i]
            if a <= addr and addr + nbytes <= b:
                return True
        while i >= 0:
            a, b = self._ranges[i]
            if a <= addr and addr + nbytes <= b:
                return True
            if b <= addr and i > 0 and self._ranges[i - 1][1] <= addr:
                break
            i -= 1
        return False

    def _resolve(self, buf, *, writable: bool) -> tuple[int, int, bool] | str:
        """(address, nbytes, is_device) or the reason the buffer is refused."""
        if isinstance(buf, tuple):
            # (address, nbytes): checked in Python ints, so no sum can wrap (bools are refused)
            if len(buf) != 2:
                return "a tuple buffer must be (address, nbytes) of ints"
            addr, n = _int_arg(buf[0]), _int_arg(buf[1])
            if addr is None or n is None:
                return "a tuple buffer must be (address, nbytes) of ints"
            if not (0 < addr < _ADDR_END and 0 < n < _ADDR_END):
                return f"address {addr:#x} and nbytes {n} must both be in [1, 2**63)"
            if not self._in_registered(addr, n):
                return f"address range {addr:#x}+{n} is not inside a registered range (register_memory)"
            return addr, n, False
        try:
            a, n = address_of(buf, writable=writable)
            return a, n, False
        except TypeError as e:
            host_error = str(e)
        # not host memory: a CUDA buffer goes to the GDS engine (or staging), if this machine has one
        try:
            from .engine.gds import cuda_buffer_address

            dev = cuda_buffer_address(buf, writable=writable)
        except TypeError as e:
            return str(e)
        except ImportError:
            dev = None
        if dev is None:
            return host_error
        return dev[0], dev[1], True

    async def _gds_route(self) -> str:
        """'gds' | 'staging'; raises EngineUnavailable (the caller reports per-key False)."""
        from .engine import gds

        if self._gds_gate is None:
            self._gds_gate = gds.GdsGate(
                queue_depth=int(self.config.ssd_queue_depth),
                probe_dir=self.path,
                staging=bool(getattr(self.config, "gds_staging", False)),
            )
        return await self._gds_gate.route()

    # ----------------------------------------------------------------------------- rows

    def _new_rows(self, k: int) -> np.ndarray:
        free = self._free_rows
        take = min(k, len(free))
        rows = free[len(free) - take :][::-1]
        del free[len(free) - take :]
        need = k - take
        if need:
            if self._nrows + need > len(self._rows_seg):
                self._grow_rows(self._nrows + need)
            rows.extend(range(self._nrows, self._nrows + need))
            self._nrows += need
            self._row_key.extend([None] * need)
        return np.asarray(rows, dtype=np.int64)

    def _grow_rows(self, n: int) -> None:
        cap = max(n, 2 * len(self._rows_seg))
        for name in ("seg", "off", "len", "crc", "flags", "gen", "depth", "tick", "pins", "live"):
            a = getattr(self, f"_rows_{name}")
            b = np.zeros(cap, a.dtype)
            b[: len(a)] = a
            setattr(self, f"_rows_{name}", b)

    def _release_rows(self, rows) -> None:
        """Give back the slots of rows already gone from the index (deferred while pinned)."""
        for r in rows:
            if self._rows_pins[r] > 0:
                self._dead_pinned.add(r)
            else:
                self._alloc.free(int(self._rows_seg[r]), int(self._rows_off[r]))
                self._row_key[r] = None
                self._free_rows.append(r)

    def _unpin(self, rows: np.ndarray) -> None:
        np.subtract.at(self._rows_pins, rows, 1)
        if self._dead_pinned:
            done = [r for r in set(rows.tolist()) if r in self._dead_pinned and self._rows_pins[r] == 0]
            for r in done:
                self._dead_pinned.discard(r)
            self._release_rows(done)

    def _object_count(self) -> int:
        if self.readonly:
            try:
                return self._index.count()
            except Exception:  # noqa: BLE001
                return -1
        return len(self._keys)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ----------------------------------------------------------------------------- index commits

    async def _commit(self, puts=(), deletes=()) -> bool:
        """One index transaction; strict commits fsync, so they run on the index thread."""
        try:
            ix, nxt = self._index, self._clock + 1
            if self.strict:
                fut = asyncio.get_running_loop().run_in_executor(
                    self._index_pool, lambda: ix.commit(puts, deletes, next_generation=nxt)
                )
                await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
            else:
                ix.commit(puts, deletes, next_generation=nxt)
            return True
        except asyncio.TimeoutError:
            self._counters["timeouts"] += 1
            log.error("%s: index commit took longer than io_timeout_s=%.1f s", self.path, self.timeout_s)
            raise
        except Exception as e:  # noqa: BLE001 - lmdb.Error (ENOSPC, MapFull) becomes a failed batch
            log.error("%s: index commit of %d puts / %d deletes failed: %s", self.path, len(puts), len(deletes), e)
            return False

    async def _drop_rows(self, rows: list[int], *, evicted: bool) -> bool:
        """Durably remove rows' keys from the index, then free their slots. Caller holds no lock."""
        if not rows:
            return True
        keys = [self._row_key[r] for r in rows]
        for k in keys:
            del self._keys[k]  # invisible to new readers first: nothing new pins these rows
        self._rows_live[rows] = False
        async with self._commit_lock:
            try:
                ok = await self._commit(deletes=[encode_key(k) for k in keys])  # decoded from bytes: always encodes
            except asyncio.TimeoutError:
                ok = None  # the commit may still land: keep the slots out of use
        if ok:
            self._release_rows(rows)
            self._counters["evictions" if evicted else "deletes"] += len(rows)
            return True
        if ok is False:  # nothing committed: the entries stand, keep serving them
            orphans = []
            for r, k in zip(rows, keys):
                if k not in self._keys:
                    self._keys[k] = r
                    self._rows_live[r] = True
                else:
                    orphans.append(r)  # re-put meanwhile: the index holds the new record, not this one
            self._release_rows(orphans)
        return False

    # ----------------------------------------------------------------------------- eviction

    def _pick_victims(self, bytes_needed: int) -> list[int]:
        n = self._nrows
        cand = np.flatnonzero(self._rows_live[:n] & (self._rows_pins[:n] == 0))
        if not len(cand) or bytes_needed <= 0:
            return []
        cls = size_classes(self._rows_len[cand])
        tick = self._rows_tick[cand]
        depth = self._rows_depth[cand].astype(np.int64)
        if self.config.eviction_policy == "prefix_aware":
            # A page's components share (put batch generation, depth): they leave together.
            # unit = (generation, depth) for rows put with depths; a row of its own otherwise
            gen = self._rows_gen[cand]
            solo = depth < 0
            k1 = np.where(solo, cand.astype(np.uint64), gen)
            k2 = np.where(solo, -1, depth)
            k0 = solo.astype(np.int8)
            order0 = np.lexsort((k2, k1, k0))
            s0, s1, s2 = k0[order0], k1[order0], k2[order0]
            new_unit = np.ones(len(order0), bool)
            new_unit[1:] = (s0[1:] != s0[:-1]) | (s1[1:] != s1[:-1]) | (s2[1:] != s2[:-1])
            unit_sorted = np.cumsum(new_unit) - 1
            inv = np.empty(len(cand), np.int64)
            inv[order0] = unit_sorted
            first = order0[new_unit]
            u_bytes = np.bincount(inv, weights=cls)
            u_tick = np.zeros(len(first), np.uint64)
            np.maximum.at(u_tick, inv, tick)
            u_depth = depth[first]
            order = np.lexsort((u_tick, -u_depth))  # deepest first, then least recently used
            csum = np.cumsum(u_bytes[order])
            m = int(np.searchsorted(csum, bytes_needed)) + 1
            chosen = np.zeros(len(first), bool)
            chosen[order[:m]] = True
            return cand[chosen[inv]].tolist()
        order = np.argsort(tick, kind="stable")
        csum = np.cumsum(cls[order])
        m = int(np.searchsorted(csum, bytes_needed)) + 1
        return cand[order[:m]].tolist()

    def _effective_capacity(self) -> int:
        """Bytes the store runs with: the configured capacity, or, while the file system refuses
        new segment files below it, the segments it has (see _write_objects)."""
        lim = self._space_limit_segments
        full = self._alloc.capacity_bytes
        return full if lim is None else min(full, lim * self.segment_bytes)

    async def _make_room(self, need_bytes: int) -> None:
        used = self._alloc.used_bytes
        high, low = self._high_bytes, self._low_bytes
        if self._space_limit_segments is not None:  # watermarks over the space the disk gave us
            eff = self._effective_capacity()
            high = min(high, int(eff * self.config.ssd_high_watermark))
            low = min(low, int(eff * self.config.ssd_low_watermark))
        if used + need_bytes <= high:
            return
        victims = self._pick_victims(used + need_bytes - low)
        if victims:
            await self._drop_rows(victims, evicted=True)

    def _try_grow(self) -> None:
        """Running below capacity after ENOSPC: create the next segment file if the file system
        has room again (once per _GROW_RETRY_S; a create costs what any grow costs)."""
        files = self._files.files
        nxt = next((i for i in range(self._alloc.n_segments) if i not in files), None)
        if nxt is None:
            self._space_limit_segments = None
            return
        self._note_space(not self._files.ensure(nxt), True)

    def _note_space(self, failed_create: bool, tried: bool) -> None:
        """Adopt (or lift) the effective capacity after a batch's segment creation."""
        have = len(self._files.files)
        lim = self._space_limit_segments
        if failed_create:
            self._space_retry_at = time.monotonic() + _GROW_RETRY_S
            if lim is None:
                self._space_limit_segments = have
                log.warning(
                    "%s: the file system has no room for segment %d (%s); running with the %d segments it has "
                    "(%d MiB of the configured %d MiB), evicting within them; trying to grow again every %.0f s",
                    self.path, have, errno_name(-(getattr(self._files, "_failed_errno", None) or errno.EIO)),
                    have, have * self.segment_bytes >> 20, self._alloc.capacity_bytes >> 20, _GROW_RETRY_S,
                )  # fmt: skip
        elif lim is not None and tried and have > lim:
            self._space_limit_segments = None
            log.warning("%s: the file system has room again; growing towards %d MiB", self.path, self._alloc.capacity_bytes >> 20)

    async def _reclaim_segment(self) -> bool:
        """Empty the least recently used segment whose slots are all published and unpinned."""
        n = self._nrows
        live = np.flatnonzero(self._rows_live[:n])
        if not len(live):
            return False
        segs = self._rows_seg[live]
        nseg = self._alloc.n_segments
        count = np.bincount(segs, minlength=nseg)
        pinned = np.bincount(segs, weights=self._rows_pins[live] > 0, minlength=nseg)
        recent = np.zeros(nseg, np.uint64)
        np.maximum.at(recent, segs, self._rows_tick[live])
        ok = (count > 0) & (pinned == 0) & (count == np.asarray(self._alloc.seg_used))
        if not ok.any():
            return False
        cand = np.flatnonzero(ok)
        seg = int(cand[np.argmin(recent[cand])])
        return await self._drop_rows(live[segs == seg].tolist(), evicted=True)

    # ----------------------------------------------------------------------------- put

    async def put_many(self, keys: list[str], buffers: list, *, depths: list[int] | None = None) -> list[bool]:
        if self.readonly:
            raise ReadOnlyStoreError(f"store {self.path} was opened read-only; put_many is not allowed")
        n = len(keys)
        if len(buffers) != n or (depths is not None and len(depths) != n):
            raise ValueError(
                f"put_many needs one buffer (and depth) per key: {n} keys, {len(buffers)} buffers, "
                f"{'no' if depths is None else len(depths)} depths"
            )
        results = [False] * n
        if self._closed:
            self._closed_call("put_many")
            return results
        self._enter()
        try:
            await self._put(keys, buffers, self._depth_array(depths, n), results)
        except Exception:  # noqa: BLE001 - never an exception for an I/O problem
            log.exception("%s: put_many failed", self.path)
        finally:
            self._leave()
        self._counters["puts"] += sum(results)
        self._counters["put_failed"] += n - sum(results)
        return results

    @staticmethod
    def _depth_array(depths, n: int):
        """depths as int32[] (one C conversion), or a list with None where a depth is not an int32
        (that key alone is refused); None when the caller passed none."""
        if depths is None:
            return None
        try:
            a = np.asarray(depths)
            if a.shape == (n,) and a.dtype.kind in "iu" and (not n or (a.min() >= -(1 << 31) and a.max() < 1 << 31)):
                return a.astype(np.int32, copy=False)
        except (TypeError, ValueError, OverflowError):
            pass
        out = []
        for d in depths:
            v = _int_arg(d)
            out.append(v if v is not None and -(1 << 31) <= v < 1 << 31 else None)
        return out

    async def _put(self, keys, buffers, depths, results) -> None:
        n = len(keys)
        refused = _Refusals("put_many")
        plain = _plain_keys(keys)
        bad_depth = depths is not None and type(depths) is list
        fast = self._put_fast_prep(keys, buffers) if plain and not bad_depth else None
        if fast is not None:
            # every key new and distinct, every buffer a registered (address, nbytes) pair
            await self._write_objects(keys, np.arange(n, dtype=np.int64), fast[0], fast[1], depths, results, refused)
            refused.log(n)
            return
        todo: list[int] = []
        addrs: list[int] = []
        lens: list[int] = []
        dev_todo: list[int] = []
        dev_addrs: list[int] = []
        dev_lens: list[int] = []
        first_of: dict[str, int] = {}
        dups: list[tuple[int, int]] = []
        max_key = self._index.max_key_bytes
        known = self._keys.get
        again: list[int] = []
        for i, k in enumerate(keys):
            # Every key is checked before any slot is reserved: nothing can fail once the write is
            # submitted, so a bad key fails alone and never frees slots the device still owns.
            if not plain:
                why = key_error(k)
                if why is not None:
                    refused.add(k, why)
                    continue
            if bad_depth and depths[i] is None:
                refused.add(k, "depth is not an int in the int32 range")
                continue
            r = known(k)
            if r is not None:
                results[i] = True  # the first bytes stay; the re-put makes the key recently used
                again.append(r)
                continue
            if k in first_of:
                dups.append((i, first_of[k]))
                continue
            first_of[k] = i
            r = self._resolve(buffers[i], writable=False)
            if isinstance(r, str):
                refused.add(k, r)
                continue
            addr, nb, on_device = r
            if nb <= 0 or nb > self.segment_bytes or nb >= 1 << 32:
                refused.add(k, f"object of {nb} bytes; must be 1..{min(self.segment_bytes, (1 << 32) - 1)}")
                continue
            if len(k) * 4 > max_key and len(encode_key(k)) > max_key:
                refused.add(k, f"key longer than {max_key} bytes")
                continue
            if on_device:
                dev_todo.append(i)
                dev_addrs.append(addr)
                dev_lens.append(nb)
            else:
                todo.append(i)
                addrs.append(addr)
                lens.append(nb)
        if again:
            # before this batch evicts anything: SGLang re-puts the prefixes it keeps hot
            self._counters["put_dedup"] += len(again)
            self._rows_tick[again] = self._tick()
        if todo:
            await self._write_objects(
                keys, np.asarray(todo, np.int64), np.asarray(addrs, np.uint64), np.asarray(lens, np.int64),
                depths, results, refused,
            )  # fmt: skip
        if dev_todo:
            try:
                route = await self._gds_route()
            except OSError as e:  # EngineUnavailable: this machine cannot do GPU I/O
                route = None
                for i in dev_todo:
                    refused.add(keys[i], str(e))
            if route:
                await self._write_objects(
                    keys, np.asarray(dev_todo, np.int64), np.asarray(dev_addrs, np.uint64),
                    np.asarray(dev_lens, np.int64), depths, results, refused, route=route,
                )  # fmt: skip
        for i, j in dups:
            results[i] = results[j]
        refused.log(n)

    def _put_fast_prep(self, keys, buffers):
        """(addrs, lens) when the batch needs no per-key decisions (keys already known plain): every key
        new and distinct, short enough, every buffer an (address, nbytes) pair inside a registered range, sizes valid.
        None otherwise (the general path decides key by key)."""
        n = len(keys)
        if not n:
            return None
        if max(map(len, keys)) > self._index.max_key_bytes:  # the caller checked: ASCII, len == bytes
            return None
        known = self._keys
        if any(map(known.__contains__, keys)) or len(set(keys)) != n:
            return None
        pair = self._resolve_pairs(buffers)
        if pair is None:
            return None
        lens = pair[1]
        if int(lens.max()) > min(self.segment_bytes, (1 << 32) - 1):
            return None
        return pair

    def _resolve_pairs(self, buffers):
        """(addrs uint64[], nbytes int64[]) when every buffer is an (address, nbytes) pair of ints wholly
        inside one registered range (the SGLang backend's hot path), in a few numpy ops; else None."""
        if not self._ranges or not buffers:
            return None
        if not all([type(b) is tuple for b in buffers]):
            return None
        try:
            a = np.array(buffers)
        except (ValueError, TypeError, OverflowError):
            return None
        if a.dtype != np.int64 or a.shape != (len(buffers), 2):
            return None
        addr, nb = a[:, 0], a[:, 1]
        if int(addr.min()) < _MIN_FAST_ADDR or int(nb.min()) <= 1:
            return None  # 0, negatives and bools (True == 1) get the checked path
        i = np.searchsorted(self._range_start_arr, addr, side="right") - 1
        # nb <= end - addr, never addr + nb: that sum wraps in int64 for nb near 2**63
        if int(i.min()) < 0 or (nb > self._range_end_arr[i] - addr).any():
            return None  # maybe inside an overlapping earlier range: the general path walks them
        return addr.astype(np.uint64), np.ascontiguousarray(nb)

    async def _write_objects(self, keys, todo, addrs, lens, depths, results, refused, route: str | None = None) -> None:
        """Reserve slots, write, [fdatasync], publish. ``route``: None (host memory), 'gds' or 'staging'.

        ``todo``: int64 key index per object; ``addrs`` uint64, ``lens`` int64, one per object.
        """
        m0 = len(todo)
        classes = size_classes(lens)
        if self._space_limit_segments is not None and time.monotonic() >= self._space_retry_at:
            self._try_grow()
        await self._make_room(int(classes.sum()))
        failed_create = False
        files = self._files
        # Once a segment file could not be created (a full file system below the configured
        # capacity), the store runs within the segments it has: no create per batch, eviction
        # over that space; every _GROW_RETRY_S it tries to grow again.
        may_grow = self._space_limit_segments is None or time.monotonic() >= self._space_retry_at

        def ensure(seg: int) -> bool:
            nonlocal failed_create
            if seg in files.files:
                return True
            if failed_create or not may_grow:
                return False
            ok = files.ensure(seg)
            failed_create = not ok
            return ok

        alloc = self._alloc
        uc = np.unique(classes)
        if len(uc) == 1:
            segs, offs = alloc.alloc_array(int(uc[0]), m0, ensure)
        else:
            segs = np.full(m0, -1, np.int64)
            offs = np.full(m0, -1, np.int64)
            for c in uc.tolist():
                js = np.flatnonzero(classes == c)
                segs[js], offs[js] = alloc.alloc_array(c, len(js), ensure)
        self._note_space(failed_create, may_grow)
        rounds = 0
        while (segs < 0).any() and rounds < _RECLAIM_ROUNDS_MAX:
            # every segment is taken and this size class has no free slot: empty a whole segment
            rounds += 1
            if not await self._reclaim_segment():
                break
            for j in np.flatnonzero(segs < 0).tolist():
                slot = alloc.alloc(int(classes[j]), ensure)
                if slot is not None:
                    segs[j], offs[j] = slot
        nxt = alloc.next_free_segment()
        if nxt is not None and self._space_limit_segments is None and self._files.want_precreate(nxt):
            asyncio.get_running_loop().run_in_executor(None, self._files.precreate, nxt)
        have = segs >= 0
        if not have.all():
            why = "no space" + (" (segment file could not be created)" if failed_create else "")
            for j in np.flatnonzero(~have).tolist():
                refused.add(keys[int(todo[j])], why)
            ok_j = np.flatnonzero(have)
            if not len(ok_j):
                return
            segs, offs, todo, addrs, lens = segs[ok_j], offs[ok_j], todo[ok_j], addrs[ok_j], lens[ok_j]
        m = len(todo)
        src = np.ascontiguousarray(addrs, np.uint64)
        nbytes = np.ascontiguousarray(lens, np.int64)
        fds = self._files.fds[segs]
        align = self._files.align[segs]
        # O_DIRECT needs aligned memory and whole blocks: stage the rest through a bounce buffer
        bounce_mask = self._files.direct[segs] & (((src % align.astype(np.uint64)) != 0) | (nbytes % align != 0))
        if route is not None:
            bounce_mask[:] = False  # device memory: kvikio / staging do their own alignment
        io_addr = src
        io_len = nbytes
        bounce = None
        copies = []
        if bounce_mask.any():
            io_addr = src.copy()
            io_len = nbytes.copy()
            bj = np.flatnonzero(bounce_mask)
            blen = -(-nbytes[bj] // align[bj]) * align[bj]
            starts = np.concatenate([[0], np.cumsum(blen)[:-1]])
            bounce = self._bounce.get(int(blen.sum()))
            io_addr[bj] = np.uint64(bounce.address) + starts.astype(np.uint64)
            io_len[bj] = blen
            copies = list(zip(io_addr[bj].tolist(), src[bj].tolist(), nbytes[bj].tolist(), blen.tolist()))

        def stage() -> None:
            for dst, s, nb, bl in copies:
                _memmove(dst, s, nb)
                if bl > nb:
                    ctypes.memset(dst + nb, 0, bl - nb)

        loop = asyncio.get_running_loop()
        good = np.zeros(m, bool)
        pre = None
        crc_job = None
        crcs = None
        try:
            if route is None:
                # One C call over the caller's memory with the GIL released, on a worker thread,
                # while the disk reads the same memory: it costs no wall time unless it outlasts
                # the write.
                crc_out = np.empty(m, np.uint32)
                crc_job = loop.run_in_executor(None, self._crc32c_many, src, nbytes, crc_out)
            if copies:
                # the thread owns the bounce buffer until it returns, even if our caller gives up
                await _wait_out(loop.run_in_executor(None, stage))
            async with self._write_sem:
                task = None
                try:
                    if route is None:
                        write = self._write_engine.write_many(fds, offs, io_addr, io_len)
                    else:
                        write = self._write_device(route, fds, offs, io_addr, io_len)
                    task = asyncio.ensure_future(write)
                    if route is None:
                        # the write task submits on the next loop pass; the index records (all
                        # but their CRC and generation) are packed while it runs. Keys and depths
                        # were checked before the slots were reserved: this cannot fail.
                        await asyncio.sleep(0)
                        pre = self._pack_pending(keys, todo, segs, offs, nbytes, depths)
                    res = await self._await_io(task, "write", segs)
                    if res is None:
                        for b in range(m):
                            refused.add(keys[int(todo[b])], f"write outlived io_timeout_s={self.timeout_s:g} s")
                    else:
                        if route is not None:
                            res, dev_crcs = res
                            crcs = np.asarray(dev_crcs, np.uint32)
                        good = res == io_len
                        if not good.all():
                            bad = np.flatnonzero(~good)
                            for b in bad[:1].tolist():
                                refused.add(keys[int(todo[b])], f"write failed: {errno_name(int(res[b]))}")
                            for b in bad[1:].tolist():
                                refused.add(keys[int(todo[b])], "write failed")
                except Exception as e:  # noqa: BLE001 - EngineClosed, validation: the batch fails
                    log.error("%s: write batch failed: %s", self.path, e)
                    good[:] = False
                finally:
                    if task is not None and not task.done():
                        # an error or our caller's cancellation: the device may still read the
                        # caller's memory and write these slots; they stay ours until it is done
                        task.cancel()
                        await _settle(task)
            if self.strict and good.any():
                touched = np.unique(segs[good]).tolist()
                sync = self._write_engine.sync
                fdl = self._files.fds
                if len(touched) == 1:
                    try:
                        await asyncio.wait_for(sync(int(fdl[touched[0]])), self.timeout_s)
                        done = [None]
                    except Exception as e:  # noqa: BLE001 - incl. timeout
                        done = [e]
                else:
                    done = await asyncio.gather(
                        *(asyncio.wait_for(sync(int(fdl[s])), self.timeout_s) for s in touched), return_exceptions=True
                    )
                for s, r in zip(touched, done):
                    if isinstance(r, BaseException):  # incl. timeout: nothing in that segment is durable
                        log.error("%s: fdatasync of segment %d failed: %r", self.path, s, r)
                        good &= segs != s
        except BaseException:
            # cancelled (or failed) before publishing: nothing of the batch is published, and no
            # I/O or copy into the slots or the bounce runs any more (waited out above)
            try:
                if crc_job is not None:
                    await _settle(crc_job)  # it reads the caller's memory
            finally:
                self._alloc.free_many(segs, offs)
                if bounce is not None:
                    self._bounce.put(bounce)
            raise
        if crc_job is not None:
            await _wait_out(crc_job)
            crcs = crc_out
        if bounce is not None:
            self._bounce.put(bounce)
        if crcs is None:  # the device write failed
            crcs = np.zeros(m, np.uint32)
        # publish: one commit for the batch, only for keys not published meanwhile
        gen = self._tick()
        committed = False
        async with self._commit_lock:
            pj = np.flatnonzero(good)
            pub_idx = todo[pj].tolist()
            pub_keys = [keys[i] for i in pub_idx]
            kd = self._keys
            if any(map(kd.__contains__, pub_keys)):
                keep = [t for t, k in enumerate(pub_keys) if k not in kd]
                pj = pj[keep]
                pub_idx = [pub_idx[t] for t in keep]
                pub_keys = [pub_keys[t] for t in keep]
            npub = len(pj)
            pub_crcs = crcs[pj]
            if pre is not None:
                all_recs, enc_keys = pre
                recs = all_recs if npub == m else all_recs[pj]
                pub_depths = recs["depth"].copy()
                enc = enc_keys if npub == m else [enc_keys[j] for j in pj.tolist()]
            else:
                pub_depths = -1 if depths is None else np.asarray([int(depths[i]) for i in pub_idx], np.int32)
                recs = np.zeros(npub, REC_DTYPE)
                recs["segment"], recs["length"], recs["offset"] = segs[pj], nbytes[pj], offs[pj]
                recs["depth"], recs["flags"] = pub_depths, FLAG_CRC | FLAG_KEYCRC
                enc = _encode_all(pub_keys)
                recs["key_crc"] = key_crcs(enc)
            recs["generation"] = recs["group"] = gen
            recs["crc"] = pub_crcs
            blob = recs.tobytes()
            puts = list(zip(enc, [blob[t : t + REC_BYTES] for t in range(0, len(blob), REC_BYTES)]))
            try:
                committed = await self._commit(puts) if puts else True
            except asyncio.TimeoutError:
                return  # may still land: keep the slots out of use
            if committed and npub:
                rows = self._new_rows(npub)
                self._rows_seg[rows] = segs[pj]
                self._rows_off[rows] = offs[pj]
                self._rows_len[rows] = nbytes[pj]
                self._rows_crc[rows] = pub_crcs
                self._rows_flags[rows] = FLAG_CRC
                self._rows_gen[rows] = gen
                self._rows_depth[rows] = pub_depths
                self._rows_tick[rows] = gen
                self._rows_pins[rows] = 0
                self._rows_live[rows] = True
                rows_l = rows.tolist()
                row_key = self._row_key
                for r, k in zip(rows_l, pub_keys):
                    row_key[r] = k
                kd.update(zip(pub_keys, rows_l))
                self._counters["bytes_written"] += int(nbytes[pj].sum())
        published = np.zeros(m, bool)
        if committed:
            published[pj] = True
            for i in pub_idx:
                results[i] = True
        rest = np.flatnonzero(~published)
        if len(rest):
            self._alloc.free_many(segs[rest], offs[rest])
            for j in rest.tolist():
                if good[j]:
                    i = int(todo[j])
                    if not committed:
                        refused.add(keys[i], "index commit failed")
                    else:
                        results[i] = True  # another put of the same key published first: keep its bytes

    @staticmethod
    def _pack_pending(keys, todo, segs, offs, nbytes, depths):
        """(records, encoded keys) for every object of a write batch, CRC and generation left 0."""
        m = len(todo)
        recs = np.zeros(m, REC_DTYPE)
        recs["segment"], recs["length"], recs["offset"] = segs, nbytes, offs
        todo_l = todo.tolist()
        if depths is None:
            recs["depth"] = -1
        elif isinstance(depths, np.ndarray):
            recs["depth"] = depths[todo]
        else:
            recs["depth"] = np.asarray([depths[i] for i in todo_l], np.int32)
        recs["flags"] = FLAG_CRC | FLAG_KEYCRC
        enc = _encode_all(keys, todo_l)
        recs["key_crc"] = key_crcs(enc)
        return recs, enc

    async def _await_io(self, task: asyncio.Future, what: str, segs: np.ndarray, timeout_s: float | None = None):
        """The engine's result for ``task``, or None when it outlived io_timeout_s.

        Either way this returns only once the engine batch has ended: until then the kernel may
        still read or write the caller's memory, the slots and the bounce buffer. At the timeout
        the stall is counted and logged once with its segments and the engine is asked to cancel
        (io_uring tries IORING_OP_ASYNC_CANCEL; block I/O usually runs on to its end or to the
        block layer's timeout, and the wait goes on). A cancellation of our caller waits the same
        way (awaiting a task that is cancelled waits for its end). One timer per call: no
        wait_for/shield futures on the hot path.
        """
        stalled_at = None

        def on_timeout() -> None:
            nonlocal stalled_at
            if task.done():
                return
            stalled_at = time.monotonic()
            n = len(segs)
            self._counters["timeouts"] += 1
            self._stalled_ops += n
            u = np.unique(segs)
            names = ", ".join(segment_name(int(x)) for x in u[:4].tolist()) + (" ..." if len(u) > 4 else "")
            log.error(
                "%s: %s of %d objects outlived io_timeout_s=%.1f s on %s; cancelling it and waiting for the "
                "kernel to give back the memory", self.path, what, n, self.timeout_s, names,
            )  # fmt: skip
            task.cancel()

        h = asyncio.get_running_loop().call_later(self.timeout_s if timeout_s is None else timeout_s, on_timeout)
        try:
            return await task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if stalled_at is None or (me is not None and me.cancelling()):
                if not task.done():  # our caller gave up: the engine batch still owns the memory
                    task.cancel()
                    await _settle(task)
                raise
            return None  # our own timeout: the batch has ended (task is done)
        finally:
            h.cancel()
            if stalled_at is not None and task.done():
                self._late_completions += len(segs)
                self._stalled_wait_s = max(self._stalled_wait_s, time.monotonic() - stalled_at)

    async def _write_device(self, route: str, fds, offs, addrs, lens):
        """(results, crcs) for a write from CUDA memory; the CRC is computed on a host copy."""
        from .engine import gds

        if route == "gds":
            crcs = await gds.device_crc32c_many(addrs, lens)
            return await self._gds_gate.engine.write_many(fds, offs, addrs, lens), crcs
        # staging: device -> aligned host bounce -> O_DIRECT write of whole blocks
        blen, starts, bounce = self._stage_layout(lens)
        try:
            host = np.uint64(bounce.address) + starts.astype(np.uint64)
            crc32c = self._crc32c
            pairs = list(zip(addrs.tolist(), host.tolist(), lens.tolist()))

            def stage() -> list[int]:
                gds._device_ops.copy_d2h(pairs)
                for _, h, n in pairs:
                    ctypes.memset(h + n, 0, -n % SLOT_ALIGN_BYTES)
                return [crc32c((h, n)) for _, h, n in pairs]

            # the thread writes the bounce buffer until it returns
            crcs = await _wait_out(asyncio.get_running_loop().run_in_executor(None, stage))
            res = await self._write_engine.write_many(fds, offs, host, blen)
            return np.where(res == blen, lens, np.minimum(res, lens)), np.asarray(crcs, np.uint32)
        finally:
            self._bounce.put(bounce)

    def _stage_layout(self, lens: np.ndarray):
        blen = size_classes(lens)
        starts = np.concatenate([[0], np.cumsum(blen)[:-1]]).astype(np.int64)
        return blen, starts, self._bounce.get(int(blen.sum()))

    async def _read_device(self, route: str, fds, offs, addrs, lens, crcs, flags) -> tuple[np.ndarray, np.ndarray]:
        """(complete, verified) per op for a read into CUDA memory."""
        from .engine import gds

        gate = self._gds_gate
        verify = self.verify_crc
        got = None
        if route == "gds":
            res = await gate.engine.read_many(fds, offs, addrs, lens)
            if verify:
                got = await gds.device_crc32c_many(addrs, lens)
        else:
            # staging: O_DIRECT read of whole blocks into a host bounce, check, then copy to the device
            blen, starts, bounce = self._stage_layout(lens)
            try:
                host = np.uint64(bounce.address) + starts.astype(np.uint64)
                res = await self._read_engine.read_many(fds, offs, host, blen)
                ok = res >= lens
                crc32c = self._crc32c
                host_l, len_l = host.tolist(), lens.tolist()
                good_l = ok.tolist()

                def check_and_copy() -> list[bool]:
                    out = list(good_l)
                    if verify:
                        for j, (h, n) in enumerate(zip(host_l, len_l)):
                            if out[j] and flags[j] & FLAG_CRC and crc32c((h, n)) != int(crcs[j]):
                                out[j] = False
                    gds._device_ops.copy_h2d([(h, int(a), n) for h, a, n, o in zip(host_l, addrs.tolist(), len_l, out) if o])
                    return out

                # it copies into the caller's device memory until it returns
                checked = await _wait_out(asyncio.get_running_loop().run_in_executor(None, check_and_copy))
                return ok, np.asarray(checked, bool)
            finally:
                self._bounce.put(bounce)
        ok = res >= lens
        checked = ok.copy()
        if got is not None:
            checked &= (got.astype(np.uint32) == crcs) | ((flags & FLAG_CRC) == 0)
        return ok, checked

    # ----------------------------------------------------------------------------- get

    async def get_many(self, keys: list[str], buffers: list) -> list[bool]:
        n = len(keys)
        if len(buffers) != n:
            raise ValueError(f"get_many needs one buffer per key: {n} keys, {len(buffers)} buffers")
        results = [False] * n
        if self._closed:
            self._closed_call("get_many")
            return results
        self._enter()
        try:
            await self._get(keys, buffers, results)
        except Exception:  # noqa: BLE001
            log.exception("%s: get_many failed", self.path)
        finally:
            self._leave()
        hits = sum(results)
        self._counters["gets"] += n
        self._counters["hits"] += hits
        self._counters["misses"] += n - hits
        return results

    def _index_keys(self, keys) -> list[bytes | None]:
        """Index key bytes per key; None for a key no index key can hold (not a str, empty, no
        lossless bytes, too long): that key alone is a miss."""
        maxk = self._index.max_key_bytes
        if _plain_keys(keys) and (not keys or max(map(len, keys)) <= maxk):
            return [k.encode() for k in keys]
        enc = []
        for k in keys:
            b = encode_key(k) if key_error(k) is None else None
            enc.append(b if b is not None and len(b) <= maxk else None)
        return enc

    def _index_lookup(self, keys) -> list[bytes | None]:
        """Readers: the index record per key (None: absent, or a key that cannot be stored)."""
        enc = self._index_keys(keys)
        if None not in enc:
            return self._index.get_records(enc)
        found = iter(self._index.get_records([b for b in enc if b is not None]))
        return [None if b is None else next(found) for b in enc]

    def _writer_rows(self, keys) -> list:
        """Writers: the row per key, None when absent (a key that is not a str is never present)."""
        try:
            return list(map(self._keys.get, keys))
        except TypeError:  # an unhashable key
            get = self._keys.get
            return [get(k) if type(k) is str else None for k in keys]

    def _lookup_reader(self, keys: list[str]):
        """Readers: records from LMDB -> (idx, seg, off, len, crc, flags, gen) arrays for present keys."""
        vals = self._index_lookup(keys)
        idx = [i for i, v in enumerate(vals) if v is not None and len(v) == REC_BYTES]
        if not idx:
            return None
        recs = np.frombuffer(b"".join(vals[i] for i in idx), dtype=REC_DTYPE)
        return (
            np.asarray(idx, np.int64),
            recs["segment"].astype(np.int64),
            recs["offset"].astype(np.int64),
            recs["length"].astype(np.int64),
            recs["crc"].astype(np.uint32),
            recs["flags"].astype(np.uint32),
            recs["generation"].astype(np.uint64),
        )

    async def _get(self, keys, buffers, results) -> None:
        refused = _Refusals("get_many")
        writer = not self.readonly
        rows = None
        n = len(keys)
        if writer:
            rows_l = self._writer_rows(keys)
            if None in rows_l:
                idx_l = [i for i, r in enumerate(rows_l) if r is not None]
                if not idx_l:
                    return
                idx = np.asarray(idx_l, np.int64)
                rows = np.asarray([rows_l[i] for i in idx_l], np.int64)
            else:
                if not n:
                    return
                idx = np.arange(n, dtype=np.int64)
                rows = np.asarray(rows_l, np.int64)
            segs, offs, lens = self._rows_seg[rows], self._rows_off[rows], self._rows_len[rows]
            crcs, flags, gens = self._rows_crc[rows], self._rows_flags[rows], self._rows_gen[rows]
        else:
            found = self._lookup_reader(keys)
            if found is None:
                return
            idx, segs, offs, lens, crcs, flags, gens = found
            for s in np.unique(segs).tolist():
                if not self._files.ensure(s):
                    keep = segs != s
                    idx, segs, offs, lens, crcs, flags, gens = (a[keep] for a in (idx, segs, offs, lens, crcs, flags, gens))
            if not len(idx):
                return
        # caller memory
        m = len(idx)
        pair = self._resolve_pairs(buffers if m == n else [buffers[i] for i in idx.tolist()])
        if pair is not None and not (pair[1] < lens).any():
            dst = pair[0]
            ok = None
            devm = None
        else:
            dst = np.zeros(m, np.uint64)
            ok = np.ones(m, bool)
            devm = np.zeros(m, bool)
            for j, i in enumerate(idx.tolist()):
                r = self._resolve(buffers[i], writable=True)
                if isinstance(r, str):
                    refused.add(keys[i], r)
                    ok[j] = False
                    continue
                if r[1] < lens[j]:
                    refused.add(keys[i], f"buffer of {r[1]} bytes is smaller than the {int(lens[j])}-byte object")
                    ok[j] = False
                    continue
                dst[j] = r[0]
                devm[j] = r[2]
        if ok is not None and (not ok.all() or devm.any()):
            # keep the usable ops, host memory first and CUDA memory last
            keep = np.concatenate([np.flatnonzero(ok & ~devm), np.flatnonzero(ok & devm)])
            idx, segs, offs, lens, crcs, flags, gens, dst, devm = (
                a[keep] for a in (idx, segs, offs, lens, crcs, flags, gens, dst, devm)
            )
            if rows is not None:
                rows = rows[keep]
        m = len(idx)
        if not m:
            refused.log(len(keys))
            return
        m_host = m if devm is None else m - int(devm.sum())
        route = None
        if m_host < m:
            try:
                route = await self._gds_route()
            except OSError as e:
                for j in range(m_host, m):
                    refused.add(keys[int(idx[j])], str(e))
        if rows is not None:
            np.add.at(self._rows_pins, rows, 1)
        timed_out = False
        bounce = None
        good = np.zeros(m, bool)
        verified = np.zeros(m, bool)
        try:
            fds = self._files.fds[segs]
            align = self._files.align[segs]
            bounce_mask = self._files.direct[segs] & (((dst % align.astype(np.uint64)) != 0) | (lens % align != 0))
            if devm is not None:
                bounce_mask &= ~devm
            io_addr = dst
            io_len = lens
            has_bounce = bool(bounce_mask.any())
            if has_bounce:
                io_addr = dst.copy()
                io_len = lens.copy()
                bj = np.flatnonzero(bounce_mask)
                blen = -(-lens[bj] // align[bj]) * align[bj]
                starts = np.concatenate([[0], np.cumsum(blen)[:-1]])
                bounce = self._bounce.get(int(blen.sum()))
                io_addr[bj] = np.uint64(bounce.address) + starts.astype(np.uint64)
                io_len[bj] = blen
            verify = self.verify_crc
            crc32c_many = self._crc32c_many
            need_cpu = verify or has_bounce
            no_crc = (flags & FLAG_CRC) == 0

            def finish(lo: int, hi: int, ok: np.ndarray) -> np.ndarray:
                """Copy bounced objects out, then check the CRCs of [lo, hi) in one C call."""
                if has_bounce:
                    for j in (np.flatnonzero(bounce_mask[lo:hi] & ok) + lo).tolist():
                        _memmove(int(dst[j]), int(io_addr[j]), int(lens[j]))
                if not verify:
                    return ok
                got = np.empty(hi - lo, np.uint32)
                crc32c_many(dst[lo:hi], lens[lo:hi], got)
                return ok & ((got == crcs[lo:hi]) | no_crc[lo:hi])

            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.timeout_s
            engine = self._read_engine

            # Sub-batches go to the device a few at a time, in order: with every op in flight at
            # once the device finishes them interleaved, so every part completed near the end and
            # no CRC overlapped any I/O. A window of parts still keeps the device busy (several
            # MiB queued) while the parts before it are verified.
            bounds = _part_bounds(m_host, int(lens[:m_host].sum()) if m_host else 0)
            window = asyncio.Semaphore(_READ_PARTS_IN_FLIGHT) if len(bounds) - 1 > _READ_PARTS_IN_FLIGHT else None

            async def read(lo: int, hi: int):
                left = deadline - loop.time()
                if left <= 0:  # an earlier part stalled the window: give up before submitting
                    raise asyncio.TimeoutError
                task = asyncio.ensure_future(engine.read_many(fds[lo:hi], offs[lo:hi], io_addr[lo:hi], io_len[lo:hi]))
                res = await self._await_io(task, "read", segs[lo:hi], left)
                if res is None:
                    raise asyncio.TimeoutError
                return res

            async def part(lo: int, hi: int) -> None:
                if window is None:
                    res = await read(lo, hi)
                else:
                    async with window:
                        res = await read(lo, hi)
                ok = res >= lens[lo:hi]  # the object must come back whole; more is padding
                good[lo:hi] = ok
                if need_cpu:
                    # the thread copies into the caller's memory: it must end before we return
                    verified[lo:hi] = await _wait_out(loop.run_in_executor(None, finish, lo, hi, ok))
                else:
                    verified[lo:hi] = ok

            async def device_part(lo: int, hi: int) -> None:
                sl = slice(lo, hi)
                ok, checked = await asyncio.wait_for(
                    self._read_device(route, fds[sl], offs[sl], dst[sl], lens[sl], crcs[sl], flags[sl]), self.timeout_s
                )
                good[sl] = ok
                verified[sl] = checked

            # Sub-batches: each is verified as soon as it completes, so the CRC overlaps the I/O
            # of the rest and only the last (small) one's CRC adds wall time.
            jobs = [part(lo, hi) for lo, hi in zip(bounds, bounds[1:])]
            if route is not None:
                jobs.append(device_part(m_host, m))
            if len(jobs) == 1:
                try:
                    await jobs[0]
                    outcome = ()
                except Exception as e:  # noqa: BLE001
                    outcome = (e,)
            else:
                outcome = await asyncio.gather(*jobs, return_exceptions=True)
            for r in outcome:
                if isinstance(r, asyncio.TimeoutError):
                    timed_out = True
                elif isinstance(r, BaseException):
                    log.error("%s: read batch failed: %r", self.path, r)
                    verified[:] = False
            if timed_out:
                return  # counted and logged by _await_io
        finally:
            # Every engine await above has ended, timed out or cancelled or not (_await_io and
            # the engines wait for the kernel's completions): no read into these slots, the
            # bounce or the caller's memory is in flight any more.
            if rows is not None:
                self._unpin(rows)
            if bounce is not None:
                self._bounce.put(bounce)
        if not writer:
            # another process may have evicted and reused the slot while we read it
            idx_list = idx.tolist()
            after = self._lookup_reader([keys[i] for i in idx_list])
            now = np.zeros(m, np.uint64)
            present = np.zeros(m, bool)
            if after is not None:
                now[after[0]] = after[6]
                present[after[0]] = True
            verified &= present & (now == gens)
        if verified.all():
            if m == n:
                results[:] = [True] * n
            else:
                for i in idx.tolist():
                    results[i] = True
            self._counters["bytes_read"] += int(lens.sum())
        else:
            for i in idx[verified].tolist():
                results[i] = True
            self._counters["bytes_read"] += int(lens[verified].sum())
        bad_crc = np.flatnonzero(good & ~verified).tolist()
        if bad_crc:
            self._counters["crc_errors"] += len(bad_crc)
            for j in bad_crc[:1]:
                refused.add(keys[int(idx[j])], "checksum mismatch (entry dropped)" if writer else "checksum or generation mismatch")
        if writer:
            if bad_crc:
                drop = [
                    int(rows[j]) for j in bad_crc
                    if self._rows_live[rows[j]] and self._row_key[rows[j]] == keys[int(idx[j])]
                ]  # fmt: skip
                await self._drop_rows(sorted(set(drop)), evicted=False)
            hit_rows = rows[verified]
            if len(hit_rows):
                self._rows_tick[hit_rows] = self._tick()
        refused.log(len(keys))

    # ----------------------------------------------------------------------------- exists / delete

    def exists_many_nowait(self, keys: list[str]) -> list[bool]:
        """Thread-safe: dict reads are atomic under the GIL; LMDB read txns are per call. A key
        that cannot be stored (not a str, empty, no lossless bytes) is False alone."""
        if self._closed:
            self._closed_call("exists_many")
            return [False] * len(keys)
        if self.readonly:
            return [v is not None for v in self._index_lookup(keys)]
        d = self._keys
        try:
            return [k in d for k in keys]
        except TypeError:  # an unhashable key
            return [type(k) is str and k in d for k in keys]

    def exists_prefix_nowait(self, keys: list[str]) -> int:
        if self._closed:
            self._closed_call("exists_prefix")
            return 0
        if self.readonly:
            enc = self._index_keys(keys)
            if None in enc:
                enc = enc[: enc.index(None)]
            return self._index.exists_prefix(enc)
        d = self._keys
        n = 0
        try:
            for k in keys:
                if k not in d:
                    break
                n += 1
        except TypeError:  # an unhashable key is absent: the prefix ends there
            pass
        return n

    async def exists_many(self, keys: list[str]) -> list[bool]:
        return self.exists_many_nowait(keys)

    async def exists_prefix(self, keys: list[str]) -> int:
        return self.exists_prefix_nowait(keys)

    async def delete_many(self, keys: list[str]) -> list[bool]:
        if self.readonly:
            raise ReadOnlyStoreError(f"store {self.path} was opened read-only; delete_many is not allowed")
        results = [False] * len(keys)
        if self._closed:
            self._closed_call("delete_many")
            return results
        rows, where = [], []
        seen = set()
        for i, r in enumerate(self._writer_rows(keys)):
            if r is not None and r not in seen:
                seen.add(r)
                rows.append(r)
                where.append(i)
        if rows and await self._drop_rows(rows, evicted=False):
            for i in where:
                results[i] = True
        return results

    async def clear(self) -> None:
        """Drop every entry durably and free all space (slots being read are freed after the read)."""
        if self.readonly:
            raise ReadOnlyStoreError(f"store {self.path} was opened read-only; clear is not allowed")
        if self._closed:
            self._closed_call("clear")
            return
        async with self._commit_lock:
            rows = list(self._keys.values())
            self._keys.clear()
            self._rows_live[rows] = False
            ix, nxt = self._index, self._clock + 1
            if self.strict:
                fut = asyncio.get_running_loop().run_in_executor(self._index_pool, lambda: ix.drop_all(next_generation=nxt))
                await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
            else:
                ix.drop_all(next_generation=nxt)
            self._release_rows(rows)
            self._counters["deletes"] += len(rows)

    async def flush(self) -> bool:
        """fdatasync every segment and the index. True when all of it is durable."""
        if self._closed:
            self._closed_call("flush")
            return False
        if self.readonly:
            return True
        return await self._flush()

    async def flush_for_close(self) -> None:
        # relaxed mode: a clean close still leaves data and index durable
        try:
            await self._flush()
        except Exception as e:  # noqa: BLE001 - closing must not raise for a flush
            log.warning("%s: flush at close failed: %s", self.path, e)

    async def _flush(self) -> bool:
        # all segments at once: a slow disk costs one io_timeout_s, not one per segment
        segs = list(self._files.files)
        done = await asyncio.gather(
            *(asyncio.wait_for(self._write_engine.sync(int(self._files.fds[s])), self.timeout_s) for s in segs),
            return_exceptions=True,
        )
        ok = True
        for s, r in zip(segs, done):
            if isinstance(r, BaseException):
                log.error("%s: fdatasync of segment %d failed: %r", self.path, s, r)
                ok = False
        try:
            await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(self._index_pool, self._index.sync), self.timeout_s
            )
        except Exception as e:  # noqa: BLE001
            log.error("%s: index sync failed: %s", self.path, e)
            ok = False
        return ok

    # ----------------------------------------------------------------------------- stats

    def stats(self) -> dict:
        s = dict(self._counters)
        s.update(
            path=self.path,
            readonly=self.readonly,
            durability="strict" if self.strict else "relaxed",
            capacity_bytes=self.capacity_bytes,
            segment_bytes=self.segment_bytes,
            high_watermark=self.config.ssd_high_watermark,
            low_watermark=self.config.ssd_low_watermark,
            eviction_policy=self.config.eviction_policy,
            verify_crc=self.verify_crc,
            engine=self._read_engine.capabilities.name if self._engines else None,
            o_direct=self._files.any_direct if self._files is not None else None,
            open_seconds=round(self.open_seconds, 4) if hasattr(self, "open_seconds") else None,
            index_bytes=self._index.file_bytes() if self._index is not None else 0,
            stalled_ops=self._stalled_ops,
            late_completions=self._late_completions,
            stalled_wait_s=round(self._stalled_wait_s, 3),
        )
        if not self.readonly and hasattr(self, "_alloc"):
            s.update(
                objects=len(self._keys),
                bytes_used=self._alloc.used_bytes,
                usable_bytes=self._alloc.capacity_bytes,
                segments=self._alloc.n_segments,
                segments_free=self._alloc.free_segments(),
                segment_files=len(self._files.files),
                disk_bytes=self._files.disk_bytes(),
                size_classes=self._alloc.class_counts(),
                pinned_slots=int((self._rows_pins[: self._nrows] > 0).sum()),
                late_writes=self._late_writes,
                effective_capacity_bytes=self._effective_capacity(),
            )
        else:
            s.update(objects=self._object_count())
        return s

    # ----------------------------------------------------------------------------- in-flight tracking

    def _closed_call(self, op: str) -> None:
        """Calls after close() answer False / 0 without touching files; one line says so."""
        if not self._closed_logged:
            self._closed_logged = True
            log.warning("%s: %s after close(); every call now answers False / 0 (logged once)", self.path, op)

    def _enter(self) -> None:
        self._inflight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self._inflight -= 1
        if not self._inflight:
            self._idle.set()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
