"""The on-disk format of a store directory, in one place.

A store directory holds ``LOCK`` (the writer's pid, flock), ``MANIFEST.json`` (format version,
layout, namespace, capacity), ``index.lmdb`` (key -> record, see index.py) and ``seg-NNNNN.dat``
segment files of ``segment_bytes`` each (see segments.py). This module names those files, parses
segment file names, reads and checks the manifest, takes the lock, checks the directory is safe,
and states the capacity rules. Nothing here keeps state.

State: none (the files of a store directory).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import stat

from ..buffers import DIO_ALIGN_BYTES
from ..engine.files import open_regular
from ..errors import (
    CapacityShrinkError,
    ManifestDamagedError,
    NamespaceMismatchError,
    NotAStoreError,
    StoreError,
    StoreLockedError,
    UnsafeStorePathError,
)
from .index import INDEX_FILE, REC_BYTES, REC_DTYPE, check_own_file  # noqa: F401 - the record format, re-exported

log = logging.getLogger("umbp_nvme.store")

FORMAT_VERSION = 1
MANIFEST_FILE = "MANIFEST.json"
LOCK_FILE = "LOCK"
SLOT_ALIGN_BYTES = DIO_ALIGN_BYTES  # slot offsets and sizes; a format fact too: the manifest records it

SEGMENT_PREFIX, SEGMENT_SUFFIX = "seg-", ".dat"
SEGMENTS_MAX = 1 << 20  # a segment file name beyond this is not one the store made
SEGMENT_RECORD_BYTES = 256  # one record per 4 KiB of slots in the area after a segment's slots (records.py)
GENERATION_MAX = 1 << 62  # generations (put batches) read from the index must stay below this


def segment_name(i: int) -> str:
    return f"{SEGMENT_PREFIX}{i:05d}{SEGMENT_SUFFIX}"


def parse_segment_name(name: str) -> int | None:
    """The segment index of a file name the store made (``seg-00042.dat`` -> 42), else None."""
    if not (name.startswith(SEGMENT_PREFIX) and name.endswith(SEGMENT_SUFFIX)):
        return None
    digits = name[len(SEGMENT_PREFIX) : -len(SEGMENT_SUFFIX)]
    if not (digits.isascii() and digits.isdigit()):
        return None
    i = int(digits)
    return i if i < SEGMENTS_MAX else None


def segment_files(path: str) -> dict[int, str]:
    """Segment index -> file name for every segment file in ``path`` ({} when it cannot be listed)."""
    try:
        names = os.listdir(path)
    except OSError:
        return {}
    out = {}
    for name in names:
        i = parse_segment_name(name)
        if i is not None:
            out[i] = name
    return out


def segment_disk_bytes(path: str) -> int:
    """Bytes the segment files in ``path`` occupy on disk (allocated blocks; 0 when none)."""
    total = 0
    for name in segment_files(path).values():
        try:
            total += os.lstat(os.path.join(path, name)).st_blocks * 512
        except OSError:
            pass
    return total


def map_size_bytes(capacity_bytes: int) -> int:
    # ~200 bytes of LMDB per record at worst (key <= 511 B is rare; typical keys ~100 B), one
    # record per 4 KiB slot at most, doubled for copy-on-write: the file stays sparse anyway.
    slots = max(1, capacity_bytes // SLOT_ALIGN_BYTES)
    return int(min(max(1 << 30, slots * 1024), 1 << 40))


# --- the store directory: path checks, lock, manifest ----------------------------------------


def prepare_dir(path: str, *, readonly: bool) -> str:
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


def take_lock(path: str) -> int:
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
        e = StoreLockedError(
            f"store {path} is locked by pid {holder} (a writer holds {lock_path}); "
            "open it read-only or stop that process"
        )
        e.path, e.holder = path, holder  # for a caller that cannot open read-only (cli/commands.py)
        raise e from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def read_json_or_none(path: str, max_bytes: int = 16 << 20):
    """The JSON value in a small side file of ours (DRIVES.json, STATS.json), or None when it is
    missing, not a regular file (never followed, never blocking on a FIFO), larger than
    ``max_bytes`` or not JSON (nested too deep included: a RecursionError, not a ValueError)."""
    try:
        fd = open_regular(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError:
            return None
    if len(data) > max_bytes:
        return None
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def write_json_atomic(path: str, obj) -> None:
    write_file_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def write_file_atomic(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data``, durably: written and fsynced under a fresh name, renamed, the
    directory fsynced."""
    # a fresh name, created exclusively: never an existing file or a symlink someone planted
    tmp = f"{path}.tmp.{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
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
    fsync_dir(os.path.dirname(path))


def fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


MANIFEST_CRC = "crc32c"  # of the other fields' canonical JSON: a flipped byte is damage, not another namespace


def manifest_crc(m: dict) -> str:
    from .._uring import crc32c

    body = json.dumps({k: v for k, v in m.items() if k != MANIFEST_CRC}, sort_keys=True, separators=(",", ":"))
    return f"{crc32c(body.encode()):08x}"


def write_manifest(path: str, m: dict) -> None:
    """Write the manifest ``m`` (its checksum set first) atomically to ``path``."""
    m[MANIFEST_CRC] = manifest_crc(m)
    write_json_atomic(path, m)


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
    if MANIFEST_CRC in m and m[MANIFEST_CRC] != manifest_crc(m):
        raise ManifestDamagedError(f"{p}: its checksum does not match its content; the manifest is damaged")
    return m


def read_manifest_or_none(path: str) -> dict | None:
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
    m = read_manifest_or_none(path)
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
        fd = open_regular(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)  # a FIFO there: no writer, never a hang
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


def segment_files_extent(path: str) -> int:
    """1 + the highest segment index with a file in ``path`` (0 when none)."""
    return max(segment_files(path), default=-1) + 1


NAMESPACE_MAX_BYTES = 64 << 10  # as JSON; well inside what a manifest may be (_MANIFEST_MAX_BYTES)


def check_namespace_fits(namespace: dict | None) -> None:
    """A namespace the manifest can hold: JSON values, at most NAMESPACE_MAX_BYTES as JSON. A larger
    one (an imported archive's header may carry 16 MiB) made a manifest that every later open
    refused as damaged."""
    if namespace is None:
        return
    try:
        n = len(json.dumps(namespace).encode())
    except (TypeError, ValueError, RecursionError) as e:
        raise TypeError(f"namespace must be a dict of JSON values ({e})") from None
    if n > NAMESPACE_MAX_BYTES:
        raise StoreError(f"namespace of {n} bytes (as JSON) is over the {NAMESPACE_MAX_BYTES} a store manifest "
                         "records; a namespace names a model, dtype and layout in a few hundred bytes")


def check_namespace(path: str, stored: dict, requested: dict | None) -> None:
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


# --- creating a manifest and the capacity rules -----------------------------------------------


def new_manifest(capacity_bytes: int, segment_bytes: int, namespace: dict | None) -> dict:
    """The manifest a writer records for a new store (segment size cut to the capacity and to whole slots)."""
    seg = min(int(segment_bytes), int(capacity_bytes))
    seg -= seg % SLOT_ALIGN_BYTES
    if seg <= 0:
        raise ValueError(
            f"ssd_capacity_bytes={capacity_bytes} and ssd_segment_size_bytes="
            f"{segment_bytes} leave no room for one {SLOT_ALIGN_BYTES}-byte slot"
        )
    return {
        "format_version": FORMAT_VERSION,
        "layout": {"segment_bytes": seg, "slot_align_bytes": SLOT_ALIGN_BYTES, "record_bytes": SEGMENT_RECORD_BYTES},
        "namespace": namespace or {},
        "ssd_capacity_bytes": int(capacity_bytes),
    }


def record_slots(segment_bytes: int, cls: int) -> int:
    """Slots of size class ``cls`` in a segment whose tail holds their records (records.py):
    the most n with n slots plus ceil(n / 16) record blocks inside the segment."""
    if cls <= 0 or cls > segment_bytes:
        return 0
    per = SLOT_ALIGN_BYTES // SEGMENT_RECORD_BYTES
    n = min(segment_bytes // cls, (segment_bytes * per) // (per * cls + SLOT_ALIGN_BYTES) + 1)
    while n > 0 and n * cls + -(-n // per) * SLOT_ALIGN_BYTES > segment_bytes:
        n -= 1
    return n


def has_records(m: dict) -> bool:
    """Whether the store keeps records in its segments (a store made before them has none until
    its writer migrates it)."""
    return (m.get("layout") or {}).get("record_bytes") == SEGMENT_RECORD_BYTES


def segment_bytes_on_disk(path: str) -> int | None:
    """The segment size the files in ``path`` agree on (they are preallocated to it), else None."""
    sizes = set()
    for name in segment_files(path).values():
        try:
            st = os.lstat(os.path.join(path, name))
        except OSError:
            continue
        sizes.add(st.st_size if stat.S_ISREG(st.st_mode) else -1)
    if len(sizes) == 1:
        (size,) = sizes
        if SLOT_ALIGN_BYTES <= size <= _SEGMENT_BYTES_MAX and size % SLOT_ALIGN_BYTES == 0:
            return size
    return None


def writer_capacity(
    path: str, m: dict, segment_bytes: int, requested: int, from_manifest: bool, shrink: bool
) -> tuple[int, tuple[int, int] | None]:
    """(capacity this writer runs with, (old capacity, old segment count) when it shrinks, else None).

    Records the capacity in the manifest unless it shrinks: a shrink is recorded only once the
    evictions it causes are durable (the store does it after loading its rows).
    """
    seg = segment_bytes
    recorded = recorded_capacity_bytes(m)
    if recorded is None:
        # a store made before the manifest recorded its capacity: what is on disk is the floor
        floor = segment_files_extent(path) * seg
        if from_manifest:
            requested = max(requested, floor)
        recorded = floor
    elif from_manifest:
        requested = recorded
    if requested < seg:
        raise ValueError(f"ssd_capacity_bytes={requested} is smaller than this store's segment size ({seg} bytes)")
    old_n, new_n = recorded // seg, requested // seg
    if new_n < old_n:
        if not shrink:
            raise CapacityShrinkError(
                f"store {path} has ssd_capacity_bytes={recorded} ({old_n} segments of {seg} bytes), but this "
                f"open asks for ssd_capacity_bytes={requested} ({new_n} segments): that would drop what is stored "
                f"in segments {new_n}..{old_n - 1}. Open it with ssd_capacity_bytes={recorded} (or "
                "PageStore.open(..., capacity_from_manifest=True); the CLI: --capacity), or shrink it "
                "deliberately with PageStore.open(..., shrink=True) (SGLang: lowering ssd_capacity_bytes in "
                "its config does this), which evicts those objects"
            )
        return requested, (recorded, old_n)
    if m.get("ssd_capacity_bytes") != requested:
        if recorded_capacity_bytes(m) is not None:
            log.info("%s: capacity %d -> %d bytes", path, recorded, requested)
        m["ssd_capacity_bytes"] = requested
        write_manifest(os.path.join(path, MANIFEST_FILE), m)
    return requested, None
